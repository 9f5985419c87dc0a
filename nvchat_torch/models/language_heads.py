"""Around the Nemotron-H LLM, per timeline position: its fused input embedding ``E(text) + audio +
2 E(function)`` and its two vocabulary heads (modules ``stt_model.{embed_tokens,lm_head,function_head}``)
with greedy ids, all on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .quant import concat_linears

__all__ = ["fused_input", "language_heads", "fuse_heads", "HeadOutputs"]


def fused_input(embed_tokens: nn.Module, prev_text_id: torch.Tensor, audio_embedding: torch.Tensor,
                prev_function_id: torch.Tensor, weight: float) -> torch.Tensor:
    """The LLM input of one timeline position: ``E(text) + audio + weight * E(function)``.

    Ids are integer device tensors of shape ``audio_embedding.shape[:-1]`` (e.g. ``[B, 1]``); both
    go through one embedding lookup. ``weight`` is ``function_channel_weight`` (2.0).
    """
    if prev_text_id.shape != audio_embedding.shape[:-1] or prev_function_id.shape != prev_text_id.shape:
        raise ValueError(f"ids {list(prev_text_id.shape)} (text) and {list(prev_function_id.shape)} (function) "
                         f"must both have the shape {list(audio_embedding.shape[:-1])} of audio_embedding "
                         "without its last axis")
    text, function = embed_tokens(torch.stack((prev_text_id, prev_function_id)))
    return torch.add(text + audio_embedding, function, alpha=weight)


@dataclass
class HeadOutputs:
    text_logits: torch.Tensor  # [..., vocab]
    function_logits: torch.Tensor  # [..., vocab]
    ids: torch.Tensor  # [..., 2] int64: greedy (text id, function id), first maximum on ties

    @property
    def text_ids(self) -> torch.Tensor:
        return self.ids[..., 0]

    @property
    def function_ids(self) -> torch.Tensor:
        return self.ids[..., 1]


def fuse_heads(lm_head: nn.Module, function_head: nn.Module, release: bool = False) -> nn.Module:
    """``lm_head`` and ``function_head`` as one linear (outputs concatenated), for :func:`language_heads`;
    ``release``: the two are discarded after (see :func:`~nvchat_torch.models.quant.concat_linears`)."""
    return concat_linears([lm_head, function_head], release=release)


def language_heads(hidden: torch.Tensor, lm_head: nn.Module, function_head: nn.Module | None = None) -> HeadOutputs:
    """Both heads' logits and greedy ids from the LLM's hidden state, all on the device.

    With ``function_head=None``, ``lm_head`` is the fused module from :func:`fuse_heads`.
    """
    if function_head is None:
        both = lm_head(hidden).unflatten(-1, (2, -1))  # [..., 2, vocab]
        return HeadOutputs(both[..., 0, :], both[..., 1, :], both.argmax(-1))
    text, function = lm_head(hidden), function_head(hidden)
    return HeadOutputs(text, function, torch.stack((text.argmax(-1), function.argmax(-1)), -1))
