"""The one frame path: an 80 ms frame for every row of a batch, as one pass through log-mel, Conformer,
RNNT, LLM, TTS and codec. :class:`FrameStep` holds its rows' streaming caches (one row per conversation)
and where each row stands; a :class:`~nvchat_torch.session.StreamingSession` drives one with one row,
the :class:`~nvchat_torch.engine.BatchEngine` one with a row per session. A row that sits a step out
computes too and gets its carried state back. Each step is a host prologue (one upload), the device
step, and one read of the packed output (docs/engine.md, "How it works"; docs/performance.md, "The
compiled frame step")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..diagnostics import return_freed_memory, synchronize
from ..models.conformer import ConformerRows
from ..models.gemma import TTSRows
from ..models.language_heads import fused_input, language_heads
from ..models.layers import RowCache, RowValue
from ..models.nemotron_h import KVCache, LanguageRows
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

def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a fresh tensor of its shape. A prefill leaves the Mamba conv state a view
    of its window, whose strides depend on the prompt's length even where its batch of 1 makes it
    "contiguous"; a compiled step guards on strides, so a new session would compile again."""
    fresh = torch.empty(t.shape, device="meta").stride()
    return t if t.stride() == fresh else t.clone(memory_format=torch.contiguous_format)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


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
        # What a step feeds back to the next: the text and function ids [B, 2] the LLM reads, and the
        # codes [B, 1, Q] the TTS reads.
        self._ids = RowValue(torch.full((batch, 2), self.config.pad_token_id, dtype=torch.long, device=self.device))
        self._codes = RowValue(self._silence.repeat(batch, 1, 1))
        # What an LLM step advances of the Mamba layers. Compiled, not the SSM state: see _device_step.
        self._mixers = self._language.mixer_states(ssm=self._compiled is None)
        self._tts = self._speech.tts_model.new_cache()
        self._tts.rebind([t.new_zeros(2 * batch, *t.shape[1:]) for t, _, _ in self._tts.batched()])
        self._codec_cache = self._codec.new_cache(batch)
        self._turns = None
        if self._compiled is not None:
            self._compiled.buffers_changed()

    def _capacity_buffers(self) -> list[torch.Tensor]:
        """The key/value buffers whose capacity (dim 2) grows by blocks: dynamic to the compiler."""
        return self._language.tensors() + self._tts.keys + self._tts.values

    def _caches(self) -> list[RowCache]:
        """Every cache with a slice per row (the turn-taking policy resizes itself)."""
        return [self._mel, self._conformer, self._rnnt, self._ids, self._language, self._codes, self._tts,
                self._codec_cache]

    def _resize(self, rows: int) -> None:
        """Room for ``rows`` slots (compiled: the next power of two): rows added at the end (zeros), or the
        last ones dropped (freed)."""
        batch = rows if self.compiler is None else batch_bucket(rows)
        if self._compiled is not None:
            self._compiled.buffers_changed()
        for cache in self._caches():
            cache.resize(batch)
        if self._turns is not None:
            self._turns.resize(batch)

    @property
    def batch(self) -> int:
        """Rows in the caches (free slots below the last used one included)."""
        return self._ids.tensor.shape[0]

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
            self._language.rebind([_dense(theirs) if theirs.dtype == mine.dtype else mine
                                   for (mine, _, _), (theirs, _, _) in zip(self._language.batched(), language.batched())])
        tts = timeline.tts_cache
        self._tts.rebind([theirs if theirs.dtype == mine.dtype else mine
                          for (mine, _, _), (theirs, _, _) in zip(self._tts.batched(), tts.batched())])

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
            for cache in self._caches():
                cache.zero_row(r)
        self._rnnt.hc[:, r] = rnnt_state.hc[:, 0]
        self._ids.tensor[r] = self.config.pad_token_id
        self._codes.tensor[r] = timeline.previous_code[0]
        row = RowState(timeline_index=timeline.index)
        if language is None:  # the cache-free diagnostic: the LLM inputs so far
            self._history = timeline.history
            timeline.history = []
        else:
            row.llm_position = language.offset
            self._language.copy_row(r, language)
            for mine, theirs in zip(self._language.layers, language.layers):
                if isinstance(mine, KVCache) and isinstance(theirs, KVCache) and theirs.offset and \
                        theirs.keys.dtype == torch.bfloat16 and mine.keys.dtype != torch.bfloat16:
                    row.round_keys_until = theirs.blocks  # the reference stores bf16 until its next block
                    self._rounds_keys = True
        row.tts_position = tts.offset
        self._tts.copy_rows(r, tts)
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

    def _host_table(self, inputs: dict[int, FrameInput]) -> tuple[np.ndarray, np.ndarray, list[torch.Generator | None]]:
        """What the host knows of each row, one column per row (the fields: :data:`TABLE`); the frames'
        samples ``[B, 1280]``; and each row's generator where its TTS draws this step."""
        batch = self.batch
        frames = np.zeros((batch, self.config.input_frame_samples), dtype=np.float32)
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
        return frames, ints, generators

    def _prologue(self, inputs: dict[int, FrameInput], marks: bool) -> StepTensors:
        """The host's part before the step: what it knows of the rows as one table, uploaded in one copy,
        the frame's samples, the TTS's random numbers (drawn from the rows' generators), the caches'
        room for the step (grown in whole blocks, here and never inside the step), and the flags that
        pick the step's graph (under the compiler, a few fixed ones: see :class:`~nvchat_torch.runtime.frame_layout.StepFlags`)."""
        device, batch, static = self.device, self.batch, self._compiled is not None
        frames, ints, generators = self._host_table(inputs)
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
        parts: dict[int, list[RowCache]] = {
            HEARS: [self._mel, self._conformer, self._rnnt] + ([] if turns is None else [turns]),
            THINKS: [self._ids, self._mixers], DECODES: [self._codec_cache],
            RUNS: [self._codes] + ([] if turns is None else [turns.reasons])}
        partial = {RUNS: flags.restore, HEARS: flags.restore or flags.off_clock,
                   THINKS: flags.restore or flags.pausing, DECODES: flags.restore or flags.pausing}
        buffers = {part: [[t for t, _, _ in cache.carried()] for cache in caches] for part, caches in parts.items()}
        saved = {part: [cache.saved() for cache in caches] if partial[part] else None for part, caches in parts.items()}
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
        fed_back = self._ids.tensor
        fused = fused_input(self._embed, fed_back[:, :1], projected, fed_back[:, 1:], cfg.function_channel_weight)
        round_keys = table[ROUNDS_KEYS].bool() if flags.round_keys else None
        steps = table[THINKS].bool() if flags.in_place and partial[THINKS] else None
        rows = LanguageRows.make(own(llm_pos), self._language.capacity, round_keys, own(step.row_numbers[:batch]), steps)
        hidden = self._language_step(fused, rows)
        ids = language_heads(hidden, *self._heads).ids.view(batch, 2)
        if flags.forcing:  # force_tokens / a tool result: queued ids replace a row's outputs
            ids = torch.where(table[FORCES].t().bool(), table[FORCED_IDS].t(), ids)
        if turns is not None:
            ids = turns.take_turns(ids, user_blank, step.hold)
        self._ids.tensor = ids
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
        codes = self._speech.step(self._codes.tensor, spoken, self._tts, step.draws, deterministic, tts_rows)
        if not flags.all_tts:  # a row at timeline position 0 runs no TTS: silence, its codes kept
            tts_runs = table[RUNS_TTS, :, None, None].bool()
            codes = torch.where(tts_runs, codes, self._silence)
            self._codes.tensor = torch.where(tts_runs, codes, self._codes.tensor)
        else:
            self._codes.tensor = codes
        mark()
        clean = self._speech.replace_control_codes(codes)
        samples = self._codec.decode_step(clean.transpose(1, 2), self._codec_cache)
        self._put_back(parts[DECODES], saved[DECODES], table[DECODES])
        self._put_back(parts[RUNS], saved[RUNS], table[RUNS])
        if flags.in_place:  # compiled: the step's buffers stay its own (what CUDA graphs replay)
            for part, caches in parts.items():
                for cache, held in zip(caches, buffers[part]):
                    cache.keep_buffers(held)
        # One packed tensor for the whole batch: cat promotes the ids to the samples' float32 (a no-op
        # .float() unless the fast mode's codec gave bf16), where ids < 2**24 are exact.
        values = [transcript_ids.t(), ids, clean.view(batch, -1), samples.view(batch, -1).float()]
        if turns is not None:
            values.append(turns.reason[:, None])
        return torch.cat(values, dim=1)

    @staticmethod
    def _put_back(caches: list[RowCache], saved: list[list[torch.Tensor]] | None, advanced: torch.Tensor) -> None:
        """The rows whose ``advanced`` is 0 get the caches' carried state back as ``saved`` before the step
        (None: every row advanced it)."""
        if saved is None:
            return
        keep = advanced.bool()
        for cache, before in zip(caches, saved):
            cache.put_back(before, keep)

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
