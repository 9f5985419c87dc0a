"""A session's system prompt: its LLM ids, and the prefilled prompts kept for the next session with the
same ids (as mlx-lm's prompt cache and vLLM's prefix cache keep theirs). Every framework session sends
the same instructions and tools, so a kept prefill lets it join at once, with the frames a fresh
prefill would give (``tests/test_prompt_cache.py``). Entries are bounded in bytes, least recently used
dropped first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..tool_prompt import render_system_prompt

if TYPE_CHECKING:
    from .timeline import Timeline, TimelineState

__all__ = ["prompt_ids", "PromptCache", "PromptState"]


def prompt_ids(model: Any, system_prompt: str | None, tools: Sequence[dict] | None = None) -> list[int]:
    """The system prompt's LLM ids, the one builder sessions and training share: ``None`` is the card's
    default prompt, a blank prompt none; with ``tools``, NVIDIA's function-calling prompt; BOS + text +
    EOS. ``model``: what holds the ``config`` and the ``tokenizer`` (the model or its networks)."""
    cfg = model.config
    text = render_system_prompt(system_prompt, tools) if tools else system_prompt
    text = cfg.default_system_prompt if text is None else text
    if not text.strip():
        return []
    return [cfg.bos_token_id, *model.tokenizer.encode(text, add_special_tokens=False), cfg.eos_token_id]


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (dataclasses, lists and tensors), counted once per storage."""
    seen: set[int] = set()

    def walk(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            storage = v.untyped_storage()
            if storage.data_ptr() in seen:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()
        if isinstance(v, (list, tuple)):
            return sum(walk(x) for x in v)
        if hasattr(v, "__dataclass_fields__"):
            return sum(walk(getattr(v, name)) for name in v.__dataclass_fields__)
        return 0

    return walk(value)


@dataclass
class PromptState:
    """A timeline as its prompt's prefill left it, owned by the cache."""

    timeline: TimelineState  # Timeline.snapshot(): copies
    nbytes: int  # the tensors' bytes, each storage once


class PromptCache:
    """Prefilled timelines by key, at most ``max_bytes`` of them, least recently used evicted first.
    ``hits`` and ``misses`` count the lookups."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be non-negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, PromptState] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(prompt: Sequence[int], options: Any, model: Any) -> tuple:
        """What determines a prefilled timeline: the prompt ids, seed, mode, cache path, dtype and device."""
        return (tuple(int(i) for i in prompt), int(options.seed), bool(options.deterministic),
                bool(options.use_language_cache), str(model.dtype), str(model.device))

    def restore(self, key: tuple, timeline: Timeline) -> bool:
        """Give ``timeline`` (fresh, not prefilled) the kept state of ``key``, as copies; False when none is kept."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return False
        self._entries.move_to_end(key)
        self.hits += 1
        timeline.restore(entry.timeline)
        return True

    def save(self, key: tuple, timeline: Timeline) -> None:
        """Keep a copy of ``timeline`` as its prefill left it (before a frame step takes its caches)."""
        if key in self._entries or not self.max_bytes:
            return
        state = timeline.snapshot()
        entry = PromptState(state, _nbytes(state))
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
