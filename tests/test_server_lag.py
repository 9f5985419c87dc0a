"""Late frames are made up: a session behind (its audio held by the network, then delivered at once) gets
catch-up steps between the server's 80 ms ticks, while a session keeping pace still runs one frame per
tick; the events do not depend on when the audio came; the 503 guard measures the on-clock steps only;
``/health`` reports each session's lag; a flood past the input bound is refused, and nothing taken is
dropped. Loopback only; every wait is bounded.

The scheduler tests push audio from the worker thread right after each on-clock step (a wrapper around
the scheduler's step), so a client "on time" is on time by construction, whatever the machine's load."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import numpy as np
import pytest
import torch
import websockets

import nvchat_torch as nv
from nvchat_torch.server.app import create_app
from nvchat_torch.server.scheduler import FrameScheduler, Output
from test_server import (GA_16K_22K, RAW, TIMEOUT, assert_same_pcm, b64, get_json, question,  # noqa: F401
                         reference, serve)

FRAME = 1280  # samples of one 80 ms frame at 16 kHz
STREAM = 40  # frames each scheduler session streams
HELD = range(5, 20)  # the frames the late session's network holds; they arrive with frame 20
MARKED = 13  # a mark is queued among them, after frame 12


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


class Recorded:
    """A scheduler whose steps are logged in order, ``("step", on_clock, names that ran a frame)`` and
    ``("mark", name, frames run by then)``, and whose ``on_tick(n)`` runs on the worker thread right
    after on-clock step ``n`` (counted from 0)."""

    def __init__(self, scheduler: FrameScheduler, names: tuple[str, ...], on_tick):
        self.scheduler = scheduler
        self.log: list[tuple] = []
        self.outputs: dict[str, list[Output]] = {name: [] for name in names}
        self.opened = {name: threading.Event() for name in names}
        self.ticks = 0
        step = scheduler._step

        def logged(slots, on_clock=True):
            before = {name: self.frames(name) for name in names}
            step(slots, on_clock=on_clock)
            self.log.append(("step", on_clock, {name for name in names if self.frames(name) > before[name]}))
            if on_clock:
                self.ticks += 1
                on_tick(self.ticks - 1)

        scheduler._step = logged
        self.handles = {name: scheduler.open(nv.StreamingOptions(deterministic=True, seed=0),
                                             lambda out, name=name: self.deliver(name, out)) for name in names}

    def deliver(self, name: str, out: Output) -> None:
        self.outputs[name].append(out)
        if out.kind == "opened":
            self.opened[name].set()
        elif out.kind == "mark":
            self.log.append(("mark", name, self.frames(name)))

    def frames(self, name: str) -> int:
        return sum(1 for out in self.outputs[name] if out.kind == "events" and out.ids is not None)

    def events(self, name: str) -> list:
        return [e for out in self.outputs[name] if out.kind == "events" for e in out.events]

    def wait(self, done, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not done():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)


def assert_same_events(got: list, want: list) -> None:
    """The same events (kinds, frames, ids, text, codes) and audio within float rounding (a row of the
    batch computes what it computes alone, docs/engine.md)."""
    def key(e):
        return (e.kind, e.frame_index, e.token_id, e.delta, e.text)

    assert [key(e) for e in got] == [key(e) for e in want]
    audio = [(g, w) for g, w in zip(got, want) if g.kind == "audio"]
    assert len(audio) == STREAM
    for g, w in audio:
        np.testing.assert_array_equal(g.audio_codes, w.audio_codes)
        np.testing.assert_allclose(g.samples, w.samples, atol=1e-5, rtol=0)


@pytest.mark.parametrize("catch_up", [True, False])
def test_a_late_burst_is_caught_up_while_a_current_session_keeps_its_tick(model, question, catch_up):
    """On the real 80 ms clock: "now" gets frame n right after on-clock step n-1; "late" gets the same
    audio, but its frames 5-19 arrive together with frame 20 (a 1.2 s stall), a mark among them. With
    catch-up steps the late session runs its 15 frames of backlog between the ticks and is back in
    step with the other one before the end; "now" runs in every on-clock step and in no catch-up
    step. Without them the late session stays 15 frames behind to its end. Either way the mark comes
    after the frames before it, and both sessions get the same events."""
    audio = np.tile(question, 2)[:STREAM * FRAME].astype(np.float32) / 32768.0
    frame = lambda i: audio[i * FRAME:(i + 1) * FRAME]  # noqa: E731

    def on_tick(n: int) -> None:  # after on-clock step n: the frames that arrive for tick n + 1
        i = n + 1
        if i >= STREAM:
            return
        recorded.scheduler.push(recorded.handles["now"], frame(i))
        if i == HELD.stop:  # the held frames and this one at once, a mark (a commit) amid them
            recorded.scheduler.push(recorded.handles["late"], audio[HELD.start * FRAME:MARKED * FRAME])
            recorded.scheduler.mark(recorded.handles["late"], "burst")
            recorded.scheduler.push(recorded.handles["late"], audio[MARKED * FRAME:(i + 1) * FRAME])
        elif i not in HELD:
            recorded.scheduler.push(recorded.handles["late"], frame(i))

    scheduler = FrameScheduler(model, max_sessions=2, catch_up=catch_up)
    try:
        recorded = Recorded(scheduler, ("now", "late"), on_tick)
        assert all(recorded.opened[name].wait(TIMEOUT) for name in ("now", "late"))
        with scheduler._cond:  # frame 0 of both before the worker looks again
            for name in ("now", "late"):
                scheduler.push(recorded.handles[name], frame(0))
        recorded.wait(lambda: recorded.frames("now") == recorded.frames("late") == STREAM, "the frames did not run")
        recorded.wait(lambda: len(recorded.outputs["late"]) == STREAM + 2, "the mark did not come")
        catch_up_steps = scheduler.catch_up_steps
    finally:
        scheduler.stop()

    assert {out.kind for name in ("now", "late") for out in recorded.outputs[name]} == {"opened", "events", "mark"}
    steps = [(on_clock, ran) for kind, on_clock, ran in (e for e in recorded.log if e[0] == "step")]
    on_clock = [ran for is_on_clock, ran in steps if is_on_clock]
    catch_ups = [ran for is_on_clock, ran in steps if not is_on_clock]
    assert len(catch_ups) == catch_up_steps
    # the session on time: one frame in each of the first STREAM on-clock steps, none in a catch-up step
    assert all("now" in ran for ran in on_clock[:STREAM]) and not any("now" in ran for ran in on_clock[STREAM:])
    assert not any("now" in ran for ran in catch_ups)
    late_ticks = [n for n, ran in enumerate(on_clock) if "late" in ran]
    if catch_up:
        # the 15 held frames ran between the ticks: the late session is back in step (its last frames
        # in the same on-clock steps as the other session's), and only it ran in the catch-up steps
        assert len(catch_ups) == len(HELD) and all(ran == {"late"} for ran in catch_ups)
        assert late_ticks == [n for n in range(STREAM) if n not in HELD]
    else:  # one frame per tick: the stall's 15 frames of lag last to the end
        assert not catch_ups and late_ticks == [n for n in range(STREAM + len(HELD)) if n not in HELD]
    # the mark came right after the step that ran the frame before it, before the next one ran
    mark = next(i for i, e in enumerate(recorded.log) if e[0] == "mark")
    assert recorded.log[mark] == ("mark", "late", MARKED)
    assert recorded.log[mark - 1][0] == "step" and "late" in recorded.log[mark - 1][2]
    assert [out.kind for out in recorded.outputs["late"]].index("mark") == 1 + MARKED
    # when the audio came changes nothing in what the model made of it
    assert_same_events(recorded.events("late"), recorded.events("now"))
    ids = lambda name: [out.ids for out in recorded.outputs[name] if out.kind == "events"]  # noqa: E731
    assert ids("late") == ids("now")


def slowed(scheduler: FrameScheduler, on_clock_s: float, catch_up_s: float) -> list[bool]:
    """Make the scheduler's on-clock and catch-up steps that much longer (a sleep inside the engine's
    step, so the scheduler measures it); returns the kinds of the steps run, True for on-clock."""
    kinds: list[bool] = []
    step, engine_step = scheduler._step, scheduler.engine.step

    def logged(slots, on_clock=True):
        kinds.append(on_clock)
        step(slots, on_clock=on_clock)

    def slow():
        time.sleep(on_clock_s if kinds[-1] else catch_up_s)
        return engine_step()

    scheduler._step = logged
    scheduler.engine.step = slow
    return kinds


def run_backlog(scheduler: FrameScheduler, frames: int) -> None:
    """Open a session, queue ``frames`` frames at once, and wait until they have all run."""
    ran: list[Output] = []
    opened = threading.Event()
    handle = scheduler.open(nv.StreamingOptions(deterministic=True),
                            lambda out: opened.set() if out.kind == "opened" else ran.append(out))
    assert opened.wait(TIMEOUT)
    scheduler.push(handle, np.zeros(frames * FRAME, np.float32))
    deadline = time.monotonic() + TIMEOUT
    while len(ran) < frames:
        assert time.monotonic() < deadline, "the frames did not run"
        time.sleep(0.02)
    assert all(out.kind == "events" for out in ran)


def test_the_step_time_guard_measures_the_on_clock_steps_only(model):
    """The median behind the 503 guard (median_step_s) is that of the on-clock steps: here they take
    60 ms more than the catch-up steps between them, which outnumber them, and the median is an
    on-clock step's."""
    scheduler = FrameScheduler(model, max_sessions=1, clock=0.3)
    try:
        kinds = slowed(scheduler, on_clock_s=0.06, catch_up_s=0.0)
        run_backlog(scheduler, 30)
        assert kinds.count(False) == scheduler.catch_up_steps > kinds.count(True)  # a median of all: a catch-up's
        assert scheduler.median_step_s(recent=60.0) >= 0.06
    finally:
        scheduler.stop()


def test_a_catch_up_step_runs_only_if_it_ends_before_the_next_tick(model):
    """Catch-up steps of 100 ms on a 200 ms clock: one fits after each on-clock step, two never do; the
    scheduler predicts that from the steps it measured and runs at most one per tick."""
    scheduler = FrameScheduler(model, max_sessions=1, clock=0.2)
    try:
        kinds = slowed(scheduler, on_clock_s=0.0, catch_up_s=0.1)
        run_backlog(scheduler, 8)
    finally:
        scheduler.stop()
    assert kinds.count(False) >= 2 and kinds[0]  # the first step is on the clock
    assert "catch-up, catch-up" not in ", ".join("on-clock" if on_clock else "catch-up" for on_clock in kinds)


def test_health_reports_each_sessions_lag_and_the_worst(model):
    """While the worker is held inside a step, a session that was sent ten frames shows a lag of ten
    frames (800 ms) and the one beside it none; once the worker goes on the backlog runs and the lag
    is gone. A server without catch-up says so."""
    gate = threading.Event()

    async def start(ws) -> None:
        assert json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": {**GA_16K_22K, "nvchat": RAW}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.zeros(FRAME, np.int16))}))
        await audio_deltas(ws, 1)

    async def audio_deltas(ws, count: int) -> None:
        while count:
            event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            assert event["type"] != "error", event
            count -= event["type"] == "response.output_audio.delta"

    async def until_health(address: str, done) -> dict:
        deadline = time.monotonic() + TIMEOUT
        while not done(health := await asyncio.to_thread(get_json, f"http://{address}/health")):
            assert time.monotonic() < deadline, health
            await asyncio.sleep(0.02)
        return health

    async def run(address: str, scheduler: FrameScheduler) -> tuple[dict, dict]:
        async with websockets.connect(f"ws://{address}/v1/realtime") as behind, \
                websockets.connect(f"ws://{address}/v1/realtime") as current:
            await start(behind)
            await start(current)
            engine_step = scheduler.engine.step
            scheduler.engine.step = lambda: gate.wait(TIMEOUT) and engine_step()
            await behind.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": b64(np.zeros(10 * FRAME, np.int16))}))
            held = await until_health(address, lambda h: h["worst_lag_frames"] == 10)
            gate.set()
            await audio_deltas(behind, 10)
            after = await until_health(address, lambda h: h["worst_lag_frames"] == 0)
            return held, after

    with serve(model) as (address, app):
        held, after = asyncio.run(run(address, app.state.realtime.scheduler))
    assert held["catch_up"] is True and held["worst_lag_ms"] == 800.0
    assert sorted((s["lag_frames"], s["lag_ms"]) for s in held["sessions"]) == [(0, 0.0), (10, 800.0)]
    assert len({s["handle"] for s in held["sessions"]}) == 2
    assert after["worst_lag_ms"] == 0.0 and [s["lag_frames"] for s in after["sessions"]] == [0, 0]
    app = create_app(model, catch_up=False)
    try:
        health = app.state.realtime.health()
        assert health["catch_up"] is False and health["sessions"] == [] and health["worst_lag_frames"] == 0
    finally:
        app.state.realtime.scheduler.stop()


def test_a_flood_past_the_input_bound_is_refused_and_nothing_taken_is_dropped(model, question):
    """5 s of audio sent at once against a bound of 1 s: appends past it are refused whole with
    input_audio_buffer_full (the first is taken), and the session hears exactly the appends it took,
    in order: its output is StreamingSession's for their audio."""
    chunks = [np.tile(question, 2)[i * 3200:(i + 1) * 3200] for i in range(25)]  # 0.2 s each

    async def run(address: str) -> tuple[list[dict], bytes]:
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {
                **GA_16K_22K, "nvchat": {"deterministic": True, "seed": 0, **RAW}}}))
            for i, chunk in enumerate(chunks):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(chunk),
                                          "event_id": f"flood_{i}"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            errors, heard, committed = [], b"", False
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                if event["type"] == "error":
                    errors.append(event["error"])
                elif event["type"] == "response.output_audio.delta":
                    heard += base64.b64decode(event["delta"])
                elif event["type"] == "input_audio_buffer.committed":
                    committed = True
                elif event["type"] == "response.done" and committed:
                    return errors, heard
            raise AssertionError("the commit's response.done did not come")

    with serve(model, max_buffered_seconds=1.0) as (address, _):
        errors, heard = asyncio.run(run(address))
    assert errors and all(e["code"] == "input_audio_buffer_full" for e in errors)
    refused = {e["event_id"] for e in errors}
    assert "flood_0" not in refused and len(refused) == len(errors)
    taken = np.concatenate([c for i, c in enumerate(chunks) if f"flood_{i}" not in refused])
    _, _, want = reference(model, taken, deterministic=True, seed=0)
    assert_same_pcm(heard, want)
