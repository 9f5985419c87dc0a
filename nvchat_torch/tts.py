"""EAR-TTS: the assistant's speech tokens, 31 residual-VQ codes per 80 ms frame.

Checkpoint prefix ``tts_model``: ``tts_model.tts_model`` is :class:`EarTTS`, ``tts_model.audio_codec``
the :class:`~nvchat_torch.codec.Codec`, plus the prompt and silence buffers held by :class:`SpeechDecoder`.

One frame (:meth:`EarTTS.step`): the previous frame's codes are depth-summed through ``rvq_embs``
and projected (``embed_code``); the current text id goes through a character-aware subword encoder
plus subword-flag and BOS/EOS embeddings; a gated fusion mixes the two, and the batch is doubled
for classifier-free guidance (the unconditional row's text is ``null_emb``). A Gemma-3-style
backbone advances one position; a mixture-of-Gaussians head then proposes a latent five times
(the iterative schedule), and each proposal is assigned greedily to the next quantizers.

A session starts with a 37-position warmup (the "Aria" speaker prompt, :meth:`SpeechDecoder.start`)
that fills the key/value caches. Nothing in a step reads a tensor on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .codec import Codec
from .config import CharacterEncoderConfig, CodecConfig, MoGConfig, TTSConfig
from .layers import REDUCED, Linear, adopt, gelu_tanh, matmul, promoted, scalar, sigmoid, swap_modules
from .nemotron_h import grown_capacity
from .quant import fuse_linears

__all__ = [
    "RMSNorm",
    "GatedMLP",
    "Rotary",
    "TTSCache",
    "GemmaBackbone",
    "CharAwareSubwordEncoder",
    "GatedFusion",
    "MoGHead",
    "sample_component",
    "EarTTS",
    "TTSPrompt",
    "PromptLatents",
    "SpeechDecoder",
]

SUBWORD_VOCAB_SIZE = 131_072  # rows of the checkpoint's subword-flag tables (fixed by the reference)
PROMPT_FRAMES = 37  # frames of the speaker prompt latents (3 s)
ROPE_POSITIONS = 8192  # rotary table length until the model reserves its own (GemmaBackbone.reserve_positions)
MASKED_SCORE = -1e30  # finite, so a row with every key masked stays finite (parity trap 27)
GUMBEL_EPS = 1e-8


def _check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], integer: bool = False) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if integer and (x.is_floating_point() or x.is_complex()):
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")


# --------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """RMSNorm whose weight is an offset from one: ``x / rms(x) * (1 + weight)``.

    The Gemma backbone forms ``1 + weight`` in the weight dtype and normalises in the activation
    dtype; the reference's ``OffsetRMSNorm`` (character encoder, fusion, MoG head) computes in
    float32 and casts back (``fp32=True``). Identical in a float32 model.
    """

    def __init__(self, dim: int, eps: float, fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.fp32 = fp32

    def offset_weight(self) -> torch.Tensor:
        """``1 + weight``: Gemma adds in the weight's dtype (bf16 weights: a bf16 sum, then promoted);
        the offset norms add in float32."""
        return 1.0 + (self.weight.float() if self.fp32 else self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.offset_weight()
        if self.fp32 and x.dtype != torch.float32:  # the offset norms compute in float32 and round once
            return F.rms_norm(x.float(), self.weight.shape, weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, weight.to(promoted(x, weight)), self.eps)


class PrecomputedRMSNorm(RMSNorm):
    """``prepare()``'s swap for :class:`RMSNorm`: ``1 + weight`` computed once for activations of
    ``dtype``, the same values stored in the dtype they are used in (float32, or in the fast mode's
    bf16 the Gemma norm's own sum)."""

    def __init__(self, norm: RMSNorm, dtype: torch.dtype):
        adopt(self, norm)
        scale = norm.offset_weight().detach()
        self.register_buffer("scale", scale.to(torch.promote_types(scale.dtype, dtype)), persistent=False)

    def offset_weight(self) -> torch.Tensor:
        return self.scale


class GatedMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(gelu_tanh(gate) * up)


class FusedGatedMLP(GatedMLP):
    """``prepare()``'s swap for :class:`GatedMLP`: gate and up as one matmul (``gate_up_proj``)."""

    def __init__(self, mlp: GatedMLP):
        adopt(self, mlp)
        fuse_linears(self, ["gate_proj", "up_proj"], "gate_up_proj")

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.gate_up_proj(x).chunk(2, dim=-1)


class Rotary(nn.Module):
    """Rotate-half RoPE over all ``dim`` channels, from float32 tables indexed by position.

    ``sin`` is stored with the sign of the rotation folded in (``[-sin, sin]``), so applying it is
    ``x * cos + swap_halves(x) * sin``, computed in float32. The tables are constants: made in float32 by
    ``init_constants`` (call it again after casting the module), sized by :meth:`reserve` when the model is
    built or loaded, never while a session steps (sessions share them).
    """

    def __init__(self, dim: int, base: float, positions: int = ROPE_POSITIONS):
        super().__init__()
        self.dim, self.base = dim, base
        self.init_constants(positions=positions)

    def init_constants(self, device: torch.device | str | None = None, positions: int = ROPE_POSITIONS) -> None:
        half = self.dim // 2
        inv_freq = torch.tensor([self.base ** (-2.0 * i / self.dim) for i in range(half)],
                                dtype=torch.float32, device=device)
        angles = torch.arange(positions, dtype=torch.float32, device=device)[:, None] * inv_freq
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", torch.cat([-angles.sin(), angles.sin()], dim=-1), persistent=False)
        # swap[j, i] = 1 where x_j is the swapped-halves partner of x_i (for rotation()).
        self.register_buffer("swap", torch.roll(torch.eye(self.dim, device=device), half, dims=0), persistent=False)

    def rotation(self, position: int, dtype: torch.dtype) -> torch.Tensor:
        """RoPE at one ``position`` as a matrix ``M [dim, dim]``: ``x @ M`` rotates ``x`` (3 ops, shared by
        every layer of a step, which then rotates with one matmul)."""
        cos, sin = self.table(position, 1)
        return (torch.diag_embed(cos[0]) + self.swap * sin).to(dtype)

    def reserve(self, positions: int) -> None:
        """Make the tables cover ``positions`` positions (at load time)."""
        if positions > self.cos.shape[0]:
            self.init_constants(self.cos.device, positions)

    def table(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[length, dim]`` for positions ``start .. start + length - 1`` (views)."""
        if start + length > self.cos.shape[0]:
            raise ValueError(f"position {start + length - 1} is past the rotary table ({self.cos.shape[0]} "
                             "positions, the model's limit); a session stops before it with ContextLimit")
        return self.cos[start:start + length], self.sin[start:start + length]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [..., L, heads, dim]`` with ``cos, sin [L, 1, dim]`` (or broadcastable)."""
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        if x.dtype in REDUCED:  # MLX rotates bf16 with bf16 tables, rounding every product and the sum
            return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)
        return torch.addcmul(x * cos, swapped, sin).to(x.dtype)  # float32 tables: one rounding


class _Attention(nn.Module):
    """q/k/v/o projections without bias, on 2-D activations ``[B * L, dim]``.

    Queries and keys come out as one tensor (``[B, L, heads + kv_heads, head_dim]``) so that their
    normalisation and RoPE run once for both.
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.q_proj = Linear(dim, heads * head_dim, bias=False)
        self.k_proj = Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, dim, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[B * L, dim]`` -> queries and keys ``[B * L, (heads + kv_heads) * head_dim]``, values."""
        return torch.cat([self.q_proj(x), self.k_proj(x)], dim=-1), self.v_proj(x)

    def qk_v(self, x: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B * L, dim]`` -> queries and keys ``[B, L, heads + kv_heads, head_dim]`` (one tensor),
        values ``[B, L, kv_heads, head_dim]``."""
        qk, v = self.project(x)
        return (qk.view(batch, length, self.n_heads + self.n_kv_heads, self.head_dim),
                v.view(batch, length, self.n_kv_heads, self.head_dim))

    def split_heads(self, qk: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q ``[B, heads, L, d]``, k and v ``[B, kv_heads, L, d]`` (views)."""
        q, k = qk.transpose(1, 2).split([self.n_heads, self.n_kv_heads], dim=1)
        return q, k, v.transpose(1, 2)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, heads, L, d]`` -> ``o_proj`` ``[B * L, dim]``."""
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B * L, -1))


class FusedQKV(_Attention):
    """Base of the attention swap classes: q, k and v as one matmul (``qkv_proj``)."""

    def __init__(self, attention: _Attention):
        adopt(self, attention)
        fuse_linears(self, ["q_proj", "k_proj", "v_proj"], "qkv_proj")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.qkv_proj(x).split([(self.n_heads + self.n_kv_heads) * self.head_dim,
                                       self.n_kv_heads * self.head_dim], dim=-1)


# --------------------------------------------------------------------------------------
# Gemma-3-style backbone and its cache


@dataclass
class TTSCache:
    """Backbone keys/values of one session, rows (conditional, unconditional), ``[2, kv_heads, capacity, head_dim]``.

    A global layer (``window`` None) keeps every position at slot = position. A sliding layer keeps
    the last ``window`` positions, the current one included, in a ring (slot = position % window).
    Buffers grow on the host by :func:`~nvchat_torch.nemotron_h.grown_capacity` (a sliding one up to its
    window, a global one up to ``limit``) and are written in place. ``offset``: positions written so far
    (warmup included), the next RoPE position.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: list[int | None]
    offset: int = 0
    limit: int | None = None  # positions the rotary tables cover

    def _reserve(self, layer: int, needed: int) -> None:
        capacity = self.keys[layer].shape[2]
        if needed <= capacity:
            return
        window = self.windows[layer]
        size = grown_capacity(capacity, needed, self.limit if window is None else window)
        for buffers in (self.keys, self.values):
            old = buffers[layer]
            grown = old.new_empty(*old.shape[:2], size, old.shape[3])
            grown[:, :, :capacity] = old
            buffers[layer] = grown

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[2, kv_heads, n, head_dim]`` at positions ``offset .. offset + n - 1``; return every
        position the layer holds (``[2, kv_heads, held, head_dim]`` views, ring order for sliding layers)."""
        n, start, window = keys.shape[2], self.offset, self.windows[layer]
        if window is None:
            self._reserve(layer, start + n)
            self.keys[layer][:, :, start:start + n] = keys
            self.values[layer][:, :, start:start + n] = values
            held = start + n
        else:
            if n > window:  # only the last `window` positions are ever attended again
                keys, values = keys[:, :, n - window:], values[:, :, n - window:]
                start, n = start + n - window, window
            self._reserve(layer, min(start + n, window))
            slot = start % window
            first = min(n, window - slot)
            self.keys[layer][:, :, slot:slot + first] = keys[:, :, :first]
            self.values[layer][:, :, slot:slot + first] = values[:, :, :first]
            if first < n:  # wrapped around the ring
                self.keys[layer][:, :, :n - first] = keys[:, :, first:]
                self.values[layer][:, :, :n - first] = values[:, :, first:]
            held = min(start + n, window)
        return self.keys[layer][:, :, :held], self.values[layer][:, :, :held]


class GemmaAttention(_Attention):
    """Self-attention with q/k RMSNorm before RoPE, scale ``query_pre_attn_scalar ** -0.5``, no soft-cap."""

    def __init__(self, config: TTSConfig):
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim, config.query_pre_attn_scalar ** -0.5)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm_weight(self) -> torch.Tensor:
        """``1 + w`` of q_norm per query head, then of k_norm per key head: ``[heads + kv_heads, head_dim]``."""
        return torch.cat([self.q_norm.offset_weight().expand(self.n_heads, -1),
                          self.k_norm.offset_weight().expand(self.n_kv_heads, -1)])

    def forward(self, x: torch.Tensor, batch: int, length: int, rope: tuple[torch.Tensor, ...],
                cache: TTSCache | None, layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        """``rope``: ``(cos, sin)`` tables for the ``length`` positions, or, for one position, its rotation
        matrix ``(M,)``: the norm weights then fold into it and norm + rotation take 3 ops."""
        qk, v = self.qk_v(x, batch, length)
        qk = F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps)
        if len(rope) == 1:  # [B, 1, heads, d] @ [heads, d, d]: per head diag(1 + w) M
            qk = torch.matmul(qk.unsqueeze(-2), self.qk_norm_weight()[:, :, None] * rope[0]).squeeze(-2)
        else:
            qk = Rotary.apply(qk * self.qk_norm_weight(), rope[0][:, None], rope[1][:, None])
        q, k, v = self.split_heads(qk, v)
        if cache is not None:
            held_k, held_v = cache.write(layer, k, v)
            if length == 1:  # one new position attends to every held one (no mask, as the reference)
                # The query heads of a KV head become that many query rows (a view): plain attention
                # over the held keys, which GQA would expand per query head, every step, whole history.
                b = q.shape[0]
                out = F.scaled_dot_product_attention(q.view(b, self.n_kv_heads, -1, self.head_dim), held_k, held_v,
                                                     scale=self.scale)
                return self.output(out.view(b, self.n_heads, 1, self.head_dim))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.n_heads != self.n_kv_heads)
        return self.output(out)


class FusedGemmaAttention(FusedQKV, GemmaAttention):
    """``prepare()``'s swap for :class:`GemmaAttention`: one QKV matmul, and the q/k norms' ``1 + w``
    per head precomputed for activations of ``dtype``."""

    def __init__(self, attention: GemmaAttention, dtype: torch.dtype):
        super().__init__(attention)
        scale = attention.qk_norm_weight().detach()
        self.register_buffer("qk_scale", scale.to(torch.promote_types(scale.dtype, dtype)), persistent=False)

    def qk_norm_weight(self) -> torch.Tensor:
        return self.qk_scale


class GemmaLayer(nn.Module):
    """Pre- and post-normed attention and MLP blocks (Gemma 3)."""

    def __init__(self, config: TTSConfig, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.self_attn = GemmaAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: int, length: int, rope: tuple[torch.Tensor, ...],
                cache: TTSCache | None, layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, length, rope, cache, layer, mask)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaBackbone(nn.Module):
    """The Gemma-3 decoder stack without token embeddings or input scaling (``backbone``).

    Layer i is global (RoPE base ``rope_global_base_freq``, every position) iff
    ``(i + 1) % sliding_window_pattern == 0``; the others slide (``rope_local_base_freq``, the last
    ``sliding_window`` positions including the current one).
    """

    def __init__(self, config: TTSConfig):
        super().__init__()
        self.window = config.sliding_window
        self.layers = nn.ModuleList([GemmaLayer(config, sliding=(i + 1) % config.sliding_window_pattern != 0)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_local = Rotary(config.head_dim, config.rope_local_base_freq)
        self.rope_global = Rotary(config.head_dim, config.rope_global_base_freq)

    @property
    def max_positions(self) -> int:
        return self.rope_global.cos.shape[0]

    def reserve_positions(self, positions: int) -> None:
        """Build the rotary tables for exactly ``positions`` positions (the model does it when built, from
        the LLM's ``max_position_embeddings``), so no session changes them while stepping."""
        for rope in (self.rope_local, self.rope_global):
            rope.init_constants(rope.cos.device, positions)

    def new_cache(self, dtype: torch.dtype = torch.float32) -> TTSCache:
        """An empty cache (two rows: conditional, unconditional) for activations of ``dtype``."""
        attn = self.layers[0].self_attn
        like = self.norm.weight
        empty = [like.new_zeros(2, attn.n_kv_heads, 0, attn.head_dim, dtype=dtype) for _ in range(2 * len(self.layers))]
        windows = [self.window if layer.sliding else None for layer in self.layers]
        return TTSCache(empty[::2], empty[1::2], windows, limit=self.max_positions)

    def _run(self, x: torch.Tensor, cache: TTSCache | None, start: int,
             masks: dict[bool, torch.Tensor | None]) -> torch.Tensor:
        batch, length, width = x.shape
        if length == 1:  # a step: one rotation matrix per RoPE base, shared by the layers
            tables = {False: (self.rope_global.rotation(start, x.dtype),),
                      True: (self.rope_local.rotation(start, x.dtype),)}
        else:
            tables = {False: self.rope_global.table(start, length), True: self.rope_local.table(start, length)}
        x = x.reshape(batch * length, width)  # 2-D activations: linears without reshapes
        for index, layer in enumerate(self.layers):
            x = layer(x, batch, length, tables[layer.sliding], cache, index, masks[layer.sliding])
        if cache is not None:
            cache.offset += length
        return self.norm(x).view(batch, length, width)

    def forward(self, x: torch.Tensor, cache: TTSCache | None = None) -> torch.Tensor:
        """A whole sequence ``[B, L, H]`` from position 0 (causal; sliding layers windowed); fills an
        empty ``cache`` if one is given."""
        if cache is not None and cache.offset != 0:
            raise ValueError(f"GemmaBackbone.forward starts at position 0 but the cache already holds "
                             f"{cache.offset} positions; use forward_step")
        positions = torch.arange(x.shape[1], device=x.device)
        distance = positions[:, None] - positions[None, :]
        causal = distance >= 0
        return self._run(x, cache, 0, {False: causal, True: causal & (distance < self.window)})

    def forward_step(self, x: torch.Tensor, cache: TTSCache) -> torch.Tensor:
        """One position ``[B, 1, H]`` at ``cache.offset``, attending to every cached position."""
        if x.shape[1] != 1:
            raise ValueError(f"forward_step takes one position [B, 1, H], got {list(x.shape)}")
        return self._run(x, cache, cache.offset, {False: None, True: None})


# --------------------------------------------------------------------------------------
# Text conditioning: character-aware subword encoder, subword flags, gated fusion


class CharEncoderAttention(_Attention):
    """Bidirectional attention over one subword's characters: RoPE at positions 0.., logits soft-capped
    (``tanh(s / cap) * cap``), padding keys filled with -1e30, float32 softmax."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim, config.query_pre_attn_scalar ** -0.5)
        self.softcap = config.attn_logit_softcapping

    def forward(self, x: torch.Tensor, batch: int, length: int, cos: torch.Tensor, sin: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        qk, v = self.qk_v(x, batch, length)
        q, k, v = self.split_heads(Rotary.apply(qk, cos, sin), v)
        if self.n_heads != self.n_kv_heads:
            repeats = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        # The reference's op sequence, each op rounded in a bf16 encoder: scale, / cap, tanh, * cap.
        dt = q.dtype
        scores = matmul(q, k.transpose(-1, -2)) * scalar(self.scale, dt)
        scores = torch.tanh(scores / scalar(self.softcap, dt)) * scalar(self.softcap, dt)
        scores = torch.where(valid[:, None, None, :], scores, MASKED_SCORE)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return self.output(matmul(probs, v))


class FusedCharEncoderAttention(FusedQKV, CharEncoderAttention):
    """``prepare()``'s swap for :class:`CharEncoderAttention`: one QKV matmul."""


class CharEncoderLayer(nn.Module):
    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = CharEncoderAttention(config)
        self.mlp = GatedMLP(dim, config.intermediate_size)
        self.pre_self_attn_layernorm = RMSNorm(dim, eps, fp32=True)
        self.post_self_attn_layernorm = RMSNorm(dim, eps, fp32=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, fp32=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, fp32=True)

    def forward(self, x: torch.Tensor, batch: int, length: int, cos: torch.Tensor, sin: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.pre_self_attn_layernorm(x), batch, length, cos, sin, valid)
        x = x + self.post_self_attn_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class CharEncoder(nn.Module):
    """The one-layer T5Gemma-style encoder over characters (``backbone.encoder``), on ``[N * L, dim]``."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList([CharEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32=True)

    def forward(self, x: torch.Tensor, batch: int, length: int, cos: torch.Tensor, sin: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, batch, length, cos, sin, valid)
        return self.norm(x)


def _flag_rows(table: torch.Tensor, oov: torch.Tensor, ids: torch.Tensor, first_oov: int) -> torch.Tensor:
    """``table[ids]``, with ids >= ``first_oov`` read at the checkpoint's ``oov`` index."""
    return table[torch.where(ids >= first_oov, oov, ids)]


class SubwordFlagEmbedding(nn.Module):
    """Adds ``cont_emb[is_continuation[id]]`` (checkpoint table; ids >= vocab read at ``pad_tensor``)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.register_buffer("pad_tensor", torch.tensor(vocab_size, dtype=torch.int32))
        self.register_buffer("is_continuation", torch.zeros(vocab_size + 1, dtype=torch.int32))
        self.cont_emb = nn.Embedding(2, hidden_size)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flags = _flag_rows(self.is_continuation, self.pad_tensor, ids, self.is_continuation.shape[0] - 1)
        return x + self.cont_emb(flags)


class BOSEOSEmbedding(nn.Module):
    """Adds ``special_emb[special_flags[id]]`` (0 plain, 1 BOS, 2 EOS; ids >= vocab read at ``pad_tensor``)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        # The checkpoint's out-of-vocabulary index is the last id (the source stored max(vocab.values())).
        self.register_buffer("pad_tensor", torch.tensor(vocab_size - 1, dtype=torch.int32))
        self.register_buffer("special_flags", torch.zeros(vocab_size, dtype=torch.int32))
        self.special_emb = nn.Embedding(3, hidden_size)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flags = _flag_rows(self.special_flags, self.pad_tensor, ids, self.special_flags.shape[0])
        return x + self.special_emb(flags)


class CharAwareSubwordEncoder(nn.Module):
    """Text id -> embedding from the characters of its token string (``embed_subword``).

    :meth:`set_vocabulary` turns the tokenizer's strings into per-id character tables
    (``char_ids [ids + 1, max_chars]``, padded with the pad character; the extra last row, all
    padding, serves ids beyond the vocabulary), so a step gathers one row instead of looping over
    characters. Each selected position: characters embedded and scaled by ``sqrt(hidden)`` (rounded
    to the activation dtype), one encoder layer, mean over the real characters, ``proj_embedding``;
    an empty string or an unselected position gives 0. Every position then adds its subword-flag
    and BOS/EOS embeddings.
    """

    def __init__(self, config: CharacterEncoderConfig, out_size: int, vocab_size: int = SUBWORD_VOCAB_SIZE):
        super().__init__()
        self.backbone = nn.Module()  # checkpoint nesting: backbone.encoder
        self.backbone.encoder = CharEncoder(config)
        self.embed_tokens = nn.Embedding(config.char_vocab_size, config.hidden_size)
        self.proj_embedding = Linear(config.hidden_size, out_size, bias=False)
        self.subword_flag_emb = SubwordFlagEmbedding(vocab_size, config.hidden_size)
        self.bos_eos_emb = BOSEOSEmbedding(vocab_size, config.hidden_size)
        self.pad_char = config.char_vocab_size - 1
        self.scale = config.hidden_size ** 0.5
        self.rope = Rotary(config.head_dim, config.rope_base, positions=64)
        self.register_buffer("char_ids", None, persistent=False)  # int16 [ids + 1, max_chars]
        self.register_buffer("char_counts", None, persistent=False)  # int32 [ids + 1]

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        """Build the character tables from ``tokenizer.get_vocab()`` (token string -> id).

        The one-character tokens, sorted by id, are the character vocabulary (ids 0..n-1, pad n);
        a token's characters missing from it are skipped.
        """
        chars = sorted((token for token in vocabulary if len(token) == 1), key=vocabulary.__getitem__)
        if len(chars) + 1 != self.embed_tokens.num_embeddings:
            raise ValueError(f"the tokenizer has {len(chars)} one-character tokens, so {len(chars) + 1} character "
                             f"ids with padding, but embed_subword.embed_tokens has "
                             f"{self.embed_tokens.num_embeddings} rows")
        char_of = {c: i for i, c in enumerate(chars)}
        rows = max(vocabulary.values()) + 2
        spelled: list[list[int]] = [[] for _ in range(rows)]
        for token, index in vocabulary.items():
            spelled[index] = [char_of[c] for c in token if c in char_of]
        width = max(1, max(len(s) for s in spelled))
        table = torch.tensor([s + [self.pad_char] * (width - len(s)) for s in spelled], dtype=torch.int16)
        device = self.embed_tokens.weight.device
        self.char_ids = table.to(device)
        self.char_counts = torch.tensor([len(s) for s in spelled], dtype=torch.int32, device=device)
        self.rope.reserve(width)  # now, not in a step

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``ids [B, T]`` (and the positions to encode, ``mask [B, T]``, default all) -> ``[B, T, out]``."""
        if self.char_ids is None:
            raise RuntimeError("call set_vocabulary(tokenizer.get_vocab()) on the TTS before running it")
        rows = ids.clamp(max=self.char_ids.shape[0] - 1)
        chars = self.char_ids[rows].flatten(0, 1)  # [N = B * T, max_chars]
        count, width = chars.shape
        valid = chars != self.pad_char
        x = self.embed_tokens(chars.int().flatten())
        x = x * scalar(self.scale, x.dtype)
        cos, sin = self.rope.table(0, width)
        hidden = self.backbone.encoder(x, count, width, cos[:, None], sin[:, None], valid)
        pooled = (hidden.view(count, width, -1) * valid[..., None]).sum(1)
        pooled = pooled / self.char_counts[rows].flatten().clamp(min=1)[:, None]
        out = self.proj_embedding(pooled).view(*ids.shape, -1)
        if mask is not None:
            out = torch.where(mask[..., None], out, 0.0)
        return self.bos_eos_emb(self.subword_flag_emb(out, ids), ids)


class GatedFusion(nn.Module):
    """``final_norm(s * (g * audio_proj(audio / Q) + (1 - g) * text_proj(text)))`` with
    ``g = sigmoid(gate)``, ``s = sigmoid(residual_scale)`` (``gated_fusion_audio_text``)."""

    def __init__(self, hidden_size: int, num_codebooks: int, eps: float):
        super().__init__()
        self.num_codebooks = num_codebooks
        self.audio_proj = Linear(hidden_size, hidden_size)
        self.text_proj = Linear(hidden_size, hidden_size)
        self.gate = nn.Parameter(torch.zeros(hidden_size))
        self.residual_scale = nn.Parameter(torch.tensor(0.5))
        self.final_norm = RMSNorm(hidden_size, eps, fp32=True)

    def mixing(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``g``, ``1 - g`` and ``s``: the sigmoids in the parameters' dtype (bf16 arithmetic for bf16
        weights), then cast to the activations' ``dtype``, where ``1 - g`` is formed."""
        gate = sigmoid(self.gate).to(dtype)
        return gate, 1.0 - gate, sigmoid(self.residual_scale).to(dtype)

    def forward(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        audio = self.audio_proj(audio / self.num_codebooks)
        gate, keep, scale = self.mixing(audio.dtype)
        return self.final_norm(scale * (gate * audio + keep * self.text_proj(text)))


class FusedGatedFusion(GatedFusion):
    """``prepare()``'s swap for :class:`GatedFusion`: ``g``, ``1 - g`` and ``s`` computed once for
    activations of ``dtype`` (one ``[3, H]`` buffer)."""

    def __init__(self, fusion: GatedFusion, dtype: torch.dtype):
        adopt(self, fusion)
        gate, keep, scale = fusion.mixing(dtype)
        self.register_buffer("mixed", torch.stack([gate, keep, scale.expand_as(gate)]).detach(), persistent=False)

    def mixing(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.mixed[0], self.mixed[1], self.mixed[2, 0]


# --------------------------------------------------------------------------------------
# Mixture-of-Gaussians head


class MoGLayer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.pre_norm = RMSNorm(hidden_size, eps, fp32=True)
        self.mlp = GatedMLP(hidden_size, intermediate_size)
        self.post_norm = RMSNorm(hidden_size, eps, fp32=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


def sample_component(logits: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """A draw over the last axis of ``logits`` among the components kept by top-p (the reference's
    rule: keep k iff the probability mass strictly above k is < ``top_p``).

    Gumbel-max in the form ``argmax(p_k / E_k)`` with ``E_k = -log(u_k)`` exponential (equal to
    ``argmax(log p_k + g_k)``, g Gumbel), done in the descending order of the probabilities, where
    top-p is a prefix: no scatter back, one gather of the winner's index.
    """
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        mass_above = probs.cumsum(-1) - probs
        probs = torch.where(mass_above < top_p, probs, 0.0)
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device)
    exponential = torch.rsub(torch.log(uniform + GUMBEL_EPS), GUMBEL_EPS)  # -log(u) (guarded)
    return order.gather(-1, (probs / exponential).argmax(-1, keepdim=True)).squeeze(-1)


class MoGHead(nn.Module):
    """Proposes the next latent from the (conditional, unconditional) features (``mog_head``).

    ``mlp_stack`` (3 residual MLPs + a norm) runs on both rows; guidance mixes the features
    (``c + g (c - u)``); a component k is drawn from ``proj_logits`` (or the most likely one);
    its mean is ``low_mat[k] @ (W_mus[k] @ x) * std + proj_else(x)``, ``std = exp(max(proj_logs(x), min))``.
    """

    def __init__(self, hidden_size: int, out_size: int, config: MoGConfig):
        super().__init__()
        self.out_size = out_size
        self.num_predictions, self.low_rank = config.num_predictions, config.low_rank
        self.min_log_std = config.min_log_std
        self.mlp_stack = nn.ModuleList(
            [MoGLayer(hidden_size, config.intermediate_size, config.eps) for _ in range(config.num_layers)]
            + [RMSNorm(hidden_size, config.eps, fp32=True)])
        self.proj_logits = Linear(hidden_size, config.num_predictions, bias=False)
        self.proj_mus = Linear(hidden_size, config.num_predictions * config.low_rank, bias=False)
        self.proj_logs = Linear(hidden_size, 1, bias=False)
        self.proj_else = Linear(hidden_size, out_size, bias=False)
        self.low_mat = nn.Parameter(torch.zeros(config.num_predictions, out_size, config.low_rank))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Component logits, log std and the rest of the mean."""
        return self.proj_logits(x), self.proj_logs(x), self.proj_else(x)

    def forward(self, x: torch.Tensor, guidance_scale: float, top_p: float, generator: torch.Generator | None,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [2, H]`` (conditional, unconditional) -> (mean ``[1, out]``, std ``[1, 1]``)."""
        for layer in self.mlp_stack:
            x = layer(x)
        x = torch.lerp(x[1:], x[:1], 1.0 + guidance_scale)  # cond + g (cond - uncond)
        logits, log_std, rest = self.heads(x)
        if deterministic:
            component = logits.argmax(-1)
        else:
            component = sample_component(logits, top_p, generator)
        mus = self.proj_mus.weight.view(self.num_predictions, self.low_rank, -1).index_select(0, component)
        low = self.low_mat.index_select(0, component)
        mus, low = mus.to(promoted(x, mus)), low.to(promoted(x, low))  # stored-dtype rows: promoted, as MLX
        mean = torch.matmul(low, torch.matmul(mus, x[..., None]))  # [1, out, 1]
        std = log_std.clamp(min=self.min_log_std).exp()
        return torch.addcmul(rest, mean.view(1, -1), std), std


class FusedMoGHead(MoGHead):
    """``prepare()``'s swap for :class:`MoGHead`: ``proj_logits``, ``proj_logs`` and ``proj_else`` as one
    matmul (``proj_heads``)."""

    def __init__(self, head: MoGHead):
        adopt(self, head)
        fuse_linears(self, ["proj_logits", "proj_logs", "proj_else"], "proj_heads")

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj_heads(x).split([self.num_predictions, 1, self.out_size], dim=-1)


# --------------------------------------------------------------------------------------
# EAR-TTS


@dataclass
class TTSPrompt:
    """The speaker warmup: ``F`` positions of codes, text and the prompt latents (batch 1)."""

    codes: torch.Tensor  # [1, F, Q] long; the mask code (codebook_size) where nothing is known
    subword_ids: torch.Tensor  # [1, F] long
    subword_mask: torch.Tensor  # [1, F] bool: positions whose text goes through the char encoder
    audio_mask: torch.Tensor  # [1, F] bool: positions of real audio (its first one gets bos_emb)
    latents: torch.Tensor  # [1, F, H]: the code embedding before the first audio position


def _draw_schedule(config: TTSConfig) -> list[tuple[int, int]]:
    """(first quantizer, count) of each MoG draw of a frame: the reference's unmasking schedule
    ``masked_i = ceil((1 - (i / n) ** e) ** (1 / e) * Q)``, draws of no quantizer dropped
    (n=8, e=3, Q=31: counts 1, 1, 3, 4, 22)."""
    n, e, q = config.num_iterations, config.exponent, config.num_quantizers
    masked = [math.ceil(((1.0 - (i / n) ** e) ** (1.0 / e)) * q) for i in range(n)] + [0]
    draws, start = [], 0
    for i in range(n):
        count = masked[i] - masked[i + 1]
        if count:
            draws.append((start, count))
            start += count
    return draws


def _squared_norms(books: torch.Tensor) -> torch.Tensor:
    """``sum(e * e)`` per codebook row as the reference forms it in the codebooks' dtype (bf16: rounded
    products, float32 accumulation, one rounding), returned in float32."""
    return (books * books).sum(-1, dtype=torch.float32).to(books.dtype).float()


class EarTTS(nn.Module):
    """EAR-TTS (``tts_model.tts_model``): previous codes + current text id -> the next 31 codes.

    :meth:`warmup` primes a :class:`TTSCache` with the speaker prompt; :meth:`step` =
    :meth:`forward_step` (backbone hidden state ``[2, 1, H]``, rows conditional and unconditional)
    + :meth:`generate_codes`. Call :meth:`set_vocabulary` once with the LLM tokenizer's vocabulary.
    """

    def __init__(self, config: TTSConfig):
        super().__init__()
        self.config = config
        hidden, latent = config.hidden_size, config.latent_size
        self.backbone = GemmaBackbone(config)
        self.bos_emb = nn.Parameter(torch.zeros(hidden))
        self.null_emb = nn.Parameter(torch.zeros(hidden))
        self.embed_code = Linear(latent, hidden, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(config.character_encoder, hidden)
        self.gated_fusion_audio_text = GatedFusion(hidden, config.num_quantizers, config.rms_norm_eps)
        # Projects prompt codes when no speaker latents are given; the reference always gives them.
        self.audio_prompt_projection_W = nn.Parameter(torch.zeros(hidden, hidden))
        self.mog_head = MoGHead(hidden, latent, config.mog_head)
        self.rvq_embs = nn.Parameter(torch.zeros(config.num_quantizers, config.codebook_size, latent))
        self.schedule = _draw_schedule(config)
        # The reference runs the backbone, MoG head and distances in float32 whatever the weights'
        # dtype (its float32 code sums promote them); the opt-in fast mode sets bf16/fp16 here.
        self.activation_dtype = torch.float32
        self.init_constants()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        """(Re)create the computed constants (quantizer index, rotary tables) on ``device``."""
        self.register_buffer("quantizer_index", torch.arange(self.config.num_quantizers, device=device),
                             persistent=False)
        for module in self.modules():
            if isinstance(module, Rotary):
                module.init_constants(device, module.cos.shape[0])

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        self.embed_subword.set_vocabulary(vocabulary)

    def new_cache(self) -> TTSCache:
        return self.backbone.new_cache(self.activation_dtype)

    # ---- inputs

    def depth_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """``[..., Q]`` codes -> ``[..., latent]`` float32 sum of ``rvq_embs[q, code_q]``; the mask
        code (``codebook_size``) adds nothing."""
        mask_code = self.config.codebook_size
        rows = self.rvq_embs[self.quantizer_index, codes.clamp(max=mask_code - 1)]
        return torch.where((codes != mask_code)[..., None], rows, 0.0).sum(-2, dtype=torch.float32)

    def _fuse_inputs(self, code_embed: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Guidance doubling (the unconditional row's text is ``null_emb``) and gated fusion:
        ``[1, ..., H]`` each -> ``[2, ..., H]``."""
        cond = torch.cat([text, self.null_emb.to(text.dtype).expand_as(text)], dim=0)
        return self.gated_fusion_audio_text(code_embed, cond)

    def warmup(self, prompt: TTSPrompt, cache: TTSCache | None = None) -> torch.Tensor:
        """Run the speaker prompt from position 0, filling the empty ``cache``; -> hidden ``[2, F, H]``.

        Code embeddings are those of the previous position's codes (zeros before the first),
        replaced by the prompt latents before the first audio position, plus ``bos_emb`` there.
        """
        F_, H, Q = prompt.latents.shape[1], self.config.hidden_size, self.config.num_quantizers
        _check_shape("prompt.codes", prompt.codes, (1, F_, Q), integer=True)
        _check_shape("prompt.latents", prompt.latents, (1, F_, H))
        for name in ("subword_ids", "subword_mask", "audio_mask"):
            _check_shape(f"prompt.{name}", getattr(prompt, name), (1, F_))
        dtype = self.activation_dtype
        shifted = torch.cat([torch.zeros_like(prompt.codes[:, :1]), prompt.codes[:, :-1]], dim=1)
        code_embed = self.embed_code(self.depth_sum(shifted).to(dtype))
        audio = prompt.audio_mask
        bos = audio & ~torch.cat([torch.zeros_like(audio[:, :1]), audio[:, :-1]], dim=1)
        before_bos = (bos.cumsum(1) == 0)[..., None]
        code_embed = torch.where(before_bos, prompt.latents.to(dtype), code_embed) + bos[..., None] * self.bos_emb
        text = self.embed_subword(prompt.subword_ids, prompt.subword_mask)
        return self.backbone(self._fuse_inputs(code_embed, text), cache)

    forward = warmup

    def forward_step(self, prev_codes: torch.Tensor, text_id: torch.Tensor, cache: TTSCache) -> torch.Tensor:
        """Previous codes ``[1, 1, Q]`` and this step's text id ``[1]`` -> hidden ``[2, 1, H]``."""
        _check_shape("prev_codes", prev_codes, (1, 1, self.config.num_quantizers), integer=True)
        _check_shape("text_id", text_id, (1,), integer=True)
        code_embed = self.embed_code(self.depth_sum(prev_codes.view(1, -1)).to(self.activation_dtype))
        text = self.embed_subword(text_id.view(1, 1)).view(1, -1)
        return self.backbone.forward_step(self._fuse_inputs(code_embed, text).view(2, 1, -1), cache)

    # ---- codes

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codebooks in float32 ``[Q, K, latent]`` and their squared norms ``[Q, K]`` (see :func:`_squared_norms`)."""
        return self.rvq_embs.float(), _squared_norms(self.rvq_embs)

    def generate_codes(self, hidden: torch.Tensor, generator: torch.Generator | None = None,
                       deterministic: bool = False) -> torch.Tensor:
        """Hidden ``[2, 1, H]`` -> codes ``[1, 1, Q]`` (long) by the iterative MoG schedule.

        Each draw sees the embedding of the codes decided so far; its proposal (plus Gaussian noise
        ``* noise_scale``) is assigned greedily to the draw's quantizers, starting afresh at the
        first undecided one. ``deterministic``: the most likely component and no noise (the parity
        mode); otherwise top-p + Gumbel-max with ``generator``'s uniform and normal draws.
        """
        config = self.config
        _check_shape("hidden", hidden, (2, 1, config.hidden_size))
        books, sq_norms = self.codebooks()
        hidden = hidden.view(2, -1)
        decided: torch.Tensor | None = None  # float32 [1, latent]: sum of the chosen codebook rows
        picked: list[torch.Tensor] = []
        for draw, (start, count) in enumerate(self.schedule):
            x = hidden
            if decided is not None:  # hidden + embed_code(decided), both rows, as one addmm
                x = torch.addmm(hidden, decided.to(hidden.dtype).expand(2, -1), self.embed_code.weight.to(hidden.dtype).t())
            mean, std = self.mog_head(x, config.guidance_scale, config.top_p, generator, deterministic)
            residual = mean.float()
            if not deterministic and config.noise_scale > 0:
                noise = torch.randn(residual.shape, generator=generator, device=residual.device)
                residual = torch.addcmul(residual, std.float(), noise, value=config.noise_scale)
            last_draw = draw == len(self.schedule) - 1
            for q in range(start, start + count):
                index = torch.addmm(sq_norms[q], residual, books[q].T, alpha=-2.0).argmin(-1)  # [1]
                row = books[q].index_select(0, index)
                picked.append(index)
                if q + 1 < start + count:
                    residual = residual - row
                if not last_draw:
                    decided = row if decided is None else decided + row
        return torch.stack(picked, dim=-1).view(1, 1, config.num_quantizers)

    def step(self, prev_codes: torch.Tensor, text_id: torch.Tensor, cache: TTSCache,
             generator: torch.Generator | None = None, deterministic: bool = False) -> torch.Tensor:
        """One frame: previous codes ``[1, 1, Q]``, text id ``[1]`` -> codes ``[1, 1, Q]``."""
        return self.generate_codes(self.forward_step(prev_codes, text_id, cache), generator, deterministic)


class FusedEarTTS(EarTTS):
    """``prepare()``'s swap for :class:`EarTTS`: the codebooks kept in float32 with a zero row for the
    mask code appended (``rvq_float [Q, K + 1, latent]``: the depth sum is then a plain gather and
    sum), and their squared norms. ``rvq_embs`` becomes a view of it, so there is one copy: bf16
    codebooks are stored upcast (exactly; 2 more bytes per entry, 33 MB at full size)."""

    def __init__(self, tts: EarTTS):
        adopt(self, tts)
        books = self.rvq_embs.detach()
        padded = books.new_zeros(books.shape[0], books.shape[1] + 1, books.shape[2], dtype=torch.float32)
        padded[:, :-1] = books
        self.register_buffer("rvq_sq_norms", _squared_norms(books), persistent=False)
        self.rvq_embs.data = padded[:, :-1]
        self.register_buffer("rvq_float", padded, persistent=False)

    def depth_sum(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_float[self.quantizer_index, codes].sum(-2)  # row mask_code is zeros

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rvq_float[:, :-1], self.rvq_sq_norms


# --------------------------------------------------------------------------------------
# Speech decoder: prompt, silence and control codes around EAR-TTS and the codec


class PromptLatents(nn.Module):
    """``audio_prompt_latents.Aria``: the speaker's prompt latents ``[1, 37, H]``."""

    def __init__(self, hidden_size: int, frames: int = PROMPT_FRAMES):
        super().__init__()
        self.Aria = nn.Parameter(torch.zeros(1, frames, hidden_size))


class SpeechDecoder(nn.Module):
    """``tts_model``: EAR-TTS, the codec, the speaker prompt, silence and control codes.

    A session calls :meth:`start` (warmed cache, first previous codes), then :meth:`step` per frame
    with the LLM's text id, and decodes ``replace_control_codes(codes)`` with the codec.
    """

    def __init__(self, tts_config: TTSConfig, codec_config: CodecConfig, *,
                 pad_token_id: int = 12, eos_token_id: int = 2):
        super().__init__()
        self.config = tts_config
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.audio_codec = Codec(codec_config)
        self.tts_model = EarTTS(tts_config)
        self.register_buffer("_control_codes", torch.zeros(3, dtype=torch.int32))
        self.register_buffer("codec_silence_tokens", torch.zeros(tts_config.num_quantizers, dtype=torch.int32))
        self.audio_prompt_latents = PromptLatents(tts_config.hidden_size)

    def init_constants(self, device: torch.device | str | None = None) -> None:
        self.tts_model.init_constants(device)
        self.audio_codec.init_constants(device)

    def fuse(self) -> None:
        """The post-load transforms of EAR-TTS and the codec, as module swaps (outputs unchanged): one
        matmul for q/k/v, gate/up and the MoG heads, the norms' ``1 + w`` and the fusion gates
        precomputed in the activation dtype, the codebooks kept in float32 with their squared norms,
        the codec's codebooks stacked; and the silence codes stored as the long codes a step compares
        and returns (no conversion per step)."""
        dtype = self.tts_model.activation_dtype
        swap_modules(self, RMSNorm, lambda norm: PrecomputedRMSNorm(norm, dtype))
        swap_modules(self, GatedMLP, FusedGatedMLP)
        swap_modules(self, GemmaAttention, lambda attention: FusedGemmaAttention(attention, dtype))
        swap_modules(self, CharEncoderAttention, FusedCharEncoderAttention)
        swap_modules(self, GatedFusion, lambda fusion: FusedGatedFusion(fusion, dtype))
        swap_modules(self, MoGHead, FusedMoGHead)
        swap_modules(self, EarTTS, FusedEarTTS)
        self.audio_codec.fuse()
        self.codec_silence_tokens = self.codec_silence_tokens.long()

    def prompt(self) -> TTSPrompt:
        """The speaker warmup: codes of ``F + 1`` silent codec frames, the first and last of the
        first ``F`` set to the mask code; PAD text, encoded at the last two positions; audio at the last."""
        latents = self.audio_prompt_latents.Aria
        frames, device = latents.shape[1], latents.device
        silence = torch.zeros(1, 1, (frames + 1) * self.audio_codec.samples_per_frame, device=device)
        codes = self.audio_codec.encode(silence).transpose(1, 2)
        _check_shape("codec codes of the silent prompt", codes, (1, frames + 1, self.config.num_quantizers))
        codes = codes[:, :frames].clone()
        codes[:, [0, frames - 1]] = self.config.mask_code
        subword_ids = torch.full((1, frames), self.pad_token_id, dtype=torch.long, device=device)
        positions = torch.arange(frames, device=device)[None]
        return TTSPrompt(codes, subword_ids, positions >= frames - 2, positions == frames - 1, latents)

    def start(self) -> tuple[TTSCache, torch.Tensor]:
        """A cache warmed with the speaker prompt and the first previous codes (all mask) ``[1, 1, Q]``."""
        prompt = self.prompt()
        cache = self.tts_model.new_cache()
        self.tts_model.warmup(prompt, cache)
        return cache, prompt.codes[:, -1:].clone()

    def reset_on_eos(self, prev_codes: torch.Tensor, text_id: torch.Tensor) -> torch.Tensor:
        """``prev_codes [1, 1, Q]``, or the silence codes where ``text_id [1]`` is EOS (on the device)."""
        _check_shape("prev_codes", prev_codes, (1, 1, self.config.num_quantizers), integer=True)
        _check_shape("text_id", text_id, (1,), integer=True)
        return torch.where((text_id == self.eos_token_id).view(-1, 1, 1), self.silence_codes(prev_codes.dtype), prev_codes)

    def silence_codes(self, dtype: torch.dtype) -> torch.Tensor:
        """The silence codes in ``dtype``."""
        return self.codec_silence_tokens.to(dtype)

    def step(self, prev_codes: torch.Tensor, text_id: torch.Tensor, cache: TTSCache,
             generator: torch.Generator | None = None, deterministic: bool = False) -> torch.Tensor:
        """One frame of codes ``[1, 1, Q]`` (long) from the previous codes and this step's text id ``[1]``."""
        return self.tts_model.step(self.reset_on_eos(prev_codes, text_id), text_id, cache, generator, deterministic)

    def replace_control_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``[..., Q]`` codes with every control code replaced by its quantizer's silence code."""
        is_control = (codes[..., None] == self._control_codes).any(-1)
        return torch.where(is_control, self.silence_codes(codes.dtype), codes)
