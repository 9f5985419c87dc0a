"""Prefilled system prompts kept for the next session with the same prompt (as mlx-lm's prompt cache and
vLLM's prefix cache keep theirs).

A session's prefill advances its timeline one position per prompt token, the LLM over the prompt and
a TTS step per token (on PAD text, so the TTS half depends on the prompt's length, the seed and the
mode, not its words). Every framework session sends the same instructions and tools, so the server's
engine keeps the timeline as the prefill left it (the LLM and TTS caches, the previous codes, the
random generator's state, the position), keyed by everything that determines it: the prompt's ids,
the seed, the mode (deterministic or sampling), the cache path, and the model's dtype and device. A
session whose key is kept starts from a copy: it joins at once, and its frames are the ones a fresh
prefill would give (``tests/test_prompt_cache.py``). The entries are bounded in bytes and the least
recently used go first.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["PromptCache", "PromptState"]

# What a prefill changes on a Timeline (nvchat_torch.runtime.timeline), besides the generator's state.
_FIELDS = ("language_cache", "history", "tts_cache", "previous_code", "prev_text", "prev_function", "index",
           "last_hidden")


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
    """A timeline as its prompt's prefill left it (copies, owned by the cache)."""

    fields: dict[str, Any]
    generator_state: torch.Tensor
    nbytes: int


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

    def restore(self, key: tuple, timeline: Any) -> bool:
        """Give ``timeline`` (fresh, not prefilled) the kept state of ``key``, as copies; False when none is kept."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return False
        self._entries.move_to_end(key)
        self.hits += 1
        for name, value in copy.deepcopy(entry.fields).items():
            setattr(timeline, name, value)
        timeline.generator.set_state(entry.generator_state.clone())
        return True

    def save(self, key: tuple, timeline: Any) -> None:
        """Keep a copy of ``timeline`` as its prefill left it (before a frame step takes its caches)."""
        if key in self._entries or not self.max_bytes:
            return
        fields = copy.deepcopy({name: getattr(timeline, name) for name in _FIELDS})
        entry = PromptState(fields, timeline.generator.get_state().clone(), _nbytes(list(fields.values())))
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
