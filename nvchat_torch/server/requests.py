"""``response.create``: a client asks the agent to speak now, for :class:`~nvchat_torch.server.app.Connection`.

The model is full duplex and decides itself when to speak; what a client can ask of it is the turn.
A request forces the text channel's BOS on the next frame, and the response that opens there carries
the request's ``metadata``. A request made while a response is open or waiting joins it.
What happens to the parts the model cannot honour: docs/server.md, the ``response.create`` row.
"""

from __future__ import annotations

from typing import Any

from .conversation_state import Response, TurnState
from .ga_schema import AnyJSON, Bool, Int, ListOf, Obj, OneOf, Str, UnknownKey, check, show
from .session_config import ClientError

__all__ = ["RequestEvents", "check_response_create", "RESPONSE_CREATE"]

_FUNCTION_TOOL = Obj({"type": Str(("function",)), "name": Str(), "description": Str(), "parameters": AnyJSON()})
_MCP_TOOL = Obj({"type": Str(("mcp",)), "server_label": Str(),
                 "allowed_callers": ListOf(Str(("direct", "programmatic")), nullable=True),
                 "allowed_tools": AnyJSON(nullable=True), "authorization": Str(), "connector_id": Str(),
                 "defer_loading": Bool(), "headers": AnyJSON(nullable=True), "require_approval": AnyJSON(nullable=True),
                 "server_description": Str(), "server_url": Str(), "tunnel_id": Str()},
                required=("type", "server_label"))
_FORMAT = OneOf([Obj({"type": Str(("audio/pcm",)), "rate": Int(1)}), Obj({"type": Str(("audio/pcmu", "audio/pcma"))})])
# The GA response.create's ``response`` (openai.types.realtime.RealtimeResponseCreateParamsParam).
RESPONSE_CREATE = Obj({
    "audio": Obj({"output": Obj({"format": _FORMAT, "voice": OneOf([Str(), Obj({"id": Str()}, required=("id",))])})}),
    "conversation": Str(),  # "auto", "none" (out of band), or a conversation id
    "input": ListOf(AnyJSON()),  # the items of an out-of-band context
    "instructions": Str(),
    "max_output_tokens": OneOf([Str(("inf",)), Int(1, 4096)]),
    "metadata": AnyJSON(nullable=True),
    "output_modalities": ListOf(Str(("text", "audio"))),
    "parallel_tool_calls": Bool(),
    "prompt": Obj({"id": Str(), "variables": AnyJSON(nullable=True), "version": Str(nullable=True)},
                  required=("id",), nullable=True),
    "reasoning": Obj({"effort": Str(("minimal", "low", "medium", "high", "xhigh"))}),
    "tool_choice": OneOf([Str(("auto", "none", "required")),
                          Obj({"type": Str(("function",)), "name": Str()}, required=("type", "name")),
                          Obj({"type": Str(("mcp",)), "server_label": Str(), "name": Str(nullable=True)},
                              required=("type", "server_label"))]),
    "tools": ListOf(OneOf([_FUNCTION_TOOL, _MCP_TOOL])),
}, nullable=True)
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits on metadata


def check_response_create(event: dict) -> dict:
    """The request's ``response`` (``{}`` when absent or null), checked against the GA schema, or a
    ClientError naming the field."""
    params = event.get("response")
    if isinstance(params, dict):  # a null field is one not given (LiveKit sends "instructions": null)
        params = {key: value for key, value in params.items() if value is not None}
    try:
        check(params, RESPONSE_CREATE, "response")
    except UnknownKey as e:
        raise ClientError("unknown_parameter", str(e), e.path) from None
    except ValueError as e:
        raise ClientError("invalid_value", str(e), "response") from None
    params = params or {}
    if params.get("output_modalities") == []:
        raise ClientError("invalid_value", f"response.output_modalities must name 'audio' or 'text', got "
                          f"{show(params['output_modalities'])}", "response.output_modalities")
    metadata = params.get("metadata")
    if metadata is not None:
        if len(metadata) > METADATA_KEYS:
            raise ClientError("invalid_value", f"response.metadata has {len(metadata)} keys, over the limit of "
                              f"{METADATA_KEYS}", "response.metadata")
        for key, value in metadata.items():
            if len(key) > METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
                raise ClientError("invalid_value", f"response.metadata: keys are strings of at most "
                                  f"{METADATA_KEY_CHARS} characters and values strings of at most "
                                  f"{METADATA_VALUE_CHARS}, got {show(key)}: {show(value)}",
                                  f"response.metadata.{show(key, 40)[1:-1]}")
    return params


class RequestEvents:
    """Mixed into ``Connection``: ``response.create``."""

    response: Response | None
    turn: TurnState
    handle: int | None
    scheduler: Any
    bos_id: int
    client_event_id: str | None

    async def _response_create(self, event: dict) -> None:
        params = check_response_create(event)
        metadata = params.get("metadata")
        r = self.response
        if r is not None and r.kind != "phrase":  # the agent speaks, or is about to: the request joins its response
            if metadata is not None:
                r.metadata = metadata
            return
        if r is not None:
            # A phrase spoken while a tool runs is not the agent's turn: its response ends here, and the
            # rest of the phrase is the requested response's first audio (docs/server.md).
            await self._close_response("completed")
        # Announced at once, so a client waiting for it (LiveKit gives up after 10 s) does not wait out
        # a prompt's prefill, a backlog of frames or a tool call; its audio starts on the frame with the BOS.
        await self._open_response(metadata=metadata, waiting=True)
        if self.turn.in_tool_call:  # the pipeline's steps force the text channel: the BOS waits for the clock
            self.turn.bos_owed = True
        else:
            self._force_turn()

    def _force_turn(self) -> None:
        """The agent's BOS on the session's next frame (a session not started yet gets it when it
        starts, ``_start``)."""
        if self.handle is not None:
            self.scheduler.call(self.handle, "force_tokens", "text", [self.bos_id], tag=self.client_event_id)
