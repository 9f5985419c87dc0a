"""The OpenAI Realtime GA session values this server takes without acting on them, as a small schema.

Written from the ``openai`` SDK's request types (``openai.types.realtime``:
``RealtimeSessionCreateRequestParam`` and the audio input/output, transcription, noise-reduction and
turn-detection params; the MCP conversation items' ``RealtimeMcp*Param``). :func:`check` raises
:class:`ValueError` subclasses naming the path: an unknown key (:class:`UnknownKey`) or a value of the
wrong kind. Numbers exclude booleans, as JSON does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UnknownKey", "Schema", "Obj", "Str", "Num", "Int", "Bool", "Const", "ListOf", "OneOf", "AnyJSON", "check",
           "PASS_THROUGH", "MCP_ITEMS", "show"]


class UnknownKey(ValueError):
    def __init__(self, path: str, allowed: list[str]):
        super().__init__(f"unknown parameter {path}; it takes {', '.join(allowed) or 'no keys'}")
        self.path = path


def show(value: Any, limit: int = 60) -> str:
    """A client value for an error message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class Schema:
    nullable: bool = False  # null is allowed too

    def validate(self, value: Any, path: str) -> None:
        raise NotImplementedError

    def fail(self, value: Any, path: str, what: str) -> None:
        raise ValueError(f"{path} must be {what}, got {show(value)}")


@dataclass
class Str(Schema):
    enum: tuple[str, ...] | None = None  # the strings allowed; None: any string
    nullable: bool = False  # null is allowed too

    def validate(self, value, path):
        if not isinstance(value, str) or (self.enum is not None and value not in self.enum):
            self.fail(value, path, "a string" if self.enum is None else f"one of {', '.join(map(repr, self.enum))}")


@dataclass
class Num(Schema):
    lo: float = -math.inf  # the smallest value allowed
    hi: float = math.inf  # the largest value allowed
    integer: bool = False  # ints only
    nullable: bool = False  # null is allowed too

    def validate(self, value, path):
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not self.lo <= value <= self.hi:
            span = "" if math.isinf(self.lo) and math.isinf(self.hi) else f" in [{self.lo:g}, {self.hi:g}]"
            self.fail(value, path, ("an integer" if self.integer else "a number") + span)


def Int(lo: float = -math.inf, hi: float = math.inf, nullable: bool = False) -> Num:
    return Num(lo, hi, integer=True, nullable=nullable)


@dataclass
class Bool(Schema):
    def validate(self, value, path):
        if not isinstance(value, bool):
            self.fail(value, path, "true or false")


@dataclass
class AnyJSON(Schema):
    """Any object (free-form: metadata, prompt variables)."""
    nullable: bool = False  # null is allowed too

    def validate(self, value, path):
        if not isinstance(value, dict):
            self.fail(value, path, "an object")


@dataclass
class Const(Schema):
    """Exactly this JSON value (``["audio"]``, ``false``)."""
    value: Any  # the one value allowed, its type included

    def validate(self, value, path):
        if value != self.value or type(value) is not type(self.value):
            self.fail(value, path, repr(self.value))


@dataclass
class ListOf(Schema):
    item: Schema  # every item's schema
    nullable: bool = False  # null is allowed too

    def validate(self, value, path):
        if not isinstance(value, list):
            self.fail(value, path, "a list")
        for i, v in enumerate(value):
            check(v, self.item, f"{path}[{i}]")


@dataclass
class Obj(Schema):
    fields: dict[str, Schema]  # the keys allowed, each with its value's schema
    required: tuple[str, ...] = ()  # the keys that must be there
    nullable: bool = False  # null is allowed too

    def validate(self, value, path):
        if not isinstance(value, dict):
            self.fail(value, path, "an object")
        for key in value:
            if key not in self.fields:
                raise UnknownKey(f"{path}.{show(key, 40)[1:-1]}", sorted(self.fields))
        for key in self.required:
            if key not in value:
                raise ValueError(f"{path} needs {key!r}")
        for key, v in value.items():
            check(v, self.fields[key], f"{path}.{key}")


@dataclass
class OneOf(Schema):
    """A string constant or one of several objects, told apart by the first that fits."""
    options: list[Schema] = field(default_factory=list)  # the forms, tried in order
    nullable: bool = False  # null is allowed too

    def validate(self, value, path):
        errors = []
        for option in self.options:
            try:
                check(value, option, path)
                return
            except UnknownKey:
                if isinstance(option, Obj) and _tagged(option, value):
                    raise  # the right variant with a wrong key: say so
            except ValueError as e:
                if isinstance(option, Obj) and _tagged(option, value):
                    raise
                errors.append(str(e))
        raise ValueError(f"{path}: {show(value)} is none of its forms ({'; '.join(errors)})")


def _tagged(option: Obj, value: Any) -> bool:
    """``value`` names this variant by its ``type`` constant."""
    tag = option.fields.get("type")
    return isinstance(value, dict) and isinstance(tag, Str) and tag.enum is not None and value.get("type") in tag.enum


def check(value: Any, schema: Schema, path: str) -> None:
    if value is None:
        if schema.nullable:
            return
        raise ValueError(f"{path} may not be null")
    schema.validate(value, path)


_EFFORT = ("minimal", "low", "medium", "high", "xhigh")
_SERVER_VAD = Obj({"type": Str(("server_vad",)), "create_response": Bool(), "idle_timeout_ms": Int(0, nullable=True),
                   "interrupt_response": Bool(), "prefix_padding_ms": Int(0), "silence_duration_ms": Int(0),
                   "threshold": Num(0.0, 1.0)}, required=("type",))
_SEMANTIC_VAD = Obj({"type": Str(("semantic_vad",)), "create_response": Bool(),
                     "eagerness": Str(("low", "medium", "high", "auto")), "interrupt_response": Bool()},
                    required=("type",))

# GA session paths (below ``session``) the server accepts as given and shows in session.updated.
PASS_THROUGH: dict[str, Schema] = {
    "model": Str(),
    "include": ListOf(Str(("item.input_audio_transcription.logprobs",))),
    "max_output_tokens": OneOf([Str(("inf",)), Int(1, 4096)]),
    "parallel_tool_calls": Bool(),
    "prompt": Obj({"id": Str(), "variables": AnyJSON(nullable=True), "version": Str(nullable=True)},
                  required=("id",), nullable=True),
    "reasoning": Obj({"effort": Str(_EFFORT)}),
    "tracing": OneOf([Str(("auto",)), Obj({"group_id": Str(), "metadata": AnyJSON(), "workflow_name": Str()})],
                     nullable=True),
    "truncation": OneOf([Str(("auto", "disabled")),
                         Obj({"type": Str(("retention_ratio",)), "retention_ratio": Num(0.0, 1.0),
                              "token_limits": Obj({"post_instructions": Int(0)})},
                             required=("type", "retention_ratio"))]),
    "audio.input.noise_reduction": Obj({"strength": Num(), "type": Str(("near_field", "far_field"))}, nullable=True),
    "audio.input.transcription": Obj({"delay": Str(_EFFORT), "keywords": ListOf(Str()), "language": Str(),
                                      "languages": ListOf(Str()), "model": Str(), "prompt": Str()}, nullable=True),
    # ``false``: what pipecat sends for "no server turn detection" (its manual mode), as null
    "audio.input.turn_detection": OneOf([_SERVER_VAD, _SEMANTIC_VAD, Const(False)], nullable=True),
    "output_modalities": OneOf([Const(["audio"]), Const(["text"])]),
    "tool_choice": OneOf([Str(("auto", "none", "required")),
                          Obj({"type": Str(("function",)), "name": Str()}, required=("type", "name")),
                          Obj({"type": Str(("mcp",)), "server_label": Str(), "name": Str(nullable=True)},
                              required=("type", "server_label"))]),
    "audio.output.voice": OneOf([Str(), Obj({"id": Str()}, required=("id",))]),
    "audio.output.speed": Num(0.25, 1.5),
}

# The GA MCP conversation items a client may create (``RealtimeMcp*Param``). This server has no MCP
# tools: they are recorded, not used (items.py). ``id`` is optional here, as for every item: the
# server names an item created without one.
_MCP_ERROR = OneOf([Obj({"type": Str(("protocol_error",)), "code": Int(), "message": Str()},
                        required=("type", "code", "message")),
                    Obj({"type": Str(("tool_execution_error",)), "message": Str()}, required=("type", "message")),
                    Obj({"type": Str(("http_error",)), "code": Int(), "message": Str()},
                        required=("type", "code", "message"))], nullable=True)
_ITEM_HEAD = {"id": Str()}
MCP_ITEMS: dict[str, Obj] = {
    "mcp_approval_response": Obj({**_ITEM_HEAD, "type": Str(("mcp_approval_response",)), "approval_request_id": Str(),
                                  "approve": Bool(), "reason": Str(nullable=True)},
                                 required=("type", "approval_request_id", "approve")),
    "mcp_list_tools": Obj({**_ITEM_HEAD, "type": Str(("mcp_list_tools",)), "server_label": Str(),
                           "tools": ListOf(Obj({"input_schema": AnyJSON(), "name": Str(),
                                                "annotations": AnyJSON(nullable=True),
                                                "description": Str(nullable=True)},
                                               required=("input_schema", "name")))},
                          required=("type", "server_label", "tools")),
    "mcp_call": Obj({**_ITEM_HEAD, "type": Str(("mcp_call",)), "arguments": Str(), "name": Str(),
                     "server_label": Str(), "approval_request_id": Str(nullable=True), "error": _MCP_ERROR,
                     "output": Str(nullable=True)}, required=("type", "arguments", "name", "server_label")),
    "mcp_approval_request": Obj({**_ITEM_HEAD, "type": Str(("mcp_approval_request",)), "arguments": Str(),
                                 "name": Str(), "server_label": Str()},
                                required=("type", "arguments", "name", "server_label")),
}
