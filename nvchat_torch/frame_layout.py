"""What the host and the frame step's device part exchange, named once for both sides: the rows' table
(the one upload of a step) and the packed output (the one read)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TABLE", "PackedLayout", "FrameValues"]

# The rows' table: what the host knows of each row, one int64 row per field and one column per row,
# uploaded in one copy per step: its frame index (the audio frames it has heard), LLM and TTS positions,
# whether it runs this step, whether it hears audio (a step on the clock; one off the clock hears
# NVIDIA's silence embedding instead), whether it runs the TTS, whether its keys are still rounded to
# bf16, the text and function ids it forces and whether it forces each, the id the TTS speaks instead
# of the text id (-1: the text id), and whether it draws random numbers (a sampling row).
TABLE = ("frame", "llm_position", "tts_position", "runs", "hears", "runs_tts", "rounds_keys", "forced_text",
         "forced_function", "forces_text", "forces_function", "spoken", "draws")
(FRAME, LLM_POSITION, TTS_POSITION, RUNS, HEARS, RUNS_TTS, ROUNDS_KEYS, FORCED_TEXT, FORCED_FUNCTION, FORCES_TEXT,
 FORCES_FUNCTION, SPOKEN, DRAWS) = range(len(TABLE))


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
