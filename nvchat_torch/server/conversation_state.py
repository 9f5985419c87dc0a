"""What a GA connection keeps between the worker's outputs: the response being sent, whose turn it is, and
the phrase the TTS speaks during a tool call (docs/server.md, "Turns" and "Speech during a tool call")."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["new_id", "Response", "ResponseKind", "ResponseStatus", "TurnState", "SpokenPhrase", "ToolResultRequest"]

# What opened a response, which says what ends it (besides a cancel, a commit or the session's end):
# "turn": the agent's turn (its BOS or text, a response.create, or every frame's audio with
# listening_audio): its EOS; "call": a function call (its acknowledgement, or the call outside a turn):
# the call written; "phrase": a phrase spoken while a tool runs: the phrase's last step.
ResponseKind = Literal["turn", "call", "phrase"]
ResponseStatus = Literal["completed", "cancelled", "incomplete", "failed"]


def new_id(prefix: str) -> str:
    """A fresh protocol id (``event_...``, ``item_...``, ``resp_...``, ``sess_...``)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class Response:
    """A GA response while it is sent: one assistant ``message`` item with an audio part, and the function
    calls it carries."""

    kind: ResponseKind = "turn"  # what opened it, which says what ends it (ResponseKind)
    metadata: dict | None = None  # a response.create's metadata, echoed in the response
    # A response.create's: announced at once, and nothing of the model's frames is sent before its BOS
    # frame (a phrase spoken during a tool call is: it is speech the client hears either way).
    waiting: bool = False
    id: str = field(default_factory=lambda: new_id("resp"))  # the response's protocol id
    item_id: str = field(default_factory=lambda: new_id("item"))  # its assistant message item's id
    transcript: str = ""  # the transcript deltas sent so far, joined
    spoke: bool = False  # a transcript delta was sent: the agent speaks (the user's item is complete)
    calls: list[dict] = field(default_factory=list)  # its function_call items, completed
    audio_ms: float = 0.0  # the audio sent so far, at the output rate


@dataclass
class TurnState:
    """Whose turn it is, as the connection follows it from the policy's events, the text channel's BOS and
    EOS, the client's requests and the tool pipeline's steps."""

    user_speaking: bool = False  # speech_started sent, speech_stopped not yet (the policy's view)
    agent_turn: bool = False  # the text channel's last BOS/EOS was BOS: the agent holds the turn
    turn_muted: bool = False  # the client cancelled the agent's turn: the rest of it is not sent
    cancelled_bos: bool = False  # a response.create's response cancelled before its BOS: that turn is not sent
    # The tool pipeline is writing, waiting for or answering a call: from the frame whose function id
    # starts it until a frame heard on the clock. Its steps force the text channel, so a BOS forced
    # meanwhile would be lost.
    in_tool_call: bool = False
    bos_owed: bool = False  # a response.create's BOS, forced once the session is back on the clock


@dataclass
class SpokenPhrase:
    """The phrase the TTS is speaking during a tool call, from a ``hold_speech`` event."""

    steps_left: int = 0  # its steps still to come, 80 ms of audio each
    muted: bool = False  # the client cancelled the response that carried it: its audio is not sent


@dataclass(frozen=True)
class ToolResultRequest:
    """The tag a ``function_call_output``'s ``send_tool_result`` is queued with: what its refusal names."""

    event_id: str | None  # the client event that sent it
    call_id: str  # the call the result answers
    item_id: str  # the function_call_output item
