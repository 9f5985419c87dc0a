"""NVIDIA's tool pipeline as GA events, for :class:`~nvchat_torch.server.responses.ResponseEvents`.

The acknowledgement goes in the response that carries the call. Each later phrase goes in a
server-initiated response of its own, or in the response a client asked for meanwhile. A result after
the call's time ran out gets a notice, not an error.
Design: docs/server.md, "Speech during a tool call"; the pipeline: docs/tools.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tool_pipeline import ToolResultTooLate
from .conversation_state import Response, SpokenPhrase, ToolResultRequest, TurnState
from .scheduler import Output

__all__ = ["ToolSpeechEvents"]


class ToolSpeechEvents:
    """Mixed into ``Connection`` (through ``ResponseEvents``): the tool pipeline's steps and phrases. Uses
    the connection's ``send``, ``send_error``, ``_open_response``, ``_close_response``, ``_say``,
    ``_send_audio`` and ``_force_turn``."""

    response: Response | None
    turn: TurnState
    phrase: SpokenPhrase
    call_start_id: int  # the function channel's start-of-call id while the pipeline runs calls, else -1
    frame_samples: int
    model_rate: int

    async def _on_the_clock(self) -> None:
        """A step heard on the clock, the LLM stepping: no call is written, waited for or answered now. A
        response that was only the call's or a phrase's speech ends here (a call that did not parse has no
        function call to close it); a phrase cut short with it is over."""
        if not self.turn.in_tool_call:
            return
        self.turn.in_tool_call = False
        self.phrase = SpokenPhrase()
        if self.response is not None and self.response.kind != "turn":
            await self._close_response("completed")

    async def _after_step(self, out: Output) -> None:
        """After a step's events: a call starts at its start-of-call id (its steps run off the clock from
        the next one on); a BOS a request was owed is forced once the call is over, unless the agent took
        the turn itself meanwhile."""
        if self.call_start_id >= 0 and out.ids is not None and out.ids[1] == self.call_start_id:
            self.turn.in_tool_call = True
        if self.turn.bos_owed and not self.turn.in_tool_call:
            self.turn.bos_owed = False
            if self.response is not None and self.response.waiting:
                self._force_turn()

    async def _hold_speech(self, event: Any) -> None:
        """A phrase the TTS starts speaking: the acknowledgement while the call is written goes in the open
        response (the agent's turn, or a request's), or in one opened for the call; a phrase while the
        tool runs in the open one (a request's), or in one of its own. Its text is the message's transcript;
        ``nvchat.hold_speech`` says which phrase it is (the page marks it)."""
        self.phrase = SpokenPhrase(steps_left=event.frames)
        if self.response is None:
            await self._open_response(kind="call" if event.reason == "ack" else "phrase")
        r = self.response
        await self.send({"type": "nvchat.hold_speech", "response_id": r.id, "item_id": r.item_id,
                         "reason": event.reason, "call_id": event.call_id, "text": event.text,
                         "audio_ms": event.frames * round(self.frame_samples / self.model_rate * 1000)})
        await self._say((" " if r.transcript and not r.transcript.endswith(" ") else "") + event.text)

    async def _phrase_audio(self, samples: np.ndarray) -> None:
        """One step of the phrase being spoken, sent in the open response whether or not it waits for its
        BOS (a response opens for the rest of an acknowledgement that outlasted its call); a phrase's own
        response ends at its last step."""
        phrase = self.phrase
        phrase.steps_left -= 1
        if not phrase.muted:
            if self.response is None:
                await self._open_response(kind="phrase")
            await self._send_audio(samples, phrase=True)
        if not phrase.steps_left:
            phrase.muted = False
            if self.response is not None and self.response.kind == "phrase":
                await self._close_response("completed")

    async def _result_refused(self, out: Output) -> None:
        """A queued call the session refused. A tool result for a call whose time ran out (the timeout
        result answered it) is a notice naming the call: the client's event was valid when it was sent,
        and pipecat ends the session at any ``error``. Any other (an unknown or answered ``call_id``) is
        the client's error, naming the event that asked, not the last one read."""
        request = out.tag if isinstance(out.tag, ToolResultRequest) else None
        if request is not None and isinstance(out.error, ToolResultTooLate):
            await self.send({"type": "nvchat.notice", "code": "tool_result_too_late", "call_id": request.call_id,
                             "item_id": request.item_id, "message": f"the result came too late: {out.error}; the "
                             "model heard the timeout result instead, and the session goes on"})
            return
        await self.send_error("invalid_tool_result", str(out.error), param="item.call_id",
                              event_id=out.tag if request is None else request.event_id)
