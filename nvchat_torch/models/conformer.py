"""Cache-aware FastConformer encoder and the perception projection (``stt_model.perception``).

NeMo's streaming ``ConformerEncoder`` as this checkpoint uses it: causal depthwise-striding
subsampling (x8), macaron blocks with relative-position attention over ``left`` past frames (no
look-ahead) and a causal depthwise convolution. :meth:`FastConformer.forward` runs a whole mel
sequence; :meth:`FastConformer.forward_step` emits one encoder frame per stream per 80 ms, equal to
the offline frame of the same index (docs/api.md, "What each network computes")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .config import ConformerConfig
from .layers import (
    Conv1d,
    Conv2d,
    FusedOnCpu,
    LayerNorm,
    Linear,
    RowCache,
    RowTensor,
    add_linear,
    adopt,
    layer_step,
    layer_step_input,
    norm_linear,
    promoted,
    swap_modules,
    window_tail,
)
from .layers import linear as promoted_linear
from .quant import concat_linears

__all__ = ["FastConformer", "ConformerCache", "ConformerRows", "RelPositionAttention", "FusedRelPositionAttention",
           "relative_positions"]

# Blocked attention entries get a large finite negative, as in the reference (not -inf).
_MASKED = -1e30
# Mel frames the streaming subsampling keeps before each new chunk: at least the causal receptive
# field of the strided stack (15 frames for x8), aligned to the subsampling grid (FastConformer.mel_context).
_MEL_CONTEXT = 16
OFFLINE_CHUNK = 512  # encoder frames per piece of the offline pass (bounded memory on long audio)


def relative_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Sinusoidal encodings ``[len(positions), d_model]``: sin in even, cos in odd channels (float32)."""
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=positions.device)
                         * -(math.log(10000.0) / d_model))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).flatten(1)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, bias: bool):
        super().__init__()
        self.linear1 = Linear(d_model, d_ff, bias=bias)
        self.linear2 = Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))

    def add_to(self, x: torch.Tensor, norm: nn.Module, alpha: float) -> torch.Tensor:
        """``x + alpha * self(norm(x))``: the norm, first projection and SiLU as one op on a CPU
        (:func:`~nvchat_torch.models.layers.norm_linear`), the last projection and the sum as another."""
        return add_linear(x, self.linear2, norm_linear(norm, x, self.linear1, "silu"), alpha)


class RelPositionAttention(nn.Module):
    """Transformer-XL relative-position multi-head attention (NeMo ``RelPositionMultiHeadAttention``).

    ``score[i, j] = ((q_i + u) . k_j + (q_i + v) . P(i - j)) / sqrt(head_dim)`` with
    ``P = linear_pos(sinusoid)``, per head.
    """

    def __init__(self, d_model: int, n_heads: int, bias: bool):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.scale = self.head_dim ** -0.5
        self.linear_q = Linear(d_model, d_model, bias=bias)
        self.linear_k = Linear(d_model, d_model, bias=bias)
        self.linear_v = Linear(d_model, d_model, bias=bias)
        self.linear_out = Linear(d_model, d_model, bias=bias)
        self.linear_pos = Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q + u, q + v, k|v)`` for x [..., d]; the last is [..., 2d], keys then values."""
        q = self.linear_q(x)
        return (q + self.pos_bias_u.flatten(), q + self.pos_bias_v.flatten(),
                torch.cat([self.linear_k(x), self.linear_v(x)], dim=-1))

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; pos_emb [2T-1, d] for positions T-1 ... -(T-1); mask additive [T, T]."""
        b, t, d = x.shape
        heads = (b, t, self.n_heads, self.head_dim)
        q_u, q_v, kv = self.project(x)
        q_u, q_v = q_u.reshape(heads).transpose(1, 2), q_v.reshape(heads).transpose(1, 2)
        k, v = kv.reshape(b, t, 2, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        p = self.linear_pos(pos_emb).view(-1, self.n_heads, self.head_dim).transpose(0, 1)  # [H, 2T-1, hd]
        scores_pos = q_v @ p.transpose(-1, -2)  # [B, H, T, 2T-1]
        # Relative shift: row i, column j reads position i - j, stored at column (T-1) - i + j.
        scores_pos = scores_pos.as_strided(
            (b, self.n_heads, t, t), (scores_pos.stride(0), scores_pos.stride(1), 2 * t - 2, 1),
            scores_pos.storage_offset() + t - 1)
        bias = scores_pos * self.scale + mask
        out = F.scaled_dot_product_attention(q_u, k, v, attn_mask=bias, scale=self.scale)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, d))

    def position_scores(self, q_v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The position term of a step's scores per row, ``[B, H, 1, W]``, for ``q_v [B, H, 1, hd]``.

        ``positions [B, W, d]``: each row's ring slots' rows of the encoder's streaming distance table
        (pre-multiplied by the score scale; see :meth:`FastConformer.forward_step`).
        ``(q + v) . linear_pos(s) == ((q + v) @ W_pos_head) . s``: the query is projected, not the window."""
        w_pos = self.linear_pos.weight.view(self.n_heads, self.head_dim, -1).to(q_v.dtype)
        return torch.matmul(q_v, w_pos) @ positions.to(q_v.dtype).transpose(1, 2)[:, None]

    def forward_step(self, x: torch.Tensor, norm: nn.Module, kv: torch.Tensor, rows: "ConformerRows",
                     positions: torch.Tensor) -> torch.Tensor:
        """One frame per stream, each at its own: ``norm(x)``, ``x [B, 1, d]``, against the cached window
        ``kv [2, B, H, W, hd]`` (this layer's key/value ring); each row writes its slot and attends its
        filled slots (``rows``); ``positions``: the distance terms of its slots (:meth:`position_scores`).
        Returns ``x + attention(norm(x))``."""
        b, residual = x.shape[0], x
        q_u, q_v, kv_new = self.project(norm(x))
        kv[:, rows.batch, :, rows.slot] = kv_new.view(b, 2, self.n_heads, self.head_dim)
        q_v = q_v.view(b, self.n_heads, 1, self.head_dim)
        bias = self.position_scores(q_v, positions)
        if rows.mask is not None:  # a ring not yet full
            bias = bias + rows.mask.to(q_v.dtype)
        held = rows.length  # the slots in use: all, or the first ones while aligned rows fill the ring
        out = F.scaled_dot_product_attention(q_u.view(b, self.n_heads, 1, self.head_dim), kv[0, :, :, :held],
                                             kv[1, :, :, :held], attn_mask=bias, scale=self.scale)
        return add_linear(residual, self.linear_out, out.reshape(b, 1, -1))


class FusedRelPositionAttention(RelPositionAttention, FusedOnCpu):
    """``prepare()``'s swap for :class:`RelPositionAttention`: one matmul for q + u, q + v, k and v
    (``linear_quvkv``: linear_q appears twice in its weight and the position biases u, v join its
    bias, so the per-step bias additions disappear too); the position term reads ``linear_pos`` of the
    streaming distance table per head, which :meth:`FastConformer.fuse` stacks for all layers
    (``pos_tables``), so a step picks every layer's rows in one gather, with no projection."""

    def __init__(self, attention: RelPositionAttention, stream_pos: torch.Tensor):
        """``stream_pos``: the encoder's streaming distance table in the activation dtype, which the
        table and the fused bias take (q + u is computed there)."""
        adopt(self, attention)
        fused = concat_linears([self.linear_q, self.linear_q, self.linear_k, self.linear_v])
        dtype = promoted(stream_pos, fused.weight)
        bias = fused.weight.new_zeros(fused.weight.shape[0], dtype=dtype) if fused.bias is None else fused.bias.data.to(dtype)
        bias[: 2 * self.d_model] += torch.cat([self.pos_bias_u.flatten(), self.pos_bias_v.flatten()]).to(dtype)
        fused.bias = nn.Parameter(bias)
        self.linear_quvkv = fused
        del self.linear_q, self.linear_k, self.linear_v, self.pos_bias_u, self.pos_bias_v

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear_quvkv(x).split([self.d_model, self.d_model, 2 * self.d_model], dim=-1)

    def table(self, stream_pos: torch.Tensor) -> torch.Tensor:
        """``linear_pos`` of the distance table per head, ``[H, hd, W]``."""
        return self.linear_pos(stream_pos).view(-1, self.n_heads, self.head_dim).permute(1, 2, 0)

    def position_scores(self, q_v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``positions [H, hd, B, W]``: this layer's table at each row's slots (one gather for all layers)."""
        return q_v @ positions.permute(2, 0, 1, 3)

    def forward_step(self, x: torch.Tensor, norm: nn.Module, kv: torch.Tensor, rows: "ConformerRows",
                     positions: torch.Tensor) -> torch.Tensor:
        """On a float32 CPU model (:meth:`use_cpu_kernels`): the norm and projection as one fused kernel,
        then the ring write, position scores and attention as another (the ring is bounded: left context
        + 1 slots). ``positions``: as :meth:`position_scores` takes them, or this layer's whole table
        ``[H, hd, D]`` (a fused encoder's step), which the fused op reads at each row's slots' columns."""
        if positions.dim() == 3:
            if self.fused_on_cpu and cpu_kernels.usable(x, kv, positions) and \
                    (rows.mask is None or cpu_kernels.usable(rows.mask)):
                b = x.shape[0]
                out = torch.ops.nvchat_cpu.conformer_attention_step(
                    norm_linear(norm, x, self.linear_quvkv).view(b, -1), kv, rows.batch, rows.slot, positions,
                    rows.columns, rows.mask, rows.length, self.scale)
                return add_linear(x, self.linear_out, out.view(b, 1, -1))
            positions = positions[:, :, rows.columns]
        return super().forward_step(x, norm, kv, rows, positions)


class ConvModule(nn.Module, FusedOnCpu):
    """Pointwise conv -> GLU -> causal depthwise conv -> LayerNorm (named ``batch_norm``) -> SiLU -> pointwise."""

    def __init__(self, d_model: int, kernel_size: int, bias: bool):
        super().__init__()
        self.kernel_size = kernel_size
        self.pointwise_conv1 = Conv1d(d_model, 2 * d_model, 1, bias=bias)
        self.depthwise_conv = Conv1d(d_model, d_model, kernel_size, groups=d_model, bias=bias)
        self.batch_norm = LayerNorm(d_model)
        self.pointwise_conv2 = Conv1d(d_model, d_model, 1, bias=bias)

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        return F.glu(promoted_linear(x, self.pointwise_conv1.weight[..., 0], self.pointwise_conv1.bias), dim=-1)

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return promoted_linear(F.silu(self.batch_norm(x)), self.pointwise_conv2.weight[..., 0], self.pointwise_conv2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.pad(self._glu(x).transpose(1, 2), (self.kernel_size - 1, 0))
        return self._finish(self.depthwise_conv(g).transpose(1, 2))

    def forward_step(self, x: torch.Tensor, norm: nn.Module, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame per stream ``x [B, 1, d]`` -> ``(x + conv(norm(x)), next state)``. ``state [B, d,
        kernel - 1]`` holds each row's GLU outputs of its last ``kernel - 1`` frames, oldest first (zeros
        before its first): the window is them and this frame's, one cat, whatever frame each row is at."""
        if self.fused_on_cpu and cpu_kernels.usable(x):
            return self._fused_step(x, norm, state)
        glu = self._glu(norm(x)).transpose(1, 2)
        window = torch.cat([state, glu], dim=2)
        h = F.silu(self.batch_norm(self.depthwise_conv(window).transpose(1, 2)))
        return add_linear(x, self.pointwise_conv2, h, weight=self.pointwise_conv2.weight[..., 0]), window_tail(window, state, glu, 2)

    def use_cpu_kernels(self) -> None:
        """On a float32 CPU model (``prepare()``): GLU, the depthwise conv with its state, the norm and
        SiLU as one fused kernel, taking the float32 parameters the conv and the norm keep for their own
        fused ops (``prepare()`` gives them theirs too)."""
        self.fused_on_cpu = self.batch_norm.bias is not None

    def _fused_step(self, x: torch.Tensor, norm: nn.Module, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_step` with the norm and first projection fused, and the middle (a composite
        step's state is a view: made contiguous)."""
        if not cpu_kernels.usable(state):
            state = state.float().contiguous()
        projected = norm_linear(norm, x, self.pointwise_conv1, weight=self.pointwise_conv1.weight[..., 0])
        b = x.shape[0]
        conv, norm = self.depthwise_conv, self.batch_norm
        h, state = torch.ops.nvchat_cpu.conv_module_step(projected.view(b, -1), state, conv.taps, conv.bias_f32,
                                                         norm.weight_f32, norm.bias_f32, norm.eps)
        return add_linear(x, self.pointwise_conv2, h.view(b, 1, -1), weight=self.pointwise_conv2.weight[..., 0]), state


class ConformerLayer(nn.Module):
    def __init__(self, config: ConformerConfig):
        super().__init__()
        d, bias = config.d_model, config.use_bias
        self.norm_feed_forward1 = LayerNorm(d)
        self.feed_forward1 = FeedForward(d, d * config.ff_expansion_factor, bias)
        self.norm_self_att = LayerNorm(d)
        self.self_attn = RelPositionAttention(d, config.n_heads, bias)
        self.norm_conv = LayerNorm(d)
        self.conv = ConvModule(d, config.conv_kernel_size, bias)
        self.norm_feed_forward2 = LayerNorm(d)
        self.feed_forward2 = FeedForward(d, d * config.ff_expansion_factor, bias)
        self.norm_out = LayerNorm(d)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.add(x, self.feed_forward1(self.norm_feed_forward1(x)), alpha=0.5)
        x = x + self.self_attn(self.norm_self_att(x), pos_emb, mask)
        x = x + self.conv(self.norm_conv(x))
        x = torch.add(x, self.feed_forward2(self.norm_feed_forward2(x)), alpha=0.5)
        return self.norm_out(x)

    def forward_step(self, x: torch.Tensor, kv: torch.Tensor, conv_state: torch.Tensor, rows: "ConformerRows",
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame per stream; returns it and the convolution's next state (``kv`` is written in place)."""
        x = self.feed_forward1.add_to(x, self.norm_feed_forward1, 0.5)
        x = self.self_attn.forward_step(x, self.norm_self_att, kv, rows, positions)
        x, conv_state = self.conv.forward_step(x, self.norm_conv, conv_state)
        x = self.feed_forward2.add_to(x, self.norm_feed_forward2, 0.5)
        return self.norm_out(x), conv_state


@layer_step  # compiled once and stamped out for the other layers (layers.layer_step)
def _layer_step(layer: ConformerLayer, x: torch.Tensor, kv: torch.Tensor, conv_state: torch.Tensor, rows: ConformerRows,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.forward_step(x, kv, conv_state, rows, positions)


class CausalSubsampling(nn.Module):
    """Depthwise-striding conv subsampling over the (time, frequency) image, causal in time.

    ``conv`` = [Conv2d(1->C, 3x3, s2), ReLU] + [depthwise 3x3 s2, pointwise 1x1, ReLU] per further
    stage (checkpoint indices 0, 2, 3, 5, 6). Every strided conv sees zero padding of 2 before and
    1 after on both axes (NeMo's CausalConv2D), so a length L becomes L // 2 + 1. The padding is
    done by the conv itself (2 on each side) and the extra trailing output dropped, which is the
    same computation without a separate pad.
    """

    def __init__(self, config: ConformerConfig):
        super().__init__()
        ch = config.subsampling_conv_channels
        layers: list[nn.Module] = [Conv2d(1, ch, 3, stride=2, padding=2), nn.ReLU()]
        for _ in range(config.num_subsampling_stages - 1):
            layers += [Conv2d(ch, ch, 3, stride=2, padding=2, groups=ch), Conv2d(ch, ch, 1), nn.ReLU()]
        self.conv = nn.ModuleList(layers)
        freq = config.feat_in
        for _ in range(config.num_subsampling_stages):
            freq = freq // 2 + 1
        self.out = Linear(ch * freq, config.d_model)

    def forward(self, mel: torch.Tensor, last_only: bool = False, starts: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, T, F] -> [B, T', d_model] (only the last frame when ``last_only``).

        ``starts [B]``: where each row's mel begins (a multiple of 8; frames before it are zeroed, and so
        is each stage's output before its start), which computes every row as its mel alone would:
        a shorter window, zero padded by the convs."""
        x = mel.unsqueeze(1)  # [B, 1, T, F]
        keep = None
        if starts is not None:
            keep = (torch.arange(x.shape[2], device=x.device) >= starts[:, None])[:, None, :, None]
            x = x * keep
        for layer in self.conv:
            t, f = x.shape[-2:]
            x = layer(x)
            if isinstance(layer, nn.Conv2d) and layer.stride[0] == 2:
                x = x[..., : t // 2 + 1, : f // 2 + 1]
                if keep is not None:  # output j reads inputs 2j - 2 .. 2j: it exists for the row iff 2j does
                    keep = keep[:, :, ::2]
            elif keep is not None and isinstance(layer, nn.ReLU):
                x = x * keep
        if last_only:
            x = x[:, :, -1:]
        b, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * f))  # channel-major flatten: index c * F' + f


@dataclass
class ConformerCache(RowCache):
    """Streaming state of :meth:`FastConformer.forward_step`: ``B`` streams, each at its own frame,
    preallocated and written in place.

    ``kv [layers, 2, B, heads, left+1, head_dim]``: per layer a ring of the keys and values of the last
    ``left`` frames plus the current one (frame n in slot n mod (left+1)); ``conv``: per layer ``[B,
    d_model, kernel - 1]``, its convolution's last GLU outputs (see :meth:`ConvModule.forward_step`),
    replaced each step; ``mel [B, M, features]``: the subsampling's window of past
    mel frames, right-aligned; ``frames [B]`` (long, on the device): each row's encoder frames so far."""

    kv: torch.Tensor
    conv: list[torch.Tensor]
    mel: torch.Tensor
    frames: torch.Tensor
    # What a stream stepped without ConformerRows knows on the host (see ConformerRows.least); a batched
    # caller gives its rows' in the ConformerRows it passes.
    least: int = 0
    aligned: bool = True

    def batched(self) -> list[RowTensor]:
        return [(self.kv, 2, 1)] + self.carried()

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        self.kv = tensors[0]
        self.rebind_carried(tensors[1:])

    def carried(self) -> list[RowTensor]:
        return [(self.mel, 0, 1)] + [(t, 0, 1) for t in self.conv]

    def rebind_carried(self, tensors: list[torch.Tensor]) -> None:
        self.mel, *conv = tensors
        self.conv[:] = conv  # the same list: a step's caller may hold it


@layer_step_input
@dataclass
class ConformerRows:
    """Per-row ring indices of one batched step (made once per step, shared by the layers)."""

    batch: torch.Tensor  # [B] row numbers
    slot: torch.Tensor  # [B] the attention ring slot of this frame
    columns: torch.Tensor  # [B, W] distance-table column of every ring slot
    mask: torch.Tensor | None  # [B, 1, 1, length] 0 for filled slots, -inf before a row's first frames (None: all filled)
    length: int  # the ring slots attended: W, or the filled ones of aligned rows
    # Host-side: the frames every row has run at least, and whether they have all run that many. Once all
    # rows are past their first frames their mel windows need no masking; aligned rows attend the ring
    # slots filled so far (a slice), and rows at different frames mask theirs until every ring is full.
    least: int = 0
    aligned: bool = False


class FastConformer(nn.Module, FusedOnCpu):
    """``forward(mel [1, T, feat_in]) -> [1, T', d_model]``; each of the 3 stride-2 stages (x8) maps
    L -> L // 2 + 1, so the 8N + 1 mel frames of N audio frames give N + 1 encoder frames."""

    def __init__(self, config: ConformerConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.d_model = config.d_model
        self.left = config.left_context
        self.subsampling = config.subsampling_factor
        self.xscale = math.sqrt(config.d_model) if config.xscaling else None
        self.pre_encode = CausalSubsampling(config)
        self.layers = nn.ModuleList(ConformerLayer(config) for _ in range(config.n_layers))
        # Streaming keeps M mel frames with M = 16 + ((1 - 16) mod 8) = 17: the 1, 8, 8, ... cadence
        # leaves consumed = 1 (mod 8), so the window always starts on the subsampling grid.
        self.mel_context = _MEL_CONTEXT + (1 - _MEL_CONTEXT) % self.subsampling
        # The reference's float32 mel promotes every layer to float32, whatever the weights' dtype;
        # the opt-in fast mode sets bf16/fp16 here (see VoiceChatModel.activation_dtype).
        self.activation_dtype = torch.float32
        self.register_buffer("pos_tables", None, persistent=False)  # fuse(): every layer's position table
        self.init_constants()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        # Streaming positional table, by ring slot offset m: distance (W - m) mod W, times the
        # score scale. Rolled by the frame index it gives each slot the distance of its frame.
        window = self.left + 1
        distance = (window - torch.arange(window, device=device)) % window
        scale = (self.d_model // self.config.n_heads) ** -0.5
        self.register_buffer("stream_pos", relative_positions(distance, self.d_model) * scale, persistent=False)
        self.register_buffer("ring_slots", torch.arange(window, device=device), persistent=False)
        if self.pos_tables is not None:
            self._stack_tables()

    def fuse(self) -> None:
        """Post-load transform (outputs unchanged): :class:`FusedRelPositionAttention` in every layer, and
        their position tables stacked (``pos_tables [layers, H, hd, W]``)."""
        stream_pos = self.stream_pos.to(self.activation_dtype)
        swap_modules(self, RelPositionAttention, lambda attention: FusedRelPositionAttention(attention, stream_pos))
        self._stack_tables()

    def use_cpu_kernels(self) -> None:  # the fused attention steps read the stacked tables themselves
        self.fused_on_cpu = self.pos_tables is not None

    def _stack_tables(self) -> None:
        stream_pos = self.stream_pos.to(self.activation_dtype)
        with torch.no_grad():
            tables = torch.stack([layer.self_attn.table(stream_pos) for layer in self.layers]).contiguous()
        self.register_buffer("pos_tables", tables, persistent=False)

    def _check_mel(self, mel: torch.Tensor, where: str) -> torch.Tensor:
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[2] != self.config.feat_in:
            raise ValueError(f"FastConformer.{where}: expected mel [1, T, {self.config.feat_in}], "
                             f"got shape {tuple(mel.shape)}")
        return mel.to(self.activation_dtype)

    def forward(self, mel: torch.Tensor, chunk: int = OFFLINE_CHUNK) -> torch.Tensor:
        """The whole sequence, computed in pieces of ``chunk`` output frames so that memory stays bounded
        (a single pass needs a ``[T, T]`` mask and ``[H, T, 2T - 1]`` position scores). The pieces are
        exact: the subsampling is causal with a short reach, and a layer's output frame depends on its
        input frames up to ``left`` (attention) + ``kernel - 1`` (convolution) back, which each piece
        recomputes as a margin before it."""
        x = self._subsample(self._check_mel(mel, "forward"), chunk)
        if self.xscale is not None:
            x = x * self.xscale
        t = x.shape[1]
        margin = self.left + self.config.conv_kernel_size - 1
        if t <= chunk + margin:
            pos_emb, mask = self._offline_tables(t, x)
            for layer in self.layers:
                x = layer(x, pos_emb, mask)
            return x
        tables = {}
        for layer in self.layers:
            out = torch.empty_like(x)
            for start in range(0, t, chunk):
                end, first = min(start + chunk, t), max(0, start - margin)
                if end - first not in tables:
                    tables[end - first] = self._offline_tables(end - first, x)
                out[:, start:end] = layer(x[:, first:end], *tables[end - first])[:, start - first:]
            x = out
        return x

    def _offline_tables(self, t: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Relative position embeddings ``[2t - 1, d]`` and the additive limited-context mask ``[t, t]``."""
        idx = torch.arange(t, device=x.device)
        pos_emb = relative_positions(t - 1 - torch.arange(2 * t - 1, device=x.device), self.d_model).to(x.dtype)
        lag = idx[:, None] - idx[None, :]
        mask = torch.where((lag >= 0) & (lag <= self.left), 0.0, _MASKED).to(x.dtype)
        return pos_emb, mask

    def _subsample(self, mel: torch.Tensor, chunk: int) -> torch.Tensor:
        """``pre_encode`` in pieces of ``chunk`` output frames. Output frame j sees mel frames up to
        ``8j``; a piece's window starts two output frames early on the x8 grid (what streaming keeps,
        ``mel_context``), and those two frames, which see the window's zero padding, are dropped."""
        n_mel, s = mel.shape[1], self.subsampling
        if n_mel <= s * (chunk + 2):
            return self.pre_encode(mel)
        total = n_mel
        for _ in range(self.config.num_subsampling_stages):
            total = total // 2 + 1
        pieces = []
        for start in range(0, total, chunk):
            end = min(start + chunk, total)
            back = min(start, 2)
            first = s * (start - back)
            last = n_mel if end == total else s * (end - 1) + 1
            pieces.append(self.pre_encode(mel[:, first:last])[:, back:back + end - start])
        return torch.cat(pieces, dim=1)

    def new_cache(self, batch: int = 1) -> ConformerCache:
        """Empty history for ``batch`` streams."""
        cfg, dtype, device = self.config, self.activation_dtype, self.pre_encode.out.weight.device
        return ConformerCache(
            kv=torch.zeros(cfg.n_layers, 2, batch, cfg.n_heads, self.left + 1, cfg.head_dim, dtype=dtype, device=device),
            conv=[torch.zeros(batch, cfg.d_model, cfg.conv_kernel_size - 1, dtype=dtype, device=device)
                  for _ in range(cfg.n_layers)],
            mel=torch.zeros(batch, self.mel_context, cfg.feat_in, dtype=dtype, device=device),
            frames=torch.zeros(batch, dtype=torch.long, device=device))

    def rows_for(self, cache: ConformerCache) -> ConformerRows:
        """Each row's ring slot, distance columns and mask from ``cache.frames`` (and what the host knows:
        ``cache.least``, ``cache.aligned``). Slot j holds frame n - ((slot - j) mod w); before the ring is
        full only slots <= n are filled: the first least + 1 of aligned rows, else masked per row."""
        n, w = cache.frames, self.left + 1
        slot = n % w
        length = min(cache.least + 1, w) if cache.aligned else w
        ring = self.ring_slots[:length]
        return ConformerRows(batch=torch.arange(n.shape[0], device=n.device), slot=slot,
                             columns=(ring - slot[:, None]) % w, mask=self.ring_mask(n, cache.least, cache.aligned),
                             length=length, least=cache.least, aligned=cache.aligned)

    def ring_mask(self, frames: torch.Tensor, least: int, aligned: bool) -> torch.Tensor | None:
        """``[B, 1, 1, W]``: 0 on the slots each row has filled, -inf on the rest; None when no row needs it
        (``least``, ``aligned``: see :class:`ConformerRows`)."""
        w = self.left + 1
        if aligned or least >= w - 1:
            return None
        return torch.where(self.ring_slots <= frames[:, None], 0.0, float("-inf"))[:, None, None]

    def forward_step(self, mel: torch.Tensor, cache: ConformerCache, rows: ConformerRows | None = None) -> torch.Tensor:
        """The streaming step: one encoder frame per stream, ``mel [B, 8, feat_in]`` as
        :meth:`LogMel.forward_step` gives it for an 80 ms frame (a stream's first frame has one mel
        frame, the last) -> ``[B, 1, d]``. Each row at its own frame (``cache.frames``, which advances;
        the engine sets it for rows that sit out): a shorter mel window while it starts, its own ring
        slots and distances (``rows``, or :meth:`rows_for` the cache), no slot it has not filled."""
        if mel.dim() != 3 or mel.shape[1:] != (self.subsampling, self.config.feat_in) or \
                mel.shape[0] != cache.frames.shape[0]:
            raise ValueError(f"FastConformer.forward_step: expected mel [{cache.frames.shape[0]}, {self.subsampling}, "
                             f"{self.config.feat_in}] (one 80 ms frame per stream), got {tuple(mel.shape)}")
        mel = mel.to(self.activation_dtype)
        m, s = self.mel_context, self.subsampling
        n = cache.frames
        alone = rows is None  # a stream stepped by itself keeps its host-side counts in the cache
        rows = self.rows_for(cache) if rows is None else rows
        window = torch.cat([cache.mel, mel], dim=1)  # [B, m + s, F]
        cache.mel.copy_(window[:, -m:])
        # Mel frames this row has pushed, this one's included: 1, 1 + s, ...; the window starts at m + s minus
        # that (full from a row's frame -(-m // s) on).
        starts = None
        if rows.least < -(-m // s):
            starts = m + s - torch.where(n == 0, 1, 1 + s * n).clamp(max=m + s)
        x = self.pre_encode(window, last_only=True, starts=starts)
        if self.xscale is not None:
            x = x * self.xscale
        # Each row's slots' distance terms, for every layer at once: the stacked tables (fused), or the
        # shared distance table that each layer then projects; the fused CPU step reads each layer's
        # table at the rows' columns itself (the gather grows with the rows: 70 us at 1, 350 at 8).
        if self.fused_on_cpu:
            positions = self.pos_tables
        elif self.pos_tables is not None:
            positions = self.pos_tables[:, :, :, rows.columns]
        else:
            positions = self.stream_pos[rows.columns].expand(len(self.layers), -1, -1, -1)
        for i, (layer, kv) in enumerate(zip(self.layers, cache.kv)):
            x, cache.conv[i] = _layer_step(layer, x, kv, cache.conv[i], rows, positions[i])
        cache.frames = n + 1
        if alone:
            cache.least += 1
        return x
