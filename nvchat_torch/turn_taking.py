"""NVIDIA's turn-taking policy: the RNNT transcript head decides when the agent starts and stops.

:class:`TurnTaking` rewrites each frame's text id with NVIDIA's rules (end of utterance, barge-in,
first-turn fallback, self-play suppression), for a batch of rows on the device with no host read.
Every state is per row. :meth:`TurnTaking.punctuate` is the pipeline's transcript punctuation bias.
Design, rules and stock values: docs/turn_taking.md; where we differ from NVIDIA: docs/usage.md,
"Turn-taking".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from .models.layers import RecurrentCache, RowTensor, RowValue, linear

if TYPE_CHECKING:
    from .models.rnnt import RnntState, RnntTranscriber

__all__ = ["TurnTakingConfig", "TurnTaking", "REASONS", "reasons_of", "punctuation_ids"]

# What the policy did on a frame, as bits of the reason code ``TurnTaking.reason`` holds per row
# (bit i = REASONS[i]); a frame can carry two (user speech confirmed, and the agent given the turn).
# "speech_ended" is ours, a report that changes no id: the user's speech that a user_speech or barge_in
# reported has been silent for eou_frames without the agent being given the turn (it was left
# unconfirmed, as when the user stops within min_speech_frames of a barge-in), so a caller that
# reported the start can report the end.
REASONS = ("user_speech", "end_of_utterance", "first_turn_fallback", "barge_in", "self_play_suppressed",
           "speech_ended")


def reasons_of(code: int) -> list[str]:
    """The reasons of a reason code, in the order of :data:`REASONS`."""
    return [name for bit, name in enumerate(REASONS) if code >> bit & 1]


@dataclass(frozen=True)
class TurnTakingConfig:
    """The policy's parameters; the defaults are NVIDIA's stock values (``s2s_streaming.yaml`` and the
    wrapper's defaults), in 80 ms frames (docs/usage.md, Turn-taking)."""

    window: int = 40  # frames looked back for the agent's BOS / EOS (force_turn_taking_threshold)
    eou_frames: int = 40  # blank frames after confirmed speech that end the user's utterance (3.2 s)
    barge_in_frames: int = 40  # consecutive non-blank frames that stop a speaking agent (3.2 s)
    min_speech_frames: int = 3  # non-blank frames that confirm user speech
    min_speech_frames_first_turn: int = 2  # the same until the user's first utterance ended
    density_threshold: float = 0.15  # below it (and above 0), after the first turn ...
    density_low_min_speech: int = 6  # ... confirming takes this many frames
    noise_reset_frames: int = 10  # blanks before confirmation that reset the non-blank total
    first_turn_fallback_frames: int = 50  # from this frame, confirmed speech on the first turn starts the agent
    self_play_suppression: bool = False  # drop the model's own BOS while no user speech is confirmed
    punctuation_bias: bool = True  # transcript punctuation after pauses (rnnt_punct_bias_enabled)
    punctuation_min_blanks: int = 5  # consecutive blank frames before the bias starts growing
    punctuation_increments: tuple[tuple[str, float], ...] = ((".", 1.5), ("?", 1.5), (",", 1.0), ("!", 1.0))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("self_play_suppression", "punctuation_bias"):
                if not isinstance(value, bool):
                    raise ValueError(f"turn_taking.{f.name} must be a bool, got {value!r}")
            elif f.name == "density_threshold":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                    raise ValueError(f"turn_taking.density_threshold must be a number in [0, 1], got {value!r}")
            elif f.name == "punctuation_increments":
                if isinstance(value, Mapping):  # a mapping is accepted and kept as pairs
                    value = tuple(value.items())
                    object.__setattr__(self, f.name, value)
                try:
                    pairs = [(str(p), float(v)) for p, v in value]
                except (TypeError, ValueError):
                    raise ValueError(f"turn_taking.punctuation_increments must be (piece, increment) pairs, "
                                     f"got {value!r}") from None
                if not all(p and np.isfinite(v) for p, v in pairs):
                    raise ValueError(f"turn_taking.punctuation_increments: pieces must be non-empty and "
                                     f"increments finite, got {value!r}")
                object.__setattr__(self, f.name, tuple(pairs))
            elif isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 31:
                raise ValueError(f"turn_taking.{f.name} must be a non-negative int (frames), got {value!r}")
        if self.window < 1:
            raise ValueError(f"turn_taking.window must be at least 1 frame, got {self.window}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TurnTakingConfig":
        """From a mapping of some fields (the rest stock); unknown names raise ``ValueError``."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown turn_taking field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (``punctuation_increments`` as a mapping)."""
        out = asdict(self)
        out["punctuation_increments"] = dict(self.punctuation_increments)
        return out


# Columns of the per-row state: counters (long) and flags (bool).
_BLANKS, _CONSEC, _TOTAL, _T, _LAST_BOS, _LAST_EOS = range(_COUNTERS := 6)
_SPEAKING, _CONFIRMED, _FIRST_TURN, _USER_FIRST_TURN, _WAS_HELD, _EXEMPT, _WORDS, _IN_SPEECH = range(_FLAGS := 8)
_NEVER = -(2 ** 40)  # "no BOS / EOS emitted yet": older than any window
_PARAMS = ("window", "eou_frames", "barge_in_frames", "min_speech_frames", "min_speech_frames_first_turn",
           "density_low_min_speech", "noise_reset_frames", "first_turn_fallback_frames", "self_play_suppression",
           "punctuation_min_blanks")


def _threshold32(value: float) -> np.float32:
    """The float32 ``c`` with ``d < c`` exactly when ``float(d) < value`` for every float32 ``d`` (NVIDIA
    compares the float32 density, read to a Python float, with the float ``value``)."""
    c = np.float32(value)
    return np.nextafter(c, np.float32(np.inf)) if float(c) < value else c


def punctuation_ids(config: TurnTakingConfig, vocabulary: Sequence[str]) -> dict[int, float]:
    """``{RNNT id: increment}`` of the configured punctuation, bare and word-start forms, as NVIDIA looks
    them up in the RNNT vocabulary (the first form found keeps its id)."""
    out: dict[int, float] = {}
    for piece, increment in config.punctuation_increments:
        for variant in (piece, "\u2581" + piece):
            if variant in vocabulary:
                out.setdefault(list(vocabulary).index(variant), increment)
    return out


class TurnTaking(RecurrentCache):
    """The policy for ``batch`` conversations (rows), each with its own state; see the module doc.

    ``step(text_ids, user_blank, skip)`` runs one frame: ``text_ids [B]`` long, the LLM's text ids after
    tool forcing; ``user_blank [B]`` bool, whether the RNNT's first argmax of the frame was blank;
    ``skip [B]`` bool (None: none), rows held this frame (a tool call in progress, or a text id forced
    with ``force_tokens``): their ids pass unchanged and only their RNNT counters advance. Returns the
    ``[B]`` ids the frame emits; :attr:`reason` then holds each row's reason code (bits of
    :data:`REASONS`, 0: the policy did nothing). Rows whose config is None pass their ids through.

    ``rnnt_vocabulary`` (the RNNT's pieces) enables :meth:`punctuate`, the transcript punctuation bias,
    for rows whose config has ``punctuation_bias``.
    """

    def __init__(self, config: TurnTakingConfig | None, *, bos_id: int, eos_id: int, pad_id: int, batch: int = 1,
                 device: torch.device | str | None = None, rnnt_vocabulary: Sequence[str] = ()) -> None:
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.vocabulary = list(rnnt_vocabulary)
        self.configs: list[TurnTakingConfig | None] = [config] * batch
        self.counters = torch.zeros(batch, _COUNTERS, dtype=torch.long, device=self.device)
        self.flags = torch.zeros(batch, _FLAGS, dtype=torch.bool, device=self.device)
        self.density = torch.zeros(batch, dtype=torch.float32, device=self.device)
        self.bias = torch.zeros(batch, dtype=torch.float32, device=self.device)  # the punctuation bias
        self.reasons = RowValue(torch.zeros(batch, dtype=torch.long, device=self.device))  # each row's last reason code
        self._upload()
        self.reset(range(batch))

    @property
    def batch(self) -> int:
        return self.counters.shape[0]

    @property
    def reason(self) -> torch.Tensor:
        """``[B]``: each row's reason code of the last frame (bits of :data:`REASONS`)."""
        return self.reasons.tensor

    def batched(self) -> list[RowTensor]:
        """The tensors that carry a row's state from frame to frame (row = first axis)."""
        return [(self.counters, 0, 1), (self.flags, 0, 1), (self.density, 0, 1), (self.bias, 0, 1)]

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        self.counters, self.flags, self.density, self.bias = tensors

    def _upload(self) -> None:
        """The rows' parameters as device tensors (sent when the configs change, not per frame)."""
        # Per row: the parameters, then 1 for a row without a config (its ids pass through).
        ints = [[int(getattr(c, p)) for p in _PARAMS] + [0] if c is not None else [1] * len(_PARAMS) + [1]
                for c in self.configs]
        params = torch.tensor(ints, dtype=torch.long).view(-1, len(_PARAMS) + 1).to(self.device)
        self._params = params[:, :-3]
        self._suppression, self._min_blanks, self._on = params[:, -3].bool(), params[:, -2], params[:, -1] == 0
        self._bits = torch.tensor([1 << i for i in range(len(REASONS))]).to(self.device)
        thresholds = [_threshold32(c.density_threshold) if c is not None else 0.0 for c in self.configs]
        self._threshold = torch.tensor(np.array(thresholds, dtype=np.float32)).to(self.device)
        # The punctuation bias: per row, each punctuation piece's increment and which pieces count.
        classes = len(self.vocabulary) + 1
        increments = np.zeros((len(self.configs), classes), dtype=np.float32)
        is_punct = np.zeros((len(self.configs), classes), dtype=bool)
        for r, c in enumerate(self.configs):
            if c is not None and c.punctuation_bias:
                for i, increment in punctuation_ids(c, self.vocabulary).items():
                    increments[r, i], is_punct[r, i] = increment, True
        self.punctuating = bool(is_punct.any())
        self._increments = torch.from_numpy(increments).to(self.device)
        self._is_punct = torch.from_numpy(is_punct).to(self.device)

    def configure(self, row: int, config: TurnTakingConfig | None) -> None:
        """Give ``row`` its own config (None: its ids pass through). A row switched on starts fresh; a row
        that had a config keeps its state under the new values."""
        was = self.configs[row]
        self.configs[row] = config
        self._upload()
        if was is None:
            self.reset([row])

    def resize(self, batch: int, config: TurnTakingConfig | None = None) -> None:
        """``batch`` rows: new rows at the end (fresh, with ``config``), or the last ones dropped."""
        have = self.batch
        if batch > have:
            self.configs += [config] * (batch - have)
        else:
            del self.configs[batch:]
        super().resize(batch)
        self.reasons.resize(batch)
        self._upload()
        if batch > have:
            self.reset(range(have, batch))

    def reset(self, rows: Sequence[int] | range | int) -> None:
        """Rows back to the start of a conversation (a reused engine slot)."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        if not rows:
            return
        counters = [0] * _COUNTERS
        counters[_LAST_BOS] = counters[_LAST_EOS] = _NEVER
        flags = [False] * _FLAGS
        flags[_FIRST_TURN] = flags[_USER_FIRST_TURN] = True
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        self.counters[index] = torch.tensor(counters, dtype=torch.long).to(self.device)
        self.flags[index] = torch.tensor(flags).to(self.device)
        self.density[index] = 0.0
        self.bias[index] = 0.0
        self.reasons.tensor[index] = 0

    @property
    def active(self) -> bool:
        """Whether any row has a config (with none, the caller can skip the policy)."""
        return any(c is not None for c in self.configs)

    def step(self, text_ids: torch.Tensor, user_blank: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """One frame for every row (see the class doc); no host read."""
        # Kept to few kernels (it runs every frame): on bools ``a > b`` is ``a & ~b``.
        blanks, consec, total, t, last_bos, last_eos = self.counters.unbind(1)
        speaking, confirmed, first_turn, user_first_turn, was_held, exempt, words, in_speech = self.flags.unbind(1)
        window, eou, barge_in, min_speech, min_first, low_min, noise_reset, fallback = self._params.unbind(1)
        tok, blank = text_ids, user_blank
        held = torch.zeros_like(blank) if skip is None else skip
        speech = ~blank
        # The post-tool exemption is armed on the first frame not held after a hold.
        exempt = exempt | (was_held > held)
        # RNNT counters (held rows too); the density moves only while the agent is silent.
        density = torch.where(speaking, self.density, speech * 0.1 + self.density * 0.9)
        blanks = (blanks + 1) * blank
        consec = (consec + 1) * speech
        total = total + speech
        on = self._on > held  # the rows the policy runs on this frame
        since = t - window
        bos_in_window, eos_in_window = last_bos >= since, last_eos >= since
        is_bos, is_eos = tok == self.bos_id, tok == self.eos_id
        # 1. thresholds
        need = torch.where(user_first_turn, min_first, min_speech)
        need = torch.where(((density > 0) & (density < self._threshold)) > first_turn, low_min, need)
        # 2. self-play suppression (the first such BOS after a hold passes once)
        candidate = on & self._suppression & is_bos & ~(speaking | first_turn | confirmed)
        suppressed = candidate > exempt
        exempt = exempt > candidate
        go = on > suppressed  # the rows the rules below act on
        out = torch.where(suppressed, self.pad_id, tok)
        confirmed_before = confirmed
        # 3. agent state: the model's own BOS / EOS (now or in the window); EOS wins
        starts = go & (bos_in_window | is_bos)
        stops = go & (eos_in_window | is_eos)
        speaking = (speaking | starts) > stops
        first_turn = first_turn > starts
        reset = (go & is_bos) | stops
        confirmed = confirmed > reset
        # 4. noise guard
        total = torch.where(reset | (go & (blanks >= noise_reset) > (confirmed | speaking)), 0, total)
        # 5. confirmation
        confirm = (go & ((consec >= need) | (total >= need))) > speaking
        user_speech = confirm > confirmed_before
        confirmed = confirmed | confirm
        # 6. first-turn fallback (a BOS in the window has already ended the first turn in step 3)
        fallback_fires = go & first_turn & confirmed & (t >= fallback)
        # 7. end of utterance (stops here either way)
        utterance_ends = (go & confirmed & (blanks >= eou)) > (fallback_fires | speaking)
        eou_fires = utterance_ends > (bos_in_window | is_bos)
        take = fallback_fires | eou_fires
        # 8. barge-in. Its rows are speaking, so 6 and 7 did not act, and step 3 saw no EOS.
        barge = go & speaking & (consec >= barge_in)
        out = torch.where(take, self.bos_id, torch.where(barge, self.eos_id, out))
        confirmed = confirmed > take
        total = torch.where(take | barge, 0, total)
        consec = torch.where(barge, 0, consec)
        speaking = (speaking | take) > barge
        first_turn = first_turn > take
        user_first_turn = user_first_turn > take
        # The window: the ids this row emitted, as their last frames.
        gives_turn = out == self.bos_id
        last_bos = torch.where(gives_turn, t, last_bos)
        last_eos = torch.where(out == self.eos_id, t, last_eos)
        # 9. (ours, a report only) the reported speech ends with no turn given: see REASONS.
        in_speech = in_speech | user_speech | barge
        speech_ends = (on & in_speech & (blanks >= eou)) > (confirmed | gives_turn)
        in_speech = in_speech > (gives_turn | speech_ends)
        self.reasons.tensor = (torch.stack([user_speech, eou_fires, fallback_fires, barge, suppressed, speech_ends], 1)
                               * self._bits).sum(1)
        self.counters = torch.stack([blanks, consec, total, t + 1, last_bos, last_eos], dim=1)
        self.flags = torch.stack([speaking, confirmed, first_turn, user_first_turn, held, exempt, words, in_speech],
                                 dim=1)
        self.density = density
        return out  # a row without a config: never `go`, so its id is as given

    def take_turns(self, ids: torch.Tensor, user_blank: torch.Tensor, hold: torch.Tensor) -> torch.Tensor:
        """The policy on a frame step's ``[batch, 2]`` ids, after tool forcing (NVIDIA's frame order): a tool
        call holds the text at PAD from its start-of-call token on, and a held row skips the policy;
        ``user_blank`` is the RNNT's first argmax of the frame being blank (it emitted nothing); ``hold``
        ``[3, batch]``: held, text held at PAD, start-of-call id."""
        held, pad_text, call_start = hold.unbind(0)
        starts = ids[:, 1] == call_start
        text = torch.where(pad_text.bool() | starts, self.pad_id, ids[:, 0])
        text = self.step(text, user_blank, held.bool() | starts)
        return torch.stack([text, ids[:, 1]], dim=1)

    def punctuate_rows(self, transcriber: RnntTranscriber, state: RnntState, encoded: torch.Tensor,
                       transcript_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`punctuate` on a frame step's RNNT ids: the joint's first prediction again (a blank row's
        state is the one it was made from), and the predictor advanced through the punctuation a row
        emits (``state`` updated)."""
        joint, decoder = transcriber.joint, transcriber.decoder
        hc = state.hc
        frame_bias = joint.enc(encoded.reshape(encoded.shape[0], -1)) + joint.pred.bias
        logits = joint.joint_net(linear(hc[-1], joint.pred.weight, frame_bias))
        transcript_ids, emit = self.punctuate(logits, transcript_ids)
        advanced = decoder.step(decoder.input_gates(transcript_ids[0].clamp(min=0)), hc[:2 * decoder.layers],
                                with_output=True)
        state.hc = torch.where(emit[:, None], advanced, hc)
        return transcript_ids

    def punctuate(self, logits: torch.Tensor, transcript_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The transcript punctuation bias (``rnnt_punct_bias_*``), run after the frame's RNNT step and
        before :meth:`step`: ``logits [B, classes]``, the joint's first prediction of the frame;
        ``transcript_ids [S, B]`` the frame's ids (-1: none). On a blank frame with a bias, the biased
        argmax is emitted if it is punctuation. Returns the ids with it (at position 0) and the rows
        that emitted it (the caller advances their predictor through it). Then: any emitted piece
        resets the bias, punctuation ends the words, and a blank frame after words, from the
        ``punctuation_min_blanks``-th consecutive blank on, raises the bias by 1."""
        first = transcript_ids[0]
        biased = logits.float() + self.bias[:, None] * self._increments
        choice = biased.argmax(-1)
        emit = (first < 0) & (self.bias > 0) & self._is_punct.gather(1, choice[:, None])[:, 0]
        ids = torch.cat([torch.where(emit, choice, first)[None], transcript_ids[1:]])
        emitted = ids[0] >= 0
        punct = (self._is_punct.gather(1, ids.t().clamp(min=0)) & (ids.t() >= 0)).any(1)
        words = self.flags[:, _WORDS]
        grow = ~emitted & words & (self.counters[:, _BLANKS] + 1 >= self._min_blanks)
        self.bias = torch.where(emitted, 0.0, self.bias + grow.float())
        self.flags[:, _WORDS] = (words | emitted) & ~punct
        return ids, emit
