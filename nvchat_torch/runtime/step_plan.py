"""How a step of a session runs besides what it hears: what it forces, what its TTS speaks, which networks
step, whether its speech comes out (:class:`StepPlan`); and the steps off the clock a caller asks for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..events import VoiceChatEvent

__all__ = ["StepPlan", "PLAIN", "off_clock_steps"]


@dataclass(frozen=True)
class StepPlan:
    """How a step runs besides what it hears (a frame of audio; none off the clock, where it hears NVIDIA's
    silence embedding instead). ``text``: the text id it forces (-1: the model's own), ``spoken``: the id
    its TTS speaks instead of the text id (-1: the text id), ``keep_audio``: whether its 80 ms of speech
    comes out as an ``audio`` event (the codec runs either way, so the speech that follows is
    continuous), ``thinks``: whether the LLM steps (not while a tool runs: the TTS alone speaks),
    ``speaks``: whether the TTS and codec step (not: 80 ms of silence, their state as it was)."""

    text: int = -1
    spoken: int = -1
    keep_audio: bool = True
    thinks: bool = True
    speaks: bool = True
    event: VoiceChatEvent | None = None  # an event that starts with this step (a phrase spoken while a tool runs)


def off_clock_steps(count: int, text: int | None, speak: Sequence[int] | None, keep_audio: bool,
                    vocab_size: int) -> list[StepPlan]:
    """``count`` steps off the clock (see :meth:`StreamingSession.step_off_clock`), checked: a bad argument
    raises ``ValueError`` naming it."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")

    def token(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < vocab_size:
            raise ValueError(f"{name} must be a token id in [0, {vocab_size}), got {value!r}")
        return int(value)

    forced = -1 if text is None else token(text, "text")
    if isinstance(speak, (str, bytes)) or speak is not None and not isinstance(speak, (Sequence, np.ndarray)):
        raise ValueError(f"speak must be a list of token ids, got {type(speak).__name__}")
    spoken = [] if speak is None else [token(i, "speak") for i in speak]
    if len(spoken) > count:
        raise ValueError(f"speak has {len(spoken)} ids for {count} step(s): at most one per step")
    if not isinstance(keep_audio, bool):
        raise ValueError(f"keep_audio must be a bool, got {keep_audio!r}")
    return [StepPlan(forced, spoken[i] if i < len(spoken) else -1, keep_audio) for i in range(count)]


PLAIN = StepPlan()  # a step of the conversation as it streams: the LLM, TTS and codec all step
