"""The worker's outputs as protocol events, for :class:`~nvchat_torch.server.app.Connection`: OpenAI
Realtime GA responses (items, transcripts, audio, function calls, the speech during a tool call) and
mlx-vlm's dialect (one event per model event). The mapping is documented in docs/server.md.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from typing import Any

import numpy as np

from ..audio_io import pcm16_encode
from ..turn_taking import TurnTakingConfig
from .conversation_state import Response, ResponseKind, ResponseStatus, SpokenPhrase, TurnState, new_id
from .scheduler import Output
from .session_config import encode_audio, format_json
from .tool_speech import ToolSpeechEvents

__all__ = ["ResponseEvents"]

log = logging.getLogger("nvchat_torch.server")


class ResponseEvents(ToolSpeechEvents):
    """The outgoing half of a connection: ``_ga_output`` / ``_mlx_output`` turn one worker output into
    events and say whether the connection is over. Mixed into ``Connection``, whose state it reads
    (``response``, ``turn``, ``user_item``, ``config``, ...) and whose ``send``, ``send_error``, ``_stats``
    and ``_end`` it uses."""

    # Connection's state and plumbing (set in its __init__ and methods)
    response: Response | None
    turn: TurnState
    phrase: SpokenPhrase
    user_item: str | None
    user_text: str
    frames: int
    session_id: str
    eos_id: int
    bos_id: int
    config: Any
    out_resampler: Any
    server: Any
    announce_open: bool
    frame_samples: int
    model_rate: int
    output_model_rate: int

    async def _client_refusal(self, out: Output) -> bool:
        """Both dialects: a queued call the session refused (a tool result: :meth:`_result_refused`), or
        options the engine would not open a session with. True when ``out`` was one of them."""
        if out.kind == "rejected":
            await self._result_refused(out)
        elif out.kind == "refused":
            await self._refused(out)
        return out.kind in ("rejected", "refused")

    # ---- GA
    async def _ga_output(self, out: Output) -> bool:
        """One worker output as GA events; True once the connection is over."""
        if out.kind == "opened" or await self._client_refusal(out):
            return False
        if out.kind == "error":
            log.error("session %s failed", self.session_id, exc_info=out.error)
            if self.response is not None:
                await self._close_response("failed")
            await self.send_error("session_failed", f"the model failed: {out.error!r}; the session is over",
                                  kind="server_error", event_id=None)
            return await self._end(1011)
        if out.kind == "mark":
            await self._mark(out.tag)
            return False
        await self._step(out)  # "events": a step's (a "limit" has none: the frames before it have run)
        if out.kind == "limit":
            if self.response is not None:
                await self._close_response("incomplete")
            await self.send_error("context_limit", str(out.error), kind="invalid_request_error", event_id=None)
            return await self._end(1000)
        return False

    async def _mark(self, tag: Any) -> None:
        """A job the connection queued behind the audio sent before it has run: ``input_audio_buffer.clear``'s,
        or a commit's (everything sent so far has been heard)."""
        if tag == "clear":
            await self.send({"type": "input_audio_buffer.cleared"})
        elif tag == "policy_off":  # a session.update switched the policy off, and every frame before it ran
            if self.turn.user_speaking:  # no policy is left to end the speech it started: it ends here
                await self._speech_stopped(self.frames)
        elif tag == "commit":
            if self.turn.user_speaking:  # the commit ends the user's speech where the audio ends
                await self._speech_stopped(self.frames)
            await self._open_user_item()
            await self.send({"type": "input_audio_buffer.committed", "item_id": self.user_item,
                             "previous_item_id": None})
            await self._complete_user_item()
            self.turn.turn_muted = False
            if self.response is None:
                await self._open_response()
            await self._send_audio(self.out_resampler(np.zeros(0, np.float32), last=True))
            if not self.response.waiting:  # one a response.create asked for goes on to its BOS
                await self._close_response("completed")

    async def _step(self, out: Output) -> None:
        """One step's events, as the protocol reads them: the policy's turn events (a barge-in ends the
        response); the turn the text channel takes or ends (its BOS or EOS); the channels' events (the
        transcripts, the audio, the calls); then the responses that ends: one that carries calls, once
        they are written; the agent's turn at its EOS."""
        heard = any(event.input_frame is not None for event in out.events)
        text_id = None if out.ids is None else out.ids[0]
        if heard and out.ids is not None:
            await self._on_the_clock()
        for event in out.events:
            if event.kind == "turn":
                await self._turn(event)
        if text_id == self.bos_id:
            await self._agent_takes_the_turn(out)
        elif text_id == self.eos_id:
            self._agent_ends_the_turn()
        for event in out.events:
            await self._ga_event(event)
        r = self.response
        if r is not None and r.calls:
            # A response that carries function calls ends once they are complete: the client sends
            # their results after its response.done, and the answer opens a response of its own.
            await self._close_response("completed")
        if heard:
            await self._stats(out)
        r = self.response
        if text_id == self.eos_id and r is not None and not r.waiting and (r.spoke or not self.config.listening_audio):
            await self._close_response("completed")
        await self._after_step(out)

    async def _agent_takes_the_turn(self, out: Output) -> None:
        """The text channel's BOS (the model's own, or the policy's, or one a response.create forced)."""
        if self.turn.user_speaking:
            # The agent takes the turn on its own BOS while the user's speech is open (no end of
            # utterance stopped it): that speech ends here, so each speech_started has its
            # speech_stopped and a later barge-in sends its own speech_started.
            frame = next((e.input_frame for e in out.events if e.input_frame is not None), self.frames)
            await self._speech_stopped(frame)
        turn = self.turn  # a cancelled turn is over, but for the BOS of a cancelled request
        turn.turn_muted, turn.cancelled_bos, turn.agent_turn = turn.cancelled_bos, False, True
        if not turn.turn_muted:
            if self.response is None:
                await self._open_response()  # the agent takes the turn (its own BOS, or the policy's)
            self.response.waiting = False  # a response.create's response starts here

    def _agent_ends_the_turn(self) -> None:
        """The text channel's EOS: a cancelled turn is over (a cancelled request's BOS may still come)."""
        self.turn.turn_muted = self.turn.agent_turn = False

    async def _turn(self, event) -> None:
        """NVIDIA's policy acted (docs/server.md, "Turns"): the user's speech starts or stops as the
        GA server VAD says it, and a barge-in ends the open response as ``cancelled``."""
        # where in the input audio (the policy acts on heard frames only: steps off the clock skip it)
        policy, frame = self.config.turn_taking, event.input_frame if event.input_frame is not None else self.frames
        if policy is None:  # switched off by a session.update while this frame was in flight
            policy = TurnTakingConfig()
        if event.reason in ("user_speech", "barge_in"):
            if event.reason == "barge_in" and self.response is not None:
                await self._close_response("cancelled", reason="turn_detected")
            if not self.turn.user_speaking:
                await self._open_user_item()
                self.turn.user_speaking = True
                # a barge-in is confirmed after barge_in_frames of speech: that is where it began
                start = frame + 1 - policy.barge_in_frames if event.reason == "barge_in" else frame
                await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": self._frame_ms(start),
                                 "item_id": self.user_item})
        elif event.reason in ("end_of_utterance", "first_turn_fallback", "speech_ended"):
            if self.turn.user_speaking:
                # the utterance ended eou_frames of silence ago; the fallback cuts in where it stands;
                # speech_ended: the speech ended as an utterance does, but the agent is not given the turn
                await self._speech_stopped(frame if event.reason == "first_turn_fallback"
                                           else frame + 1 - policy.eou_frames)
            else:  # a commit already stopped this speech: a second speech_stopped would pair with nothing
                await self._complete_user_item()
        # self_play_suppressed: the model's BOS was dropped; nothing a client sees changes

    async def _speech_stopped(self, end_frame: int) -> None:
        """``input_audio_buffer.speech_stopped`` at ``end_frame``, and the user's item completed."""
        await self._open_user_item()
        await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": self._frame_ms(end_frame),
                         "item_id": self.user_item})
        self.turn.user_speaking = False
        await self._complete_user_item()

    def _frame_ms(self, frame: int) -> int:
        """Where ``frame`` starts in the input audio, in ms (before the stream: 0)."""
        return max(0, frame) * round(self.frame_samples / self.model_rate * 1000)

    async def _open_user_item(self) -> None:
        if self.user_item is None:
            self.user_item, self.user_text = new_id("item"), ""
            await self._item_added({"id": self.user_item, "object": "realtime.item", "type": "message",
                                    "role": "user", "status": "in_progress",
                                    "content": [{"type": "input_audio", "transcript": None}]})

    async def _ga_event(self, event) -> None:
        kind = event.kind
        if kind == "user_transcript_delta":
            if not event.delta:  # whitespace the transcript holds until text follows: no item for it
                return
            await self._open_user_item()
            self.user_text += event.delta
            await self.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": self.user_item,
                             "content_index": 0, "delta": event.delta})
            return
        if kind in ("done", "cancelled", "turn", "function_delta"):
            # function_delta: the raw function channel is mlx-vlm's; GA clients get parsed tool calls
            return
        if kind == "hold_speech":
            await self._hold_speech(event)
            return
        if kind == "audio":
            # Every frame's audio goes through the resampler (one continuous stream), and out only
            # within a response: while the model listens its near-silence is held back, and during a
            # tool call all but the phrases spoken (docs/server.md).
            samples = self.out_resampler(event.samples)
            if self.phrase.steps_left:
                await self._phrase_audio(samples)
            elif self.config.listening_audio or not self.turn.in_tool_call:
                if self.response is None and self.config.listening_audio:
                    await self._open_response()
                await self._send_audio(samples)
            return
        if kind == "tool_call_error":
            # not the client's error: a notice, and the session goes on (the model sees no result)
            await self.send({"type": "nvchat.notice", "code": "tool_call_parse_error", "message":
                             f"the model's tool call could not be used: {event.reason} (raw: {event.text!r})"})
            return
        if kind == "assistant_text_delta" and (self.turn.turn_muted or (self.response and self.response.waiting) or (
                self.response is None and not self.turn.agent_turn and self.config.turn_taking is not None
                and not self.config.listening_audio)):
            # The rest of a turn the client cancelled; or, with the policy, text outside the agent's
            # turn (BOS ... EOS), which the real model does not emit: not bot speech
            return
        if self.response is None:
            await self._open_response(kind="call" if kind == "tool_call" else "turn")
        if kind == "assistant_text_delta":
            await self._say(event.delta)
        elif kind == "tool_call":
            await self._tool_call(event)

    async def _say(self, delta: str) -> None:
        """Transcript of what the open response's message says: the model's text, or a phrase the TTS
        speaks during a tool call."""
        r = self.response
        if not r.spoke:  # the agent speaks: the user's item is complete
            r.spoke = True
            await self._complete_user_item()
        r.transcript += delta
        await self.send({"type": "response.output_audio_transcript.delta", "response_id": r.id,
                         "item_id": r.item_id, "output_index": 0, "content_index": 0, "delta": delta})

    async def _send_audio(self, samples: np.ndarray, phrase: bool = False) -> None:
        """Audio in the open response, unless it waits for its BOS (a ``phrase`` spoken during a tool call
        goes either way)."""
        r = self.response
        if len(samples) and r is not None and (phrase or not r.waiting):
            r.audio_ms += len(samples) * 1000 / self.config.output_rate
            self._spoken(r.item_id, math.floor(r.audio_ms), len(r.transcript))
            await self.send({"type": "response.output_audio.delta", "response_id": r.id, "item_id": r.item_id,
                             "output_index": 0, "content_index": 0,
                             "delta": base64.b64encode(encode_audio(samples, self.config.output_format)).decode()})

    async def _complete_user_item(self) -> None:
        if self.user_item is not None:
            await self.send({"type": "conversation.item.input_audio_transcription.completed",
                             "item_id": self.user_item, "content_index": 0, "transcript": self.user_text,
                             "usage": {"type": "duration", "seconds": round(self.frames * 0.08, 2)}})
            await self._item_done({"id": self.user_item, "object": "realtime.item", "type": "message", "role": "user",
                                   "status": "completed",
                                   "content": [{"type": "input_audio", "transcript": self.user_text}]})
            self.user_item, self.user_text = None, ""

    def _response_object(self, r: Response, status: str, output: list, reason: str = "client_cancelled") -> dict:
        body = {"id": r.id, "object": "realtime.response", "status": status, "output": output,
                "conversation_id": self.session_id, "output_modalities": ["audio"], "metadata": r.metadata,
                "audio": {"output": {"format": format_json(self.config.output_format, self.config.output_rate)}}}
        if status == "cancelled":
            body["status_details"] = {"type": "cancelled", "reason": reason}
        return body

    async def _open_response(self, metadata: dict | None = None, waiting: bool = False,
                             kind: ResponseKind = "turn") -> None:
        """Open a response: the agent takes the turn, or (``waiting``, a ``response.create``'s) will on
        the frame with its BOS, nothing of the frames before that sent; or a tool call's speech."""
        self.response = r = Response(kind=kind, metadata=metadata, waiting=waiting)
        await self.send({"type": "response.created", "response": self._response_object(r, "in_progress", [])})
        item = {"id": r.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        await self.send({"type": "response.output_item.added", "response_id": r.id, "output_index": 0,
                         "item": item})
        await self._item_added(item)
        await self.send({"type": "response.content_part.added", "response_id": r.id, "item_id": r.item_id,
                         "output_index": 0, "content_index": 0, "part": {"type": "audio", "transcript": ""}})

    async def _close_response(self, status: ResponseStatus, reason: str = "client_cancelled") -> None:
        r, self.response = self.response, None
        ids = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        await self.send({"type": "response.output_audio.done", **ids})
        await self.send({"type": "response.output_audio_transcript.done", **ids, "transcript": r.transcript})
        await self.send({"type": "response.content_part.done", **ids,
                         "part": {"type": "audio", "transcript": r.transcript}})
        item = {"id": r.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "completed" if status == "completed" else "incomplete",
                "content": [{"type": "output_audio", "transcript": r.transcript}]}
        await self.send({"type": "response.output_item.done", "response_id": r.id, "output_index": 0,
                         "item": item})
        await self._item_done(item)
        await self.send({"type": "response.done",
                         "response": self._response_object(r, status, [item, *r.calls], reason)})

    async def _cancel_response(self) -> None:
        """``response.cancel``: the open response ends as ``cancelled``, and the rest of what it was saying
        is not sent: the agent's turn (until its EOS, its next BOS or a commit), or the phrase it carries.
        A request still waiting for its BOS: one already forced will come, and that turn is not sent; one
        owed (a tool call runs) is not forced."""
        r, turn = self.response, self.turn
        turn.cancelled_bos, turn.bos_owed = r.waiting and not turn.bos_owed, False
        self.phrase.muted = self.phrase.steps_left > 0
        await self._close_response("cancelled")
        if r.kind != "phrase":  # a phrase's response is not the agent's turn
            turn.turn_muted = True

    async def _tool_call(self, event) -> None:
        r = self.response
        arguments = json.dumps(event.arguments, ensure_ascii=False)
        index = 1 + len(r.calls)
        item = {"id": new_id("item"), "object": "realtime.item", "type": "function_call", "status": "in_progress",
                "call_id": event.call_id, "name": event.name, "arguments": ""}
        await self.send({"type": "response.output_item.added", "response_id": r.id, "output_index": index,
                         "item": item})
        await self._item_added(item)
        ids = {"response_id": r.id, "item_id": item["id"], "output_index": index, "call_id": event.call_id}
        await self.send({"type": "response.function_call_arguments.delta", **ids, "delta": arguments})
        await self.send({"type": "response.function_call_arguments.done", **ids, "name": event.name,
                         "arguments": arguments})
        item = {**item, "status": "completed", "arguments": arguments}
        r.calls.append(item)
        await self.send({"type": "response.output_item.done", "response_id": r.id, "output_index": index,
                         "item": item})
        await self._item_done(item)

    # ---- mlx-vlm's dialect
    async def _mlx_output(self, out: Output) -> bool:
        if out.kind == "opened":
            if self.announce_open:
                await self.send({"type": "session.updated", "session": {
                    "id": self.session_id, "state": "ready", "model": self.server.model_name,
                    "frame_samples": self.frame_samples,
                    "input_audio_format": {"type": "pcm16", "sample_rate": self.model_rate},
                    "output_audio_format": {"type": "pcm16", "sample_rate": self.output_model_rate}}})
            return False
        if out.kind == "mark":
            if out.tag == "clear":
                await self.send({"type": "input_audio_buffer.cleared"})
            return False
        if await self._client_refusal(out):
            return False
        if out.kind == "error":
            log.error("session %s failed", self.session_id, exc_info=out.error)
            await self.send_error("inference_error", f"the model failed: {out.error!r}", kind="server_error",
                                  event_id=None)
            return await self._end(1011)
        for event in out.events:
            payload = self._mlx_event(event)
            if payload is not None:
                await self.send(payload)
            if event.kind in ("done", "cancelled"):  # as mlx-vlm: the session ends with its stream
                return await self._end(1000)
        if out.kind == "limit":
            await self.send_error("context_limit", str(out.error), event_id=None)
            return await self._end(1000)
        return False

    @staticmethod
    def _mlx_event(event) -> dict | None:
        head = {"frame_index": event.frame_index}
        if event.kind in ("assistant_text_delta", "function_delta"):
            name = "response.text.delta" if event.kind == "assistant_text_delta" else "response.function.delta"
            return {"type": name, **head, "token_id": event.token_id, "delta": event.delta, "text": event.text}
        if event.kind == "user_transcript_delta":
            return {"type": "conversation.item.input_audio_transcription.delta", **head, "delta": event.delta,
                    "transcript": event.text}
        if event.kind == "audio":
            return {"type": "response.audio.delta", **head,
                    "delta": base64.b64encode(pcm16_encode(event.samples)).decode("ascii"), "format": "pcm16",
                    "sample_rate": event.sample_rate, "channels": 1, "audio_codes": event.audio_codes.tolist()}
        if event.kind == "hold_speech":  # ours, not mlx-vlm's: a phrase the TTS speaks from this frame on
            return {"type": "nvchat.hold_speech", **head, "text": event.text, "reason": event.reason,
                    "call_id": event.call_id, "frames": event.frames}
        if event.kind == "done":
            return {"type": "response.done", **head}
        if event.kind == "cancelled":
            return {"type": "response.cancelled", **head}
        return None  # kinds mlx-vlm does not have (tool calls): its clients read the raw function channel
