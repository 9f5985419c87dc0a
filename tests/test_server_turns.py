"""Turns and the conversation over the GA protocol: NVIDIA's policy as server VAD events, responses
that follow the agent's turns, barge-in as a cancelled response, conversation items for everything,
and every valid GA client event and value taken without an ``error`` (docs/server.md).

All on loopback with bounded waits; the tiny model's RNNT is made to hear loudness
(``test_pipecat.voice_activity_rnnt``), so the policy's events fall on known frames.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import importlib.util
import io
import json
import warnings

import numpy as np
import pytest
import soundfile as sf
import torch
import websockets

import nvchat_torch as nv
from nvchat_torch.audio_io import StreamResampler, g711_decode, g711_encode, pcm16_encode, resample
from nvchat_torch.turn_taking import TurnTakingConfig
from mlx_oracle import synth_audio
from test_engine import assert_same_events
from test_server import (EXAMPLE, GA_16K_22K, RAW, TIMEOUT, WEATHER, _HookedModel, assert_same_pcm, b64,
                         mlx_conversation, serve, text_logit_bias)
from test_turn_taking import PROMPT, WAVE_SECONDS, sparse, speechy  # noqa: F401 (fixtures)

POLICY = TurnTakingConfig(window=10, eou_frames=10, barge_in_frames=8, first_turn_fallback_frames=10_000,
                          punctuation_bias=False)
FRAME = 1280


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def heard(make_checkpoint):
    """A model whose RNNT hears loudness (blank on quiet frames)."""
    from test_pipecat import voice_activity_rnnt

    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    hook = voice_activity_rnnt(model)
    yield model
    hook.remove()


def conversation_audio() -> np.ndarray:
    """int16 at 16 kHz: quiet, a question, a pause, the question again over the agent, a long pause."""
    speech, _ = sf.read(EXAMPLE, dtype="int16")
    quiet = lambda frames: np.zeros(frames * FRAME, np.int16)  # noqa: E731
    return np.concatenate([quiet(5), speech[:32000], quiet(15), speech[:25600], quiet(30)])


async def run_ga(address: str, pcm: np.ndarray | list[bytes], session: dict, before=(), during=(),
                 at: int = 0) -> list[dict]:
    """Connect, send ``before`` events, the session.update, the audio frame by frame (int16 at 16 kHz,
    or the appends' bytes), with ``during`` after frame ``at``, then commit; every event up to the
    commit's response.done."""
    appends = [b64(pcm[i:i + FRAME]) for i in range(0, len(pcm), FRAME)] if isinstance(pcm, np.ndarray) else \
        [base64.b64encode(chunk).decode("ascii") for chunk in pcm]
    async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
        events = [json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))]
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        for event in before:
            await ws.send(json.dumps(event))
        for i, audio in enumerate(appends):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            if i == at:
                for event in during:
                    await ws.send(json.dumps(event))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        committed = False
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            events.append(event)
            committed = committed or event["type"] == "input_audio_buffer.committed"
            if committed and event["type"] == "response.done":
                return events


def reference(model, pcm: np.ndarray, bos: bool = False, **options):
    """What a deterministic StreamingSession emits for ``pcm``; ``bos``: the agent's BOS forced on the
    first frame, as a response.create before the audio asks for it."""
    session = model.create_streaming_session(nv.StreamingOptions(deterministic=True, **options))
    if bos:
        session.force_tokens("text", [model.config.bos_token_id])
    events = session.push_audio(pcm.astype(np.float32) / 32768.0, 16000) + session.flush(pad_partial=True)
    return session, events


def test_turns_become_server_vad_events_and_responses_follow_the_agent(heard):
    pcm = conversation_audio()
    with serve(heard, turn_taking=POLICY, clock=0) as (address, _):
        events = asyncio.run(run_ga(address, pcm, {**GA_16K_22K, "nvchat": {"deterministic": True}}))
    _, ref = reference(heard, pcm, turn_taking=POLICY)
    turns = [(e.frame_index, e.reason) for e in ref if e.kind == "turn"]
    reasons = [r for _, r in turns]
    assert reasons[:3] == ["user_speech", "end_of_utterance", "barge_in"] and "end_of_utterance" in reasons[3:]
    eou1, barge = turns[1][0], turns[2][0]
    eou2 = next(f for f, r in turns[3:] if r == "end_of_utterance")
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and "nvchat.notice" not in kinds
    assert events[0]["session"]["nvchat"]["turn_taking"] == POLICY.to_dict()
    assert events[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    # the policy's events as GA's server VAD: started (user speech, barge-in), stopped (the agent's turn)
    vad = [e for e in events if e["type"].startswith("input_audio_buffer.speech_")]
    assert [e["type"][len("input_audio_buffer.speech_"):] for e in vad] == ["started", "stopped", "started", "stopped"]
    assert vad[0]["audio_start_ms"] == turns[0][0] * 80
    assert vad[1]["audio_end_ms"] == (eou1 + 1 - POLICY.eou_frames) * 80
    assert vad[2]["audio_start_ms"] == (barge + 1 - POLICY.barge_in_frames) * 80
    assert vad[0]["item_id"] == vad[1]["item_id"] != vad[2]["item_id"] == vad[3]["item_id"]
    # the user's items: added when speech starts, done with the transcript when it stops
    for start, stop in ((vad[0], vad[1]), (vad[2], vad[3])):
        added = [e for e in events if e["type"] == "conversation.item.added" and e["item"]["id"] == start["item_id"]]
        done = [e for e in events if e["type"] == "conversation.item.done" and e["item"]["id"] == start["item_id"]]
        assert events.index(added[0]) < events.index(start) and events.index(stop) < events.index(done[0])
        assert done[0]["item"]["role"] == "user" and done[0]["item"]["content"][0]["transcript"]
    # responses: the agent's first turn, cancelled by the barge-in; its second, closed by the commit
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert [r["status"] for r in done] == ["cancelled", "completed"]
    assert done[0]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    created = [i for i, k in enumerate(kinds) if k == "response.created"]
    assert created[0] > kinds.index("input_audio_buffer.speech_stopped")
    # at the barge-in the response ends first, then the user's speech starts
    assert kinds.index("response.done") < kinds.index("input_audio_buffer.speech_started", created[0])
    for r in done:  # each assistant message is a conversation item, done before its response
        item = r["output"][0]
        assert any(e["type"] == "conversation.item.done" and e["item"]["id"] == item["id"] for e in events)
    # audio only within responses, and exactly the session's audio of the agent's turns
    inside, open_ = [], False
    for e in events:
        open_ = (open_ or e["type"] == "response.created") and e["type"] != "response.done"
        if e["type"] == "response.output_audio.delta":
            assert open_
            inside.append(base64.b64decode(e["delta"]))
    audio = [e.samples for e in ref if e.kind == "audio"]
    want = np.concatenate(audio[eou1:barge] + audio[eou2:])
    have = np.frombuffer(b"".join(inside), np.int16).astype(np.int32)
    assert have.shape[0] == want.shape[0]
    assert np.abs(have - np.frombuffer(pcm16_encode(want), np.int16)).max() <= 1


def test_listening_audio_gives_the_sessions_whole_timeline_with_the_policy(heard):
    """nvchat.listening_audio: every frame's audio, equal to a StreamingSession with the same policy."""
    pcm = conversation_audio()
    session = {**GA_16K_22K, "nvchat": {"deterministic": True, "listening_audio": True,
                                        "turn_taking": {"window": 10, "eou_frames": 10, "barge_in_frames": 8,
                                                        "first_turn_fallback_frames": 10_000,
                                                        "punctuation_bias": False}}}
    with serve(heard, turn_taking=False, clock=0) as (address, _):
        events = asyncio.run(run_ga(address, pcm, session))
    created = events[0]["session"]["nvchat"]
    assert created["turn_taking"] is False and created["listening_audio"] is False
    updated = [e for e in events if e["type"] == "session.updated"][-1]["session"]["nvchat"]
    assert updated["turn_taking"] == POLICY.to_dict() and updated["listening_audio"] is True
    ref_session, ref = reference(heard, pcm, turn_taking=POLICY)
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    want = np.frombuffer(pcm16_encode(np.concatenate([e.samples for e in ref if e.kind == "audio"])), np.int16)
    have = np.frombuffer(audio, np.int16).astype(np.int32)
    assert have.shape == want.shape and np.abs(have - want).max() <= 1
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert ref_session.text.startswith(text) and text
    assert [e["type"] for e in events].count("input_audio_buffer.speech_started") == 2


class _EachStep(_HookedModel):
    """The model, but the server's engine calls ``before_step()`` before each step and ``after_step()``
    after it, with the sessions it opened in ``self.sessions``."""

    def __init__(self, model):
        super().__init__(model)
        self.sessions: list = []

    def opened(self, handle):
        self.sessions.append(handle)

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def create_engine(self, max_sessions, profile=False):
        engine = super().create_engine(max_sessions, profile)
        step = engine.step

        def each_step():
            self.before_step()
            try:
                return step()
            finally:
                self.after_step()

        engine.step = each_step
        return engine


class OwnTurnAt(_EachStep):
    """Each session emits BOS on frame ``frame``, forced on its text channel just before that frame
    runs: the model taking the turn itself, not the policy."""

    def __init__(self, model, frame: int):
        super().__init__(model)
        self.frame, self.forced = frame, set()

    def before_step(self) -> None:
        for h in self.sessions:
            if h.frame_index == self.frame and id(h) not in self.forced:
                self.forced.add(id(h))
                h.force_tokens("text", [self._model.config.bos_token_id])


def reference_by_frame(model, pcm: np.ndarray, before, **options) -> list:
    """As ``reference``, frame by frame, calling ``before(frame, session)`` before each frame."""
    session = model.create_streaming_session(nv.StreamingOptions(deterministic=True, **options))
    wave, events = pcm.astype(np.float32) / 32768.0, []
    for i in range(0, len(wave), FRAME):
        before(i // FRAME, session)
        events += session.push_audio(wave[i:i + FRAME], 16000)
    return events + session.flush(pad_partial=True)


def reference_forced(model, pcm: np.ndarray, frame: int, token: int, **options) -> list:
    """As ``reference``, frame by frame, with ``token`` forced on the text channel at ``frame``."""
    return reference_by_frame(model, pcm, lambda i, session: session.force_tokens("text", [token]) if i == frame
                              else None, **options)


def test_the_models_own_turn_stops_the_users_speech_and_a_barge_in_starts_it_again(heard):
    """The model takes the turn with its own BOS while the user's confirmed speech is open (no end of
    utterance): speech_stopped is sent on that frame, so the barge-in that follows sends its own
    speech_started; a commit during speech stops it too. Every speech_started has its speech_stopped,
    naming the same user item."""
    speech, _ = sf.read(EXAMPLE, dtype="int16")
    quiet = np.zeros(5 * FRAME, np.int16)
    pcm = np.concatenate([quiet, speech[:32000], np.zeros(15 * FRAME, np.int16), speech[:25600]])  # ends in speech
    _, plain = reference(heard, pcm, turn_taking=POLICY)
    confirmed = next(e.frame_index for e in plain if e.kind == "turn" and e.reason == "user_speech")
    own = confirmed + 2  # the model's BOS, while the user still speaks
    bos = heard.config.bos_token_id
    ref = reference_forced(heard, pcm, own, bos, turn_taking=POLICY)
    turns = [(e.frame_index, e.reason) for e in ref if e.kind == "turn" and e.frame_index > confirmed]
    acts = [(f, r) for f, r in turns if r != "user_speech"]  # re-confirmations after a barge-in send nothing
    assert [r for _, r in acts] == ["barge_in", "end_of_utterance", "barge_in"], turns
    (barge1, _), (eou, _), (barge2, _) = acts
    assert own < barge1 and [e.token_id for e in ref if e.kind == "turn" and e.frame_index == eou] == [bos]
    with serve(OwnTurnAt(heard, own), turn_taking=POLICY, clock=0) as (address, _):
        events = asyncio.run(run_ga(address, pcm, {**GA_16K_22K, "nvchat": {"deterministic": True}}))
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    vad = [e for e in events if e["type"].startswith("input_audio_buffer.speech_")]
    assert [(e["type"][len("input_audio_buffer.speech_"):], e.get("audio_start_ms", e.get("audio_end_ms")))
            for e in vad] == [("started", confirmed * 80), ("stopped", own * 80),
                              ("started", (barge1 + 1 - POLICY.barge_in_frames) * 80),
                              ("stopped", (eou + 1 - POLICY.eou_frames) * 80),
                              ("started", (barge2 + 1 - POLICY.barge_in_frames) * 80),
                              ("stopped", len(pcm) // FRAME * 80)]  # the commit, where the audio ends
    items = [e["item_id"] for e in vad]
    assert items[0::2] == items[1::2] and len(set(items)) == 3
    for item in set(items):  # each user item is done after its speech stops
        done = [i for i, e in enumerate(events) if e["type"] == "conversation.item.done" and e["item"]["id"] == item]
        assert len(done) == 1 and done[0] > events.index(vad[items.index(item) + 1])
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert [(r["status"], r.get("status_details", {}).get("reason")) for r in done] == \
        [("cancelled", "turn_detected"), ("cancelled", "turn_detected"), ("completed", None)]
    # the model's own turn opens the first response after its speech_stopped; each barge-in ends the
    # open response, then the user's speech starts
    assert events.index(vad[1]) < kinds.index("response.created")
    cancels = [i for i, k in enumerate(kinds) if k == "response.done"][:2]
    assert [kinds.index("input_audio_buffer.speech_started", i) for i in cancels] == \
        [events.index(vad[2]), events.index(vad[4])]
    assert events.index(vad[5]) < kinds.index("input_audio_buffer.committed")


class OwnTokenAt(_EachStep):
    """On frame ``frame`` of each session the model itself picks ``token`` (its text logits biased for
    that step of the server's engine)."""

    def __init__(self, model, frame: int, token: int):
        super().__init__(model)
        self.frame, self.armed = frame, False
        self.hook = text_logit_bias(model, token, 1e4, lambda: self.armed)

    def before_step(self) -> None:
        self.armed = any(h.frame_index == self.frame for h in self.sessions)

    def after_step(self) -> None:
        self.armed = False


def test_speech_left_unconfirmed_by_the_models_own_turn_still_gets_its_speech_stopped(heard):
    """The model's own BOS while the user has spoken for barge_in_frames is stopped at once (a barge-in
    on the frame it starts), which leaves the user's speech unconfirmed; the user stops a frame later, too
    soon to be confirmed again, so no end of utterance comes and the agent is not given the turn. The
    policy reports ``speech_ended`` eou_frames later, and the server sends the speech_stopped that pairs
    with its speech_started, then the next turn goes as usual."""
    pcm = conversation_audio()
    own = 5 + 25 - 2  # the model's BOS two frames before the first speech ends
    bos, eos = heard.config.bos_token_id, heard.config.eos_token_id
    server = OwnTokenAt(heard, own, bos)
    try:
        ref = reference_by_frame(heard, pcm, lambda i, _: setattr(server, "armed", i == own), turn_taking=POLICY)
        server.armed = False
        turns = [(e.frame_index, e.reason) for e in ref if e.kind == "turn"]
        confirmed = turns[0][0]
        # the BOS became the barge-in's EOS; silence from own + 2, so eou_frames of it end on own + 11
        assert turns[:3] == [(confirmed, "user_speech"), (own, "barge_in"),
                             (own + 1 + POLICY.eou_frames, "speech_ended")], turns
        assert [r for _, r in turns[3:]] == ["user_speech", "end_of_utterance"], turns
        assert [e.token_id for e in ref if e.kind == "turn" and e.reason == "barge_in"] == [eos]
        with serve(server, turn_taking=POLICY, clock=0) as (address, _):
            events = asyncio.run(run_ga(address, pcm, {**GA_16K_22K, "nvchat": {"deterministic": True}}))
    finally:
        server.hook.remove()
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    vad = [e for e in events if e["type"].startswith("input_audio_buffer.speech_")]
    eou = turns[4][0]
    assert [(e["type"][len("input_audio_buffer.speech_"):], e.get("audio_start_ms", e.get("audio_end_ms")))
            for e in vad] == [("started", confirmed * 80), ("stopped", (own + 2) * 80),
                              ("started", turns[3][0] * 80), ("stopped", (eou + 1 - POLICY.eou_frames) * 80)]
    items = [e["item_id"] for e in vad]
    assert items[0::2] == items[1::2] and len(set(items)) == 2
    first_done = next(i for i, e in enumerate(events) if e["type"] == "conversation.item.done"
                      and e["item"]["id"] == items[0])
    assert events.index(vad[1]) < first_done < events.index(vad[2])
    # the model's BOS never reached the text channel, so no response opened before the second turn's
    assert kinds.index("response.created") > events.index(vad[3])


def test_switching_the_policy_off_mid_speech_ends_that_speech(heard):
    """A session.update that switches the policy off while the user's speech is open (after its
    speech_started, before its end of utterance) ends that speech where the audio sent before the update
    ends: no policy is left to end it. The speech that follows starts nothing."""
    pcm = conversation_audio()
    _, ref = reference(heard, pcm, turn_taking=POLICY)
    confirmed = next(e.frame_index for e in ref if e.kind == "turn" and e.reason == "user_speech")
    off = {"type": "session.update", "session": {"type": "realtime", "nvchat": {"turn_taking": False}}}
    with serve(heard, turn_taking=POLICY, clock=0) as (address, _):
        events = asyncio.run(run_ga(address, pcm, {**GA_16K_22K, "nvchat": {"deterministic": True}},
                                    during=[off], at=confirmed + 5))
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    vad = [e for e in events if e["type"].startswith("input_audio_buffer.speech_")]
    assert [e["type"][len("input_audio_buffer.speech_"):] for e in vad] == ["started", "stopped"], vad
    assert vad[0]["audio_start_ms"] == confirmed * 80 and vad[0]["item_id"] == vad[1]["item_id"]
    # the update is answered at once; the speech stops once the frames sent before it have run, where
    # they end (the update came after frame confirmed + 5)
    updated = [i for i, e in enumerate(events) if e["type"] == "session.updated"][-1]
    assert events[updated]["session"]["nvchat"]["turn_taking"] is False
    assert vad[1]["audio_end_ms"] == (confirmed + 6) * 80 and updated < events.index(vad[1])
    done = [e for e in events if e["type"] == "conversation.item.done" and e["item"]["id"] == vad[0]["item_id"]]
    assert len(done) == 1 and events.index(vad[1]) < events.index(done[0])


def test_every_valid_ga_event_and_value_is_taken(model):
    """Valid GA values the model cannot honour are taken and session.updated shows what is in effect;
    message items before the audio join the prompt, during it they are recorded with a notice; items
    can be truncated, retrieved and deleted; no event gets an error."""
    speech, _ = sf.read(EXAMPLE, dtype="int16")
    pcm = speech[:12 * FRAME]
    values = {**GA_16K_22K, "output_modalities": ["text"], "tool_choice": "required",
              "audio": {**GA_16K_22K["audio"],
                        "input": {**GA_16K_22K["audio"]["input"], "transcription": {"model": "whisper-1"},
                                  "turn_detection": {"type": "semantic_vad", "eagerness": "high"}},
                        "output": {**GA_16K_22K["audio"]["output"], "voice": "alloy"}},
              "nvchat": {"deterministic": True, **RAW}}
    hello = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}
    before = [{"type": "conversation.item.create", "event_id": "m1", "item": {**hello, "id": "item_hello"}},
              {"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                                                            "content": [{"type": "input_text", "text": "Be brief."}]}},
              # a framework replaying its context's tool result before the audio: history, not heard
              {"type": "conversation.item.create", "item": {"type": "function_call_output", "id": "item_result",
                                                            "call_id": "call_old", "output": '{"ok": true}'}},
              {"type": "response.cancel"},  # with no response open: nothing to cancel
              # the agent's turn asked for before the audio: its BOS on the first frame (not cancelled:
              # a cancel before its BOS frame would keep that turn from being sent)
              {"type": "response.create", "response": {"output_modalities": ["audio"], "conversation": "auto"}}]
    transcription = {"type": "transcription", "include": ["item.input_audio_transcription.logprobs"],
                     "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                                         "noise_reduction": {"type": "far_field"},
                                         "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}}
    # G.711 both ways, then back to pcm16 before the next append: no audio is sent in between
    g711 = {"input": {"format": {"type": "audio/pcma"}}, "output": {"format": {"type": "audio/pcmu"}}}
    mcp = [{"type": "mcp_list_tools", "id": "item_mcp_tools", "server_label": "docs",
            "tools": [{"name": "search", "input_schema": {"type": "object"}, "description": None}]},
           {"type": "mcp_approval_request", "id": "item_mcp_ask", "server_label": "docs", "name": "search",
            "arguments": "{}"},
           {"type": "mcp_approval_response", "id": "item_mcp_ok", "approval_request_id": "item_mcp_ask",
            "approve": True, "reason": None},
           {"type": "mcp_call", "id": "item_mcp_call", "server_label": "docs", "name": "search", "arguments": "{}",
            "output": None, "error": {"type": "tool_execution_error", "message": "no"}}]
    during = [{"type": "conversation.item.create", "item": {**hello, "id": "item_late"}},
              {"type": "session.update", "session": transcription},
              {"type": "session.update", "session": {"type": "realtime", "instructions": "changed"}},
              {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}},
              {"type": "session.update", "session": {"type": "realtime", "audio": g711}},
              {"type": "session.update", "session": {"type": "realtime", "audio": GA_16K_22K["audio"]}},
              *({"type": "conversation.item.create", "item": item} for item in mcp),
              {"type": "conversation.item.retrieve", "item_id": "item_hello"},
              {"type": "conversation.item.truncate", "item_id": "item_late", "content_index": 0, "audio_end_ms": 0},
              {"type": "conversation.item.delete", "item_id": "item_late"},
              {"type": "output_audio_buffer.clear"}]
    with serve(model, clock=0) as (address, _):
        events = asyncio.run(run_ga(address, pcm, values, before, during))
    kinds = [e["type"] for e in events]
    assert "error" not in kinds, [e for e in events if e["type"] == "error"]
    first = [e["session"] for e in events if e["type"] == "session.updated"][0]
    assert first["output_modalities"] == ["audio"] and first["tool_choice"] == "auto"
    assert first["audio"]["output"]["voice"] == model.config.speaker
    assert first["audio"]["input"]["transcription"] == {"model": "nvchat-rnnt"}
    assert first["audio"]["input"]["turn_detection"] is None  # the raw model: no turn detection
    assert {"output_modalities", "tool_choice", "audio.output.voice", "audio.input.transcription",
            "audio.input.turn_detection"} <= set(first["nvchat"]["not_applied"])
    updates = [e["session"] for e in events if e["type"] == "session.updated"]
    last = updates[-1]
    assert last["instructions"] == model.config.default_system_prompt and "instructions" in last["nvchat"]["not_applied"]
    # the transcription session is taken; in effect the conversation runs on, and RNNT transcribes
    transcribing = [u for u in updates if "type" in u["nvchat"]["not_applied"]]
    assert transcribing and transcribing[0]["type"] == "realtime" and "type" not in last["nvchat"]["not_applied"]
    assert transcribing[0]["audio"]["input"]["transcription"] == {"model": "nvchat-rnnt"}
    assert {"include", "audio.input.noise_reduction"} <= set(transcribing[0]["nvchat"]["not_applied"])
    assert [u["audio"]["input"]["format"] for u in updates[-2:]] == [{"type": "audio/pcma"}, GA_16K_22K["audio"][
        "input"]["format"]]
    assert updates[-2]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    for verb in ("retrieved", "truncated", "deleted", "added", "done"):
        assert f"conversation.item.{verb}" in kinds, verb
    for item in mcp:  # recorded as given
        added = [e["item"] for e in events if e["type"] == "conversation.item.added" and e["item"]["id"] == item["id"]]
        assert added == [{**item, "object": "realtime.item"}]
        assert any(e["type"] == "conversation.item.done" and e["item"]["id"] == item["id"] for e in events)
    notices = [e for e in events if e["type"] == "nvchat.notice"]
    assert [(n["code"], n["item_id"]) for n in notices] == [
        ("item_not_heard", "item_result"), ("item_not_heard", "item_late"),
        *(("item_not_used", item["id"]) for item in mcp)]
    assert "output_audio_buffer.cleared" in kinds
    # what the model heard: the prompt with the messages created before the audio, one line each
    prompt = "\n".join(p for p in (model.config.default_system_prompt, "User: Hello there", "Be brief.") if p)
    ref_session, ref = reference(model, pcm, bos=True, system_prompt=prompt)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    raw, _ = reference(model, pcm, bos=True)
    assert ref_session.text.startswith(text) and text and not raw.text.startswith(text)


def sndfile_g711(law: str):
    """libsndfile's G.711 (an implementation independent of ours): (encode int16 -> bytes, decode bytes -> int16)."""
    subtype = {"pcmu": "ULAW", "pcma": "ALAW"}[law]

    def encode(pcm: np.ndarray) -> bytes:
        out = io.BytesIO()
        sf.write(out, pcm.astype(np.int16), 8000, format="RAW", subtype=subtype)
        return out.getvalue()

    def decode(data: bytes) -> np.ndarray:
        return sf.read(io.BytesIO(data), dtype="int16", format="RAW", subtype=subtype, samplerate=8000,
                       channels=1)[0]

    return encode, decode


@pytest.mark.parametrize("law", ["pcmu", "pcma"])
def test_g711_is_the_itu_codec(law):
    """Decoding equals libsndfile's for all 256 codes; encoding equals CPython's audioop (Sun's ITU
    reference code) where it still exists, and is otherwise checked to pick the code whose step holds
    the value (libsndfile's encoder rounds where the reference truncates, so it is no oracle here)."""
    _, decode = sndfile_g711(law)
    codes = bytes(range(256))
    assert np.array_equal(g711_decode(codes, law), decode(codes).astype(np.float32) / 32768.0)
    pcm = np.arange(-32768, 32768)
    got = np.frombuffer(g711_encode(pcm / 32767.0, law), np.uint8)  # pcm16's rounding gives back pcm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = importlib.util.find_spec("audioop") and importlib.import_module("audioop")
    if audioop:
        lin2 = audioop.lin2ulaw if law == "pcmu" else audioop.lin2alaw
        assert np.array_equal(got, np.frombuffer(lin2(pcm.astype("<i2").tobytes(), 2), np.uint8))
    else:
        levels = np.sort(decode(codes).astype(np.int64))
        back = decode(got.tobytes()).astype(np.int64)
        i = np.searchsorted(levels, back)  # the value lies within a step of the level it decodes to
        step = np.maximum(np.diff(levels, prepend=levels[0])[i], np.diff(levels, append=levels[-1])[i])
        assert (np.abs(back - np.clip(pcm, levels[0], levels[-1])) <= step).all()


@pytest.mark.parametrize("law_in, law_out", [("pcmu", "pcma"), ("pcma", "pcmu")])
def test_g711_audio_round_trips_through_the_server(model, law_in, law_out):
    """audio/pcmu and audio/pcma (8 kHz G.711) both ways: the client's bytes are decoded and resampled
    to 16 kHz, and the model's 22.05 kHz audio resampled to 8 kHz and encoded, one soxr stream each
    way: what the client gets is the session's audio for that input, to one pcm16 step before the code."""
    speech, _ = sf.read(EXAMPLE, dtype="int16")
    encode, decode = sndfile_g711(law_in)
    sent = encode(resample(speech[:16000].astype(np.float32) / 32768.0, 16000, 8000).clip(-1, 1) * 32767)
    session = {"type": "realtime", "audio": {"input": {"format": {"type": f"audio/{law_in}"}},
                                             "output": {"format": {"type": f"audio/{law_out}"}}},
               "nvchat": {"deterministic": True, **RAW}}
    with serve(model, clock=0) as (address, _):
        events = asyncio.run(run_ga(address, [sent[i:i + 640] for i in range(0, len(sent), 640)], session))
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    updated = [e["session"] for e in events if e["type"] == "session.updated"][0]
    assert updated["audio"]["input"]["format"] == {"type": f"audio/{law_in}"}
    assert updated["audio"]["output"]["format"] == {"type": f"audio/{law_out}"}
    wave = StreamResampler(8000, 16000)(decode(sent).astype(np.float32) / 32768.0, last=True)
    session_ref = model.create_streaming_session(nv.StreamingOptions(deterministic=True))
    ref = session_ref.push_audio(wave, 16000) + session_ref.flush(pad_partial=True)
    out = StreamResampler(22050, 8000)(np.concatenate([e.samples for e in ref if e.kind == "audio"]), last=True)
    got = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in events
                                 if e["type"] == "response.output_audio.delta"), np.uint8)
    assert got.shape == out.shape and len(got) > 8000
    step = 1 / 32767.0  # the engine's audio is the session's within float rounding: one pcm16 step
    near = [np.frombuffer(g711_encode(out + d, law_out), np.uint8) for d in (-step, 0.0, step)]
    assert ((got == near[0]) | (got == near[1]) | (got == near[2])).all()
    assert (got == near[1]).mean() > 0.99
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert text and session_ref.text.startswith(text)


def test_keys_outside_the_ga_forms_are_still_errors(model):
    """The forms taken above, with a key their GA schema does not have, or without a required one."""
    bad = [({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": {
               "type": "audio/pcmu", "rate": 8000}}}}}, "unsupported_audio_format", "session.audio.input.format.rate"),
           ({"type": "session.update", "session": {"type": "transcription", "instructions": "hi"}},
            "unknown_parameter", "session.instructions"),
           ({"type": "session.update", "session": {"type": "transcription", "audio": {"output": {}}}},
            "unknown_parameter", "session.audio.output"),
           ({"type": "session.update", "session": {"type": "audio/pcmu"}}, "invalid_value", "session.type"),
           ({"type": "conversation.item.create", "item": {"type": "mcp_call", "name": "x", "arguments": "{}",
                                                          "server_label": "s", "result": "?"}},
            "unknown_parameter", "item.result"),
           ({"type": "conversation.item.create", "item": {"type": "mcp_call", "name": "x", "arguments": "{}"}},
            "invalid_value", "item")]

    async def run(address):
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            got = []
            for event, _, _ in bad:
                await ws.send(json.dumps(event))
                got.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))  # the answer to it
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            return got, json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["type"]

    with serve(model, clock=0) as (address, _):
        errors, after = asyncio.run(run(address))
    assert [(e["error"]["code"], e["error"]["param"]) for e in errors] == [(code, param) for _, code, param in bad]
    assert after == "session.updated"


def test_tools_the_model_cannot_call_are_refused_at_session_update(model):
    """The tiny model's tokenizer has no tool-call markers: the update is refused, the session runs."""
    async def run(address):
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {**GA_16K_22K, "tools": [WEATHER]}}))
            error = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.zeros(2 * FRAME, np.int16))}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            kinds = []
            while "response.done" not in kinds:
                kinds.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["type"])
            return error, kinds

    with serve(model, clock=0) as (address, _):
        error, kinds = asyncio.run(run(address))
    assert error["type"] == "error" and error["error"]["code"] == "tools_unsupported"
    assert "<SPECIAL_20>" in error["error"]["message"] and "error" not in kinds


def test_turn_taking_settings_and_the_mlx_dialect(heard):
    """nvchat.turn_taking: false, an object, unknown fields and bad values; mlx-vlm's dialect has the
    policy only when asked (its ids are the raw model's otherwise)."""
    pcm = conversation_audio()

    async def mlx(address, config):
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": config}))
            await ws.recv()
            for i in range(0, len(pcm), FRAME):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm[i:i + FRAME]),
                                          "sample_rate": 16000}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            events = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
            return [e["token_id"] for e in events if e["type"] == "response.text.delta"]

    async def settings(address):
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            got = []
            for ext in ({"turn_taking": False}, {"turn_taking": {"eou_frames": 20}}, {"turn_taking": {"eou": 1}},
                        {"turn_taking": {"eou_frames": -1}}, {"turn_taking": True}):
                await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "nvchat": ext}}))
                got.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
            return got

    mlx_config = {"system_prompt": None, "seed": 0, "nvchat": {"deterministic": True}}
    with serve(heard, turn_taking=POLICY, clock=0) as (address, _):
        raw_ids = asyncio.run(mlx(address, mlx_config))
        policy_ids = asyncio.run(mlx(address, {**mlx_config, "nvchat": {"deterministic": True, "turn_taking": {
            "window": 10, "eou_frames": 10, "barge_in_frames": 8, "first_turn_fallback_frames": 10_000,
            "punctuation_bias": False}}}))
        updates = asyncio.run(settings(address))
    raw, raw_events = reference(heard, pcm)
    with_policy, policy_events = reference(heard, pcm, turn_taking=POLICY)
    assert raw_ids == [e.token_id for e in raw_events if e.kind == "assistant_text_delta"]
    assert policy_ids == [e.token_id for e in policy_events if e.kind == "assistant_text_delta"] != raw_ids
    assert updates[0]["session"]["nvchat"]["turn_taking"] is False
    assert updates[1]["session"]["nvchat"]["turn_taking"] == TurnTakingConfig(eou_frames=20).to_dict()
    assert updates[2]["error"]["code"] == "unknown_parameter" and "eou" in updates[2]["error"]["param"]
    assert updates[3]["error"]["code"] == "invalid_value"
    assert updates[4]["session"]["nvchat"]["turn_taking"] == TurnTakingConfig().to_dict()


@pytest.mark.parametrize("name, fired", [("speechy", {"user_speech", "first_turn_fallback", "barge_in"}),
                                         ("sparse", {"user_speech", "end_of_utterance"})])
def test_a_session_an_engine_row_and_the_server_give_the_same_frames_with_the_policy(request, name, fired):
    """NVIDIA's stock policy on checkpoints built to make it fire: the same audio through a
    StreamingSession, a BatchEngine row stepped beside another conversation, and the server (mlx-vlm's
    dialect, which carries each frame's token ids and audio codes) gives the same text and function
    ids frame by frame, the same audio codes, and the same audio (the server's to one pcm16 step)."""
    model = request.getfixturevalue(name)
    wave = synth_audio(WAVE_SECONDS)[:62 * FRAME]
    pcm = np.round(np.clip(wave, -1, 1) * 32767).astype(np.int16)
    heard = pcm.astype(np.float32) / 32768.0  # what the server hears of the pcm16
    options = nv.StreamingOptions(system_prompt=PROMPT, seed=0, deterministic=True, turn_taking=TurnTakingConfig())
    frames = range(0, len(heard), FRAME)
    session = model.create_streaming_session(options)
    alone, alone_ids = [], []
    for i in frames:
        alone += session.push_audio(heard[i:i + FRAME], 16000)
        alone_ids.append(session.last_ids)
    alone += session.flush(pad_partial=True)
    assert {e.reason for e in alone if e.kind == "turn"} == fired
    # the engine: this conversation in a row, beside another (its own prompt, seed, audio and policy values)
    engine = model.create_engine(max_sessions=2)
    row = engine.open(options)
    other = engine.open(nv.StreamingOptions(system_prompt="be brief", seed=1, deterministic=True,
                                            turn_taking=TurnTakingConfig(eou_frames=5, barge_in_frames=7)))
    beside = heard[::-1].copy()
    in_row, row_ids = [], []
    for k, i in enumerate(frames):
        row.push_audio(heard[i:i + FRAME], 16000)
        if k % 3:  # the other one sits out every third step
            other.push_audio(beside[i:i + FRAME], 16000)
        stepped = engine.step()
        assert row in stepped
        in_row += stepped[row]
        row_ids.append(row.last_ids)
    row.flush()
    for _ in range(5):  # bounded: the flush's step, then nothing is left
        if row.closed:
            break
        in_row += engine.step().get(row, [])
    assert row.closed and row_ids == alone_ids
    assert_same_events(in_row, alone)
    config = {"system_prompt": PROMPT, "seed": 0, "nvchat": {"deterministic": True, "turn_taking": True}}
    with serve(model, clock=0) as (address, _):
        events, code = asyncio.run(mlx_conversation(address, pcm, config))
    assert code == 1000

    def channel(kind_server: str, kind_session: str):
        return ([(e["frame_index"], e["token_id"]) for e in events if e["type"] == kind_server],
                [(e.frame_index, e.token_id) for e in alone if e.kind == kind_session])

    for server_kind, session_kind in (("response.text.delta", "assistant_text_delta"),
                                      ("response.function.delta", "function_delta")):
        got, want = channel(server_kind, session_kind)
        assert got == want
    got_text, _ = channel("response.text.delta", "assistant_text_delta")
    assert got_text and all(alone_ids[f][0] == t for f, t in got_text if t is not None)  # the frames' own ids
    chunks = [e for e in events if e["type"] == "response.audio.delta"]
    assert [c["frame_index"] for c in chunks] == list(range(len(alone_ids)))
    assert np.array_equal(np.array([c["audio_codes"] for c in chunks]),
                          np.stack([e.audio_codes for e in alone if e.kind == "audio"]))
    assert_same_pcm(b"".join(base64.b64decode(c["delta"]) for c in chunks),
                    np.concatenate([e.samples for e in alone if e.kind == "audio"]))
