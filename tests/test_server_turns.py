"""Turns and the conversation over the GA protocol: NVIDIA's policy as server VAD events, responses
that follow the agent's turns, barge-in as a cancelled response, conversation items for everything,
and every valid GA client event and value taken without an ``error`` (docs/server.md).

All on loopback with bounded waits; the tiny model's RNNT is made to hear loudness
(``test_pipecat.voice_activity_rnnt``), so the policy's events fall on known frames.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import soundfile as sf
import torch
import websockets

import nvchat_torch as nv
from nvchat_torch.audio_io import pcm16_encode
from nvchat_torch.turn_taking import TurnTakingConfig
from test_server import EXAMPLE, GA_16K_22K, RAW, TIMEOUT, WEATHER, b64, serve

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


async def run_ga(address: str, pcm: np.ndarray, session: dict, before=(), during=()) -> list[dict]:
    """Connect, send ``before`` events, the session.update, the audio frame by frame (``during`` after
    the first frame), then commit; every event up to the commit's response.done."""
    async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
        events = [json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))]
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        for event in before:
            await ws.send(json.dumps(event))
        for i in range(0, len(pcm), FRAME):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm[i:i + FRAME])}))
            if i == 0:
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


def reference(model, pcm: np.ndarray, **options):
    session = model.create_streaming_session(nv.StreamingOptions(deterministic=True, **options))
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
                                                            "content": [{"type": "input_text", "text": "Be brief."}]}}]
    during = [{"type": "conversation.item.create", "item": {**hello, "id": "item_late"}},
              {"type": "session.update", "session": {"type": "realtime", "instructions": "changed"}},
              {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}},
              {"type": "conversation.item.retrieve", "item_id": "item_hello"},
              {"type": "conversation.item.truncate", "item_id": "item_late", "content_index": 0, "audio_end_ms": 0},
              {"type": "conversation.item.delete", "item_id": "item_late"},
              {"type": "response.create", "response": {"output_modalities": ["audio"]}},
              {"type": "response.cancel"}, {"type": "output_audio_buffer.clear"}]
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
    last = [e["session"] for e in events if e["type"] == "session.updated"][-1]
    assert last["instructions"] == model.config.default_system_prompt and "instructions" in last["nvchat"]["not_applied"]
    for verb in ("retrieved", "truncated", "deleted", "added", "done"):
        assert f"conversation.item.{verb}" in kinds, verb
    notices = [e for e in events if e["type"] == "nvchat.notice"]
    assert [(n["code"], n["item_id"]) for n in notices] == [("item_not_heard", "item_late")]
    assert "output_audio_buffer.cleared" in kinds
    # what the model heard: the prompt with the messages created before the audio, one line each
    prompt = "\n".join(p for p in (model.config.default_system_prompt, "User: Hello there", "Be brief.") if p)
    ref_session, ref = reference(model, pcm, system_prompt=prompt)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    raw, _ = reference(model, pcm)
    assert ref_session.text.startswith(text) and text and not raw.text.startswith(text)


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
