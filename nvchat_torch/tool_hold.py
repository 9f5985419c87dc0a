"""What the assistant says while a tool call is written and while the tool runs, and how the result is spelled.

This is the configuration of NVIDIA's spoken tool phases: :class:`ToolHold`, the phrase layout
(:func:`layout_phrase`) and the number spelling (:func:`spell_numbers`, :func:`tool_response_text`).
The session drives the phases.
Design, with NeMo's line numbers: docs/tools.md, "Speaking while a tool runs".
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .tool_prompt import format_tool_response, tool_result_json

__all__ = [
    "ToolHold",
    "ACKNOWLEDGEMENTS",
    "REMINDERS",
    "TIMEOUT_MESSAGE",
    "MAX_PHRASE_CHARACTERS",
    "PAD_FLOOR",
    "PAD_PER_CHARACTER",
    "trailing_pad_count",
    "layout_phrase",
    "spell_numbers",
    "spell_tool_response_numbers",
    "tool_response_text",
]

# Our own phrases (NVIDIA's lists in P's data/*.json set the tone: short, warm, ASCII). The acknowledgements
# are shorter than the on-hold lines and open differently, so the two phases sound like two moves.
ACKNOWLEDGEMENTS = (
    "Sure, one moment.",
    "Of course, let me see.",
    "Absolutely, one second.",
    "Sure thing, I'm on it.",
    "Good question, let me see.",
    "Certainly, just a moment.",
    "No problem, checking now.",
    "Right away, give me a moment.",
)
REMINDERS = (
    "I'm still on it, thanks for waiting.",
    "It's coming, just a little longer.",
    "Thanks for your patience, almost ready.",
    "Still waiting on the answer.",
    "Any second now.",
    "The answer is on its way.",
    "Pulling that together now.",
    "Nearly ready, thanks for holding.",
)
TIMEOUT_MESSAGE = "The request did not finish in time."

# The layout's trailing PADs: max(PAD_FLOOR, ceil(PAD_PER_CHARACTER x characters)) (P 195-196).
PAD_FLOOR = 17
PAD_PER_CHARACTER = 0.5
# A phrase is played whole before the next phase starts (P 1656-1678), and the timeout is measured only
# after the on-hold phrases (P 1728-1730): a long line makes the user wait longer for the answer. 200
# characters lay out as about 150 frames with the release's tokenizer (about 4.5 characters a token, plus
# the 100 PADs and BOS / EOS), 12 s of speech, already most of NVIDIA's 15 s timeout; at worst (one token a
# character) 302 frames, 24 s. NVIDIA's own phrases are 14 to 97 characters (the longest, the 401 apology
# at P 379-381), so this is twice their longest.
MAX_PHRASE_CHARACTERS = 200


def _default_on_hold() -> Mapping[str, str | Sequence[str]]:
    return MappingProxyType({"default": REMINDERS})


def _default_timeout_result() -> Any:
    return {"error": "timeout", "message": TIMEOUT_MESSAGE}


def _check_phrase(where: str, phrase: Any) -> str:
    if not isinstance(phrase, str):
        raise ValueError(f"{where} must be a string, got {type(phrase).__name__}")
    if not phrase.strip():
        raise ValueError(f"{where} is empty")
    if not phrase.isascii():
        bad = next(c for c in phrase if not c.isascii())
        raise ValueError(f"{where} must be ASCII, as NVIDIA asks of what the model reads, got {bad!r} in {phrase!r}")
    if not phrase.isprintable():
        raise ValueError(f"{where} holds a control character (tab, newline, ...): {phrase!r}")
    if len(phrase) > MAX_PHRASE_CHARACTERS:
        raise ValueError(f"{where} has {len(phrase)} characters, more than the {MAX_PHRASE_CHARACTERS} a phrase may "
                         f"have (it is spoken whole before the answer can come): {phrase[:40]!r}...")
    return phrase


def _check_phrases(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{where} must be a list of phrases, got {type(value).__name__}")
    return tuple(_check_phrase(f"{where}[{i}]", p) for i, p in enumerate(value))


def _check_seconds(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where} must be a finite number of seconds above 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ToolHold:
    """One session's phrases and timing for its tool calls; the defaults are NVIDIA's stock settings (Y 123-136).

    Phrases are non-empty printable ASCII of at most :data:`MAX_PHRASE_CHARACTERS` characters. Bad values
    raise ``ValueError`` naming the field; :meth:`check_tools` checks the ``on_hold`` names against the
    session's tools, and :meth:`from_mapping` takes the fields as plain JSON values.
    """

    # One, picked at random per call, is spoken while the model writes the call (``fc_random_ack_enabled:
    # true``; P 198-259, 450-459). ``()``: none, the setting false.
    acknowledgements: tuple[str, ...] = ACKNOWLEDGEMENTS
    # Per tool name a phrase or phrases, one picked at random; ``"default"`` for the other tools. Spoken once
    # the call is written, while the tool runs (Layer 1; P 1641-1651, 1686-1700). The default
    # ``{"default": REMINDERS}`` is NVIDIA's stock Layer 1: with no per-tool map (``fc_on_hold_messages_path:
    # null``) and ``tool_reminder_enabled: true`` a random reminder line is spoken, whatever the tool. A map
    # given replaces it whole: keep a ``"default"`` entry for a line on the tools it does not name. ``{}``: no
    # Layer 1 (``tool_reminder_enabled: false``).
    on_hold: Mapping[str, str | Sequence[str]] = field(default_factory=_default_on_hold)
    # Lines that follow while the tool is still running (Layer 2; P 1702-1722). NVIDIA's stock list is none.
    generic: tuple[str, ...] = ()
    max_generic: int = 2  # at most this many generic lines, distinct and random (NVIDIA's count is 2)
    # The wait before each generic line; the result is checked before and after it (NVIDIA's gap is 1 s).
    generic_gap_s: float = 1.0
    # How long the result is then waited for (``fc_tool_timeout_sec``). It is counted after the on-hold
    # phrases (P 1728-1730, 385-390).
    timeout_s: float = 15.0
    # Injected as the tool's result past ``timeout_s``. P 1731-1736 inject ``{"error": "timeout", "message":
    # ...}``; the message here is ours.
    timeout_result: Any = field(default_factory=_default_timeout_result)
    # Spoken when the timeout hits. NVIDIA lays out a fallback phrase (P 376-378) but never speaks it, so the
    # default is None.
    timeout_phrase: str | None = None
    # Numbers in the result spelled out in words before injection (``fc_convert_num_to_text: true``;
    # :func:`tool_response_text`).
    spell_numbers: bool = True

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: normalise in place once
        set_field(self, "acknowledgements", _check_phrases("tool_hold.acknowledgements", self.acknowledgements))
        set_field(self, "generic", _check_phrases("tool_hold.generic", self.generic))
        if not isinstance(self.on_hold, Mapping):
            raise ValueError(f"tool_hold.on_hold must be a mapping of tool name to phrase(s), "
                             f"got {type(self.on_hold).__name__}")
        on_hold: dict[str, tuple[str, ...]] = {}
        for name, value in self.on_hold.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tool_hold.on_hold keys must be tool names or \"default\", got {name!r}")
            where = f"tool_hold.on_hold[{json.dumps(name)}]"
            phrases = (_check_phrase(where, value),) if isinstance(value, str) else _check_phrases(where, value)
            if not phrases:
                raise ValueError(f"{where} must hold at least one phrase (leave the tool out instead)")
            on_hold[name] = phrases
        set_field(self, "on_hold", MappingProxyType(on_hold))
        if isinstance(self.max_generic, bool) or not isinstance(self.max_generic, int) or self.max_generic < 0:
            raise ValueError(f"tool_hold.max_generic must be an int >= 0, got {self.max_generic!r}")
        set_field(self, "generic_gap_s", _check_seconds("tool_hold.generic_gap_s", self.generic_gap_s))
        set_field(self, "timeout_s", _check_seconds("tool_hold.timeout_s", self.timeout_s))
        try:
            serialised = tool_result_json(self.timeout_result)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"tool_hold.timeout_result: {e}") from None
        # A copy of what will be injected: the same JSON, not shared with the caller.
        set_field(self, "timeout_result", json.loads(serialised))
        if self.timeout_phrase is not None:
            _check_phrase("tool_hold.timeout_phrase", self.timeout_phrase)
        if not isinstance(self.spell_numbers, bool):
            raise ValueError(f"tool_hold.spell_numbers must be a bool, got {self.spell_numbers!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ToolHold:
        """From plain JSON values (the server's ``nvchat.tool_hold``): some of the fields, the rest stock;
        lists become tuples. An unknown key raises ``ValueError`` naming it."""
        if not isinstance(values, Mapping):
            raise ValueError(f"tool_hold must be a mapping of its fields, got {type(values).__name__}")
        names = [f.name for f in fields(cls)]
        for key in values:
            if key not in names:
                raise ValueError(f"unknown tool_hold field {key!r}; known: {', '.join(names)}")
        kwargs = dict(values)
        for key in ("acknowledgements", "generic"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        if isinstance(kwargs.get("on_hold"), Mapping):
            kwargs["on_hold"] = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs["on_hold"].items()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values; ``ToolHold.from_mapping(hold.to_dict()) == hold``."""
        return {
            "acknowledgements": list(self.acknowledgements),
            "on_hold": {name: list(phrases) for name, phrases in self.on_hold.items()},
            "generic": list(self.generic),
            "max_generic": self.max_generic,
            "generic_gap_s": self.generic_gap_s,
            "timeout_s": self.timeout_s,
            "timeout_result": json.loads(json.dumps(self.timeout_result)),
            "timeout_phrase": self.timeout_phrase,
            "spell_numbers": self.spell_numbers,
        }

    def check_tools(self, names: Iterable[str]) -> None:
        """Raise ``ValueError`` naming ``on_hold["x"]`` if ``x`` is neither ``"default"`` nor one of ``names``
        (the session's tools)."""
        known = list(names)
        for name in self.on_hold:
            if name != "default" and name not in known:
                offered = ", ".join(known) if known else "none were given"
                raise ValueError(f"tool_hold.on_hold[{json.dumps(name)}]: {name!r} is not one of the session's tools "
                                 f"({offered}); use a tool's name or \"default\"")

    # ---- NVIDIA's picks, with the session's random generator
    def on_hold_phrases(self, tool_name: str) -> tuple[str, ...]:
        """The tool's own on-hold phrases, else the ``"default"`` ones, else none (P 1645-1647)."""
        phrases = self.on_hold.get(tool_name) or self.on_hold.get("default") or ()
        return tuple(phrases)

    def pick_acknowledgement(self, rng: random.Random) -> str | None:
        """One acknowledgement at random (P 450-459), None when there are none."""
        return self.acknowledgements[rng.randrange(len(self.acknowledgements))] if self.acknowledgements else None

    def pick_on_hold(self, tool_name: str, rng: random.Random) -> str | None:
        """One of :meth:`on_hold_phrases` at random (P 1648-1649), None when there are none."""
        phrases = self.on_hold_phrases(tool_name)
        return rng.choice(phrases) if phrases else None

    def pick_generic(self, rng: random.Random) -> list[str]:
        """Up to ``max_generic`` distinct generic lines in random order (P 1703-1706)."""
        return rng.sample(self.generic, min(self.max_generic, len(self.generic)))

    def phrases(self) -> tuple[str, ...]:
        """Every phrase this configuration can speak, once each (to lay them out when a session starts)."""
        every = [*self.acknowledgements, *(p for ps in self.on_hold.values() for p in ps), *self.generic]
        if self.timeout_phrase is not None:
            every.append(self.timeout_phrase)
        return tuple(dict.fromkeys(every))


# --------------------------------------------------------------------------------------
# Phrase layout


def trailing_pad_count(phrase: str) -> int:
    """The PADs after a phrase's tokens: ``max(17, ceil(0.5 x characters))`` (P 190-196, 241): time for the
    codec to finish the last words before the EOS, growing with the phrase."""
    return max(PAD_FLOOR, math.ceil(PAD_PER_CHARACTER * len(phrase)))


def layout_phrase(tokenizer: Any, phrase: str, *, bos_id: int, pad_id: int, eos_id: int) -> list[int]:
    """The text-channel ids the TTS speaks a phrase from: ``[BOS] + ids + [PAD] x trailing_pad_count + [EOS]``
    (P 239-248; the same for the on-hold and generic lines, P 283-290, 322-328, 349-356). BOS and EOS make
    it a whole utterance, so the TTS is not left mid-speech for what follows.

    The ids are NeMo's ``tokenizer.text_to_ids(phrase)``: its HF wrapper (``AutoTokenizer``, no
    ``include_special_tokens``) runs ``convert_tokens_to_ids(tokenize(phrase))``, which is
    ``encode(phrase, add_special_tokens=False)`` (no BOS added; tests/test_tool_hold.py checks the two
    agree). The phrase is checked as :class:`ToolHold` checks one, and one whose text holds a special token
    (``"<s>"``, ``"<SPECIAL_20>"``, ...) raises ``ValueError``: it would act as a control token."""
    _check_phrase("the phrase", phrase)
    ids = [int(i) for i in tokenizer.encode(phrase, add_special_tokens=False)]
    control = {bos_id, pad_id, eos_id, *getattr(tokenizer, "all_special_ids", ())}
    control.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", True))
    for i in ids:
        if i in control:
            raise ValueError(f"the phrase {phrase!r} holds the special token {tokenizer.convert_ids_to_tokens(i)!r} "
                             f"(id {i}), which would act as a control token on the text channel")
    return [bos_id, *ids, *[pad_id] * trailing_pad_count(phrase), eos_id]


# --------------------------------------------------------------------------------------
# Numbers in words (W 1977-2024, with fc_convert_num_to_text: true in Y)

_inflect_lock = threading.Lock()  # the engine keeps the current call's options on itself
_inflect_engine: list[Any] = []  # created on first use: importing inflect takes a second


def _number_to_words(number: int) -> str:
    with _inflect_lock:
        if not _inflect_engine:
            import inflect

            _inflect_engine.append(inflect.engine())
        return str(_inflect_engine[0].number_to_words(number, andword=""))


def _digit_words(digits: str) -> str:
    return " ".join(_number_to_words(int(d)) for d in digits)


def spell_numbers(value: Any) -> Any:
    """NVIDIA's ``_convert_nums_in_json`` (W 1977-2003) on a parsed JSON value: every number in it (dict
    values and list items, at any depth; not keys, not digits inside strings) becomes its words with
    ``inflect``'s ``number_to_words(n, andword="")``: ``1234`` -> ``"one thousand, two hundred thirty-four"``,
    ``-5`` -> ``"minus five"``; a float is its int part, ``" point "`` and the digits after the ``"."`` of
    ``str(x)`` one word each: ``21.5`` -> ``"twenty-one point five"``, ``3.0`` -> ``"three point zero"``.
    A number inflect cannot spell becomes ``str(x)``. NVIDIA's quirks, kept:

    * ``-0.5`` -> ``"zero point five"`` (the int part of a float in (-1, 0) is 0: the sign is lost);
    * a float ``str`` writes with an exponent: no ``"."`` gives the int part alone (``1e-05`` -> ``"zero"``,
      ``1e+16`` -> ``"ten quadrillion"``), a ``"."`` before it gives ``str(x)`` (``1.5e-07`` -> ``"1.5e-07"``);
    * NaN and infinities -> ``"nan"``, ``"inf"``, ``"-inf"``; integers from 10**36 up (past inflect's
      decillions) -> their digits;
    * ``True`` / ``False`` -> ``"True"`` / ``"False"`` (bool is an int there; inflect 7.6 fails on it and NVIDIA
      falls back to ``str``; inflect 7.5 and older spell both ``"zero"``. NeMo does not pin inflect, so this
      follows the current release, without asking inflect);
    * None and strings are kept.
    """
    if isinstance(value, dict):
        return {k: spell_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [spell_numbers(v) for v in value]
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        try:
            text = str(value)
            words = _number_to_words(int(value))
            fraction = text.split(".")[1] if "." in text else ""
            return words + " point " + _digit_words(fraction) if fraction else words
        except Exception:  # noqa: BLE001 (NVIDIA's fallback: NaN, inf, an exponent after the ".")
            return str(value)
    if isinstance(value, int):
        try:
            return _number_to_words(value)
        except Exception:  # noqa: BLE001 (NVIDIA's fallback: out of inflect's range)
            return str(value)
    return value


_RESPONSE_TAGS = re.compile(r"(<TOOL_RESPONSE>)(.*?)(</TOOL_RESPONSE>)", re.DOTALL)


def spell_tool_response_numbers(text: str) -> str:
    """NVIDIA's ``_convert_tool_response_nums_to_text`` (W 2005-2024): the JSON between each
    ``<TOOL_RESPONSE>`` ... ``</TOOL_RESPONSE>`` (the first closing tag after the opening one) is parsed,
    spelled (:func:`spell_numbers`) and written back with ``json.dumps``' defaults; content that does not
    parse is left as it is (so a result string that holds ``"</TOOL_RESPONSE>"`` keeps its numbers)."""

    def spell(match: re.Match[str]) -> str:
        try:
            return match.group(1) + json.dumps(spell_numbers(json.loads(match.group(2)))) + match.group(3)
        except (json.JSONDecodeError, TypeError):
            return match.group(0)

    return _RESPONSE_TAGS.sub(spell, text)


def tool_response_text(results: list[Any], spell: bool) -> str:
    """What NVIDIA injects for the results of one call span: ``<TOOL_RESPONSE>[r1, r2]</TOOL_RESPONSE>``
    (:func:`~nvchat_torch.tool_prompt.format_tool_response`; P 1751), numbers spelled when ``spell`` (P 1753-1756).
    ``{"temperature_c": 21.5}`` -> ``<TOOL_RESPONSE>[{"temperature_c": "twenty-one point five"}]</TOOL_RESPONSE>``."""
    text = format_tool_response(results)
    return spell_tool_response_numbers(text) if spell else text
