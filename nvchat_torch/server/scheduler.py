"""Where the server steps its sessions: one worker thread driving a :class:`~nvchat_torch.engine.BatchEngine`
on a fixed 80 ms clock.

Every model call runs on the worker thread, never on the event loop, so pings and the other
connections' I/O stay live. The time between on-clock steps goes to prompt prefill pieces and to
catch-up steps for sessions that are behind.
Design: docs/server.md, "How it runs" (catch-up steps, prefill in pieces).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from ..events import ContextLimit, StreamingOptions
from ..runtime.prompt import PromptCache

__all__ = ["FrameScheduler", "Output", "OutputKind", "WARM_PROMPT_TOKENS"]

log = logging.getLogger("nvchat_torch.server")


OutputKind = Literal["opened", "events", "mark", "limit", "rejected", "refused", "error"]


@dataclass
class Output:
    """What the worker hands back to a connection, in the order the jobs ran."""

    # "opened": the session's prompt is prefilled; "events": one step's or a flush's events; "mark": every
    # job queued before the mark has run; "limit": max_streaming_seconds was reached, the frames before it
    # ran and the rest was dropped; "rejected": a queued call raised ``ValueError`` and the session goes on;
    # "refused": the engine would not open the session; "error": the session is over.
    kind: OutputKind
    events: list = field(default_factory=list)  # "events": the events
    # "events": the step's raw text and function ids when its LLM stepped and its audio came out. None: a
    # step of the TTS alone while a tool runs, or one whose speech is not kept.
    ids: tuple[int, int] | None = None
    compute_s: float = 0.0  # "events": the wall time of the step that ran it
    tag: Any = None  # "mark", "rejected", "refused": the tag as queued
    error: BaseException | None = None  # "limit", "rejected", "refused", "error": the exception


class _Slot:
    def __init__(self, deliver: Callable[[Output], None]):
        self.deliver = deliver
        self.session = None  # its EngineSession once opened
        self.jobs: deque = deque()
        self.fed = 0  # samples given to the session, for padding the partial frame
        self.closed = False


CATCH_UP_MARGIN = 0.1  # of the clock: kept free between a catch-up step's predicted end and the next tick
RECENT_S = 2.0  # the step and prefill times a catch-up's or a piece's duration is predicted from, seconds
# A catch-up step is predicted to take the 90th percentile of the recent steps: on a busy machine a rare
# step descheduled for hundreds of ms would otherwise stop every catch-up for RECENT_S.
CATCH_UP_QUANTILE = 0.9
# The prompt tokens the default mode's prefill track (sampling, seed 0: nvchat_torch.runtime.speech_track) is made
# for while the worker is idle, so that the server's first caller finds it: a prompt with tools is ~600.
WARM_PROMPT_TOKENS = 640


class FrameScheduler:
    """``clock``: seconds between on-clock steps (the frame duration: real time); 0 steps as soon as a
    frame is pending (batch processing, tests). ``catch_up``: sessions behind get extra steps between
    the ticks (the module doc); False runs at most one frame per session per tick, so a lag once
    built up lasts. ``warm_prompt_tokens``: while the worker has nothing else to do, it extends the
    prefill track of the server's default mode (sampling, seed 0) that far, one TTS step at a time
    (0: the first session to need it makes it)."""

    def __init__(self, model, max_sessions: int = 4, clock: float | None = None, prompt_cache_bytes: int = 1 << 30,
                 catch_up: bool = True, warm_prompt_tokens: int = WARM_PROMPT_TOKENS):
        self.model = model
        self.engine = model.create_engine(max_sessions=max_sessions)
        # Sessions with a prompt prefilled before join at once (nvchat_torch.runtime.prompt); 0: none kept.
        self.engine.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None
        self.clock = model.config.frame_duration if clock is None else clock
        self.catch_up = catch_up
        self.frame_samples = model.config.input_frame_samples
        self.sample_rate = model.config.input_sample_rate
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._closing: list[_Slot] = []  # closed by their connection: released on the worker thread
        self._next = 0
        self._stop = False
        self._steps: deque[tuple[float, float]] = deque(maxlen=25)  # (when, wall time) of recent on-clock steps
        # Catch-up steps and single prefill pieces, (when, wall time): kept apart from the on-clock steps,
        # whose median alone says whether the server keeps real time (median_step_s).
        self._catch_ups: deque[tuple[float, float]] = deque(maxlen=100)
        self._pieces: deque[tuple[float, float]] = deque(maxlen=25)
        self._behind: dict[_Slot, int] = {}  # worker only: steps a session had left after the last on-clock step
        self.catch_up_steps = 0  # run so far
        if isinstance(warm_prompt_tokens, bool) or not isinstance(warm_prompt_tokens, int) or warm_prompt_tokens < 0:
            raise ValueError(f"warm_prompt_tokens must be a non-negative int, got {warm_prompt_tokens!r}")
        # Its pieces, run while idle (a prompt of n tokens takes n - 1 steps: its first position runs no TTS).
        self._warming = iter(model.speech_tracks().extend(0, False, warm_prompt_tokens - 1)) \
            if warm_prompt_tokens > 1 else None
        self._thread = threading.Thread(target=self._run, name="nvchat-frames", daemon=True)
        self._thread.start()

    # ---- called from the event loop (any thread)
    def open(self, options: StreamingOptions, deliver: Callable[[Output], None], tag: Any = None) -> int:
        """Queue a new session; ``deliver`` is called on the worker thread with each Output. Options the
        engine refuses (a prompt longer than the context) give ``Output("refused", error=, tag=tag)``."""
        with self._cond:
            handle = self._next
            self._next += 1
            slot = self._slots[handle] = _Slot(deliver)
            slot.jobs.append(("open", options, tag))
            self._cond.notify()
        return handle

    def push(self, handle: int, samples: np.ndarray) -> None:
        """Queue 16 kHz float32 audio."""
        if len(samples):
            self._queue(handle, ("audio", samples))

    def pad(self, handle: int) -> None:
        """Queue zeros that complete the partial frame, so all audio pushed so far is heard."""
        self._queue(handle, ("pad",))

    def mark(self, handle: int, tag: Any) -> None:
        """Deliver ``Output("mark", tag=tag)`` once every job queued before it has run."""
        self._queue(handle, ("mark", tag))

    def flush(self, handle: int, pad_partial: bool) -> None:
        self._queue(handle, ("flush", pad_partial))

    def cancel(self, handle: int) -> None:
        self._queue(handle, ("cancel",))

    def call(self, handle: int, method: str, *args, tag: Any = None) -> None:
        """Queue ``session.<method>(*args)`` (e.g. send_tool_result); its events come back as "events",
        a ``ValueError`` as ``Output("rejected", error=, tag=tag)``."""
        self._queue(handle, ("call", method, args, tag))

    def drop_audio(self, handle: int) -> int:
        """Drop audio that has not run yet (queued, and buffered in the engine: the worker drops that
        before any other job); returns how many queued samples were dropped."""
        with self._cond:
            slot = self._slots.get(handle)
            if slot is None:
                return 0
            dropped = sum(len(job[1]) for job in slot.jobs if job[0] == "audio")
            slot.jobs = deque(job for job in slot.jobs if job[0] != "audio")
            slot.jobs.appendleft(("drop",))
            self._cond.notify()
            return dropped

    def backlog_samples(self, handle: int) -> int:
        """Samples received and not run yet: queued, and frames waiting in the engine."""
        with self._cond:
            slot = self._slots.get(handle)
            return 0 if slot is None else self._backlog(slot)

    def lags(self) -> dict[int, int]:
        """Every open session's lag, by handle: the samples of input it has received and not run yet
        (as :meth:`backlog_samples` counts them), all read under one lock."""
        with self._cond:
            return {handle: self._backlog(slot) for handle, slot in self._slots.items()}

    def lag_report(self) -> dict:
        """The lags as ``/health`` shows them: each session's (whole frames and ms, by handle, in the order
        the sessions opened) and the worst."""
        lags = [{"handle": handle, "lag_frames": samples // self.frame_samples,
                 "lag_ms": round(samples / self.sample_rate * 1000, 1)} for handle, samples in sorted(self.lags().items())]
        return {"sessions": lags, "worst_lag_frames": max((lag["lag_frames"] for lag in lags), default=0),
                "worst_lag_ms": max((lag["lag_ms"] for lag in lags), default=0.0)}

    def _backlog(self, slot: _Slot) -> int:
        waiting = 0 if slot.session is None else slot.session.pending_frames * self.frame_samples
        return waiting + sum(len(job[1]) for job in slot.jobs if job[0] == "audio")

    def close(self, handle: int) -> None:
        """Forget the session at once: its queued jobs are dropped and its caches released."""
        with self._cond:
            slot = self._slots.pop(handle, None)
            if slot is not None:
                slot.closed = True
                slot.jobs.clear()
                self._closing.append(slot)
                self._cond.notify()

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._slots)

    def median_step_s(self, recent: float = 2.0) -> float:
        """The median wall time of the on-clock steps run in the last ``recent`` seconds (0 when none
        ran): how near the server is to falling behind real time with the sessions it has. Catch-up
        steps are not counted: they only use time the on-clock steps leave."""
        since = time.perf_counter() - recent
        times = sorted(t for when, t in list(self._steps) if when >= since)
        return times[len(times) // 2] if times else 0.0

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _queue(self, handle: int, *jobs) -> None:
        with self._cond:
            slot = self._slots.get(handle)
            if slot is None:
                return  # closed: nothing to do
            slot.jobs.extend(jobs)
            self._cond.notify()

    # ---- the worker thread
    @staticmethod
    def _ready(slot: _Slot) -> bool:
        """The slot's session is in the batch and has a step to run (or its end to report; once reported,
        the session is closed and waits for its connection to close the slot)."""
        s = slot.session
        return s is not None and not s.closed and not s.prefilling and bool(s.pending_steps or s.finishing)

    def _busy(self) -> bool:
        return bool(self._closing) or bool(self.engine.joining) or self._warming is not None or \
            any(s.jobs or self._ready(s) or self._holding(s) for s in self._slots.values())

    @staticmethod
    def _holding(slot: _Slot) -> bool:
        """A tool runs for the slot's session: it steps every tick, audio or not (the TTS alone speaks)."""
        s = slot.session
        return s is not None and not s.closed and not s.prefilling and s.holding

    def _tick_holds(self, slots: list[_Slot]) -> None:
        """Before an on-clock step: each session a tool runs for takes a step even without audio, so its
        phrases and its timeout go by wall time (with a real clock: with none, by the audio given)."""
        if not self.clock:
            return
        for slot in slots:
            if self._holding(slot):
                slot.session.hold_tick()

    def _warm(self) -> None:
        """One piece of making the default mode's prefill track while nothing else waits (one TTS step). A
        failure stops the warming only: a session needing the track extends it itself."""
        try:
            if next(self._warming, None) is None:
                self._warming = None
        except Exception:
            log.exception("making the prefill track failed; sessions will make it as they need it")
            self._warming = None

    def _run(self) -> None:
        tick = time.perf_counter()  # when the next on-clock step is due
        while True:
            with self._cond:
                while not self._stop and not self._busy():
                    self._cond.wait()
                if self._stop:
                    return
            slots = self._open_slots()
            for slot in slots:
                self._feed(slot)
            self._tick_holds(slots)
            if not any(self._ready(s) for s in slots):
                if self.engine.joining:  # nobody to step: prefill for a clock, then look at the jobs again
                    self._prefill(slots, max(self.clock, 0.02))
                elif self._warming is not None and not any(s.jobs for s in slots):
                    self._warm()
                continue
            # On-clock steps, at least one clock apart, while a session has a step left: a late one (or the
            # first after idling) starts now and the clock restarts from it. The time before each goes to
            # the joining sessions' prefills (at least one piece per tick) and to the catch-up steps of the
            # sessions behind (_spare). The sessions keeping pace are handed their audio only at the tick,
            # so they sit the catch-up steps out and run one frame per tick.
            while not self._stop:
                now = time.perf_counter()
                if tick > now:
                    self._spare(slots, tick)
                elif self.engine.joining:
                    self._prefill(slots, 0.0)
                    tick = time.perf_counter()
                else:
                    tick = now
                slots = self._open_slots()
                for slot in slots:  # what arrived meanwhile runs in this step
                    self._feed(slot)
                self._tick_holds(slots)
                if not any(self._ready(s) for s in slots):
                    break  # the next frame to arrive starts a step at once
                tick += self.clock
                self._step(slots)
                if not any(self._ready(s) for s in slots):
                    break

    def _open_slots(self) -> list[_Slot]:
        """The slots open now, after releasing the sessions whose connections closed them."""
        with self._cond:
            closing, self._closing = self._closing, []
            slots = list(self._slots.values())
        for slot in closing:
            if slot.session is not None and not slot.session.closed:
                slot.session.cancel()
            slot.session = None
        return slots

    def _spare(self, slots: list[_Slot], tick: float) -> None:
        """The time until ``tick`` (the next on-clock step): pieces of the joining sessions' prefills and
        catch-up steps for the sessions behind, then sleep. A catch-up step runs only if a step as long
        as the CATCH_UP_QUANTILE of the recent ones (on-clock and catch-up) would end a margin before
        the tick, so the sessions keeping pace are not made late; a prefill piece only if the longest
        recent one would. When both want the time, each turn goes to the one that has had less of this
        tick, so neither starves the other (the first turn to the prefills: one piece per tick)."""
        margin = CATCH_UP_MARGIN * self.clock
        prefill_s = catch_up_s = 0.0
        pieces = 0
        self._feed_between_ticks(slots)
        while True:
            left = tick - time.perf_counter()
            behind = self._still_behind()
            step_s = self._predicted(self._steps, self._catch_ups, quantile=CATCH_UP_QUANTILE)
            step_fits = behind and step_s + margin <= left
            piece_fits = bool(self.engine.joining) and (not pieces or self._predicted(self._pieces) + margin <= left)
            if piece_fits and not behind:  # the rest of the wait to the prefills, as many pieces as fit
                self._prefill(slots, left)
                break
            start = time.perf_counter()
            if piece_fits and (not step_fits or prefill_s <= catch_up_s):
                self._prefill(slots, 0.0)  # one piece
                pieces += 1
                self._pieces.append((start, time.perf_counter() - start))
                prefill_s += self._pieces[-1][1]
            elif step_fits:
                self._catch_up(slots)
                catch_up_s += time.perf_counter() - start
            else:
                break
        left = tick - time.perf_counter()
        if left > 0:
            time.sleep(left)

    @staticmethod
    def _predicted(*records: deque[tuple[float, float]], quantile: float = 1.0) -> float:
        """What the next such call is expected to take: the ``quantile`` (1: the longest) of the wall
        times in the records over the last RECENT_S seconds, else their latest."""
        since = time.perf_counter() - RECENT_S
        recent = sorted(t for record in records for when, t in list(record) if when >= since)
        if recent:
            return recent[math.ceil(quantile * len(recent)) - 1]
        return max([record[-1][1] for record in records if record] or [0.0])

    def _still_behind(self) -> bool:
        """Forget the sessions no longer behind (caught up, their audio dropped, closed; without catch-up,
        their steps off the clock done); any left?"""
        for slot, steps in list(self._behind.items()):
            s = slot.session
            if slot.closed or s is None or s.closed or min(steps, s.pending_steps) <= 0 or \
                    not (self.catch_up or s.off_clock_due):
                del self._behind[slot]
        return bool(self._behind)

    def _catch_up(self, slots: list[_Slot]) -> None:
        """One catch-up step: the sessions with a step queued run it (the ones behind; the others were
        handed no audio since the tick and sit out). Then the sessions are fed again, so a job waiting
        for the frames just run (a mark, a tool result) runs in this tick."""
        self._open_slots()  # a session closed meanwhile runs no more
        self._step(slots, on_clock=False)
        for slot in self._behind:
            if slot.session is not None and not slot.closed:
                # a step off the clock due (a tool call written, its result injected) keeps it behind
                steps = min(self._behind[slot] - 1, slot.session.pending_steps)
                self._behind[slot] = max(steps, int(slot.session.off_clock_due))
        self._still_behind()  # the ones caught up now keep pace: their new audio waits for the tick
        self._feed_between_ticks(slots)

    def _feed_between_ticks(self, slots: list[_Slot]) -> None:
        """Between the ticks the sessions behind get all their jobs; the others only the jobs before
        their next audio, so they sit the catch-up steps out."""
        for slot in slots:
            self._feed(slot, audio=slot in self._behind)

    def _feed(self, slot: _Slot, audio: bool = True) -> None:
        """Run the slot's queued jobs in order: audio is only buffered; any other job waits until the
        frames queued before it have run. ``audio=False`` stops at the first job that would queue a
        frame (a session keeping pace is handed its audio at the tick)."""
        while not slot.closed:
            with self._cond:
                if not slot.jobs:
                    return
                job = slot.jobs[0]
                if not audio and job[0] in ("audio", "pad", "flush"):
                    return
                if job[0] not in ("audio", "open", "drop") and slot.session is not None and slot.session.pending_frames:
                    return
                slot.jobs.popleft()
            self._execute(slot, job)

    def _prefill(self, slots: list[_Slot], seconds: float) -> None:
        """Pieces of the joining sessions' prompt prefills for about ``seconds``; "opened" to those done."""
        joined = set(self.engine.prefill(seconds))
        for slot in slots:
            if slot.session is None or slot.closed:
                continue
            if slot.session in joined:
                slot.deliver(Output("opened"))
            elif slot.session.failure is not None:  # its prefill raised: it alone ends
                self._fail(slot, slot.session.failure)

    def _execute(self, slot: _Slot, job: tuple) -> None:
        kind = job[0]
        try:
            if kind == "open":  # the prompt is prefilled in pieces between steps (_prefill): "opened" then
                try:
                    slot.session = self.engine.open(job[1], defer_prefill=True)
                except ValueError as e:  # options the model cannot run (a prompt past its context)
                    with self._cond:
                        slot.jobs.clear()
                    slot.deliver(Output("refused", error=e, tag=job[2]))
                    return
                if slot.session.prefilling:
                    return
                out = Output("opened")
            elif kind == "mark":
                out = Output("mark", tag=job[1])
            elif kind == "limit":
                out = Output("limit", error=job[1])
            else:
                session = slot.session
                if session is None or session.closed:
                    return  # closed while this job was in flight
                if kind == "drop":
                    session.drop_audio()
                    slot.fed = 0
                    return
                if kind in ("audio", "pad"):
                    samples = job[1] if kind == "audio" else np.zeros(-slot.fed % self.frame_samples, np.float32)
                    if not len(samples):
                        return
                    slot.fed += len(samples)
                    try:
                        session.push_audio(samples, self.sample_rate)
                    except ContextLimit as limit:  # reported once the frames before it have run
                        with self._cond:
                            slot.jobs.clear()
                            slot.jobs.append(("limit", limit))
                    return
                if kind == "flush":
                    session.flush(pad_partial=job[1])
                    return  # its done event comes with its last step
                if kind == "cancel":
                    events = session.cancel()
                else:  # "call": a bad argument (say an unknown call_id) is the client's error, not the session's
                    try:
                        events = getattr(session, job[1])(*job[2]) or []
                    except ValueError as e:
                        slot.deliver(Output("rejected", error=e, tag=job[3]))
                        return
                out = Output("events", events=events)
        except Exception as e:  # this session ends; the others go on
            self._fail(slot, e)
            return
        slot.deliver(out)

    def _fail(self, slot: _Slot, error: BaseException) -> None:
        with self._cond:
            slot.jobs.clear()
        if slot.session is not None and not slot.session.closed:
            slot.session.cancel()
        slot.session = None
        slot.deliver(Output("error", error=error))

    def _step(self, slots: list[_Slot], on_clock: bool = True) -> None:
        """One engine step and its events delivered. After an on-clock step, the sessions with steps
        left are the ones behind (catch-up steps until the next tick run those)."""
        start = time.perf_counter()
        try:
            results = self.engine.step()
        except Exception as e:  # the batch failed: every session in it is over
            for slot in slots:
                if slot.session is not None and not slot.session.prefilling:
                    self._fail(slot, e)
            return
        compute_s = time.perf_counter() - start
        if on_clock:
            self._steps.append((start, compute_s))
        else:
            self._catch_ups.append((start, compute_s))
            self.catch_up_steps += 1
        for slot in slots:
            if slot.session is not None and slot.session.failure is not None:  # it alone failed
                self._fail(slot, slot.session.failure)
                continue
            events = results.get(slot.session) if slot.session is not None else None
            if events is None or slot.closed:
                continue
            ran = any(e.kind == "audio" for e in events)
            slot.deliver(Output("events", events=events, ids=slot.session.last_ids if ran else None,
                                compute_s=compute_s if ran else 0.0))
        if on_clock and self.clock > 0:  # without catch-up, still the steps off the clock (not frames)
            self._behind = {slot: slot.session.pending_steps if self.catch_up else 1 for slot in slots
                            if slot.session is not None and not slot.closed and not slot.session.prefilling
                            and (slot.session.pending_steps if self.catch_up else slot.session.off_clock_due)}
