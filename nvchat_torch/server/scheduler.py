"""Where the server steps its sessions: one worker thread, one frame per session per turn.

Every model call (opening a session, which prefills its system prompt, and each 80 ms frame) runs
on the worker thread, never on the event loop, so pings and the other connections' I/O stay live.
Each turn gives every session that has work one job of at most one frame, so frames of different
sessions interleave fairly. This class is the one place that steps sessions: an engine that steps
them as one batch can replace it behind the same five methods (open, push, pad, mark, close).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..events import ContextLimit, StreamingOptions

__all__ = ["FrameScheduler", "Output"]


@dataclass
class Output:
    """What the worker hands back to a connection, in the order the jobs ran.

    kind: "opened" | "events" (one frame's or a flush's events; ``ids`` the frame's raw text and
    function ids, ``compute_s`` the wall time it took) | "mark" (``tag`` as queued) | "limit"
    (``events`` ran, then max_streaming_seconds was reached) | "rejected" (a queued call raised
    ``ValueError``; the session goes on) | "error" (``error``: the exception; the session is over).
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
        self.session = None
        self.jobs: deque = deque()
        self.fed = 0  # samples given to the session, for padding the partial frame
        self.closed = False


class FrameScheduler:
    def __init__(self, model):
        self.model = model
        self.frame_samples = model.config.input_frame_samples
        self.sample_rate = model.config.input_sample_rate
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}  # insertion order is the round-robin order
        self._next = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nvchat-frames", daemon=True)
        self._thread.start()

    # ---- called from the event loop (any thread)
    def open(self, options: StreamingOptions, deliver: Callable[[Output], None]) -> int:
        """Queue a new session; ``deliver`` is called on the worker thread with each Output."""
        with self._cond:
            handle = self._next
            self._next += 1
            slot = self._slots[handle] = _Slot(deliver)
            slot.jobs.append(("open", options))
            self._cond.notify()
        return handle

    def push(self, handle: int, samples: np.ndarray) -> None:
        """Queue 16 kHz float32 audio, split so that each job runs at most one frame."""
        step = self.frame_samples
        self._queue(handle, *[("audio", samples[i:i + step]) for i in range(0, len(samples), step)])

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

    def call(self, handle: int, method: str, *args) -> None:
        """Queue ``session.<method>(*args)`` (e.g. send_tool_result); its events come back as "events"."""
        self._queue(handle, ("call", method, args))

    def drop_audio(self, handle: int) -> int:
        """Drop queued audio that has not run yet; returns how many samples were dropped."""
        with self._cond:
            slot = self._slots.get(handle)
            if slot is None:
                return 0
            kept = deque(job for job in slot.jobs if job[0] != "audio")
            dropped = sum(len(job[1]) for job in slot.jobs if job[0] == "audio")
            slot.jobs = kept
            return dropped

    def backlog_samples(self, handle: int) -> int:
        with self._cond:
            slot = self._slots.get(handle)
            return 0 if slot is None else sum(len(job[1]) for job in slot.jobs if job[0] == "audio")

    def close(self, handle: int) -> None:
        """Forget the session at once: its queued jobs are dropped and its caches released."""
        with self._cond:
            slot = self._slots.pop(handle, None)
            if slot is not None:
                slot.closed = True
                slot.jobs.clear()
                slot.session = None

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._slots)

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
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not any(s.jobs for s in self._slots.values()):
                    self._cond.wait()
                if self._stop:
                    return
                turn = [(slot, slot.jobs.popleft()) for slot in self._slots.values() if slot.jobs]
            for slot, job in turn:
                if not slot.closed:
                    self._execute(slot, job)

    def _execute(self, slot: _Slot, job: tuple) -> None:
        kind = job[0]
        try:
            if kind == "open":
                slot.session = self.model.create_streaming_session(job[1])
                out = Output("opened")
            elif kind == "mark":
                out = Output("mark", tag=job[1])
            else:
                session = slot.session
                if session is None:
                    return  # closed while this job was in flight
                start = time.perf_counter()
                if kind in ("audio", "pad"):
                    samples = job[1] if kind == "audio" else np.zeros(-slot.fed % self.frame_samples, np.float32)
                    if not len(samples):
                        return
                    slot.fed += len(samples)
                    try:
                        events = session.push_audio(samples, self.sample_rate)
                    except ContextLimit as limit:
                        slot.jobs.clear()
                        slot.deliver(Output("limit", events=list(limit.events), error=limit))
                        return
                elif kind == "flush":
                    events = session.flush(pad_partial=job[1])
                elif kind == "cancel":
                    events = session.cancel()
                else:  # "call": a bad argument (say an unknown call_id) is the client's error, not the session's
                    try:
                        events = getattr(session, job[1])(*job[2]) or []
                    except ValueError as e:
                        slot.deliver(Output("rejected", error=e))
                        return
                ran = any(e.kind == "audio" for e in events)
                out = Output("events", events=events, ids=session.last_ids if ran else None,
                             compute_s=time.perf_counter() - start if ran else 0.0)
        except Exception as e:  # this session ends; the others go on
            slot.jobs.clear()
            slot.session = None
            out = Output("error", error=e)
        slot.deliver(out)
