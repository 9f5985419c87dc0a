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

from .conformer import ConformerRows
from .diagnostics import return_freed_memory, synchronize
from .gemma import TTSRows
from .language_heads import fused_input, language_heads
from .layers import linear
from .nemotron_h import KVCache, LanguageRows, MambaCache
from .rnnt import RnntState
from .turn_taking import TurnTaking, TurnTakingConfig

if TYPE_CHECKING:
    from .networks import VoiceChatNetworks
    from .timeline import Timeline
    from .tools import ToolChannel

__all__ = ["FrameStep", "FrameInput", "RowState"]

# The tensors of a language cache layer, by its kind.
_STATE_NAMES: dict[type, tuple[str, ...]] = {MambaCache: ("conv_state", "ssm_state"), KVCache: ("keys", "values")}

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


@dataclass
class FrameInput:
    """One row's frame: 16 kHz samples ``[1280]``, the row's generator (None: the deterministic mode),
    and its tool channel when it forces ids (tool results, ``force_tokens``). With turn-taking: whether
    the row is held this frame (a tool call in progress, or its text id forced: the policy skips it),
    whether its text id is held at PAD (a tool call), and the start-of-call id that holds it from the
    frame it appears on the function channel (-1: none)."""

    samples: np.ndarray
    generator: torch.Generator | None = None
    tools: ToolChannel | None = None
    held: bool = False
    pad_text: bool = False
    call_start: int = -1


@dataclass
class RowState:
    """Where a row stands: frames run (its log-mel and Conformer stream position), the next LLM and TTS
    positions (prompt and speaker warmup included), the timeline index (prompt steps included; index 0
    runs no TTS), and the LLM positions below which its keys are still stored in bf16 (a bf16 prompt's
    cache, which the reference keeps until its next 256-slot block: see ``LanguageRows``)."""

    frame_index: int = 0
    llm_position: int = 0
    tts_position: int = 0
    timeline_index: int = 0
    round_keys_until: int = 0


class FrameStep:
    """The batched caches of up to any number of rows and the pass that steps them (see the module doc).

    ``perception_cache=False`` / ``language_cache=False``: the reference's cache-free diagnostics (the
    encoder over a window of recent audio; the LLM over the whole history every frame), for one row.
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
        # The cache-free diagnostics (one row): the audio window, and the LLM inputs so far.
        self._window_samples = self._perception.uncached_window_frames * cfg.input_frame_samples
        self._audio_window = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._history: list[torch.Tensor] = []
        with torch.inference_mode():
            self._silence = model.tts_model.silence_codes(torch.long).view(1, 1, -1)
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

    def _recurrent(self) -> list[tuple[_Ref, int, int]]:
        """The state a row carries from frame to frame: (where, batch axis, rows per slot)."""
        refs: list[tuple[_Ref, int, int]] = [((self._mel, "samples"), 0, 1), ((self._conformer, "mel"), 0, 1),
                                            ((self._rnnt, "hc"), 1, 1), ((self, "_ids"), 0, 1),
                                            ((self, "_codes"), 0, 1), ((self._codec_cache, "spectrum"), 0, 1)]
        refs += [((self._conformer.conv, i), 0, 1) for i in range(len(self._conformer.conv))]
        refs += [((self._codec_cache.blocks, i), 0, 1) for i in range(len(self._codec_cache.blocks))]
        for c in self._language.layers:
            if isinstance(c, MambaCache):
                refs += [((c, "conv_state"), 0, 1), ((c, "ssm_state"), 0, 1)]
        return refs

    def _buffers(self) -> list[tuple[_Ref, int, int]]:
        """Every batched cache tensor: the recurrent state, rings and key/value buffers."""
        refs = self._recurrent() + [((self._conformer, "kv"), 2, 1)]
        for c in self._language.layers:
            if isinstance(c, KVCache):
                refs += [((c, "keys"), 0, 1), ((c, "values"), 0, 1)]
        for buffers in (self._tts.keys, self._tts.values):
            refs += [((buffers, i), 0, 2) for i in range(len(buffers))]
        return refs

    def _resize(self, batch: int) -> None:
        """``batch`` slots: rows added at the end (zeros), or the last ones dropped (freed)."""
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
                        setattr(mine, name, getattr(theirs, name))
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
        language, tts = timeline.language_cache, timeline.tts_cache
        if clear:
            for ref, axis, per in self._buffers():
                _get(ref).narrow(axis, r * per, per).zero_()
        self._rnnt.hc[:, r] = rnnt_state.hc[:, 0]
        self._ids[r] = self.config.pad_token_id
        self._codes[r] = timeline.previous_code[0]
        row = RowState(timeline_index=timeline.index)
        language = timeline.language_cache
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
        row.tts_position = tts.offset
        for layer in range(len(tts.keys)):
            window = tts.windows[layer]
            held = tts.offset if window is None else min(tts.offset, window)
            self._tts._reserve(layer, held)
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
                self._resize(len(self.rows))

    # ---- the step
    def run(self, inputs: dict[int, FrameInput], profile: bool = False) -> tuple[np.ndarray, list[float]]:
        """One frame for each slot in ``inputs``; the other rows sit out. Returns ``[batch, values]``: each
        row's transcript ids, (text, function) ids, codes and samples (then, while a row has turn-taking,
        each row's reason code: bits of ``turn_taking.REASONS``), read from the device at once, and
        the stage marks (``time.perf_counter()`` at the start and after perception, RNNT, LLM, TTS and
        codec, each after a device sync when ``profile``; else the start and the end)."""
        cfg, device, batch = self.config, self.device, self.batch
        stamps = [time.perf_counter()]

        def mark() -> None:
            if profile:
                synchronize(device)
                stamps.append(time.perf_counter())

        frames = np.zeros((batch, cfg.input_frame_samples), dtype=np.float32)
        # Per row: frame index, LLM position, TTS position, runs (0/1), runs the TTS, rounds its keys.
        ints = np.zeros((6, batch), dtype=np.int64)
        generators: list[torch.Generator | None] = [None] * batch
        for r, row in enumerate(self.rows):
            if row is None:
                continue
            ints[:3, r] = (row.frame_index, row.llm_position, row.tts_position)
            given = inputs.get(r)
            if given is None:  # sits out at its own positions: its writes land past them
                continue
            frames[r] = given.samples
            tts_runs = row.timeline_index > 0  # timeline position 0 runs no TTS
            ints[3:, r] = (1, tts_runs, row.llm_position < row.round_keys_until)
            if tts_runs:
                generators[r] = given.generator
        everyone = len(inputs) == batch
        # The TTS's modes: all rows deterministic, all that draw this step sampling, or a mix (per row).
        # One session's generator is passed as itself: the same draws as a list of one, fewer ops.
        samplers = [g for g in generators if g is not None]
        deterministic: bool | torch.Tensor = not samplers
        mixed = bool(samplers) and any(generators[r] is None and ints[4, r] for r in inputs)
        generator = generators[0] if batch == 1 else generators
        # What the host knows of the rows, sent in one copy: the per-row table above, the row numbers,
        # each session's two TTS rows' positions and sliding-ring slots, the Conformer ring slots and
        # distance columns (the first `length` slots while the running rows are aligned and filling).
        run = [int(ints[0, r]) for r in inputs]  # the frames each running row has run
        least, aligned = min(run), min(run) == max(run)
        ring = self._perception.encoder.left + 1
        length = min(least + 1, ring) if aligned else ring
        slot = ints[0] % ring
        columns = (np.arange(length) - slot[:, None]) % ring
        tts2 = np.repeat(ints[2], 2)
        window = self._speech.tts_model.backbone.window
        sizes = (6 * batch, 2 * batch, 2 * batch, 2 * batch, batch, batch * length)
        host = np.concatenate([ints.ravel(), np.arange(2 * batch), tts2, tts2 % window, slot, columns.ravel()])
        turns = self._turns
        if turns is not None:  # per row: held, text held at PAD, start-of-call id (rides in the same copy)
            holds = np.zeros((3, batch), dtype=np.int64)
            holds[2] = -1
            for r, given in inputs.items():
                holds[:, r] = (given.held, given.pad_text, given.call_start)
            sizes += (3 * batch,)
            host = np.concatenate([host, holds.ravel()])
        with torch.inference_mode():
            table, row_numbers, tts_positions, tts_ring, conformer_slot, conformer_columns, *hold = \
                torch.from_numpy(host).to(device).split(sizes)
            table = table.view(6, batch)
            frame_index, llm_pos = table[0], table[1]
            if mixed:
                deterministic = torch.tensor([g is None for g in generators], device=device)
            state = self._recurrent() if turns is None else \
                self._recurrent() + [((turns, name), 0, 1) for name in turns.STATE]
            saved = [] if everyone else [(ref, axis, per, _get(ref).clone()) for ref, axis, per in state]
            encoder = self._perception.encoder
            self._conformer.least, self._conformer.aligned = least, aligned
            conformer_rows = ConformerRows(row_numbers[:batch], conformer_slot, conformer_columns.view(batch, length),
                                           encoder.ring_mask(frame_index, self._conformer), length)
            projected, encoded = self._perceive(torch.from_numpy(frames).to(device), frame_index, conformer_rows)
            mark()
            transcript_ids = self._transcriber.forward_step(encoded, self._rnnt)  # [S, batch]
            if turns is not None:
                user_blank = transcript_ids[0] < 0  # the frame's first argmax was blank (before punctuation)
                if turns.punctuating:
                    transcript_ids = self._punctuate(turns, encoded, transcript_ids)
            mark()
            fused = fused_input(self._embed, self._ids[:, :1], projected, self._ids[:, 1:],
                                cfg.function_channel_weight)
            round_keys = table[5].bool() if ints[5].any() else None
            # Rows that run all at the last position (a lone session): no per-row masks to make.
            end = int(ints[1].max()) + 1
            rows = LanguageRows.make(llm_pos, end, round_keys, all(ints[1, r] == end - 1 for r in inputs),
                                     row_numbers[:batch])
            hidden = self._language_step(fused, rows)
            ids = language_heads(hidden, *self._heads).ids.view(batch, 2)
            for r, given in inputs.items():  # force_tokens / a tool result: queued ids replace this row's outputs
                if given.tools is not None and given.tools.forcing:
                    ids[r] = given.tools.apply(ids[r])
            if turns is not None:
                ids = self._take_turns(turns, ids, user_blank, hold[0].view(3, batch))
            self._ids = ids
            mark()
            end = int(ints[2].max()) + 1
            tts_rows = TTSRows.make(tts_positions, end, window, all(ints[2, r] == end - 1 for r in inputs),
                                    row_numbers, tts_ring)
            codes = self._speech.step(self._codes, ids[:, 0], self._tts, generator, deterministic, tts_rows)
            if not ints[4].all():  # a row at timeline position 0 runs no TTS: silence, its codes kept
                tts_runs = table[4, :, None, None].bool()
                codes = torch.where(tts_runs, codes, self._silence)
                self._codes = torch.where(tts_runs, codes, self._codes)
            else:
                self._codes = codes
            mark()
            clean = self._speech.replace_control_codes(codes)
            samples = self._codec.decode_step(clean.transpose(1, 2), self._codec_cache)
            runs = table[3].bool() if saved else None
            for ref, axis, per, before in saved:  # rows that sat out: as they were
                keep = runs.repeat_interleave(per).view([-1 if a == axis else 1 for a in range(before.dim())])
                _set(ref, torch.where(keep, _get(ref), before))
            # One host read for the whole batch: cat promotes the ids to the samples' float32 (a no-op
            # .float() unless the fast mode's codec gave bf16), where ids < 2**24 are exact.
            values = [transcript_ids.t(), ids, clean.view(batch, -1), samples.view(batch, -1).float()]
            if turns is not None:
                values.append(turns.reason[:, None])
            packed = torch.cat(values, dim=1).numpy(force=True)
        stamps.append(time.perf_counter())
        for r in inputs:
            row = self.rows[r]
            row.tts_position += int(row.timeline_index > 0)
            row.llm_position += 1
            row.frame_index += 1
            row.timeline_index += 1
        return packed, stamps

    def _punctuate(self, turns: TurnTaking, encoded: torch.Tensor, transcript_ids: torch.Tensor) -> torch.Tensor:
        """The transcript punctuation bias (``TurnTaking.punctuate``) on the frame's RNNT ids: the joint's
        first prediction again (a blank row's state is the one it was made from), and the predictor
        advanced through the punctuation a row emits."""
        joint, decoder = self._transcriber.joint, self._transcriber.decoder
        hc = self._rnnt.hc
        frame_bias = joint.enc(encoded.reshape(encoded.shape[0], -1)) + joint.pred.bias
        logits = joint.joint_net(linear(hc[-1], joint.pred.weight, frame_bias))
        transcript_ids, emit = turns.punctuate(logits, transcript_ids)
        advanced = decoder.step(decoder.input_gates(transcript_ids[0].clamp(min=0)), hc[:2 * decoder.layers],
                                with_output=True)
        self._rnnt.hc = torch.where(emit[:, None], advanced, hc)
        return transcript_ids

    def _take_turns(self, turns: TurnTaking, ids: torch.Tensor, user_blank: torch.Tensor,
                    hold: torch.Tensor) -> torch.Tensor:
        """The policy on the frame's ``[batch, 2]`` ids, after tool forcing (NVIDIA's frame order): a tool
        call holds the text at PAD from its start-of-call token on, and a held row skips the policy;
        ``user_blank`` is the RNNT's first argmax of the frame being blank (it emitted nothing)."""
        held, pad_text, call_start = hold.unbind(0)
        starts = ids[:, 1] == call_start
        text = torch.where(pad_text.bool() | starts, self.config.pad_token_id, ids[:, 0])
        text = turns.step(text, user_blank, held.bool() | starts)
        return torch.stack([text, ids[:, 1]], dim=1)

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
