"""The EAR-TTS backbone (``tts_model.tts_model.backbone``): a Gemma-3-style decoder stack, its
attention with a key/value cache (:class:`TTSCache`), and the transformer pieces the character
encoder (:mod:`nvchat_torch.models.subword`) shares with it: rotary tables, q/k/v attention, gated MLP.

Layer i is global (every position) iff ``(i + 1) % sliding_window_pattern == 0``, the others slide
over the last ``sliding_window`` positions; each has its own RoPE base. A step attends one new
position to every held one and reads nothing on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .config import TTSConfig
from .layers import (
    REDUCED,
    FusedOnCpu,
    Linear,
    OffsetRMSNorm,
    RowCache,
    RowTensor,
    adopt,
    gelu_tanh,
    grown_capacity,
    layer_step,
    layer_step_input,
    norm_linear,
)
from .quant import fuse_linears

__all__ = ["GatedMLP", "FusedGatedMLP", "Rotary", "FusedQKV", "TTSCache", "TTSRows", "GemmaAttention", "FusedGemmaAttention",
           "GemmaLayer", "GemmaBackbone"]

ROPE_POSITIONS = 8192  # rotary table length until the model reserves its own (GemmaBackbone.reserve_positions)


class GatedMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.gate_proj(x), self.up_proj(x)

    def gated(self, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        """``gelu_tanh(gate(h)) * up(h)`` of ``h = norm(x)``: the down projection's input."""
        gate, up = self.gate_up(x if norm is None else norm(x))
        return gelu_tanh(gate) * up

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """``norm``: the pre-norm, applied to x here (fused with the gate and up projections on a CPU)."""
        return self.down_proj(self.gated(x, norm))


class FusedGatedMLP(GatedMLP):
    """``prepare()``'s swap for :class:`GatedMLP`: gate and up as one matmul (``gate_up_proj``); on a CPU
    the pre-norm, that matmul and the gate as one kernel (:func:`~nvchat_torch.models.layers.norm_linear`)."""

    def __init__(self, mlp: GatedMLP):
        adopt(self, mlp)
        fuse_linears(self, ["gate_proj", "up_proj"], "gate_up_proj")

    def gated(self, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        return norm_linear(norm, x, self.gate_up_proj, "gelu_tanh_mul")


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
        # swap[j, i] = 1 where x_j is the swapped-halves partner of x_i (for rotation_rows()).
        self.register_buffer("swap", torch.roll(torch.eye(self.dim, device=device), half, dims=0), persistent=False)

    def rotation_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """RoPE at each row's position as a matrix: ``positions [R]`` -> ``M [R, 1, 1, dim, dim]``; ``x @ M``
        rotates ``x`` (3 ops, shared by every layer of a step, which then rotates with one matmul)."""
        cos, sin = self.cos[positions], self.sin[positions]
        return (torch.diag_embed(cos) + self.swap * sin[:, None]).to(dtype)[:, None, None]

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


class AttentionProjections(nn.Module):
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


class FusedQKV(AttentionProjections):
    """Base of the attention swap classes: q, k and v as one matmul (``qkv_proj``)."""

    def __init__(self, attention: AttentionProjections):
        adopt(self, attention)
        fuse_linears(self, ["q_proj", "k_proj", "v_proj"], "qkv_proj")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.qkv_proj(x).split([(self.n_heads + self.n_kv_heads) * self.head_dim,
                                       self.n_kv_heads * self.head_dim], dim=-1)


# --------------------------------------------------------------------------------------
# The backbone and its cache


@dataclass
class TTSCache(RowCache):
    """Backbone keys/values of one session, rows (conditional, unconditional), ``[2, kv_heads, capacity, head_dim]``.

    A global layer (``window`` None) keeps every position at slot = position. A sliding layer keeps
    the last ``window`` positions, the current one included, in a ring (slot = position % window).
    Buffers grow on the host by :func:`~nvchat_torch.models.layers.grown_capacity` (a sliding one up to its
    window, a global one up to ``limit``) and are written in place. ``offset``: positions written so far
    (warmup included), the next RoPE position.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: list[int | None]
    offset: int = 0
    limit: int | None = None  # positions the rotary tables cover

    def reserve_layer(self, layer: int, needed: int) -> None:
        capacity = self.keys[layer].shape[2]
        if needed <= capacity:
            return
        window = self.windows[layer]
        size = grown_capacity(capacity, needed, self.limit if window is None else window)
        for buffers in (self.keys, self.values):
            old = buffers[layer]
            grown = old.new_zeros(*old.shape[:2], size, old.shape[3])  # masked slots must be finite (see KVCache)
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
            self.reserve_layer(layer, start + n)
            self.keys[layer][:, :, start:start + n] = keys
            self.values[layer][:, :, start:start + n] = values
            held = start + n
        else:
            if n > window:  # only the last `window` positions are ever attended again
                keys, values = keys[:, :, n - window:], values[:, :, n - window:]
                start, n = start + n - window, window
            self.reserve_layer(layer, min(start + n, window))
            slot = start % window
            first = min(n, window - slot)
            self.keys[layer][:, :, slot:slot + first] = keys[:, :, :first]
            self.values[layer][:, :, slot:slot + first] = values[:, :, :first]
            if first < n:  # wrapped around the ring
                self.keys[layer][:, :, :n - first] = keys[:, :, first:]
                self.values[layer][:, :, :n - first] = values[:, :, first:]
            held = min(start + n, window)
        return self.keys[layer][:, :, :held], self.values[layer][:, :, :held]

    def reserve(self, end: int) -> bool:
        """Room for positions ``[0, end)`` in every layer (a sliding one up to its window), grown in whole
        blocks outside any step; returns whether a buffer grew (a compiled step then sees a new capacity)."""
        grew = False
        for layer, window in enumerate(self.windows):
            needed = end if window is None else min(end, window)
            grew |= needed > self.keys[layer].shape[2]
            self.reserve_layer(layer, needed)
        return grew

    def batched(self) -> list[RowTensor]:
        return [(t, 0, 2) for t in self.keys + self.values]  # two rows a conversation: (conditional, unconditional)

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        layers = len(self.keys)
        self.keys[:], self.values[:] = tensors[:layers], tensors[layers:]

    def copy_rows(self, row: int, prefilled: TTSCache) -> None:
        """Row ``row`` (its two) from a one-conversation cache's positions (a prefill's); a buffer that is
        the prefill's own already is left as it is."""
        for layer, window in enumerate(self.windows):
            held = prefilled.offset if window is None else min(prefilled.offset, window)
            self.reserve_layer(layer, held)
            for mine, theirs in ((self.keys, prefilled.keys), (self.values, prefilled.values)):
                if mine[layer] is not theirs[layer]:
                    mine[layer][2 * row:2 * row + 2, :, :held] = theirs[layer][:, :, :held]

    def capacities(self) -> tuple[int, int]:
        """The slots a global layer and a sliding layer hold (0 where there is no such layer)."""
        held = {window is None: self.keys[layer].shape[2] for layer, window in enumerate(self.windows)}
        return held.get(True, 0), held.get(False, 0)

    def row_slots(self, layer: int, rows: "TTSRows") -> torch.Tensor:
        """Each row's slot in ``layer``: its position, or position % window in a sliding layer."""
        return rows.positions if self.windows[layer] is None else rows.ring_slots

    def write_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                   rows: "TTSRows") -> tuple[torch.Tensor, torch.Tensor]:
        """One position per row ``[R, kv_heads, 1, head_dim]``, each at its own ``rows.positions`` (slot =
        position, or position % window in a sliding layer), written in place; returns the whole buffers,
        whose slots past a row's position its masks block (the caller reserved the room: :meth:`reserve`)."""
        slots = self.row_slots(layer, rows)
        self.keys[layer][rows.batch, :, slots] = keys[:, :, 0]
        self.values[layer][rows.batch, :, slots] = values[:, :, 0]
        return self.keys[layer], self.values[layer]


@layer_step_input
@dataclass
class TTSRows:
    """Where each row of a batched step stands (:meth:`GemmaBackbone.forward_step`), made once per step
    by :meth:`make` and shared by the layers: ``positions [R]`` (long, on the device; a session's two
    rows share theirs), the row numbers, and per row its sliding layers' ring slot. Masks over the whole
    buffers (:meth:`TTSCache.capacities`): a global layer's slots up to the row's position (``held [R, 1,
    1, global capacity]``), a sliding layer's ring only as far as the row has filled it (``ring [R, 1, 1,
    sliding capacity]``). Nothing depends on a host-side position: the step's shapes are the buffers',
    which change only when a block is added."""

    positions: torch.Tensor
    batch: torch.Tensor
    ring_slots: torch.Tensor
    held: torch.Tensor
    ring: torch.Tensor

    @classmethod
    def make(cls, positions: torch.Tensor, capacities: tuple[int, int], window: int,
             batch: torch.Tensor | None = None, ring_slots: torch.Tensor | None = None) -> "TTSRows":
        """``capacities``: the global and sliding layers' slots; ``batch`` (the row numbers) and
        ``ring_slots`` (``positions % window``): if the caller has them on the device already."""
        if batch is None:
            batch = torch.arange(positions.shape[0], device=positions.device)
        if ring_slots is None:
            ring_slots = positions % window
        # A global layer's slot = position; a sliding layer's ring slot j holds some position <= the row's,
        # and is filled once the row got there. (Two masks, not views of one: a layer step takes no
        # inputs that share storage.)
        held, ring = ((torch.arange(capacity, device=positions.device) <= positions[:, None])[:, None, None]
                      for capacity in capacities)
        return cls(positions, batch, ring_slots, held, ring)


class GemmaAttention(AttentionProjections):
    """Self-attention with q/k RMSNorm before RoPE, scale ``query_pre_attn_scalar ** -0.5``, no soft-cap."""

    def __init__(self, config: TTSConfig):
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim, config.query_pre_attn_scalar ** -0.5)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm_weight(self) -> torch.Tensor:
        """``1 + w`` of q_norm per query head, then of k_norm per key head: ``[heads + kv_heads, head_dim]``."""
        return torch.cat([self.q_norm.offset_weight().expand(self.n_heads, -1),
                          self.k_norm.offset_weight().expand(self.n_kv_heads, -1)])

    def forward(self, x: torch.Tensor, batch: int, length: int, rope: tuple[torch.Tensor, ...],
                cache: TTSCache | None, layer: int, mask: torch.Tensor | None,
                rows: TTSRows | None = None) -> torch.Tensor:
        """``rope``: ``(cos, sin)`` tables for the ``length`` positions, or, for one position, its rotation
        matrix ``(M,)`` (per row, ``[R, 1, 1, d, d]``, with ``rows``): the norm weights then fold into it
        and norm + rotation take 3 ops. ``rows``: one position per row, each at its own (``mask`` says
        which slots it attends)."""
        qk, v = self.qk_v(x, batch, length)
        qk = F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps)
        if len(rope) == 1:  # [B, 1, heads, d] @ [heads, d, d]: per head diag(1 + w) M
            qk = torch.matmul(qk.unsqueeze(-2), self.qk_norm_weight()[:, :, None] * rope[0]).squeeze(-2)
        else:
            qk = Rotary.apply(qk * self.qk_norm_weight(), rope[0][:, None], rope[1][:, None])
        q, k, v = self.split_heads(qk, v)
        if rows is not None:  # one position per row, against the slots the rows hold
            held_k, held_v = cache.write_rows(layer, k, v, rows)
            return self.attend_held(q, held_k, held_v, mask)
        if cache is not None:  # a sequence from position 0 (the speaker warmup): it attends to itself
            cache.write(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.n_heads != self.n_kv_heads)
        return self.output(out)


    def attend_held(self, q: torch.Tensor, held_k: torch.Tensor, held_v: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """One position per row: queries ``[R, heads, (1,) d]`` over the held keys/values ``[R, kv_heads, S, d]``
        -> ``o_proj``. The query heads of a KV head become that many query rows (a view): plain attention
        over the held keys, which GQA would expand per query head, every step, whole history."""
        b = q.shape[0]
        out = F.scaled_dot_product_attention(q.view(b, self.n_kv_heads, -1, self.head_dim), held_k, held_v,
                                             attn_mask=mask, scale=self.scale)
        return self.output(out.view(b, self.n_heads, 1, self.head_dim))


class FusedGemmaAttention(FusedQKV, GemmaAttention, FusedOnCpu):
    """``prepare()``'s swap for :class:`GemmaAttention`: one QKV matmul, and the q/k norms' ``1 + w``
    per head precomputed for activations of ``dtype``."""

    def __init__(self, attention: GemmaAttention, dtype: torch.dtype):
        super().__init__(attention)
        scale = attention.qk_norm_weight().detach()
        self.register_buffer("qk_scale", scale.to(torch.promote_types(scale.dtype, dtype)), persistent=False)

    def qk_norm_weight(self) -> torch.Tensor:
        return self.qk_scale

    def use_cpu_kernels(self) -> None:
        """On a float32 CPU model (``prepare()``): a streaming step's q/k norms, rotation and cache write
        as one fused kernel before the attention (row ``r`` of a step is row ``r`` of the cache, as the
        frame step and :meth:`GemmaBackbone.rows_at` number them)."""
        self.fused_on_cpu = self.qk_scale.dtype == torch.float32

    def forward(self, x: torch.Tensor, batch: int, length: int, rope: tuple[torch.Tensor, ...],
                cache: TTSCache | None, layer: int, mask: torch.Tensor | None,
                rows: TTSRows | None = None) -> torch.Tensor:
        if not (self.fused_on_cpu and rows is not None and len(rope) == 1 and cpu_kernels.usable(x, rope[0])):
            return super().forward(x, batch, length, rope, cache, layer, mask, rows)
        slots = cache.row_slots(layer, rows)
        keys, values = cache.keys[layer], cache.values[layer]
        if not cpu_kernels.usable(keys, values):
            return super().forward(x, batch, length, rope, cache, layer, mask, rows)
        q = torch.ops.nvchat_cpu.gemma_qk_step(self.qkv_proj(x), self.qk_scale, rope[0].view(-1, self.head_dim, self.head_dim),
                                               keys, values, slots, self.q_norm.eps)
        return self.attend_held(q, keys, values, mask)


class GemmaLayer(nn.Module):
    """Pre- and post-normed attention and MLP blocks (Gemma 3)."""

    def __init__(self, config: TTSConfig, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.self_attn = GemmaAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: int, length: int, rope: tuple[torch.Tensor, ...],
                cache: TTSCache | None, layer: int, mask: torch.Tensor | None,
                rows: TTSRows | None = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, length, rope, cache, layer, mask, rows)
        h = self.post_attention_layernorm.add_to(x, attn)
        return self.post_feedforward_layernorm.add_to(h, self.mlp(h, self.pre_feedforward_layernorm))


@layer_step  # compiled once per kind (sliding, global) and stamped out for the other layers (layers.layer_step)
def _layer_step(layer: GemmaLayer, x: torch.Tensor, rope: tuple[torch.Tensor, ...], keys: torch.Tensor,
                values: torch.Tensor, window: int | None, mask: torch.Tensor, rows: TTSRows) -> torch.Tensor:
    """One position per row ``x [R, H]``; the layer's keys and values, written in place, as a cache of one layer."""
    return layer(x, x.shape[0], 1, rope, TTSCache([keys], [values], [window]), 0, mask, rows)


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
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
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

    def _run(self, x: torch.Tensor, cache: TTSCache | None, masks: dict[bool, torch.Tensor],
             rows: TTSRows | None = None) -> torch.Tensor:
        batch, length, width = x.shape
        if rows is not None:  # one rotation matrix per row and RoPE base
            tables = {False: (self.rope_global.rotation_rows(rows.positions, x.dtype),),
                      True: (self.rope_local.rotation_rows(rows.positions, x.dtype),)}
        else:
            tables = {False: self.rope_global.table(0, length), True: self.rope_local.table(0, length)}
        x = x.reshape(batch * length, width)  # 2-D activations: linears without reshapes
        for index, layer in enumerate(self.layers):
            if rows is not None:
                x = _layer_step(layer, x, tables[layer.sliding], cache.keys[index], cache.values[index],
                                cache.windows[index], masks[layer.sliding], rows)
            else:
                x = layer(x, batch, length, tables[layer.sliding], cache, index, masks[layer.sliding])
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
        out = self._run(x, cache, {False: causal, True: causal & (distance < self.window)})
        if cache is not None:
            cache.offset += x.shape[1]
        return out

    def rows_at(self, cache: TTSCache, rows: int = 2) -> TTSRows:
        """``rows`` rows all at ``cache.offset``: one stream's step (its conditional and unconditional rows),
        with room reserved for it."""
        cache.reserve(cache.offset + 1)
        positions = torch.full((rows,), cache.offset, dtype=torch.long, device=self.norm.weight.device)
        return TTSRows.make(positions, cache.capacities(), self.window)

    def forward_step(self, x: torch.Tensor, cache: TTSCache, rows: TTSRows | None = None) -> torch.Tensor:
        """The streaming step: one position per row ``[R, 1, H]``, each at its own ``rows.positions``,
        attending to the positions it holds (the engine's sessions side by side; ``cache.offset`` is
        then left to the caller). Without ``rows`` every row is at ``cache.offset``, which advances:
        one stream stepping alone (:meth:`rows_at`)."""
        alone = rows is None
        rows = self.rows_at(cache, x.shape[0]) if rows is None else rows
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[0] != rows.positions.shape[0]:
            raise ValueError(f"forward_step takes one position per row [{rows.positions.shape[0]}, 1, H], "
                             f"got {list(x.shape)}")
        out = self._run(x, cache, {False: rows.held, True: rows.ring}, rows)
        if alone:
            cache.offset += 1
        return out
