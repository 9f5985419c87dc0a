"""The GA conversation as a list of items, for :class:`~nvchat_torch.server.app.Connection`: the
``conversation.item.*`` client events and the ``conversation.item.added`` / ``.done`` server events.

The model is full duplex and hears audio only, so items are mostly a record for the client. What
the model hears of a client's ``message`` item is decided here.
Design: docs/server.md, "Conversation items: what the model hears".
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from .conversation_state import ToolResultRequest, new_id
from .ga_schema import MCP_ITEMS, UnknownKey, check, show
from .session_config import ClientError

__all__ = ["ItemEvents", "MAX_ITEMS", "render_message"]

MAX_ITEMS = 1024  # items kept for retrieve/truncate/delete per connection; the oldest are forgotten
MAX_SPOKEN = 64  # assistant items whose transcript can be cut at a playback position (the latest ones)
MESSAGE_ROLES = ("user", "assistant", "system")
TEXT_PARTS = ("input_text", "output_text", "text")
OTHER_PARTS = ("input_audio", "output_audio", "audio", "input_image")
PART_KEYS = frozenset({"type", "text", "audio", "transcript", "image_url", "detail"})
ITEM_KEYS = frozenset({"id", "object", "type", "status", "role", "content", "call_id", "name", "arguments", "output"})


def render_message(role: str, text: str) -> str:
    """A message's text as it is added to the prompt before the conversation starts: a system
    message as it is, a user or assistant message as a line naming its speaker."""
    return text if role == "system" else f"{role.capitalize()}: {text}"


def _message_text(item: dict) -> str:
    return "\n".join(part["text"] for part in item.get("content") or []
                     if part.get("type") in TEXT_PARTS and part.get("text"))


def _check_item(item: Any) -> dict:
    """A GA item the client may create (message, function_call, function_call_output, the MCP items),
    or a ClientError."""
    if not isinstance(item, dict):
        raise ClientError("invalid_value", "conversation.item.create needs an 'item' object", "item")
    if isinstance(item.get("type"), str) and item["type"] in MCP_ITEMS:
        try:
            check(item, MCP_ITEMS[item["type"]], "item")
        except UnknownKey as e:
            raise ClientError("unknown_parameter", str(e), e.path) from None
        except ValueError as e:
            raise ClientError("invalid_value", str(e), "item") from None
        return item
    for key in item:
        if key not in ITEM_KEYS:
            raise ClientError("unknown_parameter", f"unknown parameter item.{show(key, 40)[1:-1]}; an item takes "
                              f"{', '.join(sorted(ITEM_KEYS))}", f"item.{show(key, 40)[1:-1]}")
    kind = item.get("type")
    if "id" in item and not isinstance(item["id"], str):
        raise ClientError("invalid_value", f"item.id must be a string, got {show(item['id'])}", "item.id")
    if kind == "message":
        if item.get("role") not in MESSAGE_ROLES:
            raise ClientError("invalid_value", f"item.role must be one of {', '.join(MESSAGE_ROLES)}, got "
                              f"{show(item.get('role'))}", "item.role")
        content = item.get("content", [])
        if not isinstance(content, list):
            raise ClientError("invalid_value", "item.content must be a list of content parts", "item.content")
        for i, part in enumerate(content):
            where = f"item.content[{i}]"
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS + OTHER_PARTS:
                raise ClientError("invalid_value", f"{where} must be a content part with a type of "
                                  f"{', '.join(TEXT_PARTS + OTHER_PARTS)}, got {show(part)}", where)
            for key, value in part.items():
                if key not in PART_KEYS:
                    raise ClientError("unknown_parameter", f"unknown parameter {where}.{show(key, 40)[1:-1]}",
                                      f"{where}.{show(key, 40)[1:-1]}")
                if key != "type" and value is not None and not isinstance(value, str):
                    raise ClientError("invalid_value", f"{where}.{key} must be a string", f"{where}.{key}")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise ClientError("invalid_value", "function_call_output needs string 'call_id' and 'output'", "item")
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key, ""), str):
                raise ClientError("invalid_value", f"item.{key} must be a string", f"item.{key}")
    else:
        raise ClientError("invalid_value", f"item.type must be message, function_call, function_call_output or "
                          f"one of {', '.join(MCP_ITEMS)}, got {show(kind)}", "item.type")
    return item


def _nonneg_int(event: dict, key: str) -> int:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ClientError("invalid_value", f"'{key}' must be a non-negative integer, got {show(value)}", key)
    return value


class ItemEvents:
    """Mixed into ``Connection``: the conversation's items and their events. Uses the connection's
    ``send``, ``scheduler``, ``handle``, ``config`` and ``client_event_id``."""

    handle: int | None
    scheduler: Any
    config: Any
    client_event_id: str | None

    def _init_items(self) -> None:
        self.items: OrderedDict[str, dict] = OrderedDict()
        # Per assistant item, how much of its transcript had been said at each audio delta's end:
        # [(audio_ms, transcript characters)], so a truncation cuts the transcript where playback stopped.
        self.spoken: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()

    def _spoken(self, item_id: str, audio_ms: int, chars: int) -> None:
        marks = self.spoken.setdefault(item_id, [])
        marks.append((audio_ms, chars))
        self.spoken.move_to_end(item_id)
        while len(self.spoken) > MAX_SPOKEN:
            self.spoken.popitem(last=False)

    async def _item_added(self, item: dict, previous_item_id: Any = ...) -> None:
        """Record ``item`` (a GA item with ``id``) and send ``conversation.item.added``."""
        if previous_item_id is ...:
            previous_item_id = next(reversed(self.items), None)
        self.items[item["id"]] = item
        self.items.move_to_end(item["id"])
        while len(self.items) > MAX_ITEMS:
            self.items.popitem(last=False)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous_item_id, "item": item})

    async def _item_done(self, item: dict) -> None:
        """``item`` is complete: recorded as it now is, and ``conversation.item.done`` sent."""
        if item["id"] in self.items:
            self.items[item["id"]] = item
        await self.send({"type": "conversation.item.done", "item": item})

    def _find_item(self, event: dict, code: str) -> dict:
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise ClientError("invalid_value", f"'item_id' must be a string, got {show(item_id)}", "item_id")
        if item_id not in self.items:
            raise ClientError(code, f"no item with id {show(item_id)} in this conversation", "item_id")
        return self.items[item_id]

    async def _item_create(self, event: dict) -> None:
        item = dict(_check_item(event.get("item")))
        previous = event.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise ClientError("invalid_value", "'previous_item_id' must be a string or null", "previous_item_id")
        item["id"] = item.get("id") or new_id("item")
        if item["id"] in self.items:
            raise ClientError("item_already_exists", f"an item with id {show(item['id'])} already exists", "item.id")
        notice = None  # why the model does not hear the item, if it does not (a notice, not an error)
        if item["type"] == "function_call_output" and self.handle is None:
            # history (a framework replays its context's tool results), not an answer to this model's call
            notice = ("item_not_heard", "no conversation is running, so this tool result answers no call of the "
                      "model: it is recorded, and the model does not hear it")
        elif item["type"] == "function_call_output":
            try:
                value = json.loads(item["output"])
            except (ValueError, RecursionError):
                value = item["output"]
            self.scheduler.call(self.handle, "send_tool_result", item["call_id"], value,
                                tag=ToolResultRequest(self.client_event_id, item["call_id"], item["id"]))
        elif item["type"] in MCP_ITEMS:
            notice = ("item_not_used", f"this server has no MCP tools: this {item['type']} item is recorded, and "
                      "the model does not use it")
        elif item["type"] == "message" and not self._message_heard(item):
            notice = ("item_not_heard", "the conversation is running and the model hears audio only: this item is "
                      "recorded, and the model does not hear it")
        # GA's MCP items have no status; the others are complete as the client gives them
        item = {**item, "object": "realtime.item"} if item["type"] in MCP_ITEMS else \
            {**item, "object": "realtime.item", "status": "completed"}
        # GA's "root" (the start of the conversation) is answered as GA does: null
        await self._item_added(item, (None if previous == "root" else previous) if "previous_item_id" in event else ...)
        await self._item_done(item)
        if notice is not None:
            await self.send({"type": "nvchat.notice", "code": notice[0], "item_id": item["id"], "message": notice[1]})

    def _message_heard(self, item: dict) -> bool:
        """Before the conversation starts, a message's text joins the prompt (docs/server.md)."""
        text = _message_text(item)
        if self.handle is not None:
            return not text
        if text:
            self.config.messages = [*self.config.messages, render_message(item["role"], text)]
        return True

    async def _item_truncate(self, event: dict) -> None:
        item = self._find_item(event, "item_truncate_invalid_item_id")
        content_index = _nonneg_int(event, "content_index")
        audio_end_ms = _nonneg_int(event, "audio_end_ms")
        # The model's context is its own timeline: what it said stays there. The item's transcript is cut
        # where the client's playback stopped (what had been said by the end of the last delta played).
        marks = self.spoken.get(item["id"])
        if marks is not None and item.get("role") == "assistant":
            said = max([chars for ms, chars in marks if ms <= audio_end_ms], default=0)
            content = [{**part, "transcript": part["transcript"][:said]} if part.get("type") == "output_audio"
                       else part for part in item.get("content") or []]
            item = {**item, "content": content}
        self.items[item["id"]] = {**item, "nvchat_audio_end_ms": audio_end_ms}
        await self.send({"type": "conversation.item.truncated", "item_id": item["id"], "content_index": content_index,
                         "audio_end_ms": audio_end_ms})

    async def _item_retrieve(self, event: dict) -> None:
        item = self._find_item(event, "item_retrieve_invalid_item_id")
        await self.send({"type": "conversation.item.retrieved",
                         "item": {k: v for k, v in item.items() if not k.startswith("nvchat_")}})

    async def _item_delete(self, event: dict) -> None:
        item = self._find_item(event, "item_delete_invalid_item_id")
        del self.items[item["id"]]
        await self.send({"type": "conversation.item.deleted", "item_id": item["id"]})
