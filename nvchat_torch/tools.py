"""Tool calls: the tools in the system prompt, calls parsed from the function channel, results fed back.

The format is the one the checkpoint was trained on, from NVIDIA's NeMo ``nemotron-labs-voicechat``
branch. :class:`ToolChannel` is the per-session state the streaming session drives: it parses calls
from the function ids the frame loop already reads, and keeps the queue of forced ids
(:meth:`StreamingSession.force_tokens`, tool results), which it substitutes on the device.
Design and format: docs/tools.md, "The API".
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .events import VoiceChatEvent
from .tool_prompt import (CALL_END, CALL_START, MAX_TOOLS, RESPONSE_END, TOOL_SYSTEM_MESSAGE, format_tool_response,
                          render_system_prompt, response_text, tool_result_json, validate_tools)

__all__ = [
    "TOOL_SYSTEM_MESSAGE",
    "MAX_TOOLS",
    "CALL_START",
    "CALL_END",
    "RESPONSE_END",
    "validate_tools",
    "render_system_prompt",
    "parse_tool_calls",
    "format_tool_response",
    "tool_result_json",
    "ToolChannel",
]

# --------------------------------------------------------------------------------------
# Calls and results


def parse_tool_calls(text: str) -> list[tuple[str, dict]]:
    """The ``(name, arguments)`` calls in the decoded text of one call span: ``<TOOLCALL>`` JSON
    ``</TOOLCALL>`` (the tags may be missing), one object or a list; ``arguments`` a dict, a JSON
    string of one, or absent (``{}``). Raises ``ValueError`` with the reason when it is malformed."""
    body = text.strip()
    if "<TOOLCALL>" in body:
        body = body.split("<TOOLCALL>", 1)[1]
    body = body.split("</TOOLCALL>", 1)[0].strip()
    if not body:
        raise ValueError("the call span holds no JSON")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"the call is not valid JSON ({e})") from None
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("the call list is empty")
    calls = []
    for i, item in enumerate(items):
        where = f"call {i}" if isinstance(value, list) else "the call"
        if not isinstance(item, dict):
            raise ValueError(f"{where} is not a JSON object: {item!r}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} has no string 'name'")
        arguments = item.get("arguments")
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} ({name}): the arguments string is not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where} ({name}): arguments must be a JSON object, got {arguments!r}")
        calls.append((name, arguments))
    return calls


def _unchanged(text: str) -> str:
    return text


def _token_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"the tokenizer has no {token} token, which tool calls need "
                         f"(the VoiceChat tokenizer has <SPECIAL_20> and <SPECIAL_21>)")
    return token_id


# --------------------------------------------------------------------------------------
# The session's function channel


@dataclass
class _Span:
    """The calls of one closed span and their results, in call order."""

    call_ids: list[str]
    results: dict[str, str] = field(default_factory=dict)  # call_id -> serialised result


class ToolChannel:
    """What a streaming session does with its output channels beyond decoding them.

    * Parsing (when tools were given): :meth:`feed` takes each frame's function id (read from the
      frame's one host read) and returns ``tool_call`` / ``tool_call_error`` events when a span closes.
    * Forcing: :meth:`force` queues ids that replace the model's outputs, one per frame per channel;
      :meth:`apply` substitutes the current frame's on the device (``torch.where`` on a table uploaded
      when the queue changes), so no host read is added and an empty queue costs nothing.
    * Results: :meth:`send_result` collects them; when every call of a span has one, the tokenised
      ``<TOOL_RESPONSE>`` is queued on the function channel with the text channel held at PAD.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping] | None, *, pad_id: int, vocab_size: int,
                 device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.device = device
        self.tool_names = [d["name"] for d in validate_tools(tools)]
        self.parsing = bool(self.tool_names)
        if self.parsing:
            self.start_id = _token_id(tokenizer, CALL_START)
            self.end_id = _token_id(tokenizer, CALL_END)
        self._open: list[int] | None = None  # ids of the open span (PAD dropped)
        self._calls = 0
        self._spans: dict[str, _Span] = {}  # call_id -> its span, until answered
        self._answered: set[str] = set()
        # Forced ids per channel, front = next frame; None = the model's own output.
        self._text: deque[int | None] = deque()
        self._function: deque[int | None] = deque()
        self._injected: deque[bool] = deque()  # per queued function id: part of a tool result (not parsed)
        self._injected_now = False
        # What the response text becomes before it is tokenised (the tool pipeline spells its numbers), and
        # whether its tokens' frames hold the text at PAD here (the pipeline's steps force PAD themselves).
        self.transform_response: Callable[[str], str] = _unchanged
        self.pad_text_while_injecting = True

    # ---- forcing
    @property
    def forcing(self) -> bool:
        return bool(self._text or self._function)

    def force(self, channel: str, ids: Any) -> None:
        """Queue ``ids`` to replace the model's ``channel`` ("text" or "function") outputs, one per frame."""
        if channel not in ("text", "function"):
            raise ValueError(f"channel must be 'text' or 'function', got {channel!r}")
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        elif hasattr(ids, "tolist"):  # numpy
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"ids must be a list of token ids, got {type(ids).__name__}")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"token ids must be ints in [0, {self.vocab_size}), got {i!r}")
        if channel == "text":
            self._text.extend(ids)
        else:
            self._function.extend(ids)
            self._injected.extend([False] * len(ids))

    def _inject(self, ids: list[int]) -> None:
        """Queue a tool result on the function channel with the text channel at PAD for those frames."""
        start = len(self._function)
        self._function.extend(ids)
        self._injected.extend([True] * len(ids))
        if not self.pad_text_while_injecting:
            return
        while len(self._text) < start:
            self._text.append(None)
        for j in range(len(ids)):
            if start + j < len(self._text):
                self._text[start + j] = self.pad_id
            else:
                self._text.append(self.pad_id)

    def take_forced(self, text_too: bool = True) -> tuple[int, int, int, int]:
        """This frame's forced ids, taken off the queues as host ints, which ride in the frame step's one
        upload: ``(text id, function id, text forced, function forced)``; a channel not forced keeps the
        model's id (its value is then 0 and unused). ``text_too=False``: the step forces its text itself,
        and a queued text id waits for the next."""
        text = self._text.popleft() if self._text and text_too else None
        function = None
        self._injected_now = False
        if self._function:
            function = self._function.popleft()
            self._injected_now = self._injected.popleft()
        return (0 if text is None else text, 0 if function is None else function,
                int(text is not None), int(function is not None))

    # ---- parsing
    def feed(self, token_id: int, frame_index: int) -> list[VoiceChatEvent]:
        """The events of this frame's function id (after any substitution)."""
        injected, self._injected_now = self._injected_now, False
        if not self.parsing or injected:  # a tool result is the user's text, not a call
            return []
        if token_id == self.start_id:
            events = []
            if self._open is not None:
                events.append(self._error(frame_index, self._open, "a new call started before this one closed"))
            self._open = []
            return events
        if self._open is None:
            return []
        if token_id == self.end_id:
            span, self._open = self._open, None
            return self._close(span, frame_index)
        if token_id != self.pad_id:
            self._open.append(token_id)
        return []

    def finish(self, frame_index: int) -> list[VoiceChatEvent]:
        """At the end of the stream: a ``tool_call_error`` for a call span still open (never closed)."""
        if self._open is None:
            return []
        span, self._open = self._open, None
        return [self._error(frame_index, span, "the stream ended inside a tool call (its closing token never came)")]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _error(self, frame_index: int, ids: list[int], reason: str, name: str | None = None) -> VoiceChatEvent:
        return VoiceChatEvent("tool_call_error", frame_index, text=self._decode(ids), name=name, reason=reason)

    def _close(self, ids: list[int], frame_index: int) -> list[VoiceChatEvent]:
        text = self._decode(ids)
        try:
            calls = parse_tool_calls(text)
        except ValueError as e:
            return [VoiceChatEvent("tool_call_error", frame_index, text=text, reason=str(e))]
        events, span = [], _Span([])
        for name, arguments in calls:
            if name not in self.tool_names:
                events.append(VoiceChatEvent("tool_call_error", frame_index, text=text, name=name,
                                             arguments=arguments,
                                             reason=f"the model called {name!r}, which is not among the "
                                                    f"tools offered ({', '.join(self.tool_names)})"))
                continue
            self._calls += 1
            call_id = f"call_{self._calls}"
            span.call_ids.append(call_id)
            self._spans[call_id] = span
            events.append(VoiceChatEvent("tool_call", frame_index, text=text, call_id=call_id, name=name,
                                         arguments=arguments))
        return events

    # ---- results
    def send_result(self, call_id: str, output: Any) -> None:
        """Record the result of ``call_id``; once its span has all of them, queue the response."""
        if call_id in self._answered:
            raise ValueError(f"the call {call_id!r} has already been answered")
        span = self._spans.get(call_id)
        if span is None:
            raise ValueError(f"unknown call_id {call_id!r} (no tool_call event had it)")
        span.results[call_id] = tool_result_json(output)
        self._answered.add(call_id)
        del self._spans[call_id]
        if len(span.results) == len(span.call_ids):
            text = self.transform_response(response_text([span.results[c] for c in span.call_ids]))
            self._inject(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def awaiting(self) -> list[str]:
        """The call ids still waiting for a result."""
        return list(self._spans)

    # ---- what turn-taking holds (nvchat_torch.turn_taking): read before a frame
    @property
    def in_call(self) -> bool:
        """A call span is open: its start token came, its end token not yet."""
        return self._open is not None

    @property
    def injecting(self) -> bool:
        """Tool-result ids are still queued on the function channel."""
        return any(self._injected)

    @property
    def text_forced(self) -> bool:
        """The next frame's text id is forced (``force`` or a result's PAD)."""
        return bool(self._text) and self._text[0] is not None
