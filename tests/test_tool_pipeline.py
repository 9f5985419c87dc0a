"""NVIDIA's two-phase tool pipeline in a session (nvchat_torch.tool_pipeline): the call written off the
clock while the acknowledgement is spoken, the TTS alone speaking while the tool runs, the timeout, the
result injected off the clock with its numbers spelled; the same as engine rows, and the policy held.
The steps themselves (off the clock, the TTS alone) are checked against the MLX reference in
tests/test_off_clock.py; here, what the pipeline asks of them, against NVIDIA's rules."""

from __future__ import annotations

import math

import pytest
import torch

import nvchat_torch as nv
from mlx_oracle import synth_audio
from nvchat_torch import ToolHold
from test_engine import assert_same_events
from test_tools import TOOLS

FRAME = 1280
ACK = "Sure, one moment."
ON_HOLD = "Still looking that up for you."
CALL = '<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL><SPECIAL_21>'


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def wave():
    return synth_audio(12.0)


def nvidia_layout(model, phrase: str) -> list[int]:
    """NVIDIA's layout of a phrase (P 195-196, 239-248): [BOS] + its ids + [PAD] x max(17, ceil(0.5 x
    characters)) + [EOS]."""
    cfg = model.config
    ids = model.tokenizer.encode(phrase, add_special_tokens=False)
    return [cfg.bos_token_id, *ids, *[cfg.pad_token_id] * max(17, math.ceil(0.5 * len(phrase))), cfg.eos_token_id]


class Recorder:
    """A session pushed one frame at a time, with every step's input to the frame step recorded."""

    def __init__(self, model, wave, **options):
        options = {"deterministic": True, "tools": TOOLS, **options}
        self.session = model.create_streaming_session(nv.StreamingOptions(**options))
        self.wave, self.frame, self.inputs, self.events = wave, 0, [], []
        step = self.session.frame_step
        run = step.run

        def recorded(inputs, profile=False):
            self.inputs += list(inputs.values())
            return run(inputs, profile)

        step.run = recorded

    def push(self, frames: int = 1) -> list:
        out = []
        for _ in range(frames):
            out += self.session.push_audio(self.wave[self.frame * FRAME:(self.frame + 1) * FRAME], 16000)
            self.frame += 1
        self.events += out
        return out

    def call(self, model) -> list:
        """The model starts the call in the next frame (its function channel forced): the push's events."""
        self.session.force_tokens("function", model.tokenizer.encode(CALL, add_special_tokens=False))
        return self.push()


def hold(**fields) -> ToolHold:
    return ToolHold(**{"acknowledgements": (ACK,), "on_hold": {"default": (ON_HOLD,)}, "timeout_s": 2.0, **fields})


def test_the_call_is_written_off_the_clock_while_the_acknowledgement_is_spoken(model, wave):
    drive = Recorder(model, wave, tool_hold=hold())
    drive.push(3)
    before = len(drive.inputs)
    events = drive.call(model)
    call = model.tokenizer.encode(CALL, add_special_tokens=False)
    steps = drive.inputs[before:]
    # one push: the start-of-call frame on the clock, then the rest of the call off the clock
    assert len(steps) == len(call) and steps[0].samples is not None
    assert all(s.samples is None and s.thinks and s.speaks for s in steps[1:])
    assert drive.session.input_frames == 4 and drive.session.frame_index == 3 + len(call)
    # the text channel at PAD, the TTS speaking the acknowledgement as NVIDIA lays it out, one id a step
    pad = model.config.pad_token_id
    assert all(s.text == pad for s in steps[1:])
    ack = nvidia_layout(model, ACK)
    spoken = [s.spoken for s in steps[1:]]
    assert spoken[:len(ack)] == ack[:len(spoken)] and all(t == -1 for t in spoken[len(ack):])
    # the call as the model wrote it, its speech kept, the phrase announced where it starts
    assert [e.token_id for e in events if e.kind == "function_delta"] == call
    assert sum(e.kind == "audio" for e in events) == len(call)
    (ack_event,) = [e for e in events if e.kind == "hold_speech"]
    assert (ack_event.text, ack_event.reason, ack_event.call_id, ack_event.frame_index) == (ACK, "ack", None, 4)
    (tool_call,) = [e for e in events if e.kind == "tool_call"]
    assert tool_call.frame_index == 3 + len(call) - 1 and drive.session.pipeline.waiting


def test_while_the_tool_runs_the_tts_alone_speaks_then_silence_until_the_timeout(model, wave):
    drive = Recorder(model, wave, tool_hold=hold())
    drive.push(3)
    drive.call(model)
    row = drive.session.frame_step.rows[0]
    llm = row.llm_position
    call = model.tokenizer.encode(CALL, add_special_tokens=False)
    ack, on_hold = nvidia_layout(model, ACK), nvidia_layout(model, ON_HOLD)
    rest = ack[len(call) - 1:]  # what of the acknowledgement the call's steps did not speak: it finishes
    timeout = math.ceil(2.0 / 0.08)
    before = len(drive.inputs)
    waiting = drive.push(len(rest) + len(on_hold) + timeout - 1)
    steps = drive.inputs[before:]
    assert row.llm_position == llm and all(s.samples is not None and not s.thinks for s in steps)
    assert [s.spoken for s in steps[:len(rest) + len(on_hold)]] == rest + on_hold
    assert all(not s.speaks for s in steps[len(rest) + len(on_hold):])
    audio = [e for e in waiting if e.kind == "audio"]
    assert len(audio) == len(steps) and not audio[-1].samples.any() and audio[0].samples.any()
    assert [(e.text, e.reason, e.call_id) for e in waiting if e.kind == "hold_speech"] == [(ON_HOLD, "on_hold", "call_1")]
    assert not any(e.kind in ("assistant_text_delta", "function_delta") for e in waiting)
    # the last frame of the wait (2 s of silence): then the timeout result goes in, off the clock, its
    # speech not kept
    before = len(drive.inputs)
    events = drive.push()
    timed_out = model.tokenizer.encode('<TOOL_RESPONSE>[{"error": "timeout", "message": '
                                       '"The request did not finish in time."}]</TOOL_RESPONSE>', add_special_tokens=False)
    steps = drive.inputs[before:]
    assert [s.samples is None for s in steps] == [False] + [True] * (len(timed_out) + 1)
    assert [e.token_id for e in events if e.kind == "function_delta"][:len(timed_out)] == timed_out
    assert [e.input_frame for e in events if e.kind == "audio"] == [drive.session.input_frames - 1]
    assert not drive.session.pipeline.active and row.llm_position == llm + len(timed_out) + 1
    with pytest.raises(ValueError, match="timed out"):
        drive.session.send_tool_result("call_1", {"temperature_c": 21})


def test_a_result_goes_in_off_the_clock_at_once_with_its_numbers_spelled(model, wave):
    drive = Recorder(model, wave, tool_hold=hold(timeout_s=15.0))
    drive.push(3)
    drive.call(model)
    call = model.tokenizer.encode(CALL, add_special_tokens=False)
    rest = nvidia_layout(model, ACK)[len(call) - 1:]
    drive.push(len(rest) + 3)  # the rest of the acknowledgement, then the on-hold phrase begins
    drive.session.send_tool_result("call_1", {"temperature_c": 21.5, "sky": "clear", "days": [3, 4]})
    on_hold = nvidia_layout(model, ON_HOLD)
    # the phrase begun finishes first, then in the same push the result goes in, off the clock, and
    # the session is back on the clock for its next frame
    before = len(drive.inputs)
    events = drive.push(len(on_hold) - 3)
    response = model.tokenizer.encode('<TOOL_RESPONSE>[{"temperature_c": "twenty-one point five", "sky": "clear", '
                                      '"days": ["three", "four"]}]</TOOL_RESPONSE>', add_special_tokens=False)
    steps = drive.inputs[before:]
    phrase, injected = steps[:len(on_hold) - 3], steps[len(on_hold) - 3:]
    assert [s.spoken for s in phrase] == on_hold[3:] and not any(s.thinks for s in phrase)
    assert len(injected) == len(response) + 1
    assert all(s.samples is None and s.thinks and s.text == model.config.pad_token_id for s in injected)
    assert [e.token_id for e in events if e.kind == "function_delta"][:len(response)] == response
    assert [e.kind for e in events].count("audio") == len(phrase)  # the injected steps' speech is not kept
    assert not drive.session.pipeline.active
    after = len(drive.inputs)
    drive.push()
    assert [(s.samples is not None, s.thinks) for s in drive.inputs[after:]] == [(True, True)]


def test_a_result_already_in_skips_the_phrases_not_begun(model, wave):
    drive = Recorder(model, wave, tool_hold=hold(acknowledgements=()))
    drive.push(3)
    drive.call(model)
    drive.session.send_tool_result("call_1", "sunny")
    before = len(drive.inputs)
    events = drive.push()
    assert not any(e.kind == "hold_speech" for e in events)
    assert [s.samples is None for s in drive.inputs[before:]][-1] is False
    assert not drive.session.pipeline.active


def test_generic_phrases_follow_after_their_gap_and_the_timeout_after_them(model, wave):
    generic = ("Thanks for waiting.", "Almost there now.", "Bear with me.")
    drive = Recorder(model, wave, tool_hold=hold(acknowledgements=(), generic=generic, generic_gap_s=0.24, timeout_s=0.4))
    drive.push(3)
    drive.call(model)
    before = len(drive.inputs)
    events = drive.push(200)
    plans = drive.inputs[before:]
    said = [e for e in events if e.kind == "hold_speech"]
    assert [e.reason for e in said] == ["on_hold", "on_hold", "on_hold"] and said[0].text == ON_HOLD
    assert len({e.text for e in said[1:]}) == 2 and {e.text for e in said[1:]} <= set(generic)
    # between the phrases, 3 silent frames (0.24 s); after the last, 5 (0.4 s) before the timeout result
    speaking = "".join("s" if p.samples is not None and not p.thinks and p.speaks else
                       "." if p.samples is not None and not p.thinks else "x" for p in plans)
    lengths = [len(nvidia_layout(model, e.text)) for e in said]
    assert speaking.startswith("s" * lengths[0] + "..." + "s" * lengths[1] + "..." + "s" * lengths[2] + "....." + "x")


@pytest.mark.parametrize("deterministic", [True, False])
def test_engine_rows_run_the_pipeline_as_sessions_alone(model, wave, deterministic):
    """A row calling a tool beside a row that streams: each row's events equal those of its session alone
    (its call written, its wait, its result injected, batched with the other row's frames)."""
    options = [nv.StreamingOptions(deterministic=deterministic, seed=3, tools=TOOLS, tool_hold=hold()),
               nv.StreamingOptions(deterministic=deterministic, seed=4, system_prompt="be brief")]
    call = model.tokenizer.encode(CALL, add_special_tokens=False)

    def script(h, k: int) -> None:  # what the caller does before pushing frame k
        if k == 3:
            h.force_tokens("function", call)
        if k == 12:
            h.send_tool_result("call_1", {"temperature_c": 7})

    alone = []
    for i, o in enumerate(options):
        session, events = model.create_streaming_session(o), []
        for k in range(40):
            if i == 0:
                script(session, k)
            events += session.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
        alone.append(events)
    engine = model.create_engine(max_sessions=2)
    handles, got = [engine.open(o) for o in options], [[], []]
    for k in range(40):
        script(handles[0], k)
        for h in handles:
            h.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
        while any(h.pending_steps for h in handles):  # the row writing or injecting takes steps of its own
            for h, events in engine.step().items():
                got[handles.index(h)] += events
    assert any(e.kind == "hold_speech" for e in got[0]) and any(e.kind == "tool_call" for e in got[0])
    for events, want in zip(got, alone):
        assert_same_events(events, want)


def test_a_server_tick_steps_a_holding_row_without_audio(model, wave):
    engine = model.create_engine(max_sessions=1)
    h = engine.open(nv.StreamingOptions(deterministic=True, tools=TOOLS, tool_hold=hold(acknowledgements=())))
    h.push_audio(wave[:3 * FRAME], 16000)
    while h.pending_steps:
        engine.step()
    h.force_tokens("function", model.tokenizer.encode(CALL, add_special_tokens=False))
    h.push_audio(wave[3 * FRAME:4 * FRAME], 16000)
    while h.pending_steps:  # the call written off the clock, its first token on this frame
        engine.step()
    assert h.holding and h.pending_steps == 0
    frames = h.input_frames
    h.hold_tick()
    assert h.pending_steps == 1
    (events,) = engine.step().values()
    assert [e.kind for e in events] == ["hold_speech", "audio"] and events[1].input_frame is None
    assert h.input_frames == frames and engine.step() == {}  # one step per tick
    h.push_audio(wave[4 * FRAME:5 * FRAME], 16000)
    h.hold_tick()  # audio is queued: the frame is the tick's step
    assert h.pending_steps == 1


def test_the_turn_taking_policy_is_held_through_the_call(model, wave):
    drive = Recorder(model, wave, tool_hold=hold(), turn_taking={"eou_frames": 4})
    drive.push(3)
    drive.call(model)
    before = len(drive.inputs)
    events = drive.push(40)
    assert all(s.held for s in drive.inputs[before:]) and not any(e.kind == "turn" for e in events)


def test_without_tool_hold_a_call_streams_a_token_per_frame_as_before(model, wave):
    drive = Recorder(model, wave, tool_hold=None)
    drive.push(3)
    drive.call(model)
    assert drive.session.pipeline is None and drive.session.frame_index == 4
    assert all(s.samples is not None and s.thinks for s in drive.inputs)


def test_the_end_of_the_stream_stops_a_call_being_written(model, wave):
    """A flush while the call is being written: the writing stops (its span reported unfinished) and the
    session ends, rather than write on up to NVIDIA's safety limit of 2000 steps."""
    engine = model.create_engine(max_sessions=1)
    h = engine.open(nv.StreamingOptions(deterministic=True, tools=TOOLS, tool_hold=hold()))
    span = model.tokenizer.encode('<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Par',
                                  add_special_tokens=False)
    h.force_tokens("function", span)
    h.push_audio(wave[:FRAME], 16000)
    for _ in range(len(span) + 3):  # the span forced, then the model's own tokens: still writing
        engine.step()
    assert h._host.pipeline.stage == "writing" and h.pending_steps
    h.flush()
    ending = engine.step()[h]
    # (before them, the function channel's text held back, if its last token split a character)
    assert [e.kind for e in ending][-2:] == ["tool_call_error", "done"] and not any(e.kind == "audio" for e in ending)
    assert "ended inside a tool call" in ending[-2].reason



def test_a_timeout_phrase_is_spoken_once_then_the_timeout_result_goes_in(model, wave):
    drive = Recorder(model, wave, tool_hold=hold(acknowledgements=(), on_hold={}, timeout_s=0.4,
                                                 timeout_phrase="Sorry, that is taking too long."))
    drive.push(3)
    drive.call(model)
    events = drive.push(5 + len(nvidia_layout(model, "Sorry, that is taking too long.")) + 3)
    said = [(e.reason, e.text) for e in events if e.kind == "hold_speech"]
    assert said == [("timeout", "Sorry, that is taking too long.")]
    assert any(e.kind == "function_delta" for e in events) and not drive.session.pipeline.active


def test_a_text_id_forced_during_the_call_waits_for_the_step_back_on_the_clock(model, wave):
    """The pipeline's steps force the text channel to PAD themselves; a text id the caller forces meanwhile
    (a server's BOS for the answer it was asked for) is the text of the first step back on the clock."""
    drive = Recorder(model, wave, tool_hold=hold(acknowledgements=()))
    session = drive.session
    ids = []  # (the step heard audio, its LLM stepped, its ids)
    done = session.frame_done

    def recorded(packed, stamps, plan=None, heard=True):
        events = done(packed, stamps, plan, heard)
        ids.append((heard, plan is None or plan.thinks, session.last_ids))
        return events

    session.frame_done = recorded
    drive.push(3)
    drive.call(model)
    bos = model.config.bos_token_id
    session.force_tokens("text", [bos])
    drive.push(2)
    session.send_tool_result("call_1", "sunny")
    start = len(ids)
    drive.push(60)  # the phrase begun ends, the result goes in, the conversation resumes
    assert not session.pipeline.active
    back = next(k for k in range(start, len(ids)) if ids[k][0] and ids[k][1])  # heard, and the LLM stepped
    assert ids[back][2][0] == bos
    assert all(step[2][0] == model.config.pad_token_id for step in ids[start:back] if step[1])  # forced PAD
