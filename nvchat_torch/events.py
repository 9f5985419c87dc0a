"""What a session emits and records: events, options, frame timings and the profile summary.

Names follow mlx-vlm's streaming session so clients port unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = [
    "EventKind",
    "VoiceChatEvent",
    "StreamingOptions",
    "ContextLimit",
    "FrameTiming",
    "VoiceChatProfile",
    "TokenAccumulator",
    "VoiceChatResult",
]

EventKind = Literal["assistant_text_delta", "function_delta", "user_transcript_delta", "audio", "done", "cancelled",
                    "tool_call", "tool_call_error"]


@dataclass
class VoiceChatEvent:
    """One frame-aligned output of a streaming session."""

    kind: EventKind
    frame_index: int | None = None
    token_id: int | None = None
    delta: str | None = None
    text: str | None = None
    samples: np.ndarray | None = None  # float32, `sample_rate` Hz (audio events)
    sample_rate: int | None = None
    audio_codes: np.ndarray | None = None  # int32 [num_quantizers] (audio events)
    # tool_call / tool_call_error events (nvchat_torch.tools); `text` is the call span's decoded text
    call_id: str | None = None
    name: str | None = None
    arguments: dict | None = None
    reason: str | None = None  # tool_call_error: why the span was not a call to an offered tool


@dataclass
class StreamingOptions:
    """How a streaming session runs. ``deterministic`` picks the most likely MoG component with no noise."""

    system_prompt: str | None = None
    seed: int = 0
    max_streaming_seconds: float | None = None
    use_language_cache: bool = True
    use_perception_cache: bool = True
    profile: bool = False
    deterministic: bool = False
    tools: list[dict] | None = None  # OpenAI-format function tools (nvchat_torch.tools), at most 5

    def __post_init__(self) -> None:
        if self.tools is not None:
            from .tools import validate_tools

            validate_tools(self.tools)
        if self.max_streaming_seconds is not None and not self.max_streaming_seconds > 0:
            raise ValueError(f"max_streaming_seconds must be positive, got {self.max_streaming_seconds}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


class ContextLimit(RuntimeError):
    """The session reached its length limit (``max_streaming_seconds``, or the model's own context).
    ``events`` holds the events of the frames of the same ``push_audio`` call that ran before the
    limit; its remaining audio is dropped. ``flush()`` then ends the session without raising."""

    def __init__(self, message: str, events: list | None = None):
        super().__init__(message)
        self.events: list = [] if events is None else events


@dataclass(frozen=True)
class FrameTiming:
    """Stage latencies of one 80 ms audio frame, each measured after a device synchronize."""

    frame_index: int
    perception_ms: float
    rnnt_ms: float
    language_ms: float
    tts_ms: float
    codec_ms: float
    total_ms: float


STAGES = ("perception", "rnnt", "language", "tts", "codec", "total")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation at position ``(n - 1) * q`` of the sorted values (the reference's rule)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


@dataclass
class VoiceChatProfile:
    frame_duration_ms: float
    frames: list[FrameTiming] = field(default_factory=list)

    def summary(self, drop_first: int = 0) -> dict:
        """Per stage mean / p50 / p95 / max (ms) after dropping ``drop_first`` cold frames, with the
        real-time factor (mean total / frame duration; below 1 keeps up with live audio)."""
        frames = self.frames[drop_first:]
        stages = {}
        for stage in STAGES:
            values = [getattr(f, f"{stage}_ms") for f in frames]
            stages[stage] = {"mean_ms": sum(values) / len(values) if values else 0.0,
                             "p50_ms": percentile(values, 0.5), "p95_ms": percentile(values, 0.95),
                             "max_ms": max(values, default=0.0)}
        mean_total = stages["total"]["mean_ms"]
        return {"frames": len(frames), "dropped_cold_frames": min(drop_first, len(self.frames)),
                "frame_duration_ms": self.frame_duration_ms,
                "processing_frames_per_second": 1000.0 / mean_total if mean_total else 0.0,
                "realtime_factor": mean_total / self.frame_duration_ms if mean_total else 0.0,
                "stages": stages}

    def table(self, drop_first: int = 0) -> str:
        """The summary as a text table."""
        s = self.summary(drop_first)
        lines = [f"{'stage':<11}{'mean ms':>9}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}"]
        for stage, v in s["stages"].items():
            lines.append(f"{stage:<11}{v['mean_ms']:>9.2f}{v['p50_ms']:>9.2f}{v['p95_ms']:>9.2f}{v['max_ms']:>9.2f}")
        lines.append(f"frames {s['frames']} (dropped {s['dropped_cold_frames']} cold), "
                     f"{s['processing_frames_per_second']:.1f} frames/s, "
                     f"real-time factor {s['realtime_factor']:.3f} (< 1 keeps up with live audio)")
        return "\n".join(lines)


class TokenAccumulator:
    """Cumulative text of one output channel: ids in ``skip`` are dropped; ``delta`` is the new suffix
    of the cumulative decode when it extends the old one, else the single-token decode.

    The cumulative decode is kept incrementally, as LLM servers' streaming detokenizers do: only a
    small tail window of tokens is decoded per token (the ones since the last stable point, plus
    the window before them for context), so a token's decoding costs the same however long the
    session (what grows is only the copy of the cumulative text each event carries). ``text``
    equals ``tokenizer.decode(tokens)`` at every step: a window that does not extend its prefix's
    decode (a tokenizer cleaning up across the boundary) falls back to one full decode.
    """

    MAX_TAIL = 16  # tokens kept undecided while the tail ends in an incomplete character

    def __init__(self, tokenizer: Any, skip: set[int]) -> None:
        self.tokenizer = tokenizer
        self.skip = skip
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # tokens[prefix:read] is the context window before the undecided tail
        self._read = 0  # tokens[:read] decode to self._stable
        self._stable = ""
        self._piece = ""  # text = stable + piece
        self._prefix_text = ""  # decode(tokens[prefix:read])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def append(self, token_id: int) -> tuple[str, str] | None:
        if token_id in self.skip:
            return None
        self.tokens.append(token_id)
        window = self._decode(self.tokens[self._prefix:])
        if window.startswith(self._prefix_text):
            piece = window[len(self._prefix_text):]
            updated = self._stable + piece
            extends = piece.startswith(self._piece)  # text is stable + piece: compare the tails only
            settle = not updated.endswith("\ufffd") or len(self.tokens) - self._read >= self.MAX_TAIL
        else:  # the new token changed text before the window: decode everything once
            updated = self._decode(self.tokens)
            extends = updated.startswith(self.text)
            settle = True
        if extends:
            delta = updated[len(self.text):]
        else:  # a tokenizer may revise a partial multi-byte sequence; the cumulative text stays authoritative
            delta = self._decode([token_id])
        if settle:
            self._stable, self._piece = updated, ""
            self._prefix, self._read = self._read, len(self.tokens)
            self._prefix_text = self._decode(self.tokens[self._prefix:self._read])
        else:
            self._piece = piece
        self.text = updated
        return delta, updated


@dataclass
class VoiceChatResult:
    """The offline answer to one audio turn."""

    text: str
    text_ids: np.ndarray  # int64 [frames]
    function_ids: np.ndarray  # int64 [frames]
    function_text: str
    user_transcript: str
    audio: np.ndarray  # float32 [frames * 1764] at sample_rate
    audio_codes: np.ndarray  # int32 [frames, 31]
    sample_rate: int
    tool_calls: list[VoiceChatEvent] = field(default_factory=list)  # tool_call / tool_call_error (with tools)
