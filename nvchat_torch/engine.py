"""Many conversations on one model: every open session's next 80 ms frame as one batched pass.

``engine = model.create_engine(max_sessions=8)``; ``h = engine.open(StreamingOptions(...))``;
``h.push_audio(samples, rate)`` buffers; ``engine.step()`` runs one frame for every session with a
complete frame pending and returns ``{handle: events}``; ``h.flush()`` / ``h.cancel()`` end a session.
Each session is a row of the engine's :class:`~nvchat_torch.runtime.frame_step.FrameStep`, so a row
computes what its session alone computes (docs/engine.md, "How it works")."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .audio_io import as_mono_float32
from .events import ContextLimit, FrameTiming, StreamingOptions, VoiceChatEvent, VoiceChatProfile
from .runtime.frame_step import FrameStep
from .runtime.prompt import PromptCache
from .runtime.step_plan import StepPlan, off_clock_steps
from .session import AudioInput, StreamingSession
from .turn_taking import TurnTakingConfig

if TYPE_CHECKING:
    from .networks import VoiceChatNetworks

__all__ = ["BatchEngine", "EngineSession"]


class EngineSession:
    """A conversation in a :class:`BatchEngine` (``engine.open``): push audio, end it; the engine steps it."""

    def __init__(self, engine: BatchEngine, session: StreamingSession, slot: int | None) -> None:
        self.engine = engine
        # Its host side (detokenizers, tool channel, limits, frame counter): a session whose frames run as a
        # row of the engine's step, so not one to push audio to (this handle buffers and the engine steps).
        self._host = session
        self.slot = slot  # its row in the batch; None while its deferred prefill runs
        self._pending = np.zeros(0, dtype=np.float32)
        self._queued: list[np.ndarray] = []  # complete frames waiting for a step
        self._off_clock: deque[StepPlan] = deque()  # steps off the clock waiting: they run before the frames
        self._ticks = 0  # a step of the TTS alone asked for while a tool runs (hold_tick)
        self.finishing = False  # flushed: done once its frames have run
        self.closed = False

    # ---- what the session shows
    @property
    def options(self) -> StreamingOptions:
        return self._host.options

    @property
    def frame_index(self) -> int:
        """Steps run after the prompt, heard or off the clock."""
        return self._host.frame_index

    @property
    def input_frames(self) -> int:
        """Audio frames heard."""
        return self._host.input_frames

    @property
    def text(self) -> str:
        return self._host.text

    @property
    def function_text(self) -> str:
        return self._host.function_text

    @property
    def user_transcript(self) -> str:
        return self._host.user_transcript

    @property
    def last_ids(self) -> tuple[int, int] | None:
        return self._host.last_ids

    @property
    def max_seconds(self) -> float:
        return self._host.max_seconds

    @property
    def failure(self) -> BaseException | None:
        """What closed the session, if a step failed on it."""
        return self.engine.failure_of(self)

    @property
    def pending_frames(self) -> int:
        """Complete frames of audio waiting for a step: how far the session is behind its input."""
        return len(self._queued)

    @property
    def pending_steps(self) -> int:
        """Steps waiting to run: its queued audio frames, the steps off the clock asked for
        (:meth:`step_off_clock`) and the tool pipeline's (one counted while any is due), and a tick
        while a tool runs (:meth:`hold_tick`)."""
        pipeline = self._host.pipeline
        due = pipeline is not None and pipeline.due
        return len(self._queued) + len(self._off_clock) + due + self._ticks

    @property
    def off_clock_due(self) -> bool:
        """A step off the clock is due: asked for (:meth:`step_off_clock`), or the tool pipeline's (a call
        written, its result injected). A server runs them in the time between its ticks."""
        pipeline = self._host.pipeline
        return bool(self._off_clock) or (pipeline is not None and pipeline.due)

    @property
    def holding(self) -> bool:
        """A tool runs: the LLM stands still, the TTS alone speaks (docs/tools.md)."""
        return self._host.pipeline is not None and self._host.pipeline.waiting

    def hold_tick(self) -> None:
        """While a tool runs, a step of the TTS alone in the next engine step even without audio queued: a
        server calls it every 80 ms tick, so the on-hold phrases and the timeout go by wall time, not only
        by the audio its client sends. Nothing while no tool runs or audio is queued."""
        self._ticks = int(self.holding and not self._queued)

    def _next_step(self) -> tuple[np.ndarray | None, StepPlan | None] | None:
        """The next step to run (its samples, None off the clock, and its plan), taken off the queues; None:
        nothing to run. Steps asked for off the clock first, then the tool pipeline's, then a frame."""
        pipeline = self._host.pipeline
        if self._off_clock:
            return None, self._off_clock.popleft()
        plan = None if pipeline is None else pipeline.off_clock()
        if plan is not None:
            return None, plan
        if self._queued:
            self._ticks = 0
            return self._queued.pop(0), None if pipeline is None else pipeline.frame_plan()
        if self._ticks:
            self._ticks = 0
            if self.holding:
                return None, pipeline.frame_plan()
        return None

    @property
    def pending_tool_calls(self) -> list[str]:
        return self._host.pending_tool_calls

    @property
    def profile(self) -> VoiceChatProfile:
        """With ``StreamingOptions(profile=True)``: the stage times of the steps that ran its frames."""
        return self._host.profile

    @property
    def prefilling(self) -> bool:
        """Opened with ``defer_prefill=True`` and not yet in the batch (:meth:`BatchEngine.prefill`)."""
        return self.slot is None and not self.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else "prefilling" if self.slot is None else \
            "finishing" if self.finishing else "open"
        return f"EngineSession(slot={self.slot}, frame={self.frame_index}, {state})"

    # ---- input
    def push_audio(self, samples: AudioInput, sample_rate: int = 16000) -> None:
        """Buffer ``samples`` (as :meth:`StreamingSession.push_audio` takes them); the engine's steps run
        them, one frame per step. Bad input raises ``ValueError`` and changes nothing. Frames past the
        session's limit raise :class:`ContextLimit`; the ones before it are kept and run."""
        self._check_open("push_audio")
        cfg = self._host.config
        chunk = as_mono_float32(samples, sample_rate, cfg.input_sample_rate)
        pending = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        size = self._host.frame_samples
        n = pending.shape[0] // size
        room = self._host.max_frames - self.frame_index - self.pending_steps
        self._queued += [pending[i * size:(i + 1) * size] for i in range(min(n, room))]
        self._pending = pending[n * size:].copy()
        if n > room:
            self._pending = np.zeros(0, dtype=np.float32)
            limit = self._host.max_frames
            raise ContextLimit(f"the session reaches its limit of {limit} frames "
                               f"({self._host.max_seconds:.1f} s): {n - room} frame(s) of this push were dropped")

    def flush(self, pad_partial: bool = True) -> None:
        """End the stream: the partial frame, zero-padded if ``pad_partial`` (and within the limit), and
        every pending frame run in the following steps, whose last returns this session's ``done``.
        Flushing again does nothing."""
        if self.finishing and not self.closed:
            return
        self._check_open("flush")
        if self._pending.size and pad_partial and self.frame_index + self.pending_steps < self._host.max_frames:
            frame = np.zeros(self._host.frame_samples, dtype=np.float32)
            frame[:self._pending.size] = self._pending
            self._queued.append(frame)
        self._pending = np.zeros(0, dtype=np.float32)
        if self._host.pipeline is not None:
            self._host.pipeline.end()
        self.finishing = True

    def cancel(self) -> list[VoiceChatEvent]:
        """Drop pending audio and end now: ``[cancelled]``; its slot is free for the next session."""
        if self.closed:
            return []
        self.engine._release(self)
        return self._host.final_events(tools=False) + [VoiceChatEvent(kind="cancelled", frame_index=self.frame_index)]

    def drop_audio(self) -> int:
        """Drop the audio not run yet (buffered frames and the partial one); returns how many samples.
        The session goes on from the next audio pushed."""
        self._check_open("drop_audio")
        dropped = len(self._queued) * self._host.frame_samples + self._pending.size
        self._queued, self._pending = [], np.zeros(0, dtype=np.float32)
        return dropped

    def step_off_clock(self, count: int, *, text: int | None = None, speak: Sequence[int] | None = None,
                       keep_audio: bool = True) -> None:
        """Queue ``count`` steps off the clock (as :meth:`StreamingSession.step_off_clock` runs them): they
        run in the engine's next steps, one per step and batched with the other rows, before this
        session's queued frames; their events come back from those steps. See
        :meth:`BatchEngine.step_off_clock`."""
        self.engine.step_off_clock(self, count, text=text, speak=speak, keep_audio=keep_audio)

    def send_tool_result(self, call_id: str, output: Any) -> None:
        """As :meth:`StreamingSession.send_tool_result`."""
        self._host.send_tool_result(call_id, output)

    def force_tokens(self, channel: str, ids: Any) -> None:
        """As :meth:`StreamingSession.force_tokens`."""
        self._host.force_tokens(channel, ids)

    def set_turn_taking(self, config: TurnTakingConfig | Mapping[str, Any] | None) -> None:
        """As :meth:`StreamingSession.set_turn_taking`, from this session's next frame."""
        self._check_open("set_turn_taking")
        self._host.set_turn_taking(config)
        if self.slot is not None:
            self.engine.frame_step.set_turn_taking(self.slot, self._host.options.turn_taking)

    def _check_open(self, call: str) -> None:
        if self.closed:
            failure = self.engine.failure_of(self)
            if failure is not None:
                raise RuntimeError(f"{call}: the session was closed when an engine step failed with "
                                   f"{type(failure).__name__}: {failure}; open a new one") from failure
            raise RuntimeError(f"{call}: the session is closed (flushed, cancelled or finished); open a new one")
        if self.finishing:
            raise RuntimeError(f"{call}: the session was flushed; its last frames run in the next steps")


class BatchEngine:
    """Steps up to ``max_sessions`` streaming sessions of one model as one batch (see the module doc).

    Each session's events equal those of a :class:`StreamingSession` fed the same audio: in the
    deterministic mode the same ids and codes and audio within float rounding (docs/engine.md); in
    the sampling mode each session draws from its own generator, so its output depends on its seed
    and audio only. A step reads the host once, and its op count does not grow with the batch.
    """

    def __init__(self, model: VoiceChatNetworks, max_sessions: int = 8, profile: bool = False) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive int, got {max_sessions!r}")
        self.model = model
        self.config = cfg = model.config
        self.device = model.device
        self.max_sessions = max_sessions
        self.profile = VoiceChatProfile(frame_duration_ms=cfg.frame_duration * 1000.0) if profile else None
        self.steps = 0
        self.frame_step = FrameStep(model)  # the batch: one row per slot
        self._slots: list[EngineSession | None] = []  # by slot (the FrameStep's rows)
        self._joining: list[EngineSession] = []  # deferred prefills, oldest first (see prefill)
        self._failures: dict[EngineSession, BaseException] = {}
        # Prefilled prompts kept for the next session with the same one (a PromptCache; None: none kept).
        self.prompt_cache: PromptCache | None = None

    def step_off_clock(self, handle: EngineSession, count: int, *, text: int | None = None,
                       speak: Sequence[int] | None = None, keep_audio: bool = True) -> None:
        """Queue ``count`` timeline steps for ``handle`` that hear no audio (NVIDIA's silence embedding on
        the user channel): ``text`` forced on the text channel (None: the model's own), ``speak`` the ids
        its TTS speaks instead, one per step from the first, ``keep_audio`` whether their speech comes out
        as ``audio`` events. They run before its queued frames, one per :meth:`step`, batched with the
        other rows through the same frame path. Nothing changes when it raises: ``ValueError`` for a
        session of another engine or a bad argument, ``RuntimeError`` for a closed or flushed session,
        :class:`ContextLimit` for steps past its limit."""
        if not isinstance(handle, EngineSession) or handle.engine is not self:
            raise ValueError(f"step_off_clock: {handle!r} is not a session of this engine")
        handle._check_open("step_off_clock")
        host = handle._host
        steps = off_clock_steps(count, text, speak, keep_audio, self.config.text_config.vocab_size)
        host.check_room(handle.frame_index + handle.pending_steps + count)
        handle._off_clock.extend(steps)

    def failure_of(self, handle: EngineSession) -> BaseException | None:
        """What closed ``handle``, if a step or its prefill failed on it."""
        return self._failures.get(handle)

    # ---- sessions
    @property
    def sessions(self) -> list[EngineSession]:
        """The open sessions, by slot."""
        return [s for s in self._slots if s is not None]

    @property
    def joining(self) -> list[EngineSession]:
        """Sessions opened with ``defer_prefill=True`` whose prompt prefill has not finished: they hold
        no slot yet and sit out every step (:meth:`prefill` advances them)."""
        return list(self._joining)

    def open(self, options: StreamingOptions | None = None, *, defer_prefill: bool = False,
             **kwargs: Any) -> EngineSession:
        """A new session in a free slot, its system prompt prefilled now, at batch 1, as a
        :class:`StreamingSession` does. With ``defer_prefill`` the prefill is left to :meth:`prefill`,
        which runs it in pieces between steps, so a long prompt does not stall the sessions already
        streaming; until it has run the session buffers its audio and sits out. Raises ``RuntimeError``
        when ``max_sessions`` are open (joining ones included)."""
        if options is None:
            options = StreamingOptions(**kwargs)
        elif kwargs:
            raise TypeError("pass either a StreamingOptions or keyword options, not both")
        if not (options.use_perception_cache and options.use_language_cache):
            raise ValueError("the batched engine runs the cached networks: use_perception_cache and "
                             "use_language_cache must be True (the uncached paths are diagnostics for one session)")
        if len(self.sessions) + len(self._joining) >= self.max_sessions:
            raise RuntimeError(f"the engine is full: {self.max_sessions} sessions are open (max_sessions)")
        handle = EngineSession(self, StreamingSession(self.model, options, prefill=not defer_prefill, own_frames=False,
                                                      prompt_cache=self.prompt_cache), None)
        if handle._host.prefilling:
            self._joining.append(handle)
        else:
            self._join(handle)
        return handle

    def prefill(self, seconds: float | None = None) -> list[EngineSession]:
        """Advance the deferred prefills, oldest first, one piece at a time (an LLM call over up to 64
        prompt positions, or one TTS step) for about ``seconds`` of wall time: a piece starts only
        while the time left exceeds the longest piece seen so far, and at least one runs per call, so a
        prefill always progresses. ``None`` runs them all. Returns the sessions that joined the batch
        (their prefill complete, their caches in a slot). A prefill that raises closes its session
        only (:attr:`EngineSession.failure`)."""
        joined: list[EngineSession] = []
        start = time.perf_counter()
        longest, pieces = 0.0, 0
        while self._joining:
            now = time.perf_counter()
            if seconds is not None and pieces and now - start + longest > seconds:
                break
            pieces += 1
            handle = self._joining[0]
            try:
                done = handle._host.prefill_step()
                if done:
                    self._joining.pop(0)
                    self._join(handle)
                    joined.append(handle)
            except Exception as error:
                self._failures[handle] = error
                self._release(handle)
            longest = max(longest, time.perf_counter() - now)
        return joined

    def _join(self, handle: EngineSession) -> None:
        """Give a prefilled session a slot (the first free one, or a new row) and its caches."""
        session = handle._host
        handle.slot = session.join_into(self.frame_step)
        self._slots += [None] * (handle.slot + 1 - len(self._slots))
        self._slots[handle.slot] = handle

    def _release(self, handle: EngineSession) -> None:
        handle.closed = True
        handle._host.closed = True
        handle._queued, handle._pending = [], np.zeros(0, dtype=np.float32)
        handle._off_clock.clear()
        handle._ticks = 0
        if handle in self._joining:  # still prefilling: it holds no slot
            self._joining.remove(handle)
            return
        if self._slots[handle.slot] is handle:
            self._slots[handle.slot] = None
            self.frame_step.leave(handle.slot)
        del self._slots[len(self.frame_step.rows):]  # trailing free slots are cut off

    # ---- the step
    def step(self) -> dict[EngineSession, list[VoiceChatEvent]]:
        """One step for every session with one pending (a step off the clock, else a complete frame), as
        one batch; the events per session (a flushed session's ``done`` with its last step). Sessions
        with nothing pending sit out. A failure inside the batched pass closes every session of the engine (their caches may be
        partly advanced) and is raised; one in a session's own events (its detokenizers, tool parsing)
        closes that session only, which then has no entry and a :attr:`EngineSession.failure`."""
        out: dict[EngineSession, list[VoiceChatEvent]] = {}
        running = {s: step for s in self._slots if s is not None and (step := s._next_step()) is not None}
        if running:
            try:
                packed, stamps = self._run(running)
            except BaseException as error:
                for s in self.sessions:
                    self._failures[s] = error
                    self._release(s)
                raise
            for s, (samples, plan) in running.items():
                try:
                    out[s] = s._host.frame_done(packed[s.slot], stamps, plan, heard=samples is not None)
                except Exception as error:  # this session's host side failed: it alone ends
                    self._failures[s] = error
                    self._release(s)
        for s in self.sessions:
            if s.finishing and not s.pending_steps:
                ending = s._host.final_events()
                out.setdefault(s, []).extend(ending + [VoiceChatEvent(kind="done", frame_index=s.frame_index)])
                self._release(s)
        return out

    def _run(self, running: dict[EngineSession, tuple[np.ndarray | None, StepPlan | None]]) -> tuple[np.ndarray, list[float]]:
        """The batched pass of each row's step (its samples or None, its plan): ``[rows, values]`` of each
        row's transcript ids, ids, codes and samples, and the stage marks (each session that profiles
        records its step's in ``frame_done``)."""
        profile = self.profile is not None or any(s.options.profile for s in running)
        inputs = {s.slot: s._host.frame_input(samples, plan) for s, (samples, plan) in running.items()}
        packed, stamps = self.frame_step.run(inputs, profile)
        if self.profile is not None:
            self.profile.frames.append(FrameTiming.from_stamps(self.steps, stamps))
        self.steps += 1
        return packed, stamps
