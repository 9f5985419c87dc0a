"""NVIDIA's two-phase tool pipeline for one session: a tool call is written and its result injected off
the clock, and the assistant speaks while it does.

The stages are idle, writing, waiting and injecting. The session asks :meth:`ToolPipeline.off_clock`
for a step to run now, :meth:`ToolPipeline.frame_plan` how a frame runs, and
:meth:`ToolPipeline.after` follows each step's events.
Design, with NeMo's line numbers: docs/tools.md, "Speaking while a tool runs" and "How it runs".
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

from .events import VoiceChatEvent
from .runtime.step_plan import StepPlan
from .tool_hold import ToolHold, layout_phrase, spell_tool_response_numbers
from .tools import ToolChannel

__all__ = ["ToolPipeline", "ToolResultTooLate", "MAX_WRITING_STEPS"]

MAX_WRITING_STEPS = 2000  # a call not closed by then goes back on the clock (W 1189: max_async_steps)


class ToolResultTooLate(ValueError):
    """A result for a call whose time ran out: the timeout result answered it."""


class ToolPipeline:
    """The stages of one session's tool calls (see the module doc). ``seed``: NVIDIA picks its phrases at
    random; a session picks them from a generator of its own seed, so a session is repeatable."""

    def __init__(self, hold: ToolHold, tools: ToolChannel, tokenizer: Any, *, bos_id: int, eos_id: int, pad_id: int,
                 frame_duration: float, seed: int) -> None:
        self.hold = hold
        self.tools = tools
        self.pad_id = pad_id
        self.random = random.Random(seed)
        self.stage = "idle"
        # The ids the TTS speaks next, one a step, each with the event its phrase starts with.
        self.speech: deque[tuple[int, VoiceChatEvent | None]] = deque()
        self.generic: list[str] = []  # the generic phrases still to come
        self.gap_frames = math.ceil(hold.generic_gap_s / frame_duration)
        self.timeout_frames = math.ceil(hold.timeout_s / frame_duration)
        self.silent = 0  # frames of silence so far: before the next generic phrase, or towards the timeout
        self.writing_steps = 0
        self.calls: list[str] = []  # the call ids being waited for
        self.timed_out: set[str] = set()
        self.tail = False  # injecting: the step after the result's last token has run
        if hold.spell_numbers:
            tools.transform_response = spell_tool_response_numbers
        tools.pad_text_while_injecting = False  # its steps force PAD themselves; a forced text id waits
        # Every phrase laid out now: one the tokenizer cannot speak is an error when the session starts.
        self.layouts = {phrase: layout_phrase(tokenizer, phrase, bos_id=bos_id, pad_id=pad_id, eos_id=eos_id)
                        for phrase in hold.phrases()}

    @property
    def active(self) -> bool:
        """A call is being written, waited for or answered: the policy is suspended."""
        return self.stage != "idle"

    @property
    def due(self) -> bool:
        """A step is due off the clock: the call is being written, or its result injected (or in, and no
        phrase being spoken)."""
        return self.stage in ("writing", "injecting") or (self.stage == "waiting" and not self.speech and (
            self.tools.injecting or self._timed_out_now()))

    def _timed_out_now(self) -> bool:
        """The wait is over: the lines spoken, then ``timeout_s`` of silence, with calls still unanswered."""
        return (self.stage == "waiting" and not self.speech and not self.generic and bool(self.tools.awaiting)
                and self.silent >= self.timeout_frames)

    @property
    def waiting(self) -> bool:
        """The LLM stands still while the tool runs (the server gives the session a step every tick)."""
        return self.stage == "waiting"

    def _say(self, phrase: str | None, reason: str, call_id: str | None) -> None:
        if phrase is None:
            return
        ids = self.layouts[phrase]
        event = VoiceChatEvent("hold_speech", text=phrase, reason=reason, call_id=call_id, frames=len(ids))
        self.speech.extend((token, event if k == 0 else None) for k, token in enumerate(ids))

    # ---- what the session asks before a step
    def off_clock(self) -> StepPlan | None:
        """The step to run now, off the clock: writing the call, or injecting its result; None: none."""
        if self._timed_out_now():
            self._time_out()
        if self.stage == "waiting" and not self.speech and self.tools.injecting:
            self.stage, self.tail = "injecting", False  # the result is in and no phrase is being spoken
        if self.stage == "writing":  # the acknowledgement, one id a step; PAD once it is spoken
            token, event = self.speech.popleft() if self.speech else (-1, None)
            return StepPlan(text=self.pad_id, spoken=token, event=event)
        if self.stage == "injecting":
            if self.tools.injecting or not self.tail:
                self.tail = not self.tools.injecting
                return StepPlan(text=self.pad_id, keep_audio=False)
            self.stage = "idle"
        return None

    def end(self) -> None:
        """The stream ends (flush): a call being written stops there (the session reports it unfinished);
        a result already in still goes in."""
        if self.stage == "writing":
            self.stage = "idle"
            self.speech.clear()

    def result_sent(self) -> None:
        """After a result is taken: once a call's results are all in, the phrases not begun are not spoken
        (a started one finishes). NVIDIA speaks its on-hold phrase whatever the result (P 1686-1700: its
        thread plays it before it looks), which would hold an answer already in hand for the phrase's
        seconds."""
        if not self.tools.injecting:
            return
        first = next((k for k, (_, event) in enumerate(self.speech) if event is not None), None)
        if first is not None:
            for _ in range(len(self.speech) - first):
                self.speech.pop()
        self.generic = []

    def frame_plan(self) -> StepPlan | None:
        """How the next frame of audio runs: on the clock (None), or while the tool runs, the TTS alone
        speaking the next id of a phrase, or silence (the timeout counted in those frames)."""
        if self.stage != "waiting":
            return None
        if not self.speech and self.generic and self.silent >= self.gap_frames:
            self.silent = 0
            self._say(self.generic.pop(0), "on_hold", self.calls[0])
        if self.speech:
            token, event = self.speech.popleft()
            return StepPlan(spoken=token, thinks=False, event=event)
        self.silent += 1
        return StepPlan(thinks=False, speaks=False)

    def _time_out(self) -> None:
        """The tool took too long: its result is the timeout result (P 1731-1736)."""
        for call_id in list(self.tools.awaiting):
            self.tools.send_result(call_id, self.hold.timeout_result)
            self.timed_out.add(call_id)
        self._say(self.hold.timeout_phrase, "timeout", self.calls[0])

    # ---- what a step gave
    def after(self, plan: StepPlan, function_id: int, events: list[VoiceChatEvent], frame_index: int) -> list[VoiceChatEvent]:
        """Follow one step (its ``plan``, the function channel's id when the LLM stepped, its events);
        returns the events to add: the phrase it started speaking, if any."""
        added = [] if plan.event is None else [_at(plan.event, frame_index)]
        if not plan.thinks:
            return added
        tools = self.tools
        if self.stage == "idle" and tools.parsing and function_id == tools.start_id:
            self.stage, self.writing_steps = "writing", 0
            self._say(self.hold.pick_acknowledgement(self.random), "ack", None)
        elif self.stage == "writing":
            self.writing_steps += 1
            calls = [e for e in events if e.kind == "tool_call"]
            closed = bool(calls) or (any(e.kind == "tool_call_error" for e in events) and not tools.in_call)
            if calls:  # the call is written: wait for its result
                self.stage, self.calls, self.silent = "waiting", [str(e.call_id) for e in calls], 0
                self.generic = self.hold.pick_generic(self.random)
                self._say(self.hold.pick_on_hold(str(calls[0].name), self.random), "on_hold", self.calls[0])
            elif closed or self.writing_steps >= MAX_WRITING_STEPS:  # nothing to wait for
                self.stage = "idle"
                self.speech.clear()
        return added

    def check_result(self, call_id: str) -> None:
        """Before a result is taken: one for a call whose time ran out is refused (:class:`ToolResultTooLate`)."""
        if call_id in self.timed_out:
            raise ToolResultTooLate(f"the call {call_id!r} timed out after {self.hold.timeout_s:g} s and was answered with "
                             "the timeout result; its result can no longer be taken")


def _at(event: VoiceChatEvent, frame_index: int) -> VoiceChatEvent:
    event.frame_index = frame_index
    return event
