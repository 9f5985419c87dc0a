"""What a session emits and records: events, options, frame timings and the profile summary.

Names follow mlx-vlm's streaming session so clients port unchanged.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .tool_hold import ToolHold
from .turn_taking import TurnTakingConfig

_log = logging.getLogger("nvchat_torch")

__all__ = [
    "EventKind",
    "VoiceChatEvent",
    "StreamingOptions",
    "ContextLimit",
    "FrameTiming",
    "VoiceChatProfile",
    "TokenAccumulator",
    "DetokenizerError",
    "VoiceChatResult",
]

EventKind = Literal["assistant_text_delta", "function_delta", "user_transcript_delta", "audio", "done", "cancelled",
                    "tool_call", "tool_call_error", "turn", "hold_speech"]


@dataclass
class VoiceChatEvent:
    """One frame-aligned output of a streaming session."""

    kind: EventKind  # what the event carries; the fields it does not use stay None
    frame_index: int | None = None  # the step that emitted it, counted from the session's first
    token_id: int | None = None  # the id the step emitted on the event's channel
    delta: str | None = None  # text deltas: the newly emitted text
    # Text deltas: the channel's cumulative text. tool_call / tool_call_error: the call span's decoded text.
    text: str | None = None
    samples: np.ndarray | None = None  # float32, `sample_rate` Hz (audio events)
    sample_rate: int | None = None  # Hz of `samples` (audio events)
    audio_codes: np.ndarray | None = None  # int32 [num_quantizers] (audio events)
    call_id: str | None = None  # tool_call / tool_call_error (nvchat_torch.tools): the call's id
    name: str | None = None  # tool_call / tool_call_error: the tool's name as written
    arguments: dict | None = None  # tool_call: the parsed arguments
    # tool_call_error: why the span was not a call to an offered tool; turn (StreamingOptions.turn_taking):
    # what the policy did this frame, one of nvchat_torch.turn_taking.REASONS ("user_speech",
    # "end_of_utterance", "first_turn_fallback", "barge_in", "self_play_suppressed", "speech_ended");
    # `token_id` is the id the frame emitted
    reason: str | None = None
    # The audio frame the step heard, counted from the session's first (None: a step off the clock,
    # which heard none, or an event of no step). `frame_index` counts every step, heard or not.
    input_frame: int | None = None
    # hold_speech (nvchat_torch.tool_pipeline): the steps (80 ms of speech each) the phrase takes, from
    # this event's; `text` the phrase, `reason` "ack" | "on_hold" | "timeout", `call_id` its call's
    frames: int | None = None


MAX_STREAMING_SECONDS = 1e9  # a bound for max_streaming_seconds (any model's context is far shorter)


@dataclass
class StreamingOptions:
    """How a streaming session runs."""

    system_prompt: str | None = None  # the prompt the session starts from; None: none
    seed: int = 0  # seeds the session's sampling
    max_streaming_seconds: float | None = None  # a length limit (ContextLimit past it); None: the model's context
    use_language_cache: bool = True  # False recomputes the LLM each step (a diagnostic)
    use_perception_cache: bool = True  # False recomputes the mel and encoder over recent audio (a diagnostic)
    profile: bool = False  # time each stage of each step (VoiceChatProfile)
    deterministic: bool = False  # pick the most likely MoG component, with no noise
    tools: list[dict] | None = None  # OpenAI-format function tools (nvchat_torch.tools), at most 5
    # NVIDIA's turn-taking policy (nvchat_torch.turn_taking; a mapping of some of its fields is taken
    # too); None: the raw model decides alone when to speak, as the MLX reference does
    turn_taking: TurnTakingConfig | None = None
    # With tools: NVIDIA's two-phase tool pipeline (nvchat_torch.tool_hold, docs/tools.md: the call written
    # and the result injected off the clock, phrases spoken meanwhile; a mapping of its fields is taken
    # too); None: a call and its result stream one token per frame, in silence
    tool_hold: ToolHold | None = field(default_factory=ToolHold)

    def __post_init__(self) -> None:
        if isinstance(self.turn_taking, Mapping):
            self.turn_taking = TurnTakingConfig.from_dict(self.turn_taking)
        self.check("turn_taking", self.turn_taking)
        if isinstance(self.tool_hold, Mapping):
            self.tool_hold = ToolHold.from_mapping(self.tool_hold)
        if self.tool_hold is not None and not isinstance(self.tool_hold, ToolHold):
            raise ValueError(f"tool_hold must be None, a ToolHold or a mapping of its fields, "
                             f"got {type(self.tool_hold).__name__}")
        if self.tools is not None:
            from .tool_prompt import validate_tools

            tools = validate_tools(self.tools)
            if self.tool_hold is not None:
                self.tool_hold.check_tools(tool["name"] for tool in tools)
        self.check("max_streaming_seconds", self.max_streaming_seconds)
        self.check("seed", self.seed)

    @staticmethod
    def check(name: str, value: Any) -> None:
        """Raise ``ValueError`` if ``value`` cannot be option ``name`` (the checks that need no model)."""
        if name == "seed":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"seed must be an int, got {value!r}")
            if not -2 ** 63 <= value < 2 ** 64:  # torch.Generator.manual_seed's range
                raise ValueError(f"seed must fit in 64 bits, got {value}")
        elif name == "turn_taking":
            if value is not None and not isinstance(value, (TurnTakingConfig, Mapping)):
                raise ValueError(f"turn_taking must be None, a TurnTakingConfig or a mapping of its fields, "
                                 f"got {type(value).__name__}")
            if isinstance(value, Mapping):
                TurnTakingConfig.from_dict(value)
        elif name == "max_streaming_seconds" and value is not None:
            try:
                finite = math.isfinite(float(value))
            except (TypeError, ValueError, OverflowError):
                finite = False
            if not finite or not 0 < value <= MAX_STREAMING_SECONDS:
                raise ValueError(f"max_streaming_seconds must be a number of seconds in (0, {MAX_STREAMING_SECONDS:g}], "
                                 f"got {value!r}")


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

    frame_index: int  # the step timed
    perception_ms: float  # mel and audio encoder
    rnnt_ms: float  # user-transcript decoder
    language_ms: float  # language model
    tts_ms: float  # speech-token decoder
    codec_ms: float  # codes to samples
    total_ms: float  # the whole step, start to end

    @classmethod
    def from_stamps(cls, frame_index: int, stamps: Sequence[float]) -> "FrameTiming":
        """From the six ``time.perf_counter()`` marks of a profiled step (start, then after each stage), or
        the two of a compiled step (start and end: one graph has no stage marks, so its stages read 0
        and the whole frame is in ``total_ms``)."""
        if len(stamps) == 2:
            return cls(frame_index, 0.0, 0.0, 0.0, 0.0, 0.0, (stamps[1] - stamps[0]) * 1000.0)
        perception, rnnt, language, tts, codec = np.diff(stamps) * 1000.0
        return cls(frame_index, perception, rnnt, language, tts, codec, (stamps[-1] - stamps[0]) * 1000.0)


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
    frame_duration_ms: float  # one step's share of real time (80 ms)
    frames: list[FrameTiming] = field(default_factory=list)  # one per profiled step, in order

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


class DetokenizerError(AssertionError):
    """A :class:`TokenAccumulator` in ``strict`` mode found a new token changing the decode of the text
    before it (its emitted text might then not be a prefix of the decode): a tokenizer behaviour its
    stability rules do not cover, a bug to fix there."""


def _byte_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the byte-fallback tokens ``<0x00>`` .. ``<0xFF>`` (SentencePiece / Llama style), found by
    name and checked back with ``convert_ids_to_tokens``; empty for a tokenizer without them (ByteLevel)."""
    names = [f"<0x{b:02X}>" for b in range(256)]
    names += [n.lower() for n in names if n.lower() != n]  # the decoder reads either case
    try:
        ids = [i for i in tokenizer.convert_tokens_to_ids(names) if isinstance(i, int) and i >= 0]
        back = tokenizer.convert_ids_to_tokens(ids)  # unknown names come back as the unk token
    except Exception:  # not a transformers tokenizer: no byte tokens known
        return frozenset()
    return frozenset(i for i, t in zip(ids, back) if isinstance(t, str) and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t))


def _cleans_up(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` applies ``clean_up_tokenization`` (" ." -> "." ...). transformers 5
    ignores the flag for BPE models, so when the flag is on, a probe ("a .") decides where it can."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = tokenizer.encode("a . b", add_special_tokens=False)
        raw = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        cleaned = tokenizer.clean_up_tokenization(raw)
        if cleaned != raw:
            return tokenizer.decode(ids, skip_special_tokens=False) == cleaned
    except Exception:
        pass
    return True  # the probe could not tell: the flag says it applies


class TokenAccumulator:
    """Streamed text of one output channel (text or function), token by token, as LLM servers'
    incremental detokenizers do (vLLM's prefix/read offsets, HF ``TextStreamer``'s hold-back).

    ``append(token_id)`` returns None for ids in ``skip`` (dropped, as if never sent); otherwise
    ``(delta, text)``: ``delta`` the newly *emitted* text (``""`` while everything new is held back)
    and ``text`` the cumulative emitted text, the concatenation of every delta so far. ``finish()``
    ends the stream: it releases what is held back, as ``(delta, text)``, or None when nothing is.
    Emitted text is never revised: at every step ``text`` is a prefix of ``full_text``, the decode of
    all tokens (``tokenizer.decode(tokens, skip_special_tokens=False)``), and after ``finish()`` the two
    are equal. So a client that joins the deltas gets exactly the decode, with no U+FFFD from a
    character split over frames. A session shows ``text`` (what it has streamed) and, when its stream
    ends, calls ``finish()`` and sends the returned delta as the channel's last delta.

    What is held back is text the next tokens could still change:

    - a tail ending in U+FFFD: a multi-byte UTF-8 character whose bytes are split over tokens
      (ByteLevel BPE, GPT-2 style: lossy UTF-8 over the joined bytes) shows as U+FFFD until it
      completes; a real invalid byte is released once a later token shows it cannot complete;
    - a run of byte-fallback tokens ``<0xHH>`` (SentencePiece / Llama): the decoder turns the whole
      run into its string if it is valid UTF-8, else every byte into U+FFFD, so appending a byte can
      change earlier characters of the run; nothing in a run is settled until a non-byte token ends it;
    - with ``clean_up_tokenization_spaces`` in effect, text from a space among the last three
      characters (" n't", " 's", " ' " ... could still match): the emitted text is the cleaned-up
      settled text up to a point no clean-up pattern can straddle.

    Cost: each token decodes a small window, the tokens since the last settled point plus the
    context before them. The context is at least one token, so decoders that strip a leading space at
    the start of a decode (Metaspace, ``Strip``) see the same text. That is two decodes of 1-5 tokens in the
    usual case, whatever the session's length. The held tail grows only while it is undecided:
    inside a run of byte-fallback tokens (every token then decodes the run, O(run length)), or over
    tokens that decode to nothing; a ByteLevel tail that keeps ending in U+FFFD (invalid bytes) is
    settled inside once it is ``INNER_CHECK`` tokens long (a few more decodes on those tokens), so
    it stays a few tokens long. The emitted ``text`` itself is a new string per event (each event
    carries the cumulative text).

    ``strict`` (tests): raise :class:`DetokenizerError` when the window's decode does not extend its
    context's decode (a tokenizer behaviour these rules do not cover); otherwise that logs a warning
    and resynchronises with one full decode.
    """

    INNER_CHECK = 4  # tokens held before looking for a settled point inside the tail
    INNER_SPAN = 3  # how far back from the end that search goes (a UTF-8 character spans <= 3 more bytes)
    strict = False

    def __init__(self, tokenizer: Any, skip: set[int]) -> None:
        self.tokenizer = tokenizer
        self.skip = skip
        self.tokens: list[int] = []
        self.text = ""  # emitted text: the concatenation of every delta
        self.finished = False
        self._bytes = _byte_token_ids(tokenizer)
        self._cleanup = _cleans_up(tokenizer)
        self._prefix = 0  # tokens[prefix:read] is the context before the undecided tail
        self._read = 0  # tokens[:read] are settled
        self._prefix_text = ""  # decode(tokens[prefix:read]), raw (no clean-up)
        self._pending = ""  # settled raw text not yet emitted (clean-up hold-back; else emptied each step)
        self._tail = ""  # raw text of tokens[read:] in context, undecided
        self._warned = False

    # ---- what is decoded
    @property
    def full_text(self) -> str:
        """``tokenizer.decode(tokens, skip_special_tokens=False)``, kept incrementally: the emitted
        ``text`` plus what is held back (equal to ``text`` after ``finish()``)."""
        return self.text + self._held()

    @property
    def held(self) -> str:
        """The text ``finish()`` would release now (``full_text`` minus ``text``)."""
        return self._held()

    def _held(self) -> str:
        rest = self._pending + self._tail
        return self.tokenizer.clean_up_tokenization(rest) if self._cleanup and rest else rest

    def _decode(self, ids: list[int]) -> str:
        if self._cleanup:
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- the stream
    def append(self, token_id: int) -> tuple[str, str] | None:
        if token_id in self.skip:
            return None
        if self.finished:
            raise RuntimeError("TokenAccumulator.append after finish(): the stream has ended")
        tokens = self.tokens
        tokens.append(token_id)
        n = len(tokens)
        window = self._decode(tokens[self._prefix:])
        if not window.startswith(self._prefix_text):
            return self._resync("the new token changed the decode of the context before it")
        tail = window[len(self._prefix_text):]
        self._tail = tail
        if token_id not in self._bytes and not tail.endswith("\ufffd"):
            self._settle(n, tail, window)
        elif n - self._read >= self.INNER_CHECK:
            self._settle_inside(window)
        return self._emit()

    def finish(self) -> tuple[str, str] | None:
        """End the stream: emit what is held back, so ``text == full_text``; None when nothing is.
        Later calls return None; ``append`` after it raises."""
        if self.finished:
            return None
        rest = self._held()
        self.finished = True
        self._pending = self._tail = ""
        self._prefix = self._read = len(self.tokens)
        if not rest:
            return None
        self.text += rest
        return rest, self.text

    # ---- settling
    def _settle(self, k: int, piece: str, decoded: str) -> None:
        """tokens[:k] are settled: ``piece`` is the raw text of tokens[read:k], ``decoded`` that of
        tokens[prefix:k]. The new context is tokens[read:k] (kept wider while it decodes to nothing)."""
        self._pending += piece
        if self._read > self._prefix:
            context = self._decode(self.tokens[self._read:k])
            if context:
                self._prefix, decoded = self._read, context
        self._read, self._prefix_text = k, decoded
        self._tail = self._tail[len(piece):] if k < len(self.tokens) else ""

    def _settle_inside(self, window: str) -> None:
        """The tail still ends undecided: settle at the latest boundary k of its last tokens whose two
        sides decode apart exactly as together (so later bytes cannot join across it) and that does
        not split a run of byte tokens."""
        tokens, n = self.tokens, len(self.tokens)
        for k in range(n - 1, max(self._read, n - 1 - self.INNER_SPAN), -1):
            if tokens[k - 1] in self._bytes and tokens[k] in self._bytes:
                continue
            left = self._decode(tokens[self._prefix:k])
            if not left.startswith(self._prefix_text) or not window.startswith(left):
                continue
            right = self._decode(tokens[k:])
            if right and left + right == window:
                self._settle(k, left[len(self._prefix_text):], left)
                return

    def _emit(self) -> tuple[str, str]:
        pending = self._pending
        if not self._cleanup:
            self._pending = ""
            if pending:
                self.text += pending
            return pending, self.text
        # clean-up patterns are a space and at most 3 characters: emit up to a point with no space in
        # the 3 raw characters before it (the raw text before ``pending`` ends so already)
        m = len(pending)
        while m > 0 and " " in pending[max(0, m - 3):m]:
            m = pending.rfind(" ", 0, m)
        if m <= 0:
            return "", self.text
        delta = self.tokenizer.clean_up_tokenization(pending[:m])
        self._pending = pending[m:]
        self.text += delta
        return delta, self.text

    def _resync(self, why: str) -> tuple[str, str]:
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=False)
        message = (f"TokenAccumulator: {why} (tokens {self.tokens[self._prefix:]}, context "
                   f"{self._prefix_text!r}); resynchronised with a full decode")
        if self.strict:
            raise DetokenizerError(message)
        if not self._warned:
            self._warned = True
            _log.warning(message)
        common = 0
        for a, b in zip(self.text, full):
            if a != b:
                break
            common += 1
        delta = full[common:]
        n = len(self.tokens)
        self.text, self._pending, self._tail = full, "", ""
        self._prefix, self._read = max(0, n - 1), n
        self._prefix_text = self._decode(self.tokens[self._prefix:])
        return delta, self.text


@dataclass
class VoiceChatResult:
    """The offline answer to one audio turn."""

    text: str  # what the assistant said, decoded
    text_ids: np.ndarray  # int64 [frames]
    function_ids: np.ndarray  # int64 [frames]
    function_text: str  # the function channel, decoded
    user_transcript: str  # what the user said, as the model heard it
    audio: np.ndarray  # float32 [frames * 1764] at sample_rate
    audio_codes: np.ndarray  # int32 [frames, 31]
    sample_rate: int  # Hz of `audio`
    tool_calls: list[VoiceChatEvent] = field(default_factory=list)  # tool_call / tool_call_error (with tools)
