"""Fuzzing the realtime server: 10,000 random and malformed client events on one connection, while a
second connection streams examples/question.wav beside it and must get exactly what
``StreamingSession`` emits alone.

Everything runs on loopback (127.0.0.1) with ``create_app(model, clock=0)`` and the tiny model; every
wait is bounded, so the test ends by itself.

How the events are judged
-------------------------
Each generated event is *bad* (it must get exactly one ``error`` naming its ``event_id``, with one of
the codes listed for it) or *valid* (it must get no error at all), by construction: the generator
knows the state it drives the server through. The fuzzed connection starts with a valid GA
``session.update`` (:data:`C0`, which fixes the dialect to GA), then runs a *pre-start* phase (no
valid append has been sent, so the session has not started), a valid ``session.update`` that sets
every fixed field back to ``C0`` (bad updates the server wrongly accepts may have changed them), one
valid append that starts the session, and a *post-start* phase. Valid ``session.update`` events
never change the fields that are fixed once audio has started (instructions, input format, tools,
``nvchat`` deterministic/seed/max_streaming_seconds), so they are valid in either phase; the output
format, ``nvchat.stats`` and the GA keys the server takes without acting on them change freely.

What the server is expected to do, per kind (codes from docs/server.md; ``unknown_parameter`` is
the code for the rule that an unknown key anywhere in a ``session.update`` is an error):

- not JSON, JSON that is not an object (array, number, string, null, true), JSON nested deeper than
  any parser recursion limit: ``invalid_json``. The server cannot read an ``event_id`` from these,
  so their errors are counted (per batch of events), not matched.
- binary WebSocket frames: an error (``invalid_message`` or ``invalid_json``), counted.
- a message over ``MAX_MESSAGE_BYTES``: ``message_too_large`` (matched if the server names its
  event_id, else counted).
- ``type`` missing, not a string, or not an event this server takes: ``unknown_event_type`` (or
  ``invalid_value`` for a non-string ``type``). A non-string ``event_id`` cannot be echoed: counted.
- ``input_audio_buffer.append``: ``audio`` missing or not a string -> ``invalid_value``; not strict
  base64 (characters outside the alphabet, whitespace, wrong padding, non-ASCII) ->
  ``invalid_base64``; an odd byte count -> ``invalid_audio_length``; a ``sample_rate`` (mlx-vlm's
  key) that is not the session's input rate -> ``unsupported_audio_format``. Valid: strict base64
  of an even number of bytes (including none).
- ``input_audio_buffer.commit`` before any audio -> ``input_audio_buffer_commit_empty``; after:
  valid (``committed`` ... ``response.done``). ``input_audio_buffer.clear``, ``response.cancel`` (with
  or without an open response) and ``response.create``: always valid.
- ``conversation.item.create``: ``item`` missing or not an object, or of a type GA does not have ->
  ``invalid_value``; GA ``message`` and ``function_call`` items: valid (before the start a message
  joins the prompt, after it the item is recorded with a notice); ``function_call_output`` before
  any audio: valid (recorded, with a notice); with a non-string ``call_id`` or
  ``output`` -> ``invalid_value``; with a ``call_id`` the model never issued (the tiny model makes no
  calls) -> ``invalid_tool_result``, sent once the worker has run it, still naming this event.
- ``session.update``: ``session`` missing or not an object, ``session.type`` other than
  ``"realtime"`` or ``"transcription"``, a wrong type in any position (numbers, lists, objects, booleans where strings
  are expected and so on), ``null`` where the GA schema does not allow it (everything but
  ``turn_detection``, ``transcription``, ``noise_reduction``, ``prompt``, ``tracing`` and
  ``nvchat.max_streaming_seconds``), falsy non-lists such as ``tools: 0``: ``invalid_value``;
  ``output_modalities`` other than ``["audio"]`` or ``["text"]``, ``tool_choice`` outside GA's values,
  function tools that do not validate, more than 5 tools, non-function tools: ``invalid_value`` (or
  ``tools_unsupported``); a format other than ``audio/pcm`` or a rate not listed (8000, 44100,
  16000.5, "16000", [16000], true, ...): ``unsupported_audio_format`` (or ``invalid_value``);
  ``nvchat`` with unknown keys, wrong types or out-of-range values (``max_streaming_seconds`` <= 0,
  NaN or Infinity): ``invalid_value``/``unknown_parameter``; an unknown
  key at any level (session, audio, audio.input/output, their format, nvchat, inside a tool or a GA
  object): ``unknown_parameter`` (or ``invalid_value``); GA keys with values outside the GA schema
  (``max_output_tokens: "lots"``, ``turn_detection: {"type": "vad"}``, ...): ``invalid_value``. After
  A valid update that changes the prompt, tools or ``nvchat`` options after the start is taken (not
  applied): no error.
  Valid: the GA keys of openai's ``RealtimeSessionCreateRequestParam`` with GA values, e.g.
  ``model``, ``include``, ``max_output_tokens``, ``parallel_tool_calls``, ``prompt``, ``reasoning``,
  ``tracing``, ``truncation``, ``audio.input.{format, noise_reduction, transcription,
  turn_detection}``, ``audio.output.{format, voice, speed}``.
- Unknown top-level keys on events other than ``session.update``: the docs say nothing, and this
  test expects them to be ignored (valid) unless :data:`STRICT_EVENT_KEYS` is set (OpenAI's own
  server answers ``unknown_parameter``).

What is asserted: no unhandled exception (the ``nvchat_torch.server``, ``uvicorn.error`` and
starlette/asyncio loggers, and any exception escaping a connection's reader or pump, which the
server's ``Connection.run`` would otherwise swallow); the fuzzed connection is the same one at the
end and still works (a final valid exchange); every bad event got exactly one error naming it (or,
for events without a readable event_id, the right number of anonymous errors per batch) with an
expected code; no valid event got an error; the other session's text, transcript and audio equal
``StreamingSession``'s. If the fuzzed connection dies, the test records why, reconnects and goes on,
so one run reports every problem; the events of the batch it died in are not judged.

Values that pass the type checks but that the session cannot run with (a seed outside 64 bits, a
``max_streaming_seconds`` that overflows, a prompt longer than the context) only fail when the first
append starts the session, after the reset above: the second test checks them one connection each
(refused as a client error, or run; never ``session_failed``).

``NVCHAT_FUZZ_SEED`` picks another seed; ``NVCHAT_FUZZ_REPORT=path`` writes the full findings as JSON.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import string
import time
import traceback
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
import websockets

import nvchat_torch as nv
from test_server import EXAMPLE, assert_same_pcm, b64, deltas, reference, serve

try:
    from nvchat_torch.server.app import MAX_MESSAGE_BYTES
except ImportError:  # pragma: no cover
    MAX_MESSAGE_BYTES = 4 * 1024 * 1024

SEED = int(os.environ.get("NVCHAT_FUZZ_SEED", "20250607"))
N_EVENTS = 10_000
PRE_START = 1_500  # events before the fuzzed session starts (the out-of-order phase)
BATCH = 50  # events between two barriers
WAIT = 60.0  # seconds any one wait may take
HUGE_BUDGET = 768 * 1024  # characters of huge strings in all (besides one oversize message)
AUDIO_BUDGET = 16 * 16000  # samples of valid audio the fuzzed session gets in all (16 s)
STRICT_EVENT_KEYS = False  # unknown top-level keys on events other than session.update are errors
BARRIER_TYPE = "nvchat_fuzz.barrier"  # an unknown event type: its error marks the end of a batch

# The fuzzed session's configuration: fixed fields that no valid event changes.
C0 = {"type": "realtime", "instructions": "You are being fuzzed.",
      "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
      "tools": [], "tool_choice": "auto", "nvchat": {"deterministic": True, "seed": 7, "max_streaming_seconds": None}}
OTHER = {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                       "output": {"format": {"type": "audio/pcm", "rate": 22050}}},
         "nvchat": {"deterministic": True, "seed": 0, "turn_taking": False, "listening_audio": True}}

B64_STRICT = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
WEATHER = {"type": "function", "name": "get_weather", "description": "weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

# GA keys with values of the GA schema (openai.types.realtime.realtime_session_create_request_param)
GA_VALID_EXTRAS: list[tuple[tuple[str, ...], Any]] = [
    (("model",), "nvchat"), (("model",), "gpt-realtime"),
    (("include",), []), (("include",), ["item.input_audio_transcription.logprobs"]),
    (("max_output_tokens",), "inf"), (("max_output_tokens",), 1), (("max_output_tokens",), 4096),
    (("parallel_tool_calls",), False), (("parallel_tool_calls",), True),
    (("prompt",), None), (("prompt",), {"id": "pmpt_1"}),
    (("prompt",), {"id": "pmpt_1", "version": "2", "variables": {"city": "Paris"}}),
    (("reasoning",), {"effort": "low"}),
    (("tracing",), None), (("tracing",), "auto"), (("tracing",), {"workflow_name": "fuzz", "group_id": "g"}),
    (("truncation",), "auto"), (("truncation",), "disabled"),
    (("truncation",), {"type": "retention_ratio", "retention_ratio": 0.5}),
    (("audio", "input", "noise_reduction"), {"type": "near_field"}), (("audio", "input", "noise_reduction"), None),
    (("audio", "input", "transcription"), {"model": "whisper-1"}),
    (("audio", "input", "transcription"), {"model": "gpt-4o-transcribe", "language": "en"}),
    (("audio", "input", "transcription"), None),
    (("audio", "input", "turn_detection"), None), (("audio", "input", "turn_detection"), {"type": "server_vad"}),
    (("audio", "input", "turn_detection"), {"type": "semantic_vad", "eagerness": "low"}),
    (("audio", "input", "turn_detection"), {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                            "silence_duration_ms": 500, "create_response": True,
                                            "interrupt_response": True, "idle_timeout_ms": None}),
    (("audio", "output", "voice"), "alloy"), (("audio", "output", "voice"), {"id": "voice_1"}),
    (("audio", "output", "speed"), 1.0), (("audio", "output", "speed"), 1.25),
    (("audio", "input", "turn_detection"), False),  # pipecat's "no server turn detection"
    (("output_modalities",), ["text"]), (("output_modalities",), ["audio"]),
    (("tool_choice",), "none"), (("tool_choice",), "required"), (("tool_choice",), "auto"),
    (("tool_choice",), {"type": "function", "name": "get_weather"}),
    (("tool_choice",), {"type": "mcp", "server_label": "s"}),
]

# GA keys with values outside the GA schema (or unknown keys inside GA objects)
GA_BAD_EXTRAS: dict[tuple[str, ...], list] = {
    ("model",): [5, [], {}, True],
    ("include",): ["item.input_audio_transcription.logprobs", 5, [1], ["bogus"]],
    ("max_output_tokens",): ["lots", 0, 4097, -1, [], True, 1.5],
    ("parallel_tool_calls",): ["yes", 1, []],
    ("prompt",): [5, "pmpt_1", [], {"version": "1"}, {"id": "p", "foo": 1}],
    ("reasoning",): ["high", 5, {"effort": "max"}, {"foo": 1}],
    ("tracing",): [5, "on", [], {"foo": 1}],
    ("truncation",): ["sometimes", 5, [], {"type": "retention_ratio"}, {"type": "retention_ratio",
                                                                        "retention_ratio": 0.5, "foo": 1}],
    ("audio", "input", "noise_reduction"): ["yes", 5, {"type": "mid_field"}, {"foo": 1}],
    ("audio", "input", "transcription"): [5, "whisper-1", {"model": 5}, {"foo": 1}],
    ("audio", "input", "turn_detection"): ["server_vad", 5, {"type": "vad"}, {"type": "server_vad", "foo": 1}, {}],
    ("audio", "output", "voice"): [5, [], {"name": "x"}],
    ("audio", "output", "speed"): ["fast", [], True],
}
# null where the GA schema (or the nvchat extension) does not take null
NON_NULLABLE = [("instructions",), ("audio",), ("audio", "input"), ("audio", "output"),
                ("audio", "input", "format"), ("audio", "output", "format"), ("audio", "input", "format", "rate"),
                ("audio", "output", "format", "type"), ("output_modalities",), ("tools",), ("tool_choice",),
                ("nvchat",), ("nvchat", "seed"), ("nvchat", "deterministic"), ("nvchat", "stats"), ("model",),
                ("include",), ("max_output_tokens",), ("parallel_tool_calls",), ("reasoning",), ("truncation",),
                ("audio", "output", "voice"), ("audio", "output", "speed")]
UNKNOWN_SESSION_KEYS = ["modalities", "voice", "input_audio_format", "output_audio_format",
                        "input_audio_transcription", "turn_detection", "temperature", "max_response_output_tokens",
                        "system_prompt", "seed", "max_streaming_seconds", "object", "id", "expires_at",
                        "Instructions", "tools ", "", "client_secret"]
UNKNOWN_NVCHAT_KEYS = ["frame_samples", "max_message_bytes", "started", "not_applied", "max_buffered_seconds",
                       "max_unsent_seconds", "Seed", "seed ", "temperature", "system_prompt"]
UNSUPPORTED_GA_TYPES = ["transcription_session.update", "session.created",
                        "response.done", "error", "Session.Update", "session.update ", "input_audio_buffer.append\n",
                        "", "*", "input_audio_buffer", "response.cancelled"]


@dataclasses.dataclass
class Case:
    index: int
    kind: str
    data: str | bytes
    event_id: str | None  # the id the server can read and echo (None: it cannot)
    bad: bool
    codes: frozenset = frozenset()
    id_optional: bool = False  # the server may be unable to read event_id (oversize, non-standard JSON)
    samples: int = 0  # valid audio it carries
    commit: bool = False  # a valid commit
    conn: int = -1
    batch: int = -1

    def summary(self, limit: int = 160) -> str:
        text = self.data if isinstance(self.data, str) else f"<binary {len(self.data)} bytes> {self.data[:40]!r}"
        if len(text) > limit:
            text = text[:limit] + f"... ({len(text)} chars)"
        return f"#{self.index} [{self.kind}] {text}"


def _set(obj: dict, path: tuple[str, ...], value: Any) -> dict:
    for key in path[:-1]:
        child = obj.get(key)
        if not isinstance(child, dict):
            child = obj[key] = {}
        obj = child
    obj[path[-1]] = value
    return obj


class Fuzzer:
    """Seeded event generator. ``started``: whether the fuzzed session has had its first valid append."""

    def __init__(self, rng: random.Random, pcm: np.ndarray):
        self.rng = rng
        self.pcm = pcm
        self.pos = 0
        self.huge_left = HUGE_BUDGET
        self.audio_left = AUDIO_BUDGET
        self.oversize_sent = False

    # ---- building blocks
    def huge(self, n: int, alphabet: str = "x") -> str | None:
        if n > self.huge_left:
            return None
        self.huge_left -= n
        return (alphabet * (n // len(alphabet) + 1))[:n]

    def word(self) -> str:
        r = self.rng
        return "".join(r.choice(string.ascii_letters + "_.") for _ in range(r.randint(1, 12)))

    def nested(self, depth: int) -> Any:
        value: Any = self.rng.choice([1, "x", None, True])
        for _ in range(depth):
            value = [value] if self.rng.random() < 0.5 else {"a": value}
        return value

    def junk(self, exclude: tuple = ()) -> Any:
        """A value of any JSON type; ``exclude`` names kinds not to give ("str", "dict", "list", "null", ...)."""
        r = self.rng
        pools = {
            "int": [0, 1, -1, 7, 16000, 24000, 2 ** 31, 2 ** 70, -(2 ** 70), 10 ** 40],
            "float": [0.5, -0.0, 1.5, 1e308, -1e308, 3.14159, 1e-300],
            "str": ["", "x", "audio", "realtime", "true", "null", "16000", "日本語", "\u0000", "😀" * 3,
                    "a" * 300, "\ud800"],
            "bool": [True, False],
            "null": [None],
            "list": [[], [1], ["audio"], [None], [[[]]], [1, "a", None, {"b": 2}]],
            "dict": [{}, {"a": 1}, {"type": "realtime"}, {"": ""}, {"nested": {"deeper": [1, {"x": None}]}}],
        }
        kinds = [k for k in pools if k not in exclude]
        kind = r.choice(kinds)
        if kind in ("list", "dict") and r.random() < 0.15:
            value = self.nested(r.randint(5, 150))
            if kind == "list" and not isinstance(value, list):
                value = [value]
            if kind == "dict" and not isinstance(value, dict):
                value = {"a": value}
            return value
        return r.choice(pools[kind])

    def audio(self, max_samples: int = 1280) -> tuple[str, int]:
        """Strict base64 of an even number of bytes: a slice of question.wav (or a few samples once the
        audio budget is spent)."""
        r = self.rng
        n = r.choice([0, 1, 7, 160, 320, 640, 1000, 1280, r.randint(0, max_samples)])
        n = min(n, max_samples, max(self.audio_left, 0) if self.audio_left > 16 else 16)
        self.audio_left -= n
        chunk = np.take(self.pcm, np.arange(self.pos, self.pos + n), mode="wrap")
        self.pos += n
        return b64(chunk), n

    def valid_session(self) -> dict:
        """A GA session that changes no field fixed once audio has started."""
        r = self.rng
        s: dict = {"type": "realtime"}
        if r.random() < 0.4:
            s["instructions"] = C0["instructions"]
        if r.random() < 0.4:
            fmt: dict = {"rate": 16000}
            if r.random() < 0.7:
                fmt["type"] = "audio/pcm"
            _set(s, ("audio", "input", "format"), fmt)
        if r.random() < 0.6:
            fmt = {"type": "audio/pcm"}
            rate = r.choice([24000, 22050, None])
            if rate is not None:
                fmt["rate"] = rate
            _set(s, ("audio", "output", "format"), fmt)
        for _ in range(r.choice([0, 0, 1, 2, 3])):
            path, value = r.choice(GA_VALID_EXTRAS)
            _set(s, path, json.loads(json.dumps(value)))
        if r.random() < 0.3:
            s["output_modalities"] = ["audio"]
        if r.random() < 0.3:
            s["tools"] = []
        if r.random() < 0.3:
            s["tool_choice"] = "auto"
        if r.random() < 0.5:
            ext = {k: v for k, v in C0["nvchat"].items() if r.random() < 0.5}
            if r.random() < 0.3:
                ext["stats"] = r.random() < 0.5
            s["nvchat"] = ext
        return s

    # ---- the events
    def make(self, index: int, started: bool) -> Case:
        r = self.rng
        eid = f"fz{index}"
        table = [
            (self.e_valid_update, 5), (self.e_bad_update, 30),
            (self.e_invalid_json, 4), (self.e_non_object, 2), (self.e_deep_json, 0.08), (self.e_binary, 2),
            (self.e_missing_type, 2), (self.e_type_wrong, 2), (self.e_unknown_type, 3), (self.e_id_wrong_type, 1.5),
            (self.e_append_bad, 8), (self.e_item, 5), (self.e_item_ref, 2), (self.e_clear, 1.5), (self.e_cancel, 1.5),
            (self.e_create, 1), (self.e_commit, 3 if started else 2),
            (self.e_valid_append, 14 if started else 0), (self.e_append_rate, 2 if started else 0),
            (self.e_append_extra_key, 1 if started else 0), (self.e_change_fixed, 2 if started else 0),
            (self.e_huge, 0.25),
        ]
        fns, weights = zip(*table)
        fn = r.choices(fns, weights)[0]
        if started and index >= 6000 and not self.oversize_sent:
            fn = self.e_oversize  # once, mid-way
        case = fn(index, eid, started)
        if self.huge_left > 0 and case.bad and case.event_id and r.random() < 0.002:
            big = self.huge(r.randint(10_000, 100_000))  # a huge event_id on a bad event
            if big is not None and isinstance(case.data, str) and f'"event_id": "{eid}"' in case.data:
                new = f"{eid}-{big}"
                case.data = case.data.replace(f'"event_id": "{eid}"', f'"event_id": "{new}"', 1)
                case.event_id = new
                case.kind += " +huge event_id"
        return case

    def json_case(self, index, kind, event: dict, bad, codes=(), **kw) -> Case:
        return Case(index, kind, json.dumps(event), event.get("event_id") if isinstance(event.get("event_id"), str)
                    else None, bad, frozenset(codes), **kw)

    def e_valid_update(self, index, eid, started):
        return self.json_case(index, "session.update valid", {"type": "session.update", "event_id": eid,
                                                              "session": self.valid_session()}, False)

    def e_bad_update(self, index, eid, started):
        r = self.rng
        s = self.valid_session()
        ev: dict = {"type": "session.update", "event_id": eid, "session": s}
        codes = {"invalid_value"}
        choice = r.randint(0, 18)
        if choice == 0:
            if r.random() < 0.3:
                del ev["session"]
                kind = "session missing"
            else:
                ev["session"] = self.junk(exclude=("dict",))
                kind = "session not an object"
        elif choice == 1:
            s["type"] = r.choice(["translation", "Realtime", "realtime ", "", 1, [], {}, None, True])
            kind = "session.type wrong"
        elif choice == 2:
            key = r.choice(UNKNOWN_SESSION_KEYS + [self.word()])
            s[key] = self.junk()
            kind = "unknown key in session"
            codes |= {"unknown_parameter"}
        elif choice == 3:
            s["instructions"] = self.junk(exclude=("str", "null"))
            kind = "session.instructions wrong type"
        elif choice == 4:
            path = r.choice([("audio",), ("audio", "input"), ("audio", "output")])
            _set(s, path, r.choice([0, "", [], False, 1, "pcm16", [{}], True, 24000]))
            kind = f"session.{'.'.join(path)} not an object"
        elif choice == 5:
            path = r.choice([("audio",), ("audio", "input"), ("audio", "output"), ("audio", "input", "format"),
                             ("audio", "output", "format")])
            key = r.choice(["sample_rate", "channels", "codec", "rate", "type", "foo", self.word()])
            if path[-1] == "format" and key in ("rate", "type"):
                key = "sample_rate"
            if path[-1] != "format" and key in ("format",):
                key = "foo"
            if path in (("audio", "input"), ("audio", "output")) and key == "type":
                key = "codec"
            obj = s
            for k in path:
                obj = obj.setdefault(k, {})
            if path[-1] == "format":
                obj.setdefault("type", "audio/pcm")
                obj.setdefault("rate", 16000 if "input" in path else 24000)
            obj[key] = self.junk()
            kind = f"unknown key in session.{'.'.join(path)}"
            codes |= {"unknown_parameter", "unsupported_audio_format"}
        elif choice == 6:
            side = r.choice(["input", "output"])
            _set(s, ("audio", side, "format"), r.choice(["pcm16", "audio/pcm", 16000, [], [{"type": "audio/pcm"}],
                                                         True, 0, ""]))
            kind = "format not an object"
            codes |= {"unsupported_audio_format"}
        elif choice == 7:
            side = r.choice(["input", "output"])
            fmt = {"type": r.choice(["audio/pcmu", "audio/pcma", "pcm16", "audio/wav", "audio/PCM", "", 1, [], {},
                                     True]), "rate": 16000 if side == "input" else 24000}
            _set(s, ("audio", side, "format"), fmt)
            kind = "format.type unsupported or wrong type"
            codes |= {"unsupported_audio_format"}
        elif choice == 8:
            side = r.choice(["input", "output"])
            pool = ([8000, 22050, 44100, 48000, 0, -16000, 16001, 1, 2 ** 70, 16000.5, "16000", "24000", [16000],
                     {"rate": 16000}, True, False, 1e308] if side == "input" else
                    [16000, 8000, 44100, 48000, 0, -24000, 22051, 1, 2 ** 70, 22050.5, "24000", "22050", [24000],
                     {"rate": 24000}, True, False, 1e308])
            rate = r.choice(pool)
            if r.random() < 0.02:
                rate = self.huge(r.randint(20_000, 100_000), "1") or "1" * 100
            fmt = {"rate": rate}
            if r.random() < 0.7:
                fmt["type"] = "audio/pcm"
            _set(s, ("audio", side, "format"), fmt)
            kind = f"audio.{side}.format.rate out of range or wrong type"
            codes |= {"unsupported_audio_format"}
        elif choice == 9:
            s["output_modalities"] = r.choice([5, 0, True, 1.5, "audio", "text", ["audio", "text"],
                                               ["text", "audio"], ["audio", "audio"], [], [1], [None], [["audio"]],
                                               {"audio": 1}, {"0": "audio"}, ["AUDIO"], ["audio "]])
            kind = "output_modalities wrong"
        elif choice == 10:
            many = [dict(WEATHER, name=f"f{i}") for i in range(6)]
            s["tools"] = tools = r.choice([
                "get_weather", 1, 0, "", True, False, {}, WEATHER, [1], ["x"], [None], [{}], [[]],
                [{"type": "function"}], [{"type": "function", "name": ""}], [{"type": "function", "name": 5}],
                [{"type": "function", "name": "f", "parameters": "x"}],
                [{"type": "function", "name": "f", "description": 5}], [{"type": "mcp", "server_label": "s"}],
                [{"type": "code_interpreter"}], [WEATHER, WEATHER], many, [self.nested(100)],
                [dict(WEATHER, foo=1)], [{"type": "function", "function": "x"}]])
            kind = ("tools wrong (a falsy non-list)" if tools in (0, "", False, {}) and tools is not True else
                    "tools wrong (an unknown key in a function tool)" if tools == [dict(WEATHER, foo=1)] else
                    "tools wrong")
            codes |= {"tools_unsupported", "unknown_parameter"}
        elif choice == 11:
            s["tool_choice"] = r.choice(["Auto", "auto ", "", 1, True, [], {}, {"type": "function"},
                                         {"type": "function", "name": 5}, {"type": "mcp"}, {"name": "f"}])
            kind = "tool_choice wrong"
        elif choice == 12:
            s["nvchat"] = self.junk(exclude=("dict", "null"))
            kind = "nvchat not an object"
        elif choice == 13:
            ext = s.setdefault("nvchat", {})
            ext[r.choice(UNKNOWN_NVCHAT_KEYS + [self.word()])] = self.junk()
            kind = "unknown key in nvchat"
            codes |= {"unknown_parameter"}
        elif choice == 14:
            key = r.choice(["deterministic", "stats", "seed", "max_streaming_seconds"])
            value = {"deterministic": [1, 0, "true", [], {}, 1.0],
                     "stats": [1, 0, "yes", [], {}],
                     "seed": [1.5, "0", True, False, [], {}, 7.0, 1e308],
                     "max_streaming_seconds": ["10", True, False, [], {}, 0, -1, -0.0, -1e-9, -1e308]}[key]
            s["nvchat"] = {key: r.choice(value)}
            kind = f"nvchat.{key} wrong type or not positive"
        elif choice == 15:
            # (seeds outside 64 bits and finite but overflowing limits such as 1e308 may be refused or
            # run: test_a_session_update_the_server_takes_does_not_kill_the_session checks them)
            s["nvchat"] = {"max_streaming_seconds": r.choice([float("inf"), float("-inf"), float("nan")])}
            kind = "nvchat.max_streaming_seconds not finite (non-standard JSON Infinity/NaN)"
        elif choice == 16:
            path = r.choice(list(GA_BAD_EXTRAS))
            _set(s, path, r.choice(GA_BAD_EXTRAS[path]))
            kind = f"GA key {'.'.join(path)} with a value outside the GA schema"
            codes |= {"unknown_parameter"}
        elif choice == 17:
            path = r.choice(NON_NULLABLE)
            _set(s, path, None)
            kind = f"null for non-nullable session.{'.'.join(path)}"
            codes |= {"unsupported_audio_format"}
        else:
            path = r.choice([("audio", "input", "format", "rate"), ("instructions",), ("nvchat", "seed"),
                             ("output_modalities",), ("tools",), ("audio", "output", "voice")])
            _set(s, path, self.nested(r.randint(20, 180)))
            kind = f"nested junk value in session.{'.'.join(path)}"
            codes |= {"unsupported_audio_format", "unknown_parameter"}  # a tool {"a": ...}: an unknown key
        text = json.dumps(ev)
        # (json.dumps writes inf and nan as the non-standard Infinity and NaN, which Python's json reads)
        return Case(index, f"session.update: {kind}", text, eid, True, frozenset(codes))

    def e_invalid_json(self, index, eid, started):
        r = self.rng
        good = json.dumps({"type": "input_audio_buffer.append", "event_id": eid, "audio": "AAAA"})
        text = r.choice([
            good[:r.randint(0, len(good) - 1)], good + "}", good + ",", "{", "}", "", " ", "\n", "{'type': 'x'}",
            '{"type": "session.update",}', '{"type": undefined}', "{type: 'x'}", '{"a": 1} {"b": 2}', "[1,]",
            "\u0000", "😀", "".join(r.choice(string.printable) for _ in range(r.randint(1, 80))),
            '{"type": "input_audio_buffer.commit"', '"unterminated', "tru", "nul", "0x10", "01", "+1", ".5",
            '{"event_id": "x", "type": "input_audio_buffer.commit"}\x00', "\ufeff{}",
        ])
        try:
            json.loads(text)
            text = "{" + text  # it parsed: make sure it does not
        except ValueError:
            pass
        return Case(index, "invalid JSON", text, None, True, frozenset({"invalid_json"}))

    def e_non_object(self, index, eid, started):
        text = self.rng.choice(["[]", "[1, 2]", '[{"type": "input_audio_buffer.commit"}]', "1", "-0", "1e400",
                                '"input_audio_buffer.commit"', "null", "true", "false", "NaN", "Infinity", '""'])
        return Case(index, "JSON that is not an object", text, None, True, frozenset({"invalid_json"}))

    def e_deep_json(self, index, eid, started):
        r = self.rng
        depth = r.choice([1500, 3000, 20000])
        if r.random() < 0.5:
            inner = "[" * depth + "]" * depth
        else:
            inner = '{"a":' * depth + "1" + "}" * depth
        if r.random() < 0.5:
            return Case(index, "JSON nested deeper than any recursion limit", inner, None, True,
                        frozenset({"invalid_json"}))
        text = json.dumps({"type": "session.update", "event_id": eid, "session": {"type": "realtime", "nvchat": 0}})
        text = text.replace('"nvchat": 0', f'"nvchat": {inner}')
        return Case(index, "session.update nested deeper than any recursion limit", text, eid, True,
                    frozenset({"invalid_json", "invalid_value", "unknown_parameter"}), id_optional=True)

    def e_binary(self, index, eid, started):
        r = self.rng
        data = r.choice([b"", b"\x00\x01\x02", bytes(r.randrange(256) for _ in range(r.randint(1, 300))),
                         json.dumps({"type": "input_audio_buffer.commit", "event_id": eid}).encode(),
                         json.dumps({"type": "session.update", "session": C0}).encode(), b"\xff\xfe{}"])
        return Case(index, "binary frame", data, None, True, frozenset({"invalid_message", "invalid_json"}))

    def e_missing_type(self, index, eid, started):
        ev = {"event_id": eid}
        for _ in range(self.rng.randint(0, 3)):
            ev[self.rng.choice(["audio", "session", "item", "Type", "types", self.word()])] = self.junk()
        return self.json_case(index, "type missing", ev, True, {"unknown_event_type", "invalid_value"})

    def e_type_wrong(self, index, eid, started):
        t = self.rng.choice([1, 0, 1.5, True, False, None, [], ["session.update"], {}, {"type": "session.update"}])
        return self.json_case(index, "type not a string", {"type": t, "event_id": eid, "session": C0}, True,
                              {"unknown_event_type", "invalid_value"})

    def e_unknown_type(self, index, eid, started):
        r = self.rng
        t = r.choice(UNSUPPORTED_GA_TYPES + [self.word(), "input_audio_buffer." + self.word()])
        return self.json_case(index, "unknown event type", {"type": t, "event_id": eid}, True, {"unknown_event_type"})

    def e_huge(self, index, eid, started):
        r = self.rng
        n = r.randint(50_000, 250_000)
        which = r.randint(0, 3)
        if which == 0:
            big = self.huge(n)
            ev = {"type": big or "x" * 100, "event_id": eid}
            return self.json_case(index, "huge unknown event type", ev, True, {"unknown_event_type"})
        if which == 1:
            big = self.huge(n, "QUJD*")
            return self.json_case(index, "huge invalid base64", {"type": "input_audio_buffer.append", "event_id": eid,
                                                                 "audio": big or "QUJD*"}, True, {"invalid_base64"})
        if which == 2:
            s = self.valid_session()
            s[self.huge(n, "k") or "k" * 100] = 1
            return self.json_case(index, "session.update: huge unknown key", {"type": "session.update",
                                                                            "event_id": eid, "session": s}, True,
                                  {"unknown_parameter", "invalid_value"})
        # huge but valid: instructions before the session starts (the reset before the start undoes them)
        if not started:
            big = self.huge(n, "hello ")
            if big is not None:
                s = {"type": "realtime", "instructions": big}
                return self.json_case(index, "session.update valid: huge instructions before the start",
                                      {"type": "session.update", "event_id": eid, "session": s}, False)
        return self.e_unknown_type(index, eid, started)

    def e_id_wrong_type(self, index, eid, started):
        bad_id = self.rng.choice([1, 0, 1.5, None, True, [], ["fz"], {}, {"id": eid}])
        ev = {"type": self.rng.choice(UNSUPPORTED_GA_TYPES), "event_id": bad_id}
        return self.json_case(index, "event_id not a string (on an unknown event type)", ev, True,
                              {"unknown_event_type", "invalid_value"})

    def e_append_bad(self, index, eid, started):
        r = self.rng
        ev: dict = {"type": "input_audio_buffer.append", "event_id": eid}
        which = r.randint(0, 2)
        if which == 0:
            if r.random() < 0.2:
                kind = "append: audio missing"
            else:
                ev["audio"] = self.junk(exclude=("str",))
                kind = "append: audio not a string"
            codes = {"invalid_value"}
        elif which == 1:
            good = base64.b64encode(bytes(r.randrange(256) for _ in range(2 * r.randint(1, 40)))).decode()
            bad = r.choice([
                "***", "abc$", good + "\n", " " + good, good[:-1] if len(good) % 4 == 0 else good + "A",
                good.rstrip("=") if "=" in good else good + "=", good + "====", "====", "A===",
                "A", "AB", "ABC", "QUI-", "QUI_", "QU I=", "é" * 4, "AAAA\u0000", "QUI=QUI=", "QQ==QQ==",
                good[:4] + "." + good[4:], "data:audio/pcm;base64," + good, "\\u0041AAA"])
            assert not B64_STRICT.fullmatch(bad), bad
            if not started and bad.endswith("=") and B64_STRICT.fullmatch(bad.rstrip("=")):
                # padding after whole groups: a lenient decoder takes it, and that append would start
                # the session before the generator means it to; judged after the start only
                bad = "***"
            ev["audio"] = bad
            kind, codes = "append: not strict base64", {"invalid_base64"}
        else:
            n = r.choice([1, 3, 5, 2 * r.randint(0, 1000) + 1])
            ev["audio"] = base64.b64encode(bytes(r.randrange(256) for _ in range(n))).decode()
            kind, codes = "append: odd byte count", {"invalid_audio_length"}
        return self.json_case(index, kind, ev, True, codes)

    def e_valid_append(self, index, eid, started):
        audio, n = self.audio()
        return self.json_case(index, "append valid", {"type": "input_audio_buffer.append", "event_id": eid,
                                                      "audio": audio}, False, samples=n)

    def e_append_rate(self, index, eid, started):
        audio, _ = self.audio(16)
        rate = self.rng.choice([8000, 24000, 44100, 22050, "16000", [16000], None, True, 0, -16000, 16000.5])
        return self.json_case(index, "append: sample_rate not the session's input rate",
                              {"type": "input_audio_buffer.append", "event_id": eid, "audio": audio,
                               "sample_rate": rate}, True, {"unsupported_audio_format", "invalid_value",
                                                            "unknown_parameter"})

    def e_append_extra_key(self, index, eid, started):
        audio, n = self.audio(64)
        ev = {"type": "input_audio_buffer.append", "event_id": eid, "audio": audio,
              self.rng.choice(["foo", "item_id", "format", "Audio", self.word()]): self.junk()}
        if STRICT_EVENT_KEYS:
            return self.json_case(index, "append: unknown key", ev, True, {"unknown_parameter", "invalid_value"})
        return self.json_case(index, "append valid: with an unknown key (ignored)", ev, False, samples=n)

    def extra_key(self, ev: dict) -> tuple[dict, bool]:
        """Maybe an unknown top-level key; returns whether one was added."""
        if self.rng.random() < 0.15:
            ev[self.rng.choice(["foo", "response_id", "item_id", "pad_partial", "session", self.word()])] = self.junk()
            return ev, True
        return ev, False

    def e_commit(self, index, eid, started):
        ev, extra = self.extra_key({"type": "input_audio_buffer.commit", "event_id": eid})
        if not started:
            return self.json_case(index, "commit before any audio", ev, True, {"input_audio_buffer_commit_empty",
                                                                               "unknown_parameter"})
        if extra and STRICT_EVENT_KEYS:
            return self.json_case(index, "commit: unknown key", ev, True, {"unknown_parameter"})
        return self.json_case(index, "commit valid" + (" (unknown key ignored)" if extra else ""), ev, False,
                              commit=True)

    def _simple_valid(self, index, eid, etype):
        ev, extra = self.extra_key({"type": etype, "event_id": eid})
        if extra and STRICT_EVENT_KEYS:
            return self.json_case(index, f"{etype}: unknown key", ev, True, {"unknown_parameter", "invalid_value"})
        return self.json_case(index, f"{etype} valid" + (" (unknown key ignored)" if extra else ""), ev, False)

    def e_clear(self, index, eid, started):
        return self._simple_valid(index, eid, "input_audio_buffer.clear")

    def e_cancel(self, index, eid, started):
        return self._simple_valid(index, eid, "response.cancel")

    def e_create(self, index, eid, started):
        return self._simple_valid(index, eid, "response.create")

    def e_item(self, index, eid, started):
        r = self.rng
        ev: dict = {"type": "conversation.item.create", "event_id": eid}
        which = r.randint(0, 4)
        if which == 0:
            if r.random() < 0.3:
                kind = "item missing"
            else:
                ev["item"] = self.junk(exclude=("dict",))
                kind = "item not an object"
            codes = {"invalid_value"}
        elif which == 1 and r.random() < 0.5:
            ev["item"] = r.choice([
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "be brief"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "message", "role": "user", "content": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}])
            return self.json_case(index, "conversation.item.create valid: a message or function_call item", ev,
                                  False)
        elif which == 1:
            ev["item"] = r.choice([
                {"type": self.junk(exclude=("str",))}, {"type": "Function_call_output", "call_id": "c", "output": ""},
                {}, {"call_id": "c", "output": "x"}, {"type": "message", "role": "robot", "content": []},
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "message", "role": "user", "content": [{"type": "input_txt", "text": "hi"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}])
            kind, codes = "item of no GA type, or a malformed message", {"invalid_value"}
        elif which == 2:
            item = {"type": "function_call_output", "call_id": "call_" + self.word(), "output": "{}"}
            key = r.choice(["call_id", "output"])
            if r.random() < 0.3:
                del item[key]
            else:
                item[key] = self.junk(exclude=("str",))
            ev["item"] = item
            kind, codes = f"function_call_output with {key} missing or not a string", {"invalid_value"}
        else:
            output = r.choice(['{"temperature_c": 21}', "plain text", "", "null", "1e999", json.dumps(self.nested(50))])
            deep = r.random() < 0.03
            if deep:
                output = r.choice(["[" * 3000 + "]" * 3000, '{"a": ' * 2000 + "1" + "}" * 2000])
            ev["item"] = {"type": "function_call_output", "call_id": "call_" + self.word(), "output": output}
            if started:
                kind, codes = "function_call_output for an unknown call_id", {"invalid_tool_result"}
                if deep:
                    kind += " (output: JSON nested deeper than any recursion limit)"
            else:  # recorded with an item_not_heard notice: the model has not started to listen
                return self.json_case(index, "conversation.item.create valid: function_call_output before any audio",
                                      ev, False)
        return self.json_case(index, f"conversation.item.create: {kind}", ev, True, codes)

    def e_item_ref(self, index, eid, started):
        """truncate / retrieve / delete of an item this conversation does not have (or no item_id)."""
        r = self.rng
        verb = r.choice(["truncate", "retrieve", "delete"])
        ev: dict = {"type": f"conversation.item.{verb}", "event_id": eid}
        if r.random() < 0.3:
            ev["item_id"] = self.junk(exclude=("str",))
            codes = {"invalid_value"}
        else:
            ev["item_id"] = "item_" + self.word()
            codes = {f"item_{verb}_invalid_item_id"}
        if verb == "truncate":
            ev.update(content_index=0, audio_end_ms=r.choice([0, 80, -1, "1"]))
            codes |= {"invalid_value"}
        return self.json_case(index, f"conversation.item.{verb}: an unknown or malformed item_id", ev, True, codes)

    def e_change_fixed(self, index, eid, started):
        r = self.rng
        s: dict = {"type": "realtime"}
        which = r.randint(0, 5)
        if which == 0:
            s["instructions"] = "something else"
        elif which == 1:
            s["nvchat"] = {"turn_taking": r.choice([False, True, {"eou_frames": 20}])}  # changes live
        elif which == 2:
            s["instructions"] = ""
        elif which == 3:
            s["nvchat"] = r.choice([{"seed": 8}, {"deterministic": False}, {"max_streaming_seconds": 100}])
        elif which == 4:
            s["tools"] = [WEATHER]
        else:
            s["instructions"] = None  # the default prompt is not C0's
        ev = {"type": "session.update", "event_id": eid, "session": s}
        if which == 5:
            return self.json_case(index, "session.update: null instructions", ev, True, {"invalid_value"})
        if which == 4:  # the tiny model's tokenizer has no tool-call markers
            return self.json_case(index, "session.update: tools this model cannot call", ev, True,
                                  {"tools_unsupported"})
        # taken and not applied (nvchat.not_applied), or (the policy) applied from the next frame
        return self.json_case(index, "session.update valid: changes a fixed field after the start", ev, False)

    def e_oversize(self, index, eid, started):
        self.oversize_sent = True
        text = json.dumps({"event_id": eid, "type": "input_audio_buffer.append",
                           "audio": "A" * (MAX_MESSAGE_BYTES + 1024)})
        return Case(index, "message over MAX_MESSAGE_BYTES", text, eid, True, frozenset({"message_too_large"}),
                    id_optional=True)


# ---------------------------------------------------------------------------------------------- driving


class ErrorLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record not in self.records:
            self.records.append(record)

    def failures(self) -> list[str]:
        out = []
        for r in self.records:
            msg = r.getMessage()
            if r.levelno >= logging.ERROR and (r.exc_info or "Exception in ASGI application" in msg):
                tb = "".join(traceback.format_exception(*r.exc_info))[-1500:] if r.exc_info else ""
                out.append(f"{r.name} {r.levelname}: {msg[:300]}\n{tb}")
        return out


def instrument(monkeypatch, crashes: list[dict]) -> None:
    """Record any exception escaping a connection's _handle, _read or _pump: the server's
    ``Connection.run`` gathers them with ``return_exceptions=True`` and would drop them unseen."""
    from nvchat_torch.server import app as app_module

    conn_cls = getattr(app_module, "Connection", None)
    seen: list[BaseException] = []  # kept alive, so that no two are the same object

    def record(where, exc, event=None):
        if any(e is exc for e in seen):
            return
        seen.append(exc)
        info = {"where": where, "exception": f"{type(exc).__name__}: {str(exc)[:300]}",
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-3000:]}
        if isinstance(event, dict):
            info["event_id"] = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            info["event"] = json.dumps(event)[:300] if _dumpable(event) else repr(event)[:300]
        crashes.append(info)

    handle = getattr(conn_cls, "_handle", None)
    if handle is not None:
        async def _handle(self, event, *args, **kwargs):
            try:
                return await handle(self, event, *args, **kwargs)
            except Exception as e:
                if type(e).__name__ != "ClientError":
                    record("Connection._handle", e, event)
                raise

        monkeypatch.setattr(conn_cls, "_handle", _handle)
    for name in ("_read", "_pump"):
        method = getattr(conn_cls, name, None)
        if method is None:
            continue

        def wrap(method=method, name=name):
            async def wrapper(self, *args, **kwargs):
                try:
                    return await method(self, *args, **kwargs)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    record(f"Connection.{name}", e)
                    raise
            return wrapper

        monkeypatch.setattr(conn_cls, name, wrap())


def _dumpable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (ValueError, TypeError, RecursionError):
        return False


@dataclasses.dataclass
class Conn:
    index: int
    ws: Any
    types: list = dataclasses.field(default_factory=list)
    closed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    close: str | None = None
    commits_sent: int = 0
    died_in_batch: int | None = None
    reader: Any = None


class FuzzRun:
    def __init__(self, address: str):
        self.url = f"ws://{address}/v1/realtime"
        self.conns: list[Conn] = []
        self.errors: list[tuple[int, int, dict]] = []  # (conn, batch, error event)
        self.barriers: dict[str, asyncio.Future] = {}
        self.batch = 0
        self.cases: list[Case] = []
        self.deaths: list[dict] = []
        self.sent = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    async def receive(self, conn: Conn) -> None:
        try:
            async for raw in conn.ws:
                self.bytes_received += len(raw)
                event = json.loads(raw)
                kind = event.get("type")
                conn.types.append(kind)
                if kind == "error":
                    eid = (event.get("error") or {}).get("event_id")
                    if isinstance(eid, str) and eid in self.barriers:
                        future = self.barriers.pop(eid)
                        if not future.done():
                            future.set_result(event)
                        continue
                    self.errors.append((conn.index, self.batch, event))
        except websockets.ConnectionClosed as e:
            conn.close = f"closed: code {e.rcvd.code if e.rcvd else None} ({e.rcvd.reason if e.rcvd else e})"
        except Exception as e:  # noqa: BLE001 (recorded: the test fails on it)
            conn.close = f"reader failed: {e!r}"
        finally:
            if conn.close is None:
                conn.close = "closed by the server (no close code)"
            conn.closed.set()

    async def connect(self, started: bool) -> Conn:
        ws = await websockets.connect(self.url, max_size=None, ping_interval=None, open_timeout=WAIT)
        created = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
        assert created["type"] == "session.created", created
        conn = Conn(len(self.conns), ws)
        self.conns.append(conn)
        conn.reader = asyncio.create_task(self.receive(conn))
        setup = [Case(-1, "setup: C0", json.dumps({"type": "session.update", "event_id": f"c{conn.index}-setup",
                                                   "session": C0}), f"c{conn.index}-setup", False)]
        if started:
            setup.append(Case(-1, "setup: start", json.dumps({"type": "input_audio_buffer.append",
                                                              "event_id": f"c{conn.index}-start",
                                                              "audio": b64(np.zeros(640, np.int16))}),
                              f"c{conn.index}-start", False, samples=640))
        for case in setup:
            await self.send(conn, case)
        return conn

    async def send(self, conn: Conn, case: Case) -> bool:
        case.conn, case.batch = conn.index, self.batch
        self.cases.append(case)
        if case.commit:
            conn.commits_sent += 1
        try:
            await conn.ws.send(case.data)
            self.bytes_sent += len(case.data)
            return True
        except websockets.ConnectionClosed:
            return False

    async def barrier(self, conn: Conn) -> bool:
        """Every event sent before it has been read by the server (and answered, if it errs)."""
        eid = f"barrier{self.batch}"
        future = asyncio.get_running_loop().create_future()
        self.barriers[eid] = future
        with contextlib.suppress(websockets.ConnectionClosed):
            await conn.ws.send(json.dumps({"type": BARRIER_TYPE, "event_id": eid}))
        closed = asyncio.create_task(conn.closed.wait())
        done, _ = await asyncio.wait({future, closed}, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        self.barriers.pop(eid, None)
        if future in done:
            return True
        if not conn.closed.is_set():
            conn.close = f"no answer to the barrier within {WAIT:.0f} s"
            await conn.ws.close()
        return False


async def other_session(address: str, pcm: np.ndarray, progress) -> dict:
    """A GA client streaming ``pcm`` in 1280-sample appends spread over the fuzzing, then a commit."""
    got = {"text": "", "transcript": "", "audio": b"", "errors": [], "types": [], "close": None}
    async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None, ping_interval=None) as ws:
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["type"] == "session.created"
        finished = asyncio.Event()

        async def read():
            committed = False
            try:
                async for raw in ws:
                    event = json.loads(raw)
                    kind = event["type"]
                    got["types"].append(kind)
                    if kind == "error":
                        got["errors"].append(event)
                    elif kind == "response.output_audio_transcript.delta":
                        got["text"] += event["delta"]
                    elif kind == "response.output_audio.delta":
                        got["audio"] += base64.b64decode(event["delta"])
                    elif kind == "conversation.item.input_audio_transcription.delta":
                        got["transcript"] += event["delta"]
                    elif kind == "input_audio_buffer.committed":
                        committed = True
                    elif kind == "response.done" and committed:
                        finished.set()
                        return
            except websockets.ConnectionClosed as e:
                got["close"] = f"code {e.rcvd.code if e.rcvd else None}"
            finished.set()

        reader = asyncio.create_task(read())
        await ws.send(json.dumps({"type": "session.update", "event_id": "other-update", "session": OTHER}))
        chunks = range(0, len(pcm), 1280)
        deadline = time.monotonic() + 3 * WAIT
        for n, i in enumerate(chunks):
            while progress() < (n + 1) / (len(chunks) + 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": f"other-{n}",
                                      "audio": b64(pcm[i:i + 1280])}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "other-commit"}))
        try:
            await asyncio.wait_for(finished.wait(), WAIT)
        except asyncio.TimeoutError:
            got["close"] = got["close"] or "no response.done after the commit"
        reader.cancel()
    return got


async def fuzz(address: str, pcm: np.ndarray) -> tuple[FuzzRun, dict, dict]:
    run = FuzzRun(address)
    fuzzer = Fuzzer(random.Random(SEED), pcm)
    other = asyncio.create_task(other_session(address, pcm, lambda: run.sent / N_EVENTS))
    conn = await run.connect(started=False)
    started = False
    index = 0
    while index < N_EVENTS:
        run.batch += 1
        batch_end = min(index + BATCH, N_EVENTS)
        alive = True
        while index < batch_end:
            if index == PRE_START and not started:
                # every fixed field back to C0, then the append that starts the session
                reset = Case(index, "session.update valid: reset to C0 before the start",
                             json.dumps({"type": "session.update", "event_id": f"fz{index}", "session": C0}),
                             f"fz{index}", False)
                start = Case(index + 1, "append valid: the start", json.dumps({
                    "type": "input_audio_buffer.append", "event_id": f"fz{index + 1}",
                    "audio": b64(pcm[:1280])}), f"fz{index + 1}", False, samples=1280)
                for case in (reset, start):
                    alive = await run.send(conn, case) and alive
                index += 2
                run.sent = index
                started = True
                continue
            case = fuzzer.make(index, started)
            alive = await run.send(conn, case) and alive
            index += 1
            run.sent = index
            if not alive:
                break
        if not (alive and await run.barrier(conn)):
            conn.died_in_batch = run.batch
            try:
                await asyncio.wait_for(conn.closed.wait(), 5)
            except asyncio.TimeoutError:
                pass
            run.deaths.append({"conn": conn.index, "batch": run.batch, "close": conn.close,
                               "last_errors": [e for c, b, e in run.errors if c == conn.index][-3:],
                               "batch_events": [c.summary(120) for c in run.cases
                                                if c.conn == conn.index and c.batch == run.batch][-60:]})
            if not conn.closed.is_set():
                await conn.ws.close()
            run.batch += 1
            conn = await run.connect(started)
            index = batch_end  # the rest of the batch is skipped
    # the final exchange on the fuzzed connection: a valid update, audio, a commit
    run.batch += 1
    final = [Case(-2, "final: update", json.dumps({"type": "session.update", "event_id": "final-update", "session": {
        "type": "realtime", "audio": {"output": {"format": {"type": "audio/pcm", "rate": 22050}}}}}),
        "final-update", False)]
    for n in range(3):
        final.append(Case(-2, "final: append", json.dumps({"type": "input_audio_buffer.append",
                                                           "event_id": f"final-append-{n}",
                                                           "audio": b64(pcm[n * 1280:(n + 1) * 1280])}),
                          f"final-append-{n}", False, samples=1280))
    final.append(Case(-2, "final: commit", json.dumps({"type": "input_audio_buffer.commit",
                                                       "event_id": "final-commit"}), "final-commit", False,
                      commit=True))
    for case in final:
        await run.send(conn, case)
    outcome = {"ok": False, "why": ""}
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and not conn.closed.is_set():
        committed = [i for i, t in enumerate(conn.types) if t == "input_audio_buffer.committed"]
        if len(committed) >= conn.commits_sent and "response.done" in conn.types[committed[-1]:]:
            outcome["ok"] = True
            break
        await asyncio.sleep(0.02)
    if not outcome["ok"]:
        outcome["why"] = (f"connection {conn.close}" if conn.closed.is_set() else
                          f"{conn.types.count('input_audio_buffer.committed')} of {conn.commits_sent} commits "
                          f"answered within {WAIT:.0f} s")
    await run.barrier(conn)  # any error the final events caused is in
    outcome["still_open"] = not conn.closed.is_set()
    await conn.ws.close()
    for c in run.conns:
        if c.reader is not None:
            await asyncio.wait_for(asyncio.shield(c.reader), WAIT)
    return run, await asyncio.wait_for(other, 3 * WAIT), outcome


def judge(run: FuzzRun) -> tuple[dict[str, list], dict]:
    """Match errors to events; the problems found, by category, and a per-kind table."""
    ids = {c.event_id for c in run.cases if c.event_id}
    by_id: dict[str, list] = collections.defaultdict(list)
    anon: collections.Counter = collections.Counter()
    anon_examples: dict = collections.defaultdict(list)
    anon_cases: dict = collections.defaultdict(list)
    for conn, batch, event in run.errors:
        eid = (event.get("error") or {}).get("event_id")
        if isinstance(eid, str) and eid in ids:
            by_id[eid].append(event)
        else:
            anon[(conn, batch)] += 1
            anon_examples[(conn, batch)].append(event)
    dead = {(c.index, c.died_in_batch) for c in run.conns if c.died_in_batch is not None}
    problems: dict[str, list] = collections.defaultdict(list)
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    expected_anon: collections.Counter = collections.Counter()
    for c in run.cases:
        key = (c.conn, c.batch)
        row = table[c.kind]
        row["n"] += 1
        if key in dead:
            row["not judged (connection died)"] += 1
            continue
        got = by_id.get(c.event_id, []) if c.event_id else []
        codes = [(e.get("error") or {}).get("code") for e in got]
        if c.bad:
            if c.event_id is None or (not got and c.id_optional):
                expected_anon[key] += 1
                anon_cases[key].append(c.kind)
                row["counted"] += 1
            elif not got:
                row["NO ERROR"] += 1
                problems["bad event got no error"].append(c.summary())
            elif len(got) > 1:
                row["SEVERAL ERRORS"] += 1
                problems["bad event got more than one error"].append(f"{c.summary()} -> {codes}")
            elif codes[0] not in c.codes:
                row["WRONG CODE"] += 1
                row[f"code {codes[0]}"] += 1
                problems["bad event got an unexpected code"].append(
                    f"{c.summary()} -> {codes[0]}: {got[0]['error'].get('message', '')[:200]} "
                    f"(expected one of {sorted(c.codes)})")
            else:
                row["ok"] += 1
            for e in got:
                err = e.get("error") or {}
                if not (err.get("message") and err.get("type") and "event_id" in e):
                    problems["error event without message/type/event_id"].append(json.dumps(e)[:300])
        elif got:
            row["ERROR ON A VALID EVENT"] += 1
            for e in got:
                problems["valid event got an error"].append(
                    f"{c.summary()} -> {e['error'].get('code')}: {e['error'].get('message', '')[:200]}")
        else:
            row["ok"] += 1
    for key in sorted(set(anon) | set(expected_anon)):
        if key in dead:
            continue
        if anon[key] != expected_anon[key]:
            problems["anonymous errors do not match the events without a readable event_id"].append(
                f"connection {key[0]} batch {key[1]}: {anon[key]} errors without a known event_id, "
                f"{expected_anon[key]} expected ({dict(collections.Counter(anon_cases[key]))}); got " +
                "; ".join(f"{(e.get('error') or {}).get('code')} (event_id "
                          f"{str((e.get('error') or {}).get('event_id'))[:40]!r})" for e in anon_examples[key][:12]))
    return problems, table


def format_report(problems, table, crashes, log_failures, run, other_problems, outcome) -> str:
    lines = []
    if crashes:
        lines.append(f"== {len(crashes)} exceptions escaped a connection")
        for c in crashes[:10]:
            lines.append(f"- {c['where']}: {c['exception']} on event {c.get('event', '?')}")
            lines.extend("    " + line for line in c["traceback"].strip().splitlines()[-4:])
    if log_failures:
        lines.append(f"== {len(log_failures)} unhandled exceptions in the server log")
        lines.extend("- " + f[:800] for f in log_failures[:6])
    if run.deaths:
        lines.append(f"== the fuzzed connection died {len(run.deaths)} times")
        for d in run.deaths[:10]:
            last = [f"{(e.get('error') or {}).get('code')}" for e in d["last_errors"]]
            lines.append(f"- connection {d['conn']} in batch {d['batch']}: {d['close']}; last errors {last}")
    if not outcome.get("ok") or not outcome.get("still_open") or len(run.conns) != 1:
        lines.append(f"== the final exchange: ok={outcome.get('ok')} {outcome.get('why', '')} "
                     f"still open={outcome.get('still_open')} connections used={len(run.conns)}")
    if other_problems:
        lines.append("== the other session")
        lines.extend("- " + p for p in other_problems)
    for name, items in problems.items():
        lines.append(f"== {name}: {len(items)}")
        lines.extend("- " + i for i in items[:12])
    bad_rows = {k: v for k, v in table.items()
                if any(x in v for x in ("NO ERROR", "SEVERAL ERRORS", "WRONG CODE", "ERROR ON A VALID EVENT"))}
    if bad_rows:
        lines.append("== per kind (only kinds with problems)")
        for kind in sorted(bad_rows):
            lines.append(f"- {kind}: {dict(bad_rows[kind])}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def question() -> np.ndarray:
    pcm, sr = sf.read(EXAMPLE, dtype="int16")
    assert sr == 16000
    return pcm


def test_fuzzed_connection_beside_a_streaming_session(model, question, monkeypatch):
    crashes: list[dict] = []
    instrument(monkeypatch, crashes)
    logs = ErrorLog()
    started = time.monotonic()
    with serve(model, clock=0) as (address, _):
        # after serve(): uvicorn's dictConfig has replaced the handlers of its loggers by then
        loggers = [logging.getLogger(n) for n in ("", "nvchat_torch.server", "nvchat_torch", "uvicorn",
                                                   "uvicorn.error", "starlette", "fastapi", "asyncio")]
        for logger in loggers:
            logger.addHandler(logs)
        try:
            run, other, outcome = asyncio.run(fuzz(address, question))
        finally:
            for logger in loggers:
                logger.removeHandler(logs)
    elapsed = time.monotonic() - started

    ref, events, audio = reference(model, question, deterministic=True, seed=0)
    other_problems = []
    if other["errors"] or other["close"]:
        other_problems.append(f"errors {[(e['error'].get('code'), e['error'].get('message')) for e in other['errors']]}"
                              f", close {other['close']}")
    if other["text"] != deltas(events, released=False):
        other_problems.append(f"text {other['text']!r} != {deltas(events, released=False)!r}")
    if other["transcript"] != deltas(events, "user_transcript_delta"):
        other_problems.append(f"transcript {other['transcript']!r} != {deltas(events, 'user_transcript_delta')!r}")
    try:
        assert_same_pcm(other["audio"], audio)
    except AssertionError:
        other_problems.append(f"audio differs: {len(other['audio']) // 2} samples, {len(audio)} expected")

    problems, table = judge(run)
    n_bad = sum(c.bad for c in run.cases)
    summary = (f"seed {SEED}: {len(run.cases)} events ({n_bad} bad), {run.bytes_sent / 2 ** 20:.1f} MiB sent, "
               f"{run.bytes_received / 2 ** 20:.1f} MiB received, {len(run.errors)} errors, {elapsed:.1f} s")
    print(summary)
    report = format_report(problems, table, crashes, logs.failures(), run, other_problems, outcome)
    if os.environ.get("NVCHAT_FUZZ_REPORT"):
        with open(os.environ["NVCHAT_FUZZ_REPORT"], "w") as f:
            json.dump({"summary": summary, "crashes": crashes, "log_failures": logs.failures(),
                       "deaths": run.deaths, "outcome": outcome, "other": other_problems,
                       "codes": collections.Counter((e.get("error") or {}).get("code") for _, _, e in run.errors),
                       "problems": problems, "table": {k: dict(v) for k, v in table.items()}}, f, indent=1,
                      default=str)
    assert not report, summary + "\n" + report
    assert ref.text and other["audio"]


# Values a session.update currently passes through to StreamingOptions/the engine: they must either be
# refused as a client error, or run; never kill the session once audio starts.
@pytest.mark.parametrize("session", [
    pytest.param({"nvchat": {"seed": 2 ** 64}}, id="seed-2**64"),
    pytest.param({"nvchat": {"seed": -(2 ** 63) - 1}}, id="seed--2**63-1"),
    pytest.param({"nvchat": {"max_streaming_seconds": float("inf")}}, id="max_streaming_seconds-Infinity"),
    pytest.param({"nvchat": {"max_streaming_seconds": 1e308}}, id="max_streaming_seconds-1e308"),
    pytest.param({"nvchat": {"max_streaming_seconds": 10 ** 400}}, id="max_streaming_seconds-10**400"),
    pytest.param({"instructions": "hello " * 140_000}, id="instructions-over-the-context"),
])
def test_a_session_update_the_server_takes_does_not_kill_the_session(model, question, session, monkeypatch):
    crashes: list[dict] = []
    instrument(monkeypatch, crashes)

    async def run(address):
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None, ping_interval=None) as ws:
            await asyncio.wait_for(ws.recv(), WAIT)
            await ws.send(json.dumps({"type": "session.update", "event_id": "u", "session": {
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
                **session}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": "a",
                                      "audio": b64(question[:2560])}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c"}))
            seen = []
            try:
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
                    seen.append((event["type"], (event.get("error") or {}).get("code"),
                                 (event.get("error") or {}).get("event_id"),
                                 (event.get("error") or {}).get("message", "")[:300]))
                    if event["type"] == "response.done" or (event["type"] == "error" and
                                                            event["error"].get("event_id") in ("u", "a", "c")):
                        break
                # still usable
                await ws.send(json.dumps({"type": BARRIER_TYPE, "event_id": "p"}))
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
                    seen.append((event["type"], (event.get("error") or {}).get("code"),
                                 (event.get("error") or {}).get("event_id"),
                                 (event.get("error") or {}).get("message", "")[:300]))
                    if event["type"] == "error" and event["error"].get("event_id") == "p":
                        return seen, None
            except websockets.ConnectionClosed as e:
                return seen, f"closed with {e.rcvd.code if e.rcvd else None}"

    with serve(model, clock=0) as (address, _):
        seen, closed = asyncio.run(run(address))
    errors = [s for s in seen if s[0] == "error"]
    assert closed is None and not any(e[1] == "session_failed" for e in errors) and not crashes, \
        f"connection {closed}; errors {errors}; crashes {crashes}"
