"""The one frame path: an 80 ms frame for every row of a batch, as one pass through log-mel,
Conformer, RNNT, LLM, TTS and codec.

:class:`FrameStep` holds the streaming caches of its rows (one row per conversation; two in the TTS,
its conditional and unconditional rows) and where each row stands. A :class:`StreamingSession` drives
one with one row, :class:`~nvchat_torch.engine.BatchEngine` one with a row per session: the same
networks' ``forward_step`` on the same caches, so a session alone and a row of the engine compute the
same thing.

Rows step with their own ring slots, RoPE positions and masks. A row without a frame this step
computes too and is then put back (its recurrent state restored, its positions not advanced; what it
wrote to a key/value or ring slot is past its position and is overwritten before it is read). A row
joins with the caches of its prompt prefill (:meth:`FrameStep.join`), which the
:class:`~nvchat_torch.session.Timeline` ran at batch 1 exactly as the reference does.

Everything stays on the device: ids and codes feed the next step there, and a step's outputs are
packed into one tensor that is read once (plus one sync per stage when profiling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..diagnostics import return_freed_memory, synchronize
from ..models.conformer import ConformerRows
from ..models.gemma import TTSRows
from ..models.language_heads import fused_input, language_heads
from ..models.nemotron_h import KVCache, LanguageRows, MambaCache
from ..models.rnnt import RnntState
from ..turn_taking import TurnTaking, TurnTakingConfig
from .compiled_step import CompiledStep, batch_bucket
from .frame_layout import (
    DECODES,
    DRAWS,
    FORCED_IDS,
    FORCED_TEXT,
    FORCES,
    FORCES_TEXT,
    FORCING,
    FRAME,
    HEARS,
    LLM_POSITION,
    ROUNDS_KEYS,
    RUNS,
    RUNS_TTS,
    SPOKEN,
    TABLE,
    THINKS,
    TTS_POSITION,
    FrameInput,
    PackedLayout,
    StepFlags,
    StepTensors,
)

if TYPE_CHECKING:
    from ..networks import VoiceChatNetworks
    from .compiled_step import StepCompiler
    from .timeline import Timeline

__all__ = ["FrameStep", "FrameInput", "RowState"]  # FrameInput: frame_layout's, where the host gives a row's step

# The tensors of a language cache layer, by its kind.
_STATE_NAMES: dict[type, tuple[str, ...]] = {MambaCache: ("conv_state", "ssm_state"), KVCache: ("keys", "values")}

# A place a tensor lives: (object, attribute name) or (list, index).
_Ref = tuple[Any, Any]


def _get(ref: _Ref) -> torch.Tensor:
    holder, key = ref
    return holder[key] if isinstance(key, int) else getattr(holder, key)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a fresh tensor of its shape. A prefill leaves the Mamba conv state a view
    of its window, whose strides depend on the prompt's length even where its batch of 1 makes it
    "contiguous"; a compiled step guards on strides, so a new session would compile again."""
    fresh = torch.empty(t.shape, device="meta").stride()
    return t if t.stride() == fresh else t.clone(memory_format=torch.contiguous_format)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _set(ref: _Ref, value: torch.Tensor) -> None:
    holder, key = ref
    if isinstance(key, int):
        holder[key] = value
    else:
        setattr(holder, key, value)


@dataclass
class RowState:
    """Where a row stands: audio frames heard (its log-mel and Conformer stream position; a step off the
    clock hears none), the next LLM and TTS positions (prompt and speaker warmup included), the timeline
    index (prompt steps included; index 0 runs no TTS), and the LLM positions below which its keys are
    still stored in bf16 (a bf16 prompt's cache, which the reference keeps until its next 256-slot
    block: see ``LanguageRows``)."""

    frame_index: int = 0
    llm_position: int = 0
    tts_position: int = 0
    timeline_index: int = 0
    round_keys_until: int = 0


class FrameStep:
    """The batched caches of up to any number of rows and the pass that steps them (see the module doc).

    ``perception_cache=False`` / ``language_cache=False``: the reference's cache-free diagnostics (the
    encoder over a window of recent audio; the LLM over the whole history every frame), for one row.
    With the model's step compiler (``load_model(..., compile=True)``) the device step runs compiled,
    its batch in powers of two (:func:`~nvchat_torch.runtime.compiled_step.batch_bucket`); the diagnostics stay eager.
    """

    def __init__(self, model: VoiceChatNetworks, *, perception_cache: bool = True, language_cache: bool = True) -> None:
        self.model = model
        self.config = cfg = model.config
        self.device = model.device
        self.perception_cache, self.language_cache = perception_cache, language_cache
        stt = model.stt_model
        self._perception = stt.perception
        self._transcriber = model.transcriber
        self._embed, self._llm = stt.embed_tokens, stt.llm
        self._heads = model.vocabulary_heads()
        self._speech = model.tts_model
        self._codec = model.tts_model.audio_codec
        self.rows: list[RowState | None] = []  # by slot; None: a free slot
        self._turns: TurnTaking | None = None  # the turn-taking policy, while any row has one
        self.layout = PackedLayout(cfg.audio_config.max_symbols, cfg.tts_config.num_quantizers, cfg.output_frame_samples)
        compiler: StepCompiler | None = getattr(model, "step_compiler", None)
        self.compiler = compiler if perception_cache and language_cache else None
        self._compiled = None if self.compiler is None else \
            CompiledStep(self.compiler, self._device_step, self._capacity_buffers)
        self._rounds_keys = False  # a row's LLM keys were rounded to bf16 (compiled: the rounding stays in its graph)
        # The cache-free diagnostics (one row): the audio window, and the LLM inputs so far.
        self._window_samples = self._perception.uncached_window_frames * cfg.input_frame_samples
        self._audio_window = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._history: list[torch.Tensor] = []
        with torch.inference_mode():
            self._silence = model.tts_model.silence_codes(torch.long).view(1, 1, -1)
            self._silence_embedding = model.silence_embedding()  # what a step off the clock hears
            self._start_hc = self._transcriber.new_state().hc
            self._new_caches(0)

    # ---- the caches: one row per slot (two in the TTS)
    def _new_caches(self, batch: int) -> None:
        perception, dtype = self._perception, self.model.dtype
        self._mel = perception.log_mel.new_cache(batch)
        self._conformer = perception.new_cache(batch)
        self._rnnt = RnntState(self._start_hc.repeat(1, batch, 1))
        self._language = self._llm.new_cache(batch, dtype=dtype)
        self._ids = torch.full((batch, 2), self.config.pad_token_id, dtype=torch.long, device=self.device)
        self._tts = self._speech.tts_model.new_cache()
        for buffers in (self._tts.keys, self._tts.values):
            for i, t in enumerate(buffers):
                buffers[i] = t.new_zeros(2 * batch, *t.shape[1:])
        self._codes = self._silence.repeat(batch, 1, 1)
        self._codec_cache = self._codec.new_cache(batch)
        self._turns = None
        if self._compiled is not None:
            self._compiled.buffers_changed()

    def _capacity_buffers(self) -> list[torch.Tensor]:
        """The key/value buffers whose capacity (dim 2) grows by blocks: dynamic to the compiler."""
        return self._language.tensors() + self._tts.keys + self._tts.values

    def _heard(self) -> list[tuple[_Ref, int, int]]:
        """What a row's audio advances (log-mel, Conformer, RNNT; a step off the clock leaves it as it was):
        (where, batch axis, rows per slot)."""
        refs: list[tuple[_Ref, int, int]] = [((self._mel, "samples"), 0, 1), ((self._conformer, "mel"), 0, 1),
                                            ((self._rnnt, "hc"), 1, 1)]
        return refs + [((self._conformer.conv, i), 0, 1) for i in range(len(self._conformer.conv))]

    def _thought(self, ssm: bool = True) -> list[tuple[_Ref, int, int]]:
        """What an LLM step advances: the fed-back ids and the Mamba layers' state (``ssm``: their SSM state
        too)."""
        refs: list[tuple[_Ref, int, int]] = [((self, "_ids"), 0, 1)]
        for c in self._language.layers:
            if isinstance(c, MambaCache):
                refs += [((c, "conv_state"), 0, 1)] + ([((c, "ssm_state"), 0, 1)] if ssm else [])
        return refs

    def _decoded(self) -> list[tuple[_Ref, int, int]]:
        """What a codec step advances."""
        refs: list[tuple[_Ref, int, int]] = [((self._codec_cache, "spectrum"), 0, 1)]
        return refs + [((self._codec_cache.blocks, i), 0, 1) for i in range(len(self._codec_cache.blocks))]

    def _recurrent(self) -> list[tuple[_Ref, int, int]]:
        """The state a row carries from step to step (the TTS's codes between what the LLM and codec advance)."""
        return self._heard() + self._thought() + [((self, "_codes"), 0, 1)] + self._decoded()

    def _buffers(self) -> list[tuple[_Ref, int, int]]:
        """Every batched cache tensor: the recurrent state, rings and key/value buffers."""
        refs = self._recurrent() + [((self._conformer, "kv"), 2, 1)]
        for c in self._language.layers:
            if isinstance(c, KVCache):
                refs += [((c, "keys"), 0, 1), ((c, "values"), 0, 1)]
        for buffers in (self._tts.keys, self._tts.values):
            refs += [((buffers, i), 0, 2) for i in range(len(buffers))]
        return refs

    def _resize(self, rows: int) -> None:
        """Room for ``rows`` slots (compiled: the next power of two): rows added at the end (zeros), or the
        last ones dropped (freed)."""
        batch = rows if self.compiler is None else batch_bucket(rows)
        if self._compiled is not None:
            self._compiled.buffers_changed()
        for ref, axis, per in self._buffers():
            t = _get(ref)
            have = t.shape[axis] // per
            if batch == have:
                continue
            if batch > have:
                shape = list(t.shape)
                shape[axis] = (batch - have) * per
                t = torch.cat([t, t.new_zeros(shape)], dim=axis)
            else:
                t = t.narrow(axis, 0, batch * per).clone()
            _set(ref, t)
        if self._turns is not None:
            self._turns.resize(batch)

    @property
    def batch(self) -> int:
        """Rows in the caches (free slots below the last used one included)."""
        return self._ids.shape[0]

    def cache_bytes(self) -> dict[str, int]:
        """Bytes the two caches that grow with a session hold (LLM, TTS), all rows."""
        language = self._language.nbytes if self.language_cache else sum(t.nbytes for t in self._history)
        return {"language": language, "tts": self._tts.nbytes}

    # ---- rows
    def join(self, timeline: Timeline, rnnt_state: RnntState, turn_taking: TurnTakingConfig | None = None) -> int:
        """A row (the first free slot, or a new one) with a freshly prefilled timeline's caches, which move
        into it: the timeline's own are dropped; ``turn_taking``: its policy (None: the raw model's ids).
        Returns the slot."""
        if not (self.perception_cache and self.language_cache) and self.rows:
            raise ValueError("the cache-free diagnostics run one row")
        slot = next((i for i, s in enumerate(self.rows) if s is None), len(self.rows))
        with torch.inference_mode():
            first = not self.rows  # the caches are empty: the new row's are zeros or the timeline's own
            if first:  # its prefilled caches become the step's, no copy made
                self._take_caches(timeline)
            if slot == len(self.rows):
                if slot + 1 > self.batch:
                    self._resize(slot + 1)
                self.rows.append(None)
            self.rows[slot] = self._adopt(slot, timeline, rnnt_state, clear=not first)
            self.set_turn_taking(slot, turn_taking)
        # What the timeline held and the row did not take is freed now; glibc would keep that heap (at
        # full size ~0.5 GB) for reuse that frames never make.
        return_freed_memory()
        return slot

    def _take_caches(self, timeline: Timeline) -> None:
        """An empty step takes a prefilled timeline's LLM and TTS cache tensors as its one row's (the
        batched layout with one row is the timeline's), where they have the dtype the rows keep; the
        others are copied by :meth:`_adopt`. At full size this saves the peak of two copies (~0.3 GB)."""
        language = timeline.language_cache
        if language is not None:
            for mine, theirs in zip(self._language.layers, language.layers):
                for name in _STATE_NAMES.get(type(mine), ()):
                    if getattr(theirs, name).dtype == getattr(mine, name).dtype:
                        setattr(mine, name, _dense(getattr(theirs, name)))
        tts = timeline.tts_cache
        for buffers, theirs in ((self._tts.keys, tts.keys), (self._tts.values, tts.values)):
            for layer, t in enumerate(theirs):
                if t.dtype == buffers[layer].dtype:
                    buffers[layer] = t

    def set_turn_taking(self, slot: int, config: TurnTakingConfig | None) -> None:
        """``slot``'s turn-taking policy from its next frame: switched on it starts fresh, new values keep
        its state, None switches it off. With no row using it the policy costs nothing."""
        if config is None and self._turns is None:
            return
        with torch.inference_mode():
            if self._turns is None:
                cfg = self.config
                self._turns = TurnTaking(None, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id,
                                         pad_id=cfg.pad_token_id, batch=self.batch, device=self.device,
                                         rnnt_vocabulary=cfg.rnnt_vocabulary)
            self._turns.configure(slot, config)
        if not self._turns.active:
            self._turns = None

    def _adopt(self, r: int, timeline: Timeline, rnnt_state: RnntState, clear: bool) -> RowState:
        """Row ``r`` from the timeline's caches (those :meth:`_take_caches` took are the row's already);
        ``clear``: zero the slot first (a reused or added row beside others; a first row is fresh)."""
        language, tts = timeline.language_cache, timeline.tts_cache  # None: the cache-free diagnostic's LLM
        if clear:
            for ref, axis, per in self._buffers():
                _get(ref).narrow(axis, r * per, per).zero_()
        self._rnnt.hc[:, r] = rnnt_state.hc[:, 0]
        self._ids[r] = self.config.pad_token_id
        self._codes[r] = timeline.previous_code[0]
        row = RowState(timeline_index=timeline.index)
        if language is None:  # the cache-free diagnostic: the LLM inputs so far
            self._history = timeline.history
            timeline.history = []
        else:
            row.llm_position = language.offset
            for mine, theirs in zip(self._language.layers, language.layers):
                if isinstance(mine, MambaCache):
                    if mine.conv_state is not theirs.conv_state:
                        mine.conv_state[r] = theirs.conv_state[0]
                    if mine.ssm_state is not theirs.ssm_state:
                        mine.ssm_state[r] = theirs.ssm_state[0]
                elif isinstance(mine, KVCache):
                    n = theirs.offset
                    mine.reserve(n)
                    if mine.keys is not theirs.keys:
                        mine.keys[r, :, :n] = theirs.keys[0, :, :n]
                    if mine.values is not theirs.values:
                        mine.values[r, :, :n] = theirs.values[0, :, :n]
                    if n and theirs.keys.dtype == torch.bfloat16 and mine.keys.dtype != torch.bfloat16:
                        row.round_keys_until = theirs.blocks  # the reference stores bf16 until its next block
                        self._rounds_keys = True
        row.tts_position = tts.offset
        for layer in range(len(tts.keys)):
            window = tts.windows[layer]
            held = tts.offset if window is None else min(tts.offset, window)
            self._tts.reserve_layer(layer, held)
            for mine, theirs in ((self._tts.keys, tts.keys), (self._tts.values, tts.values)):
                if mine[layer] is not theirs[layer]:
                    mine[layer][2 * r:2 * r + 2, :, :held] = theirs[layer][:, :, :held]
        timeline.language_cache = timeline.tts_cache = None  # the row holds them now
        return row

    def leave(self, slot: int) -> None:
        """Free ``slot``; trailing free slots are cut off (their rows freed), and with none left the
        caches are empty."""
        self.rows[slot] = None
        self.set_turn_taking(slot, None)
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        with torch.inference_mode():
            if not self.rows:
                self._new_caches(0)
                self._audio_window = self._audio_window[:0]
                self._history = []
            elif len(self.rows) < self.batch:
                self._resize(len(self.rows))  # compiled: only down to a smaller power of two

    # ---- the step: a host prologue (the one upload), the device step, a host epilogue (the one read)
    def run(self, inputs: dict[int, FrameInput], profile: bool = False) -> tuple[np.ndarray, list[float]]:
        """One step for each slot in ``inputs`` (a heard frame, or a step off the clock); the other rows
        sit out. Returns ``[batch, values]``: each
        row's values in the layout :attr:`layout` names (transcript ids, text and function ids, codes,
        samples, and while a row has turn-taking its reason code), read from the device at once, and
        the stage marks (``time.perf_counter()`` at the start and after perception, RNNT, LLM, TTS and
        codec, each after a device sync when ``profile`` and the step is eager; else the start and the
        end)."""
        stamps = [time.perf_counter()]
        step = self._prologue(inputs, profile and self._compiled is None)
        with torch.inference_mode():
            if step.marks:
                packed = self._device_step(step, stamps)
            elif self._compiled is not None:
                packed = self._compiled(step, (step.flags, self.batch))
            else:
                packed = self._device_step(step, None)
            values = packed.numpy(force=True)  # the one host read
        stamps.append(time.perf_counter())
        for r, given in inputs.items():
            row = self.rows[r]
            row.tts_position += int(row.timeline_index > 0 and given.speaks)
            row.llm_position += given.thinks
            row.frame_index += given.samples is not None
            row.timeline_index += given.thinks
        return values, stamps

    def _prologue(self, inputs: dict[int, FrameInput], marks: bool) -> StepTensors:
        """The host's part before the step: what it knows of the rows as one table, uploaded in one copy,
        the frame's samples, the TTS's random numbers (drawn from the rows' generators), the caches'
        room for the step (grown in whole blocks, here and never inside the step), and the flags that
        pick the step's graph (under the compiler, a few fixed ones: see :class:`~nvchat_torch.runtime.frame_layout.StepFlags`)."""
        cfg, device, batch, static = self.config, self.device, self.batch, self._compiled is not None
        frames = np.zeros((batch, cfg.input_frame_samples), dtype=np.float32)
        # What the host knows of each row, one column per row (the fields: TABLE).
        ints = np.zeros((len(TABLE), batch), dtype=np.int64)
        ints[SPOKEN] = -1
        generators: list[torch.Generator | None] = [None] * batch
        for r, row in enumerate(self.rows):
            if row is None:
                continue
            ints[[FRAME, LLM_POSITION, TTS_POSITION], r] = (row.frame_index, row.llm_position, row.tts_position)
            given = inputs.get(r)
            if given is None:  # sits out at its own positions: its writes land past them
                continue
            hears = given.samples is not None  # off the clock: zeros, whose perception is put back
            if hears:
                frames[r] = given.samples
            tts_runs = row.timeline_index > 0 and given.speaks  # timeline position 0 runs no TTS
            ints[[RUNS, HEARS, THINKS, RUNS_TTS, DECODES, ROUNDS_KEYS], r] = (
                1, hears, given.thinks, tts_runs, given.speaks, row.llm_position < row.round_keys_until)
            if given.forced is not None:  # force_tokens / a tool result
                ints[FORCING, r] = given.forced
            if given.text >= 0:  # the step's own text id (the tool channel's waits for a step without one)
                ints[[FORCED_TEXT, FORCES_TEXT], r] = (given.text, 1)
            ints[SPOKEN, r] = given.spoken
            if tts_runs:
                generators[r] = given.generator
            ints[DRAWS, r] = generators[r] is not None
        # The TTS's modes: all rows deterministic, or sampling (with deterministic rows among them: a mix).
        # One session's generator is passed as itself: the same draws as a list of one.
        samplers = [g for g in generators if g is not None]
        mixed = bool(samplers) and (static and batch > 1 or any(generators[r] is None and ints[RUNS_TTS, r] for r in inputs))
        turns = self._turns
        flags = StepFlags(restore=len(inputs) < batch or static and batch > 1,
                       turns=turns is not None, punctuating=turns is not None and turns.punctuating,
                       sampling=bool(samplers), mixed=mixed, all_tts=not static and bool(ints[RUNS_TTS].all()),
                       round_keys=self._rounds_keys if static else bool(ints[ROUNDS_KEYS].any()),
                       forcing=static or bool(ints[FORCES].any()),
                       off_clock=static or any(given.samples is None for given in inputs.values()),
                       speaking=static or bool((ints[SPOKEN] >= 0).any()),
                       pausing=static or any(not (given.thinks and given.speaks) for given in inputs.values()),
                       in_place=static)
        # The Conformer ring: the first `length` slots while the running rows are aligned and filling (eager;
        # compiled, the whole ring, masked: a fixed shape).
        run = [int(ints[FRAME, r]) for r in inputs]  # the frames each running row has run
        least, aligned = (0, False) if static else (min(run), min(run) == max(run))
        ring = self._perception.encoder.left + 1
        length = min(least + 1, ring) if aligned else ring
        slot = ints[FRAME] % ring
        columns = (np.arange(length) - slot[:, None]) % ring
        tts2 = np.repeat(ints[TTS_POSITION], 2)
        window = self._speech.tts_model.backbone.window
        sizes = [len(TABLE) * batch, 2 * batch, 2 * batch, 2 * batch, batch, batch * length]
        host = [ints.ravel(), np.arange(2 * batch), tts2, tts2 % window, slot, columns.ravel()]
        if turns is not None:  # per row: held, text held at PAD, start-of-call id (rides in the same copy)
            holds = np.zeros((3, batch), dtype=np.int64)
            holds[2] = -1
            for r, given in inputs.items():  # a step off the clock heard nothing: the policy skips it
                holds[:, r] = (given.held or given.samples is None, given.pad_text, given.call_start)
            sizes.append(3 * batch)
            host.append(holds.ravel())
        with torch.inference_mode():
            # Room for every row's next position (rows that sit out write at theirs too), in whole blocks.
            grew = self._tts.reserve(int(ints[TTS_POSITION].max()) + 1)
            if self.language_cache:
                grew |= self._language.reserve(int(ints[LLM_POSITION].max()) + 1)
            if grew and self._compiled is not None:  # new buffers (their capacity is dynamic to the compiler)
                self._compiled.buffers_changed()
            table, row_numbers, tts_positions, tts_ring, conformer_slot, conformer_columns, *hold = \
                torch.from_numpy(np.concatenate(host)).to(device).split(sizes)
            draws = None
            if samplers:
                draws = self._speech.tts_model.draws(generators[0] if batch == 1 else generators, batch, device)
        return StepTensors(torch.from_numpy(frames).to(device), table.view(len(TABLE), batch), row_numbers, tts_positions,
                           tts_ring, conformer_slot, conformer_columns.view(batch, length), least, aligned,
                           hold[0].view(3, batch) if hold else None, draws, flags, marks)

    def _device_step(self, step: StepTensors, stamps: list[float] | None) -> torch.Tensor:
        """The frame on the device: a function of the step's tensors and the caches, which it updates in
        place when compiled (so its buffers stay its own: what CUDA graphs replay). Returns the packed
        ``[batch, values]``. ``stamps``: the stage marks to append (eager and profiling only)."""
        cfg, batch, flags = self.config, self.batch, step.flags

        def mark() -> None:
            if stamps is not None:
                synchronize(self.device)
                stamps.append(time.perf_counter())

        turns = self._turns if flags.turns else None
        # Compiled, the index tensors the layer steps take are copied apart: they are slices of one upload,
        # and a layer step (a nested compile region) refuses inputs that share storage. The copies are tiny.
        own = torch.clone if flags.in_place else _same
        table = step.table
        frame_index, llm_pos = table[FRAME], table[LLM_POSITION]
        # The state a step advances, by part, each with the table row that says which rows advanced it:
        # what a frame's audio advances (the policy's counters included), an LLM step, a codec step, the
        # rest every step that runs. A part some row may skip is saved, and the rows that skip it get it
        # back once its network has run (:meth:`_put_back`). Compiled, the Mamba layers' SSM state is not
        # saved: those rows step with a time step of 0, which leaves it as it was (torch 2.13's inductor
        # miscompiled a copy of it kept aside while the layer's region updated it in place; likely
        # pytorch#198131, open: go back to the copy when it is fixed and the compiled parity test passes).
        heard = self._heard() + ([] if turns is None else [((turns, name), 0, 1) for name in turns.STATE])
        parts = {HEARS: heard, THINKS: self._thought(ssm=not flags.in_place), DECODES: self._decoded(),
                 RUNS: [((self, "_codes"), 0, 1)] + ([] if turns is None else [((turns, "reason"), 0, 1)])}
        partial = {RUNS: flags.restore, HEARS: flags.restore or flags.off_clock,
                   THINKS: flags.restore or flags.pausing, DECODES: flags.restore or flags.pausing}
        buffers = {field: [_get(ref) for ref, _, _ in refs] for field, refs in parts.items()}
        saved = {field: [t.clone() for t in buffers[field]] if partial[field] else None for field in parts}
        encoder = self._perception.encoder
        conformer_rows = ConformerRows(own(step.row_numbers[:batch]), own(step.conformer_slot), own(step.conformer_columns),
                                       encoder.ring_mask(frame_index, step.ring_least, step.ring_aligned),
                                       step.conformer_columns.shape[1], step.ring_least, step.ring_aligned)
        projected, encoded = self._perceive(step.frames, frame_index, conformer_rows)
        hears = table[HEARS].bool() if flags.off_clock else None
        if hears is not None:  # NVIDIA's silence embedding on the user channel of rows that hear no audio
            projected = torch.where(hears[:, None, None], projected, self._silence_embedding.to(projected.dtype))
        mark()
        transcript_ids = self._transcriber.forward_step(encoded, self._rnnt)  # [S, batch]
        if turns is not None:
            user_blank = transcript_ids[0] < 0  # the frame's first argmax was blank (before punctuation)
            if flags.punctuating:
                transcript_ids = turns.punctuate_rows(self._transcriber, self._rnnt, encoded, transcript_ids)
        if hears is not None:  # a row off the clock transcribes nothing
            transcript_ids = torch.where(hears, transcript_ids, -1)
        mark()
        fused = fused_input(self._embed, self._ids[:, :1], projected, self._ids[:, 1:], cfg.function_channel_weight)
        round_keys = table[ROUNDS_KEYS].bool() if flags.round_keys else None
        steps = table[THINKS].bool() if flags.in_place and partial[THINKS] else None
        rows = LanguageRows.make(own(llm_pos), self._language.capacity, round_keys, own(step.row_numbers[:batch]), steps)
        hidden = self._language_step(fused, rows)
        ids = language_heads(hidden, *self._heads).ids.view(batch, 2)
        if flags.forcing:  # force_tokens / a tool result: queued ids replace a row's outputs
            ids = torch.where(table[FORCES].t().bool(), table[FORCED_IDS].t(), ids)
        if turns is not None:
            ids = turns.take_turns(ids, user_blank, step.hold)
        self._ids = ids
        self._put_back(parts[HEARS], saved[HEARS], table[HEARS])
        self._put_back(parts[THINKS], saved[THINKS], table[THINKS])
        mark()
        tts_rows = TTSRows.make(own(step.tts_positions), self._tts.capacities(), self._speech.tts_model.backbone.window,
                                own(step.row_numbers), own(step.tts_ring))
        deterministic: bool | torch.Tensor = not flags.sampling
        if flags.mixed:  # rows that draw nothing this step take the most likely component
            deterministic = table[DRAWS] == 0
        spoken = ids[:, 0]
        if flags.speaking:  # the TTS speaks a row's own id (an acknowledgement) instead of its text id
            spoken = torch.where(table[SPOKEN] >= 0, table[SPOKEN], spoken)
        codes = self._speech.step(self._codes, spoken, self._tts, step.draws, deterministic, tts_rows)
        if not flags.all_tts:  # a row at timeline position 0 runs no TTS: silence, its codes kept
            tts_runs = table[RUNS_TTS, :, None, None].bool()
            codes = torch.where(tts_runs, codes, self._silence)
            self._codes = torch.where(tts_runs, codes, self._codes)
        else:
            self._codes = codes
        mark()
        clean = self._speech.replace_control_codes(codes)
        samples = self._codec.decode_step(clean.transpose(1, 2), self._codec_cache)
        self._put_back(parts[DECODES], saved[DECODES], table[DECODES])
        self._put_back(parts[RUNS], saved[RUNS], table[RUNS])
        if flags.in_place:  # compiled: the step's buffers stay its own (what CUDA graphs replay)
            for field, refs in parts.items():
                for (ref, _, _), buffer in zip(refs, buffers[field]):
                    new = _get(ref)
                    if new is not buffer and new.dtype == buffer.dtype:
                        buffer.copy_(new)
                        _set(ref, buffer)
        # One packed tensor for the whole batch: cat promotes the ids to the samples' float32 (a no-op
        # .float() unless the fast mode's codec gave bf16), where ids < 2**24 are exact.
        values = [transcript_ids.t(), ids, clean.view(batch, -1), samples.view(batch, -1).float()]
        if turns is not None:
            values.append(turns.reason[:, None])
        return torch.cat(values, dim=1)

    @staticmethod
    def _put_back(refs: list[tuple[_Ref, int, int]], saved: list[torch.Tensor] | None, advanced: torch.Tensor) -> None:
        """The rows whose ``advanced`` is 0 get the state of ``refs`` back as ``saved`` before the step (None:
        every row advanced it)."""
        if saved is None:
            return
        keep = advanced.bool()
        for (ref, axis, per), before in zip(refs, saved):
            rows = keep.repeat_interleave(per).view([-1 if a == axis else 1 for a in range(before.dim())])
            _set(ref, torch.where(rows, _get(ref), before))

    def _perceive(self, frames: torch.Tensor, frame_index: torch.Tensor,
                  rows: ConformerRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel and one Conformer frame per row: ``(projected [B, 1, H], encoded [B, 1, d])``."""
        if not self.perception_cache:  # the reference's cache-free path: the encoder over recent audio
            self._audio_window = torch.cat([self._audio_window, frames[0]])[-self._window_samples:]
            return self._perception.uncached_frame(self._audio_window)
        self._mel.frames = self._conformer.frames = frame_index
        mel = self._perception.log_mel.forward_step(frames, self._mel)
        return self._perception.forward_step(mel, self._conformer, rows)

    def _language_step(self, fused: torch.Tensor, rows: LanguageRows) -> torch.Tensor:
        """One LLM position per row, each at its own position."""
        if not self.language_cache:  # the cache-free diagnostic: the whole history every frame
            self._history.append(fused)
            return self._llm(torch.cat(self._history, dim=1))[:, -1:]
        return self._llm.forward_step(fused, self._language, rows)
