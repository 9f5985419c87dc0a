"""What the host and the frame step's device part exchange, named once for both sides: a row's step as
the host gives it (:class:`FrameInput`), the rows' table (the one upload of a step), the device step's
inputs and the flags that pick its graph, and the packed output (the one read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..models.mog import Draws

__all__ = ["TABLE", "FORCED_IDS", "FORCES", "FORCING", "PackedLayout", "FrameValues", "FrameInput", "StepFlags", "StepTensors"]

# The rows' table: what the host knows of each row, one int64 row per field and one column per row,
# uploaded in one copy per step: its frame index (the audio frames it has heard), LLM and TTS positions,
# whether it runs this step, whether it hears audio (a step on the clock; one off the clock hears
# NVIDIA's silence embedding instead), steps the LLM, runs the TTS, runs the codec, whether its keys are
# still rounded to bf16, the text and function ids it forces and whether it forces each, the id the TTS
# speaks instead of the text id (-1: the text id), and whether it draws random numbers (a sampling row).
TABLE = ("frame", "llm_position", "tts_position", "runs", "hears", "thinks", "runs_tts", "decodes", "rounds_keys",
         "forced_text", "forced_function", "forces_text", "forces_function", "spoken", "draws")
(FRAME, LLM_POSITION, TTS_POSITION, RUNS, HEARS, THINKS, RUNS_TTS, DECODES, ROUNDS_KEYS, FORCED_TEXT, FORCED_FUNCTION,
 FORCES_TEXT, FORCES_FUNCTION, SPOKEN, DRAWS) = range(len(TABLE))
# The forced ids of both output channels (text, function), and whether each is forced: two adjacent fields
# each, read as one slice. ToolChannel.take_forced gives the four in this order.
FORCED_IDS = slice(FORCED_TEXT, FORCED_FUNCTION + 1)
FORCES = slice(FORCES_TEXT, FORCES_FUNCTION + 1)
FORCING = slice(FORCED_TEXT, FORCES_FUNCTION + 1)


@dataclass(frozen=True)
class FrameValues:
    """One row of a step, unpacked: the RNNT's ids (-1: none), the text and function ids, the 31 codes
    and the samples, and with turn-taking the row's reason bits (None without)."""

    transcript_ids: np.ndarray
    text_id: int
    function_id: int
    codes: np.ndarray
    samples: np.ndarray
    reason: int | None


@dataclass(frozen=True)
class PackedLayout:
    """The columns of a step's packed output, one row per batch row (float32: ids < 2**24 are exact):
    ``symbols`` transcript ids, the text and function ids, ``quantizers`` codes, ``samples`` samples,
    then, while a row of the step has turn-taking, its reason code. The step packs in this order and
    :meth:`unpack` reads it back: one layout for both sides."""

    symbols: int
    quantizers: int
    samples: int

    @property
    def ids(self) -> int:
        """The column of the text id (the function id follows)."""
        return self.symbols

    @property
    def codes(self) -> slice:
        return slice(self.symbols + 2, self.symbols + 2 + self.quantizers)

    @property
    def audio(self) -> slice:
        return slice(self.codes.stop, self.codes.stop + self.samples)

    def unpack(self, row: np.ndarray) -> FrameValues:
        end = self.audio.stop
        return FrameValues(row[:self.symbols].astype(np.int64), int(row[self.ids]), int(row[self.ids + 1]),
                           row[self.codes].astype(np.int32), row[self.audio].astype(np.float32),
                           int(row[end]) if row.shape[0] > end else None)


@dataclass
class FrameInput:
    """One row's step: 16 kHz samples ``[1280]`` (None: a step off the clock, docs/engine.md), the row's
    generator (None: the deterministic mode), the ids its tool channel forces (tool results,
    ``force_tokens``), the text id the step forces (-1: none; a text id the tool channel forces waits), the id
    its TTS speaks instead of the text id (-1: the text id), and whether the LLM steps (``thinks``; not:
    its state and position stay, as while a tool runs) and the TTS and codec (``speaks``; not: no speech,
    their state stays). With turn-taking: whether the row is held (a tool call in progress, its text id
    forced, or off the clock: the policy skips it), whether its text id is held at PAD (a tool call),
    and the start-of-call id that holds it from the step it appears on the function channel (-1: none)."""

    samples: np.ndarray | None
    generator: torch.Generator | None = None
    # The ids the tool channel forces this step, taken off its queues by the session: (text id, function
    # id, text forced, function forced), as FORCING reads them; None: none.
    forced: tuple[int, int, int, int] | None = None
    held: bool = False
    pad_text: bool = False
    call_start: int = -1
    text: int = -1
    spoken: int = -1
    thinks: bool = True
    speaks: bool = True


@dataclass(frozen=True)
class StepFlags:
    """What picks the device step's graph (host-known; a compiled step is traced once per combination).
    Eager, each is set only when needed; compiled, ``restore`` and ``mixed`` hold for every batch above
    one, ``forcing``, ``off_clock``, ``speaking`` and ``pausing`` always, and ``all_tts`` never, so a
    session's graphs do not change as it goes (a first step off the clock compiles nothing)."""

    restore: bool  # rows that sit out are put back (their recurrent state as it was)
    turns: bool  # a row has the turn-taking policy
    punctuating: bool  # ... with the transcript punctuation bias
    sampling: bool  # a row draws (else every row is deterministic)
    mixed: bool  # sampling and deterministic rows together (per-row choice)
    all_tts: bool  # every row runs the TTS (none at timeline position 0)
    round_keys: bool  # rows whose LLM keys are still rounded to bf16
    forcing: bool  # rows force ids (tool results, force_tokens)
    off_clock: bool  # rows hear the silence embedding, not audio (their perception state as it was)
    speaking: bool  # rows' TTS speaks an id other than their text id
    pausing: bool  # rows whose LLM or codec does not step (their state as it was)
    in_place: bool  # the recurrent state is copied back into its buffers (compiled), not rebound (eager)


@dataclass
class StepTensors:
    """A device step's inputs, from the prologue: the samples ``[B, 1280]``, the rows' table (:data:`TABLE`)
    and the index tensors of the same upload, the TTS's random numbers, the graph's flags, and whether
    to mark the stages (eager profiling)."""

    frames: torch.Tensor
    table: torch.Tensor
    row_numbers: torch.Tensor  # [2B]
    tts_positions: torch.Tensor  # [2B]: each session's two TTS rows
    tts_ring: torch.Tensor  # [2B]: their sliding layers' ring slots
    conformer_slot: torch.Tensor  # [B]
    conformer_columns: torch.Tensor  # [B, ring slots attended]
    ring_least: int  # the frames every running row has run at least (ConformerRows.least; compiled: 0)
    ring_aligned: bool  # whether they have all run that many (compiled: False)
    hold: torch.Tensor | None  # [3, B] with turn-taking: held, text held at PAD, start-of-call id
    draws: Draws | None
    flags: StepFlags
    marks: bool
