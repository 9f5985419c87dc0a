"""Where the server steps its sessions: one worker thread driving a :class:`~nvchat_torch.engine.BatchEngine`
on a fixed 80 ms clock.

Every model call (opening a session, its system prompt's prefill, and each batched step) runs on the
worker thread, never on the event loop, so pings and the other connections' I/O stay live. A new
session's prompt is prefilled in pieces (one LLM call over up to 64 positions, or one TTS step) in
the time the worker would otherwise sleep until the next step, so a long prompt never stalls the
sessions already streaming; the new session joins the batch once its prefill is complete. Each
tick the worker hands every session its queued audio (buffering only) and runs its other jobs in
order once the frames queued before them have run; then one engine step runs one frame for every
session that has a complete frame, as one batch. A session whose client has not sent a full frame
sits that step out. The server's ``--max-sessions`` is the engine's ``max_sessions``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..events import ContextLimit, StreamingOptions
from ..prompt_cache import PromptCache

__all__ = ["FrameScheduler", "Output"]


@dataclass
class Output:
    """What the worker hands back to a connection, in the order the jobs ran.

    kind: "opened" | "events" (one frame's or a flush's events; ``ids`` the frame's raw text and
    function ids, ``compute_s`` the wall time of the step that ran it) | "mark" (``tag`` as queued) |
    "limit" (max_streaming_seconds was reached: the frames before it ran, the rest was dropped) |
    "rejected" (a queued call raised ``ValueError``; the session goes on; ``tag`` as queued) |
    "refused" (the engine would not open the session: ``error``, ``tag``) | "error" (``error``: the
    exception; the session is over).
    """

    kind: str
    events: list = field(default_factory=list)
    ids: tuple[int, int] | None = None
    compute_s: float = 0.0
    tag: Any = None
    error: BaseException | None = None


class _Slot:
    def __init__(self, deliver: Callable[[Output], None]):
        self.deliver = deliver
        self.session = None  # its EngineSession once opened
        self.jobs: deque = deque()
        self.fed = 0  # samples given to the session, for padding the partial frame
        self.closed = False


class FrameScheduler:
    """``clock``: seconds between steps (the frame duration: real time); 0 steps as soon as a frame is
    pending (batch processing, tests)."""

    def __init__(self, model, max_sessions: int = 4, clock: float | None = None, prompt_cache_bytes: int = 1 << 30):
        self.model = model
        self.engine = model.create_engine(max_sessions=max_sessions)
        # Sessions with a prompt prefilled before join at once (nvchat_torch.prompt_cache); 0: none kept.
        self.engine.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None
        self.clock = model.config.frame_duration if clock is None else clock
        self.frame_samples = model.config.input_frame_samples
        self.sample_rate = model.config.input_sample_rate
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._closing: list[_Slot] = []  # closed by their connection: released on the worker thread
        self._next = 0
        self._stop = False
        self._steps: deque[tuple[float, float]] = deque(maxlen=25)  # (when, wall time) of recent steps
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
            if slot is None:
                return 0
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
        """The median wall time of the steps run in the last ``recent`` seconds (0 when none ran): how
        near the server is to falling behind real time with the sessions it has."""
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
        """The slot's session is in the batch and has a frame to run (or its end to report)."""
        s = slot.session
        return s is not None and not s.prefilling and bool(s.pending_frames or s.finishing)

    def _busy(self) -> bool:
        return bool(self._closing) or bool(self.engine.joining) or any(s.jobs or self._ready(s)
                                                                       for s in self._slots.values())

    def _run(self) -> None:
        next_step = time.perf_counter()
        while True:
            with self._cond:
                while not self._stop and not self._busy():
                    self._cond.wait()
                if self._stop:
                    return
                closing, self._closing = self._closing, []
                slots = list(self._slots.values())
            for slot in closing:
                if slot.session is not None and not slot.session.closed:
                    slot.session.cancel()
                slot.session = None
            for slot in slots:
                self._feed(slot)
            if any(self._ready(s) for s in slots):
                # Steps start at least one clock apart: a late (or the first after idling) step starts
                # now and the clock restarts from it; no burst of steps makes up for lost time. The
                # wait before a step goes to joining sessions' prefills (at least one piece per tick).
                now = time.perf_counter()
                if next_step > now:
                    self._prefill(slots, next_step - now)
                    now = time.perf_counter()
                    if next_step > now:
                        time.sleep(next_step - now)
                elif self.engine.joining:
                    self._prefill(slots, 0.0)
                    next_step = time.perf_counter()
                else:
                    next_step = now
                next_step += self.clock
                self._step(slots)
            elif self.engine.joining:  # nobody to step: prefill for a clock, then look at the jobs again
                self._prefill(slots, max(self.clock, 0.02))

    def _feed(self, slot: _Slot) -> None:
        """Run the slot's queued jobs in order: audio is only buffered; any other job waits until the
        frames queued before it have run."""
        while not slot.closed:
            with self._cond:
                if not slot.jobs:
                    return
                job = slot.jobs[0]
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

    def _step(self, slots: list[_Slot]) -> None:
        start = time.perf_counter()
        try:
            results = self.engine.step()
        except Exception as e:  # the batch failed: every session in it is over
            for slot in slots:
                if slot.session is not None and not slot.session.prefilling:
                    self._fail(slot, e)
            return
        compute_s = time.perf_counter() - start
        self._steps.append((start, compute_s))
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
