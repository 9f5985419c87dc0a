"""Many conversations on one model: every open session's next 80 ms frame as one batched pass.

``engine = model.create_engine(max_sessions=8)``; ``h = engine.open(StreamingOptions(...))``;
``h.push_audio(samples, rate)`` buffers; ``engine.step()`` runs one frame for every session with a
complete frame pending, through log-mel, Conformer, RNNT, LLM, TTS and codec at once, and returns
``{handle: events}``; ``h.flush()`` / ``h.cancel()`` end a session.

Each session occupies a slot: one row of every cache (two in the TTS: its conditional and
unconditional rows), at its own positions. Rows step with their own ring slots, RoPE positions and
masks (``forward_rows`` of each network), so a row computes what its session alone computes; a row
without a frame this step computes too and is then put back (its recurrent state restored, its
positions not advanced; what it wrote to a key/value or ring slot is past its position and is
overwritten before it is read). A session is opened by a :class:`StreamingSession` at batch 1 (its
system prompt prefilled exactly as alone), whose caches then move into the slot; its host side
(detokenizers, tool calls, limits) stays that session's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .audio_io import as_mono_float32
from .diagnostics import synchronize
from .events import ContextLimit, FrameTiming, StreamingOptions, VoiceChatEvent, VoiceChatProfile
from .gemma import TTSRows
from .language_heads import fused_input, language_heads
from .nemotron_h import KVCache, LanguageRows, MambaCache
from .rnnt import RnntState
from .session import AudioInput, StreamingSession

if TYPE_CHECKING:
    from .networks import VoiceChatNetworks

__all__ = ["BatchEngine", "EngineSession"]


class EngineSession:
    """A conversation in a :class:`BatchEngine` (``engine.open``): push audio, end it; the engine steps it."""

    def __init__(self, engine: BatchEngine, session: StreamingSession, slot: int | None) -> None:
        self.engine = engine
        self.session = session  # its host side: detokenizers, tool channel, limits, frame counter
        self.slot = slot  # its row in the batch; None while its deferred prefill runs
        self.llm_position = 0  # the next LLM position (prompt included)
        self.tts_position = 0  # the next TTS position (speaker warmup and prompt included)
        self.round_keys_until = 0  # LLM positions below this store bf16 keys (see LanguageRows)
        self._pending = np.zeros(0, dtype=np.float32)
        self._frames: list[np.ndarray] = []  # complete frames waiting for a step
        self.finishing = False  # flushed: done once its frames have run
        self.closed = False

    # ---- what the session shows
    @property
    def options(self) -> StreamingOptions:
        return self.session.options

    @property
    def frame_index(self) -> int:
        return self.session.frame_index

    @property
    def text(self) -> str:
        return self.session.text

    @property
    def function_text(self) -> str:
        return self.session.function_text

    @property
    def user_transcript(self) -> str:
        return self.session.user_transcript

    @property
    def last_ids(self) -> tuple[int, int] | None:
        return self.session.last_ids

    @property
    def max_seconds(self) -> float:
        return self.session.max_seconds

    @property
    def failure(self) -> BaseException | None:
        """What closed the session, if a step failed on it."""
        return self.engine._failures.get(self)

    @property
    def pending_frames(self) -> int:
        """Complete frames waiting for a step."""
        return len(self._frames)

    @property
    def pending_tool_calls(self) -> list[str]:
        return self.session.pending_tool_calls

    @property
    def profile(self) -> VoiceChatProfile:
        """With ``StreamingOptions(profile=True)``: the stage times of the steps that ran its frames."""
        return self.session.profile

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
        cfg = self.session.config
        chunk = as_mono_float32(samples, sample_rate, cfg.input_sample_rate)
        pending = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        size = self.session.frame_samples
        n = pending.shape[0] // size
        room = self.session.max_frames - self.frame_index - len(self._frames)
        self._frames += [pending[i * size:(i + 1) * size] for i in range(min(n, room))]
        self._pending = pending[n * size:].copy()
        if n > room:
            self._pending = np.zeros(0, dtype=np.float32)
            limit = self.session.max_frames
            raise ContextLimit(f"the session reaches its limit of {limit} frames "
                               f"({self.session.max_seconds:.1f} s): {n - room} frame(s) of this push were dropped")

    def flush(self, pad_partial: bool = True) -> None:
        """End the stream: the partial frame, zero-padded if ``pad_partial`` (and within the limit), and
        every pending frame run in the following steps, whose last returns this session's ``done``.
        Flushing again does nothing."""
        if self.finishing and not self.closed:
            return
        self._check_open("flush")
        if self._pending.size and pad_partial and self.frame_index + len(self._frames) < self.session.max_frames:
            frame = np.zeros(self.session.frame_samples, dtype=np.float32)
            frame[:self._pending.size] = self._pending
            self._frames.append(frame)
        self._pending = np.zeros(0, dtype=np.float32)
        self.finishing = True

    def cancel(self) -> list[VoiceChatEvent]:
        """Drop pending audio and end now: ``[cancelled]``; its slot is free for the next session."""
        if self.closed:
            return []
        self.engine._release(self)
        return self.session.final_events(tools=False) + [VoiceChatEvent(kind="cancelled", frame_index=self.frame_index)]

    def drop_audio(self) -> int:
        """Drop the audio not run yet (buffered frames and the partial one); returns how many samples.
        The session goes on from the next audio pushed."""
        self._check_open("drop_audio")
        dropped = len(self._frames) * self.session.frame_samples + self._pending.size
        self._frames, self._pending = [], np.zeros(0, dtype=np.float32)
        return dropped

    def send_tool_result(self, call_id: str, output: Any) -> None:
        """As :meth:`StreamingSession.send_tool_result`."""
        self.session.send_tool_result(call_id, output)

    def force_tokens(self, channel: str, ids: Any) -> None:
        """As :meth:`StreamingSession.force_tokens`."""
        self.session.force_tokens(channel, ids)

    def _check_open(self, call: str) -> None:
        if self.closed:
            failure = self.engine._failures.get(self)
            if failure is not None:
                raise RuntimeError(f"{call}: the session was closed when an engine step failed with "
                                   f"{type(failure).__name__}: {failure}; open a new one") from failure
            raise RuntimeError(f"{call}: the session is closed (flushed, cancelled or finished); open a new one")
        if self.finishing:
            raise RuntimeError(f"{call}: the session was flushed; its last frames run in the next steps")


# A place a tensor lives: (object, attribute name) or (list, index).
_Ref = tuple[Any, Any]


def _get(ref: _Ref) -> torch.Tensor:
    holder, key = ref
    return holder[key] if isinstance(key, int) else getattr(holder, key)


def _set(ref: _Ref, value: torch.Tensor) -> None:
    holder, key = ref
    if isinstance(key, int):
        holder[key] = value
    else:
        setattr(holder, key, value)


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
        stt = model.stt_model
        self._perception = stt.perception
        self._transcriber = model.transcriber
        self._embed, self._llm = stt.embed_tokens, stt.llm
        self._heads = (model.fused_heads, None) if model.fused_heads is not None else (stt.lm_head, stt.function_head)
        self._speech = model.tts_model
        self._codec = model.tts_model.audio_codec
        self._slots: list[EngineSession | None] = []
        self._joining: list[EngineSession] = []  # deferred prefills, oldest first (see prefill)
        self._failures: dict[EngineSession, BaseException] = {}
        with torch.inference_mode():
            self._silence = model.tts_model.silence_codes(torch.long).view(1, 1, -1)
            self._start_hc = self._transcriber.new_state().hc
            self._new_caches(0)

    # ---- the batched caches: one row per slot (two in the TTS)
    def _new_caches(self, batch: int) -> None:
        perception, dtype = self._perception, self.model.dtype
        self._mel = perception.log_mel.new_rows_cache(batch)
        self._conformer = perception.new_rows_cache(batch)
        self._rnnt = RnntState(self._start_hc.repeat(1, batch, 1))
        self._language = self._llm.new_cache(batch, dtype=dtype)
        self._ids = torch.full((batch, 2), self.config.pad_token_id, dtype=torch.long, device=self.device)
        tts = self._speech.tts_model
        self._tts = tts.new_cache()
        for buffers in (self._tts.keys, self._tts.values):
            for i, t in enumerate(buffers):
                buffers[i] = t.new_zeros(2 * batch, *t.shape[1:])
        self._codes = self._silence.repeat(batch, 1, 1)
        self._codec_cache = self._codec.new_cache(batch)

    def _recurrent(self) -> list[tuple[_Ref, int, int]]:
        """The state a row carries from frame to frame: (where, batch axis, rows per slot)."""
        refs: list[tuple[_Ref, int, int]] = [((self._mel, "samples"), 0, 1), ((self._conformer, "mel"), 0, 1),
                                            ((self._rnnt, "hc"), 1, 1), ((self, "_ids"), 0, 1),
                                            ((self, "_codes"), 0, 1), ((self._codec_cache, "spectrum"), 0, 1)]
        refs += [((self._codec_cache.blocks, i), 0, 1) for i in range(len(self._codec_cache.blocks))]
        refs += [((c, "ssm_state"), 0, 1) for c in self._language.layers if isinstance(c, MambaCache)]
        return refs

    def _buffers(self) -> list[tuple[_Ref, int, int]]:
        """Every batched cache tensor: the recurrent state, rings and key/value buffers."""
        refs = self._recurrent() + [((self._conformer, "kv"), 2, 1), ((self._conformer, "conv"), 1, 1)]
        for c in self._language.layers:
            if isinstance(c, MambaCache):
                refs.append(((c, "conv_state"), 0, 1))
            elif isinstance(c, KVCache):
                refs += [((c, "keys"), 0, 1), ((c, "values"), 0, 1)]
        for buffers in (self._tts.keys, self._tts.values):
            refs += [((buffers, i), 0, 2) for i in range(len(buffers))]
        return refs

    def _resize(self, batch: int) -> None:
        """``batch`` slots: rows added at the end (zeros), or the last ones dropped (freed)."""
        for ref, axis, per in self._buffers():
            t = _get(ref)
            have = t.shape[axis] // per
            if batch > have:
                shape = list(t.shape)
                shape[axis] = (batch - have) * per
                t = torch.cat([t, t.new_zeros(shape)], dim=axis)
            else:
                t = t.narrow(axis, 0, batch * per).clone()
            _set(ref, t)

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
        handle = EngineSession(self, StreamingSession(self.model, options, prefill=not defer_prefill), None)
        if handle.session.prefilling:
            self._joining.append(handle)
        else:
            self._join(handle)
        return handle

    def prefill(self, seconds: float | None = None) -> list[EngineSession]:
        """Advance the deferred prefills, oldest first, one piece at a time (an LLM call over up to 256
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
                done = handle.session.prefill_step()
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
        slot = next((i for i, s in enumerate(self._slots) if s is None), len(self._slots))
        handle.slot = slot
        with torch.inference_mode():
            if slot == len(self._slots):
                self._resize(slot + 1)
                self._slots.append(None)
            self._adopt(handle)
        self._slots[slot] = handle

    def _adopt(self, handle: EngineSession) -> None:
        """Move a freshly prefilled session's caches into its slot's rows (and reset the rest)."""
        r, session = handle.slot, handle.session
        timeline = session._timeline
        for ref, axis, per in self._buffers():
            _get(ref).narrow(axis, r * per, per).zero_()
        self._rnnt.hc[:, r] = session._rnnt_state.hc[:, 0]
        self._ids[r] = self.config.pad_token_id
        self._codes[r] = timeline.previous_code[0]
        language = timeline.language_cache
        handle.llm_position = language.offset
        for mine, theirs in zip(self._language.layers, language.layers):
            if isinstance(mine, MambaCache):
                mine.conv_state[r] = theirs.conv_state[0]
                mine.ssm_state[r] = theirs.ssm_state[0]
            elif isinstance(mine, KVCache):
                n = theirs.offset
                mine.reserve(n)
                mine.keys[r, :, :n] = theirs.keys[0, :, :n]
                mine.values[r, :, :n] = theirs.values[0, :, :n]
                if n and theirs.keys.dtype == torch.bfloat16 and mine.keys.dtype != torch.bfloat16:
                    handle.round_keys_until = theirs.blocks  # the reference stores bf16 until its next block
        tts = timeline.tts_cache
        handle.tts_position = tts.offset
        for layer in range(len(tts.keys)):
            window = tts.windows[layer]
            held = tts.offset if window is None else min(tts.offset, window)
            self._tts._reserve(layer, held)
            self._tts.keys[layer][2 * r:2 * r + 2, :, :held] = tts.keys[layer][:, :, :held]
            self._tts.values[layer][2 * r:2 * r + 2, :, :held] = tts.values[layer][:, :, :held]
        # The slot holds them now: drop the session's own copies.
        timeline.language_cache = timeline.tts_cache = None
        session._mel_cache = session._conformer_cache = session._codec_cache = None

    def _release(self, handle: EngineSession) -> None:
        handle.closed = True
        handle.session.closed = True
        handle._frames, handle._pending = [], np.zeros(0, dtype=np.float32)
        if handle in self._joining:  # still prefilling: it holds no slot
            self._joining.remove(handle)
            return
        if self._slots[handle.slot] is handle:
            self._slots[handle.slot] = None
        while self._slots and self._slots[-1] is None:  # trailing free slots: shrink the batch
            self._slots.pop()
        with torch.inference_mode():
            if not self._slots:
                self._new_caches(0)
            elif len(self._slots) < self._rows():
                self._resize(len(self._slots))

    def _rows(self) -> int:
        return self._ids.shape[0]

    # ---- the step
    def step(self) -> dict[EngineSession, list[VoiceChatEvent]]:
        """One frame for every session with a complete frame pending, as one batch; the events per
        session (a flushed session's ``done`` with its last frame). Sessions with nothing pending sit
        out. A failure inside the batched pass closes every session of the engine (their caches may be
        partly advanced) and is raised; one in a session's own events (its detokenizers, tool parsing)
        closes that session only, which then has no entry and a :attr:`EngineSession.failure`."""
        out: dict[EngineSession, list[VoiceChatEvent]] = {}
        running = [s for s in self._slots if s is not None and s._frames]
        if running:
            try:
                packed = self._run(running)
            except BaseException as error:
                for s in self.sessions:
                    self._failures[s] = error
                    self._release(s)
                raise
            for s in running:
                session = s.session
                try:
                    events = session._frame_events(packed[s.slot])
                except Exception as error:  # this session's host side failed: it alone ends
                    self._failures[s] = error
                    self._release(s)
                    continue
                session.frame_index += 1
                session._timeline.index += 1
                out[s] = events
        for s in self.sessions:
            if s.finishing and not s._frames:
                ending = s.session.final_events()
                out.setdefault(s, []).extend(ending + [VoiceChatEvent(kind="done", frame_index=s.frame_index)])
                self._release(s)
        return out

    def _run(self, running: list[EngineSession]) -> np.ndarray:
        """The batched pass; ``[rows, values]`` of each row's transcript ids, ids, codes and samples."""
        cfg, device, rows = self.config, self.device, self._rows()
        profile = self.profile is not None or any(s.options.profile for s in running)
        stamps = [time.perf_counter()]

        def mark() -> None:
            if profile:
                synchronize(device)
                stamps.append(time.perf_counter())

        frames = np.zeros((rows, self.model.config.input_frame_samples), dtype=np.float32)
        # Per row: frame index, LLM position, TTS position, runs (0/1), runs the TTS, rounds its keys.
        ints = np.zeros((6, rows), dtype=np.int64)
        generators: list[torch.Generator | None] = [None] * rows
        for s in running:
            r = s.slot
            frames[r] = s._frames.pop(0)
            tts_runs = s.session._timeline.index > 0  # timeline position 0 runs no TTS
            ints[:, r] = (s.frame_index, s.llm_position, s.tts_position, 1, tts_runs,
                          s.llm_position < s.round_keys_until)
            if tts_runs and not s.options.deterministic:
                generators[r] = s.session._timeline.generator
        for s in self.sessions:
            if s not in running:  # sits out at its own positions: its writes land past them
                ints[:3, s.slot] = (s.frame_index, s.llm_position, s.tts_position)
        everyone = len(running) == rows
        deterministic: bool | torch.Tensor = all(g is None for g in generators)
        with torch.inference_mode():
            table = torch.from_numpy(ints).to(device)
            frame_index, llm_pos, tts_pos = table[0], table[1], table[2]
            runs, tts_runs, round_keys = table[3].bool(), table[4].bool(), table[5].bool()
            if deterministic is False:
                deterministic = torch.tensor([g is None for g in generators], device=device)
            saved = [] if everyone else [(ref, axis, per, _get(ref).clone()) for ref, axis, per in self._recurrent()]
            self._mel.frames = self._conformer.frames = frame_index
            mel = self._perception.log_mel.forward_rows(torch.from_numpy(frames).to(device), self._mel)
            projected, encoded = self._perception.forward_rows(mel, self._conformer)
            mark()
            transcript_ids = self._transcriber.step_rows(encoded, self._rnnt)  # [S, rows]
            mark()
            fused = fused_input(self._embed, self._ids[:, :1], projected, self._ids[:, 1:],
                                cfg.function_channel_weight)
            language_rows = LanguageRows.make(llm_pos, int(ints[1].max()) + 1, self._llm.config.conv_kernel,
                                              round_keys if ints[5].any() else None)
            hidden = self._llm.forward_rows(fused, self._language, language_rows)
            ids = language_heads(hidden, *self._heads).ids.view(rows, 2)
            for s in running:  # force_tokens / a tool result: queued ids replace this row's outputs
                if s.session._tools.forcing:
                    ids[s.slot] = s.session._tools.apply(ids[s.slot])
            self._ids = ids
            mark()
            tts_rows = TTSRows.make(tts_pos.repeat_interleave(2), int(ints[2].max()) + 1,
                                    self._speech.tts_model.backbone.window)
            codes = self._speech.step(self._codes, ids[:, 0], self._tts, generators, deterministic, tts_rows)
            codes = torch.where(tts_runs[:, None, None], codes, self._silence)
            self._codes = torch.where(tts_runs[:, None, None], codes, self._codes)
            mark()
            clean = self._speech.replace_control_codes(codes)
            samples = self._codec.decode_step(clean.transpose(1, 2), self._codec_cache)
            for ref, axis, per, before in saved:  # rows that sat out: as they were
                keep = runs.repeat_interleave(per).view([-1 if a == axis else 1 for a in range(before.dim())])
                _set(ref, torch.where(keep, _get(ref), before))
            # One host read for the whole batch (ids < 2**24 are exact in float32).
            ints_out = torch.cat([transcript_ids.t(), ids, clean.view(rows, -1)], dim=1)
            packed = torch.cat([ints_out.float(), samples.view(rows, -1).float()], dim=1).numpy(force=True)
        stamps.append(time.perf_counter())
        for s in running:
            s.llm_position += 1
            s.tts_position += int(s.session._timeline.index > 0)
        if profile:  # the step's stages, for the engine and for every session that asked (its frame's)
            p, r, lm, tts, codec = np.diff(stamps) * 1000.0
            total = (stamps[-1] - stamps[0]) * 1000.0
            if self.profile is not None:
                self.profile.frames.append(FrameTiming(self.steps, p, r, lm, tts, codec, total))
            for s in running:
                if s.options.profile:
                    s.session.profile.frames.append(FrameTiming(s.frame_index, p, r, lm, tts, codec, total))
        self.steps += 1
        return packed

