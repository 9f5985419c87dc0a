"""Steps off the clock: a session steps its timeline with no input audio (NVIDIA's silence embedding on
the user channel, as its tool pipeline writes a call and injects a result), alone or as a row of the
engine batched with its peers; checked against the MLX reference driven the same way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram
from mlx_oracle import synth_audio
from test_engine import assert_same_events
from test_layouts import LAYOUTS, MIN_SNR_DB, snr_db
from test_session import PROMPT

import nvchat_torch as nv
from nvchat_torch import ContextLimit

FRAME = 1280
# Heard frames and steps off the clock, in order: ("hear", frames) or ("off", steps, text, speak, keep_audio).
PAD = 12  # the tiny models' pad id (tiny_config_dict)
SCHEDULE = [("hear", 4), ("off", 3, None, None, True), ("hear", 3), ("off", 4, PAD, [40, 41, 42], True),
            ("hear", 2), ("off", 2, PAD, None, False), ("hear", 3)]


def actions(schedule) -> list[tuple]:
    """A schedule one step at a time: ("frame", index of the frame in the wave) or ("off", text, spoken
    ids (a list of at most one), keep_audio)."""
    out, frame = [], 0
    for item in schedule:
        if item[0] == "hear":
            out += [("frame", frame + k) for k in range(item[1])]
            frame += item[1]
        else:
            _, count, text, speak, keep = item
            out += [("off", text, list(speak[k:k + 1]) if speak else None, keep) for k in range(count)]
    return out


def schedule_steps(schedule) -> list[str]:
    """Each step of a schedule: "hear" or "off"."""
    return ["hear" if action[0] == "frame" else "off" for action in actions(schedule)]


def run_ours(session, wave: np.ndarray, schedule=SCHEDULE) -> tuple[list, np.ndarray]:
    """A session given ``schedule`` one step at a time: its events, and its (text, function) ids per step."""
    events, ids = [], []
    for action in actions(schedule):
        if action[0] == "frame":
            events += session.push_audio(wave[action[1] * FRAME:(action[1] + 1) * FRAME], 16000)
        else:
            events += session.step_off_clock(1, text=action[1], speak=action[2], keep_audio=action[3])
        ids.append(session.last_ids)
    return events, np.array(ids)


def reference_silence(ref) -> mx.array:
    """NVIDIA's silence embedding by the reference's own networks: its perception over one second of
    zeros, offline, first frame."""
    model = ref.model
    mel = log_mel_spectrogram(mx.zeros((16000,)), model.config.audio_config.preprocessor)
    projected, _, _ = model.stt_model.perception(mel, mx.array([mel.shape[1]]))
    return projected[:, :1]


def run_reference(ref, wave: np.ndarray, prompt: str, schedule=SCHEDULE) -> dict:
    """The reference's streaming session given the same schedule: a heard frame as it runs one, a step off
    the clock as its own timeline step on the silence embedding, with the text argmax forced and the
    TTS's text id replaced where the schedule says (the reference has no such steps: the test drives
    its timeline step directly)."""
    sess = ref.session.create_streaming_session(system_prompt=prompt, seed=0)
    silence = reference_silence(ref)
    forced: dict = {"text": None, "spoken": None}
    language_step, tts = sess._language_step, ref.model.tts_model.tts_model
    tts_step = tts.step

    def forced_language(fused):
        out = language_step(fused)
        if forced["text"] is not None:
            vocab = out.text_logits.shape[-1]
            out.text_logits = mx.where(mx.arange(vocab) == forced["text"], 1.0, 0.0).reshape(1, 1, vocab)
        return out

    def spoken_step(code, subword_ids, *args, **kwargs):
        if forced["spoken"] is not None:
            subword_ids = mx.array([[forced["spoken"]]], dtype=mx.int32)
        return tts_step(code, subword_ids, *args, **kwargs)

    sess._language_step = forced_language
    tts.step = spoken_step
    events, at = [], 0
    try:
        for item in schedule:
            if item[0] == "hear":
                events += sess.push_audio(wave[at:at + item[1] * FRAME])
                at += item[1] * FRAME
                continue
            _, count, text, speak, keep = item
            for k in range(count):
                forced["text"] = text
                forced["spoken"] = speak[k] if speak and k < len(speak) else None
                step_events, _ = sess._run_timeline_step(silence, generate_channels=True, decode_audio=True)
                events += [e for e in step_events if keep or e.kind != "audio"]
            forced["text"] = forced["spoken"] = None
    finally:
        del tts.step  # the class's own again
    prompt_steps = len(sess._text_tokens) - len(schedule_steps(schedule))
    audio = [e for e in events if e.kind == "audio"]
    return {"text_ids": np.array(sess._text_tokens[prompt_steps:]),
            "function_ids": np.array(sess._function_tokens[prompt_steps:]),
            "codes": np.stack([np.array(e.audio_codes) for e in audio]),
            "audio": np.concatenate([np.array(e.samples) for e in audio]),
            "transcript": "".join(e.delta for e in events if e.kind == "user_transcript_delta")}


@pytest.mark.parametrize("name", ["float32", "q4-f32-scales"])
def test_steps_off_the_clock_match_the_reference(make_checkpoint, reference, name):
    path = make_checkpoint(seed=0, **LAYOUTS.get(name, {}))
    ref = reference(path)
    wave = synth_audio(1.3, seed=5)
    want = run_reference(ref, wave, PROMPT)
    model = nv.load_model(path, device="cpu")
    assert_schedule_matches(model, wave, want)


def assert_schedule_matches(model, wave: np.ndarray, want: dict) -> None:
    """A session of ``model`` given SCHEDULE gives the reference's ids and codes at every step (``want``:
    :func:`run_reference`), its transcript and its audio within the parity tests' bound."""
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    got, ids = run_ours(session, wave)
    kinds = schedule_steps(SCHEDULE)
    assert session.frame_index == len(kinds) and session.input_frames == kinds.count("hear")
    # Every step's ids, heard or not, are the reference's (the forced PADs included), and the codes of
    # every step whose speech is kept.
    np.testing.assert_array_equal(ids[:, 0], want["text_ids"])
    np.testing.assert_array_equal(ids[:, 1], want["function_ids"])
    audio = [e for e in got if e.kind == "audio"]
    np.testing.assert_array_equal(np.stack([e.audio_codes for e in audio]), want["codes"])
    assert session.user_transcript == want["transcript"]
    assert snr_db(want["audio"], np.concatenate([e.samples for e in audio])) >= MIN_SNR_DB
    # the steps off the clock ran what the schedule asked: forced PADs, spoken ids, dropped speech
    off = [i for i, kind in enumerate(kinds) if kind == "off"]
    assert all(want["text_ids"][i] == PAD for i in off[3:])
    assert [e.frame_index for e in audio] == [i for i in range(len(kinds)) if i not in off[-2:]]
    assert all(e.input_frame is None for e in got if e.frame_index in off)
    heard = [e for e in got if e.frame_index not in off]
    assert {e.input_frame for e in heard} == set(range(kinds.count("hear")))


@pytest.fixture(scope="module")
def tiny():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


def test_a_step_off_the_clock_hears_nothing(ckpt_f32):
    """What a session hears is its audio alone: its transcript (log-mel, Conformer, RNNT) is the same with
    steps off the clock between its frames as without; and the steps leave the turn-taking policy's
    counters as they were."""
    wave = synth_audio(1.3, seed=5)
    model = nv.load_model(ckpt_f32, device="cpu")  # the reference's random RNNT: it transcribes this wave
    options = nv.StreamingOptions(system_prompt=PROMPT, deterministic=True, turn_taking={})
    plain = model.create_streaming_session(options)
    plain_events = plain.push_audio(wave[:15 * FRAME], 16000)
    session = model.create_streaming_session(options)
    events = session.push_audio(wave[:4 * FRAME], 16000)
    turns = session.frame_step._turns
    before = turns.saved()  # the tensors that carry a row's policy state from frame to frame
    session.step_off_clock(5, text=PAD)
    for i, ((now, _, _), then) in enumerate(zip(turns.carried(), before)):
        assert torch.equal(now, then), i
    events += session.push_audio(wave[4 * FRAME:15 * FRAME], 16000)
    assert session.input_frames == plain.input_frames == 15 and session.frame_index == 20
    transcript = [(e.input_frame, e.delta, e.text) for e in plain_events if e.kind == "user_transcript_delta"]
    assert transcript, "the transcript is empty: the check would be vacuous"
    assert [(e.input_frame, e.delta, e.text) for e in events if e.kind == "user_transcript_delta"] == transcript


def test_speech_kept_or_dropped_is_the_same_speech(tiny):
    """keep_audio=False drops the steps' audio events, not their codec steps: the speech after them is
    the same as when it is kept."""
    wave = synth_audio(1.0, seed=2)
    runs = []
    for keep in (True, False):
        session = tiny.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
        events, _ = run_ours(session, wave, [("hear", 3), ("off", 4, None, None, keep), ("hear", 5)])
        runs.append({e.frame_index: e.samples for e in events if e.kind == "audio"})
    kept, dropped = runs
    assert sorted(kept) == list(range(12)) and sorted(dropped) == [0, 1, 2] + list(range(7, 12))
    for i, samples in dropped.items():
        np.testing.assert_array_equal(samples, kept[i])


@pytest.mark.parametrize("deterministic", [True, False])
def test_engine_rows_off_the_clock_equal_sessions_alone(tiny, deterministic):
    """Steps off the clock batch with the row's peers: each row's events equal those of the same
    session alone, whatever the others do (one streams throughout, one joins later and also steps off
    the clock), in the deterministic and the sampling mode."""
    waves = [synth_audio(1.2, seed=k) for k in range(3)]
    schedules = [[("hear", 15)],
                 [("hear", 2), ("off", 3, PAD, [50, 51], True), ("hear", 4), ("off", 2, None, None, False), ("hear", 3)],
                 [("off", 2, None, None, True), ("hear", 5), ("off", 1, PAD, None, True), ("hear", 4)]]
    prompts = [PROMPT, "be brief", ""]
    options = [nv.StreamingOptions(system_prompt=p, seed=i, deterministic=deterministic) for i, p in enumerate(prompts)]
    alone = [run_ours(tiny.create_streaming_session(o), w, s)[0] for o, w, s in zip(options, waves, schedules)]
    engine = tiny.create_engine(max_sessions=3)
    handles = [engine.open(options[0]), engine.open(options[1]), None]
    todo = [actions(s) for s in schedules]
    got: list[list] = [[], [], []]
    for step in range(100):
        if step == 3:  # the third joins late
            handles[2] = engine.open(options[2])
        for i, h in enumerate(handles):
            if h is None or h.pending_steps or not todo[i]:
                continue  # a step at a time: what a session asks for runs before it asks for more
            action = todo[i].pop(0)
            if action[0] == "frame":
                h.push_audio(waves[i][action[1] * FRAME:(action[1] + 1) * FRAME], 16000)
            else:
                h.step_off_clock(1, text=action[1], speak=action[2], keep_audio=action[3])
        for h, events in engine.step().items():
            got[handles.index(h)] += events
        if all(h is not None and not h.pending_steps and not t for h, t in zip(handles, todo)):
            break
    for events, want in zip(got, alone):
        assert_same_events(events, want)
        assert [e.input_frame for e in events] == [e.input_frame for e in want]


def test_off_clock_steps_run_before_queued_frames_and_count_against_the_limit(tiny):
    engine = tiny.create_engine(max_sessions=1)
    h = engine.open(nv.StreamingOptions(deterministic=True, max_streaming_seconds=0.8))  # 10 steps
    h.push_audio(synth_audio(0.24, seed=1), 16000)  # 3 frames queued
    h.step_off_clock(2)
    assert (h.pending_frames, h.pending_steps) == (3, 5)
    events = engine.step()[h] + engine.step()[h]
    assert {e.input_frame for e in events} == {None} and h.input_frames == 0 and h.frame_index == 2
    with pytest.raises(ContextLimit):
        h.step_off_clock(6)  # 2 run + 3 frames + 6 > 10
    assert h.pending_steps == 3
    h.step_off_clock(5)
    with pytest.raises(ContextLimit):
        h.push_audio(np.zeros(FRAME, np.float32), 16000)


def test_bad_requests_change_nothing(tiny):
    engine = tiny.create_engine(max_sessions=2)
    h = engine.open(nv.StreamingOptions(deterministic=True))
    other = tiny.create_engine(max_sessions=1).open(nv.StreamingOptions(deterministic=True))
    vocab = tiny.config.text_config.vocab_size
    for count, kwargs in ((-1, {}), (1.5, {}), (True, {}), (2, {"text": vocab}), (2, {"text": -1}),
                          (1, {"speak": [1, 2]}), (2, {"speak": "hi"}), (2, {"speak": [vocab]}),
                          (1, {"keep_audio": "no"})):
        with pytest.raises(ValueError):
            h.step_off_clock(count, **kwargs)
    with pytest.raises(ValueError, match="not a session of this engine"):
        engine.step_off_clock(other, 1)
    assert h.pending_steps == 0
    h.step_off_clock(0)
    assert h.pending_steps == 0
    h.push_audio(synth_audio(0.16, seed=3), 16000)
    assert len([e for e in engine.step()[h] if e.kind == "audio"]) == 1  # still usable
    h.flush()
    with pytest.raises(RuntimeError, match="flushed"):
        h.step_off_clock(1)
    engine.step()
    h2 = engine.open(nv.StreamingOptions(deterministic=True))
    h2.cancel()
    with pytest.raises(RuntimeError, match="closed"):
        engine.step_off_clock(h2, 1)
    session = tiny.create_streaming_session(nv.StreamingOptions(deterministic=True, max_streaming_seconds=0.16))
    with pytest.raises(ContextLimit):
        session.step_off_clock(3)
    assert session.frame_index == 0
    assert len(session.step_off_clock(2)) >= 2
    session.flush()
    with pytest.raises(RuntimeError, match="closed"):
        session.step_off_clock(1)


def test_steps_off_the_clock_compile_nothing_new(ckpt_f32):
    """Compiled, a step off the clock runs in the graph every step runs (its flags are fixed: no new
    graph mid-conversation), alone and as engine rows, and gives what the eager step gives."""
    from test_compiled_step import CountingBackend

    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = nv.load_model(ckpt_f32, device="cpu", compile=backend)
    eager = nv.load_model(ckpt_f32, device="cpu")
    wave = synth_audio(1.3, seed=5)
    options = nv.StreamingOptions(system_prompt=PROMPT, seed=3)  # sampling: the draws go through the graph too
    want, _ = run_ours(eager.create_streaming_session(options), wave)
    session = compiled.create_streaming_session(options)
    events, _ = run_ours(session, wave, SCHEDULE[:1])  # heard frames only: the graph is compiled
    assert backend.batches == [1]
    for action in actions(SCHEDULE)[4:]:
        if action[0] == "frame":
            events += session.push_audio(wave[action[1] * FRAME:(action[1] + 1) * FRAME], 16000)
        else:
            events += session.step_off_clock(1, text=action[1], speak=action[2], keep_audio=action[3])
    assert backend.batches == [1]
    assert_same_events(events, want)
    # two engine rows, one off the clock while the other hears: the batch-2 graph only
    engine = compiled.create_engine(max_sessions=2)
    a, b = engine.open(options), engine.open(nv.StreamingOptions(system_prompt="hi", deterministic=True))
    a.push_audio(wave[:3 * FRAME], 16000)
    b.step_off_clock(3, text=PAD)
    rows: dict = {a: [], b: []}
    for _ in range(3):
        for h, out in engine.step().items():
            rows[h] += out
    assert backend.batches == [1, 2]
    lone_b = eager.create_streaming_session(nv.StreamingOptions(system_prompt="hi", deterministic=True))
    assert_same_events(rows[b], lone_b.step_off_clock(3, text=PAD))
    assert_same_events(rows[a], want[:len(rows[a])])
    torch._dynamo.reset()


def test_steps_of_the_tts_alone_match_the_reference(ckpt_q4, reference):
    """While a tool runs the LLM stands still and each frame heard is a step of the TTS alone (a phrase's
    id, or silence: no TTS or codec step): the perception and transcript go on, and the conversation
    then resumes where the LLM stopped. The reference driven the same way: its perception and RNNT on
    the frame, its TTS step on the id and its codec, no timeline step."""
    assert_tts_alone_matches(nv.load_model(ckpt_q4, device="cpu"), reference(ckpt_q4))


def assert_tts_alone_matches(model, ref) -> None:
    """:func:`test_steps_of_the_tts_alone_match_the_reference`'s schedule on ``model`` against ``ref``."""
    from nvchat_torch.runtime.step_plan import StepPlan

    cfg = model.config
    wave = synth_audio(1.3, seed=5)
    phrase = [cfg.bos_token_id, 40, 41, 42, PAD, PAD, cfg.eos_token_id]
    plan = [("hear", k) for k in range(4)] + [("speak", 4 + k, t) for k, t in enumerate(phrase)] + \
        [("silent", 11 + k) for k in range(3)] + [("hear", 14 + k) for k in range(2)]
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    got, ids, row = [], [], session.frame_step.rows[0]
    for item in plan:
        frame = wave[item[1] * FRAME:(item[1] + 1) * FRAME]
        if item[0] == "hear":
            events = session.push_audio(frame, 16000)
        else:
            before = (row.llm_position, row.tts_position)
            events = session._step(frame, StepPlan(spoken=item[2], thinks=False) if item[0] == "speak"
                                   else StepPlan(thinks=False, speaks=False))
            assert (row.llm_position, row.tts_position) == (before[0], before[1] + (item[0] == "speak"))
        got.append(events)
        ids.append(session.last_ids)
    # the reference, step by step
    sess = ref.session.create_streaming_session(system_prompt=PROMPT, seed=0)
    tts, codec = ref.model.tts_model.tts_model, ref.model.tts_model.audio_codec
    silence_codes = ref.model.tts_model.codec_silence_tokens
    want_codes, want_audio, transcript = [], [], ""
    for item in plan:
        frame = wave[item[1] * FRAME:(item[1] + 1) * FRAME]
        if item[0] == "hear":
            events = sess.push_audio(frame)
            transcript += "".join(e.delta for e in events if e.kind == "user_transcript_delta")
            audio = next(e for e in events if e.kind == "audio")
            want_codes.append(np.array(audio.audio_codes))
            want_audio.append(np.array(audio.samples))
            continue
        _, encoded = sess._perception_step(mx.array(frame))
        update = sess._rnnt.step(encoded)
        transcript += update[0] if update is not None else ""
        if item[0] == "speak":
            if item[2] == cfg.eos_token_id:  # as a timeline step does on an EOS text id
                sess._previous_code = mx.broadcast_to(silence_codes[None, None, :], sess._previous_code.shape)
            current = mx.array([[item[2]]], dtype=mx.int32)
            sess._previous_code = tts.step(sess._previous_code, current, mx.ones(current.shape, dtype=mx.bool_),
                                           sess._tts_cache, guidance=True).codes
            clean = sess.parent._replace_control_codes(sess._previous_code)
            want_audio.append(np.array(codec.decode_step(clean.transpose(0, 2, 1), sess._codec_cache)[0, 0]))
            want_codes.append(np.array(clean[0, 0]))
    heard_ids = [i for i, item in enumerate(plan) if item[0] == "hear"]
    prompt_steps = len(sess._text_tokens) - len(heard_ids)
    np.testing.assert_array_equal(np.array([ids[i] for i in heard_ids]),
                                  np.stack([sess._text_tokens[prompt_steps:], sess._function_tokens[prompt_steps:]], 1))
    codes = [next(e.audio_codes for e in events if e.kind == "audio") for events, item in zip(got, plan)
             if item[0] != "silent"]
    np.testing.assert_array_equal(np.stack(codes), np.stack(want_codes))
    audio = [next(e.samples for e in events if e.kind == "audio") for events, item in zip(got, plan) if item[0] != "silent"]
    assert snr_db(np.concatenate(want_audio), np.concatenate(audio)) >= MIN_SNR_DB
    assert session.user_transcript == transcript
    silent = [next(e for e in events if e.kind == "audio") for events, item in zip(got, plan) if item[0] == "silent"]
    assert all(not e.samples.any() and e.input_frame is not None for e in silent)  # heard, and silent
    assert not any(e.kind in ("assistant_text_delta", "function_delta") for events, item in zip(got, plan)
                   if item[0] != "hear" for e in events)
