"""Nemotron-H, the VoiceChat language model: Mamba-2, attention (no RoPE) and relu² MLP blocks.

Checkpoint prefix ``stt_model.llm``; the fused input and both vocabulary heads sit beside it and are
served by :mod:`nvchat_torch.models.language_heads`.
Every op runs in the promoted dtype of its operands, as in MLX. The SSM state is always float32.
Dtype policy of the states and caches: docs/parity.md, "Nemotron-H's state dtypes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .config import TextConfig
from .layers import (
    KV_BLOCK,
    REDUCED,
    Conv1d,
    FusedOnCpu,
    Linear,
    RMSNorm,
    RecurrentCache,
    RowCache,
    RowTensor,
    add_linear,
    adopt,
    grown_capacity,
    layer_step,
    layer_step_input,
    norm_linear,
    promote,
    register_float32,
    rms_norm,
    silu,
    swap_modules,
    window_tail,
)
from .quant import QuantizedLinear, fuse_linears

__all__ = [
    "SSD_CHUNK",
    "ssd_scan",
    "RMSNorm",
    "MambaCache",
    "KVCache",
    "LanguageCache",
    "MambaStates",
    "NemotronHMamba2Mixer",
    "FusedMamba2Mixer",
    "NemotronHAttention",
    "FusedNemotronHAttention",
    "NemotronHMLP",
    "NemotronHBlock",
    "NemotronHModel",
]


class GatedRMSNorm(nn.Module):
    """``y * silu(gate)`` (the gate comes first), RMS-normalised per group of channels, times weight."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups = groups
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = (silu(gate) * y).unflatten(-1, (self.groups, -1))
        return rms_norm(y, None, self.eps).flatten(-2) * self.weight


# --------------------------------------------------------------------------------------
# Caches (owned by the caller, made by NemotronHModel.new_cache)

@dataclass
class MambaCache:
    # [B, K - 1, conv_dim]: the last K - 1 raw (pre-conv) xBC rows, oldest first (MLX's layout): a step's
    # window is them and its input, one cat, and the next state is a view of that window.
    conv_state: torch.Tensor
    ssm_state: torch.Tensor  # [B, heads, head_dim, state] float32
    offset: int = 0  # positions consumed so far


@dataclass
class KVCache:
    """Keys and values ``[B, kv_heads, capacity, head_dim]``, valid up to ``offset``.

    The buffers grow by :func:`grown_capacity` (amortized copying). ``blocks`` is what the reference
    would hold, whole 256-slot blocks: its dtype rule applies when that grows
    (docs/parity.md, "Nemotron-H's state dtypes")."""

    keys: torch.Tensor  # [B, kv_heads, capacity, head_dim]
    values: torch.Tensor  # [B, kv_heads, capacity, head_dim]
    offset: int = 0  # positions written so far
    limit: int | None = None  # positions the model supports (max_position_embeddings)
    blocks: int = 0  # slots the reference would have allocated (0: none yet)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, kv_heads, L, head_dim]`` at ``offset``; return all keys and values so far."""
        end = self.offset + keys.shape[2]
        if self.offset == 0 and keys.dtype != self.keys.dtype:  # MLX allocates on the first write, in its dtype
            self.keys = self.keys.new_zeros(self.keys.shape, dtype=keys.dtype)
            self.values = self.values.new_zeros(self.values.shape, dtype=values.dtype)
        if end > self.blocks:
            if self.blocks:  # MLX concatenates a new block: a wider write promotes the buffer for good
                self.keys = self.keys.to(torch.promote_types(self.keys.dtype, keys.dtype))
                self.values = self.values.to(torch.promote_types(self.values.dtype, values.dtype))
            self.blocks = -(-end // KV_BLOCK) * KV_BLOCK
        if end > self.keys.shape[2]:
            size = grown_capacity(self.keys.shape[2], end, self.limit)
            self.keys = self._grown(self.keys, size, self.offset)
            self.values = self._grown(self.values, size, self.offset)
        self.keys[:, :, self.offset:end] = keys
        self.values[:, :, self.offset:end] = values
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reserve(self, end: int) -> None:
        """Room for positions ``[0, end)`` in every row (batched caches, whose rows each track their own)."""
        held = self.keys.shape[2]
        if end > held:  # every slot is kept: each row tracks its own length
            size = grown_capacity(held, end, self.limit)
            self.keys, self.values = self._grown(self.keys, size, held), self._grown(self.values, size, held)

    def update_rows(self, keys: torch.Tensor, values: torch.Tensor,
                    rows: LanguageRows) -> tuple[torch.Tensor, torch.Tensor]:
        """One position per row ``[B, kv_heads, 1, head_dim]`` at its ``rows.positions``, written in place (the
        caller reserved the room: :meth:`LanguageCache.reserve`); returns the whole buffers (``rows.blocked``
        masks each row's slots past its position)."""
        keys, values = keys[:, :, 0].to(self.keys.dtype), values[:, :, 0].to(self.values.dtype)
        if rows.round_keys is not None:  # still bf16 in the reference's cache: rounded as it stores them
            keep = rows.round_keys[:, None, None]
            keys = torch.where(keep, keys.to(torch.bfloat16).to(keys.dtype), keys)
            values = torch.where(keep, values.to(torch.bfloat16).to(values.dtype), values)
        self.keys[rows.batch, :, rows.positions] = keys
        self.values[rows.batch, :, rows.positions] = values
        return self.keys, self.values

    @staticmethod
    def _grown(buf: torch.Tensor, size: int, held: int) -> torch.Tensor:
        # Zeros, not new_empty: a batched row reads (masked) up to the longest row's end, and a masked
        # slot holding NaN from reused memory still poisons the softmax-weighted sum (0 * NaN).
        out = buf.new_zeros((*buf.shape[:2], size, buf.shape[3]))
        out[:, :, :held] = buf[:, :, :held]
        return out

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@layer_step_input
@dataclass
class LanguageRows:
    """Where each row of a batched step stands (:meth:`NemotronHModel.forward_step`), made once per step
    by :meth:`make` and shared by the layers.

    ``positions [B]`` (long, on the device), ``batch [B]`` (row numbers), ``blocked [B, 1, 1, capacity]``:
    the slots past each row's position, which it does not attend (all attention layers have one
    capacity: :meth:`LanguageCache.reserve`), so the step's shapes are the buffers', changing only when a
    block is added. ``round_keys [B]`` or None: rows whose keys and values are still stored in bf16, as
    the reference's cache of a bf16 prompt keeps them until its next 256-slot block (see KVCache).
    ``steps [B]`` (bool) or None: the rows whose Mamba layers advance their SSM state (the others'
    stays exactly as it was: their time step is 0); None: every row."""

    positions: torch.Tensor
    batch: torch.Tensor
    blocked: torch.Tensor
    round_keys: torch.Tensor | None = None
    steps: torch.Tensor | None = None

    @classmethod
    def make(cls, positions: torch.Tensor, capacity: int, round_keys: torch.Tensor | None = None,
             batch: torch.Tensor | None = None, steps: torch.Tensor | None = None) -> "LanguageRows":
        """``capacity``: the slots the key/value buffers hold; ``batch``: the row numbers, if the caller
        has them on the device already."""
        blocked = (torch.arange(capacity, device=positions.device) > positions[:, None])[:, None, None]
        if batch is None:
            batch = torch.arange(positions.shape[0], device=positions.device)
        return cls(positions, batch, blocked, round_keys, steps)


@dataclass
class LanguageCache(RowCache):
    layers: list[MambaCache | KVCache | None]  # one per layer, None for MLP layers
    offset: int = 0  # positions consumed so far

    @property
    def capacity(self) -> int:
        """Key/value slots every attention layer holds (0 with no attention layer)."""
        return next((c.keys.shape[2] for c in self.layers if isinstance(c, KVCache)), 0)

    def reserve(self, end: int) -> bool:
        """Room for positions ``[0, end)`` in every attention layer, grown in whole blocks (outside any
        step); returns whether a buffer grew (a compiled step then sees a new capacity)."""
        short = [c for c in self.layers if isinstance(c, KVCache) and end > c.keys.shape[2]]
        for c in short:
            c.reserve(end)
        return bool(short)

    def batched(self) -> list[RowTensor]:
        return [(t, 0, 1) for c in self.layers if c is not None
                for t in ((c.conv_state, c.ssm_state) if isinstance(c, MambaCache) else (c.keys, c.values))]

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        given = iter(tensors)
        for c in self.layers:
            if isinstance(c, MambaCache):
                c.conv_state, c.ssm_state = next(given), next(given)
            elif isinstance(c, KVCache):
                c.keys, c.values = next(given), next(given)

    def mixer_states(self, ssm: bool = True) -> MambaStates:
        """The Mamba layers' recurrent state as one row cache (``ssm``: their SSM state too)."""
        return MambaStates([c for c in self.layers if isinstance(c, MambaCache)], ssm)

    def copy_row(self, row: int, prefilled: LanguageCache) -> None:
        """Row ``row`` from a one-conversation cache (a prefill's): the Mamba state, and the keys and values
        of its positions (room reserved); a buffer that is the prefill's own already is left as it is."""
        for mine, theirs in zip(self.layers, prefilled.layers):
            if isinstance(mine, MambaCache) and isinstance(theirs, MambaCache):
                if mine.conv_state is not theirs.conv_state:
                    mine.conv_state[row] = theirs.conv_state[0]
                if mine.ssm_state is not theirs.ssm_state:
                    mine.ssm_state[row] = theirs.ssm_state[0]
            elif isinstance(mine, KVCache) and isinstance(theirs, KVCache):
                n = theirs.offset
                mine.reserve(n)
                if mine.keys is not theirs.keys:
                    mine.keys[row, :, :n] = theirs.keys[0, :, :n]
                if mine.values is not theirs.values:
                    mine.values[row, :, :n] = theirs.values[0, :, :n]

    def tensors(self) -> list[torch.Tensor]:
        """Every key/value buffer (for marking their capacity dynamic)."""
        return [t for c in self.layers if isinstance(c, KVCache) for t in (c.keys, c.values)]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the cache holds (allocated, not only the positions in use)."""
        total = 0
        for c in self.layers:
            if isinstance(c, KVCache):
                total += c.nbytes
            elif isinstance(c, MambaCache):
                total += c.conv_state.nbytes + c.ssm_state.nbytes
        return total


@dataclass
class MambaStates(RecurrentCache):
    """The Mamba layers' recurrent state, one row per conversation: what an LLM step advances (``ssm``:
    the SSM state too; a compiled step leaves it to a time step of 0 instead, see frame_step)."""

    layers: list[MambaCache]
    ssm: bool = True

    def batched(self) -> list[RowTensor]:
        return [(t, 0, 1) for c in self.layers for t in ((c.conv_state, c.ssm_state) if self.ssm else (c.conv_state,))]

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        given = iter(tensors)
        for c in self.layers:
            c.conv_state = next(given)
            if self.ssm:
                c.ssm_state = next(given)


# --------------------------------------------------------------------------------------
# Mamba-2


# Mamba-2's SSM over a whole sequence in chunks (the SSD form): the prompt prefill's scan, equal to the
# per-token recurrence that NemotronHMamba2Mixer steps with.
SSD_CHUNK = 256  # sequence chunk of the SSD scan (as the reference's ssm_attn)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over a sequence in chunks (Mamba-2's SSD form), equal to the per-token recurrence.

    x [b, L, H, P], dt [b, L, H] float32, A [H] float32, B and C [b, L, G, N] (head h reads group
    h // (H/G)), state [b, H, P, N] float32 or None (zeros). Returns y [b, L, H, P] float32
    (without the D skip) and the final state.
    """
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G
    ys = []
    for start in range(0, L, SSD_CHUNK):
        xc, dtc = x[:, start:start + SSD_CHUNK], dt[:, start:start + SSD_CHUNK]
        Bc, Cc = B[:, start:start + SSD_CHUNK], C[:, start:start + SSD_CHUNK]
        s = xc.shape[1]
        a = (dtc * A).transpose(1, 2)  # [b, H, s] log-decay per step
        dtx = (dtc.unsqueeze(-1) * xc).transpose(1, 2)  # [b, H, s, P]
        # seg[t, u] = sum of a over (u, t]: a cumulative sum of a strictly lower-triangular copy,
        # which avoids the cancellation of cumsum[t] - cumsum[u].
        seg = a.unsqueeze(-1).expand(b, H, s, s).tril(-1).cumsum(-2)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        decay = seg.exp().masked_fill(~causal, 0.0)
        CB = torch.einsum("btgn,bugn->bgtu", Cc, Bc).float()  # [b, G, s, s]
        y = (CB.unsqueeze(2) * decay.view(b, G, R, s, s)).view(b, H, s, s) @ dtx
        # State at the chunk end: every input decayed from its step to the last one.
        Bg = Bc.transpose(1, 2).unsqueeze(2).float()  # [b, G, 1, s, N]
        weighted = (dtx * decay[:, :, -1, :].unsqueeze(-1)).view(b, G, R, s, P)
        new_state = (weighted.transpose(-1, -2) @ Bg).view(b, H, P, N)
        if state is not None:
            cum = a.cumsum(-1)  # [b, H, s]
            Cg = Cc.transpose(1, 2).unsqueeze(2).float()  # [b, G, 1, s, N]
            y_prev = (Cg @ state.view(b, G, R, P, N).transpose(-1, -2)).view(b, H, s, P)
            y = y + cum.exp().unsqueeze(-1) * y_prev
            new_state = new_state + cum[..., -1].exp()[..., None, None] * state
        state = new_state
        ys.append(y.transpose(1, 2))
    if state is None:
        raise ValueError("ssd_scan: an empty sequence (L = 0) has no final state")
    return torch.cat(ys, 1) if len(ys) > 1 else ys[0], state


class NemotronHMamba2Mixer(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.state_size = config.ssm_state_size
        self.kernel = config.conv_kernel
        self.d_inner = config.mamba_d_inner
        self.conv_dim = config.mamba_conv_dim
        lo, hi = config.time_step_limit
        # The reference clips dt to time_step_limit; the default (0, inf) cannot change softplus's output.
        self.dt_min = lo if lo > 0.0 else None
        self.dt_max = hi if math.isfinite(hi) else None
        self.in_proj = Linear(config.hidden_size, self.d_inner + self.conv_dim + self.num_heads,
                                 bias=config.mamba_proj_bias)
        self.conv1d = Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                             bias=config.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, self.n_groups, config.layer_norm_epsilon)
        self.out_proj = Linear(self.d_inner, config.hidden_size, bias=config.mamba_proj_bias)

    def decay_rates(self) -> torch.Tensor:
        """``A = -exp(A_log)`` per head, float32."""
        return -torch.exp(self.A_log.float())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Some Nemotron-H exports pad in_proj with 2*d_mlp unused leading rows; adopt the stored width
        # (the children load after this hook, so the resized in_proj receives the tensor).
        stored = state_dict.get(prefix + "in_proj.weight")
        if stored is not None and stored.shape[0] != self.in_proj.out_features:
            extra = stored.shape[0] - (self.d_inner + self.conv_dim + self.num_heads)
            if extra < 0 or extra % 2:
                raise ValueError(f"'{prefix}in_proj.weight' has {stored.shape[0]} rows; expected "
                                 f"{self.d_inner + self.conv_dim + self.num_heads} plus an even padding")
            old = self.in_proj
            device = old.weight.device
            if isinstance(old, QuantizedLinear):
                self.in_proj = QuantizedLinear(old.in_features, stored.shape[0], old.bias is not None, old.spec,
                                               old.scales.dtype, device)
            else:
                self.in_proj = Linear(old.in_features, stored.shape[0], bias=old.bias is not None,
                                         device=device, dtype=old.weight.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _conv(self, xBC: torch.Tensor, cache: MambaCache | None, advance: bool = True) -> torch.Tensor:
        """Causal depthwise conv over time (zeros, or the cached rows, before the input), then SiLU. The
        cache keeps the last K - 1 inputs, whatever row is at what position (a step's window is the same
        cat for one row or many). ``advance``: a prefill, which moves ``cache.offset`` (a streaming step's
        positions are the caller's: it reads no host-side offset)."""
        K = self.kernel
        if cache is None:
            window = F.pad(xBC, (0, 0, K - 1, 0))
        else:
            state = cache.conv_state
            if advance and cache.offset == 0 and state.dtype != xBC.dtype:  # MLX makes the first zeros in the input's dtype
                state = state.to(xBC.dtype)
            window = torch.cat((state, xBC), 1)  # MLX's concat: a wider input promotes the state for good
            cache.conv_state = window_tail(window, state, xBC, 1)
            if advance:
                cache.offset += xBC.shape[1]
        # MLX's conv layer in the promoted dtype (layers.Conv1d): bf16 rounds the conv, then adds the bias
        out = self.conv1d(window.transpose(1, 2)).transpose(1, 2)
        return silu(out)

    def _ssm_step(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  state: torch.Tensor) -> torch.Tensor:
        """One token of S <- exp(dt A) S + dt x (x) B; y = S C, in place on ``state``, all heads at once.

        x [b, H, P], dt [b, H] float32, B and C [b, G, N]; returns y [b, H, P] float32.
        """
        b, H, P = x.shape
        G, N = B.shape[1:]
        if C.dtype in REDUCED:
            return self._ssm_step_reduced(x, dt, A, B, C, state)
        state.mul_(torch.exp(dt * A)[..., None, None])
        grouped = state.view(b, G, H // G * P, N)
        grouped.addcmul_((x * dt.unsqueeze(-1)).view(b, G, -1, 1), B.unsqueeze(2))
        y = grouped.view(b * G, -1, N) @ C.reshape(b * G, N, 1).float()
        return y.view(b, H, P)

    def _ssm_step_reduced(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """:meth:`_ssm_step` for bf16/fp16 x, B, C (a bf16 prompt prefill) as the reference's chunked scan
        computes one token: ``y = round(C.B) dt x + exp(dt A) (S C)``, C.B rounded to the input dtype."""
        b, H, P = x.shape
        G, N = B.shape[1:]
        decay = torch.exp(dt * A)  # [b, H]
        grouped = state.view(b, G, H // G * P, N)
        y_prev = (grouped.view(b * G, -1, N) @ C.reshape(b * G, N, 1).float()).view(b, H, P)
        cb = (C.float() * B.float()).sum(-1).to(C.dtype).float().repeat_interleave(H // G, dim=1)  # [b, H]
        dtx = x.float() * dt.unsqueeze(-1)
        state.mul_(decay[..., None, None])
        grouped.addcmul_(dtx.view(b, G, -1, 1), B.float().unsqueeze(2))
        return cb.unsqueeze(-1) * dtx + decay.unsqueeze(-1) * y_prev

    def forward(self, x: torch.Tensor, cache: MambaCache | None = None, rows: LanguageRows | None = None,
                residual: torch.Tensor | None = None, norm: nn.Module | None = None) -> torch.Tensor:
        """``rows``: the streaming step's placement (the conv and SSM state are per row whatever it is).
        ``residual``: returns ``residual + mixer(x)`` (:func:`~nvchat_torch.models.layers.add_linear`); ``norm``:
        the block's pre-norm, applied to x here (fused with ``in_proj`` on a CPU, as in every mixer)."""
        y = self.mix(norm_linear(norm, x, self.in_proj), cache, rows is None, None if rows is None else rows.steps)
        return self.out_proj(y) if residual is None else add_linear(residual, self.out_proj, y)

    def mix(self, projected: torch.Tensor, cache: MambaCache | None, advance: bool = True,
            steps: torch.Tensor | None = None) -> torch.Tensor:
        """Between the projections: ``in_proj``'s output ``[b, L, .]`` -> ``out_proj``'s input ``[b, L, d_inner]``;
        ``advance``: move ``cache.offset`` (a prefill; a streaming step leaves it to the caller); ``steps``:
        see :class:`LanguageRows`."""
        b, L, _ = projected.shape
        pad = projected.shape[-1] - (self.d_inner + self.conv_dim + self.num_heads)  # the 2*d_mlp padding
        z, xBC, dt = projected[..., pad:].split((self.d_inner, self.conv_dim, self.num_heads), dim=-1)
        xBC = self._conv(xBC, cache, advance)
        gn = self.n_groups * self.state_size
        xs, B, C = xBC.split((self.d_inner, gn, gn), dim=-1)
        xs = xs.reshape(b, L, self.num_heads, self.head_dim)
        B = B.reshape(b, L, self.n_groups, self.state_size)
        C = C.reshape(b, L, self.n_groups, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias)
        if self.dt_min is not None or self.dt_max is not None:
            dt = dt.clamp(self.dt_min, self.dt_max)
        if steps is not None:  # exp(0 A) = 1 and 0 x B = 0: the SSM state of a row that does not step stays
            dt = torch.where(steps.view(-1, 1, 1), dt, 0.0)
        A = self.decay_rates()
        if cache is not None and L == 1:
            y = self._ssm_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], cache.ssm_state).unsqueeze(1)
        else:
            y, state = ssd_scan(xs, dt, A, B, C, None if cache is None else cache.ssm_state)
            if cache is not None:
                cache.ssm_state.copy_(state)
        if xs.dtype in REDUCED:  # the D skip; in bf16 the reference rounds the product and the sum
            y = y.to(xs.dtype) + xs * self.D.to(xs.dtype)[:, None]
        else:
            y = torch.addcmul(y.to(xs.dtype), xs, self.D.to(xs.dtype)[:, None])
        return self.norm(y.reshape(b, L, self.d_inner), z)


class FusedMamba2Mixer(NemotronHMamba2Mixer, FusedOnCpu):
    """``prepare()``'s swap for :class:`NemotronHMamba2Mixer`: ``A = -exp(A_log)`` computed once, and on
    a float32 CPU model a streaming step's whole mix as one fused kernel (:mod:`~nvchat_torch.models.cpu_kernels`)."""

    def __init__(self, mixer: NemotronHMamba2Mixer):
        adopt(self, mixer)
        self.register_buffer("A", mixer.decay_rates().detach(), persistent=False)

    def decay_rates(self) -> torch.Tensor:
        return self.A

    def use_cpu_kernels(self) -> None:
        """Take the fused step on float32 activations, with its small parameters in float32 (see
        :func:`~nvchat_torch.models.layers.register_float32`); the conv's taps ``[C, K]`` and bias are the ones
        :class:`~nvchat_torch.models.layers.Conv1d` keeps (``prepare()`` gives it them too)."""
        for name, t in (("D_f32", self.D), ("dt_bias_f32", self.dt_bias), ("norm_weight_f32", self.norm.weight)):
            register_float32(self, name, t)
        self.fused_on_cpu = True

    def mix(self, projected: torch.Tensor, cache: MambaCache | None, advance: bool = True,
            steps: torch.Tensor | None = None) -> torch.Tensor:
        b, L, width = projected.shape
        if not (self.fused_on_cpu and cache is not None and L == 1 and cpu_kernels.usable(projected, cache.ssm_state)
                and cache.conv_state.dtype == torch.float32 and steps is None):
            return super().mix(projected, cache, advance, steps)
        if not cache.conv_state.is_contiguous():  # a batched prefill's state is a view of its window
            cache.conv_state = cache.conv_state.contiguous()
        pad = width - (self.d_inner + self.conv_dim + self.num_heads)
        y, cache.conv_state = torch.ops.nvchat_cpu.mamba_step(projected.view(b, width), cache.conv_state, self.conv1d.taps,
                                            self.conv1d.bias_f32, self.dt_bias_f32, self.A, self.D_f32, self.norm_weight_f32,
                                            cache.ssm_state, pad, self.n_groups, self.norm.groups, self.norm.eps,
                                            self.dt_min, self.dt_max)
        if advance:
            cache.offset += 1
        return y.view(b, 1, self.d_inner)


# --------------------------------------------------------------------------------------
# Attention (GQA, no positional encoding) and MLP


class NemotronHAttention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)

    def project(self, x: torch.Tensor, norm: nn.Module | None) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of ``norm(x)``."""
        x = x if norm is None else norm(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, rows: LanguageRows | None = None,
                residual: torch.Tensor | None = None, norm: nn.Module | None = None) -> torch.Tensor:
        b, L, _ = x.shape
        kv, rep, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q, k, v = self.project(x, norm)
        k = k.view(b, L, kv, d).transpose(1, 2)
        v = v.view(b, L, kv, d).transpose(1, 2)
        if rows is not None:
            k, v = cache.update_rows(k, v, rows)
        elif cache is not None:
            k, v = cache.update(k, v)
        S = k.shape[2]
        # Query head h reads KV head h // rep: group the rep query heads (and their L rows) per KV head.
        q = (q * self.scale).view(b, L, kv, rep, d).permute(0, 2, 3, 1, 4).reshape(b, kv, rep * L, d)
        dtype = q.dtype if q.dtype == k.dtype else promote(q.dtype, k.dtype)
        scores = q.to(dtype) @ k.to(dtype).transpose(-1, -2)  # [b, kv, rep*L, S]
        if rows is not None and rows.blocked is not None:  # each row attends its own positions
            scores = scores.masked_fill(rows.blocked, float("-inf"))
        elif L > 1:  # causal, the queries being the last L of the S positions
            allowed = torch.ones(L, S, dtype=torch.bool, device=x.device).tril(S - L)
            scores = scores.view(b, kv, rep, L, S).masked_fill(~allowed, float("-inf")).view(b, kv, rep * L, S)
        probs = scores.softmax(-1, dtype=torch.float32).to(dtype)
        out = (probs @ v.to(dtype)).view(b, kv, rep, L, d).permute(0, 3, 1, 2, 4).reshape(b, L, -1)
        return self.o_proj(out) if residual is None else add_linear(residual, self.o_proj, out)


class FusedNemotronHAttention(NemotronHAttention):
    """``prepare()``'s swap for :class:`NemotronHAttention`: q/k/v as one matmul (``qkv_proj``)."""

    def __init__(self, attention: NemotronHAttention):
        adopt(self, attention)
        fuse_linears(self, ["q_proj", "k_proj", "v_proj"], "qkv_proj")

    def project(self, x: torch.Tensor, norm: nn.Module | None) -> tuple[torch.Tensor, ...]:
        d = self.head_dim
        qkv = norm_linear(norm, x, self.qkv_proj)
        return qkv.split((self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d), dim=-1)


class NemotronHMLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: nn.Module | None = None) -> torch.Tensor:
        h = norm_linear(norm, x, self.up_proj, "relu_square")  # relu(up(norm(x)))^2, one kernel on a CPU
        return self.down_proj(h) if residual is None else add_linear(residual, self.down_proj, h)


_MIXERS = {"M": NemotronHMamba2Mixer, "*": NemotronHAttention, "-": NemotronHMLP}


class NemotronHBlock(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``."""

    def __init__(self, config: TextConfig, block_type: str):
        super().__init__()
        if block_type not in _MIXERS:
            raise ValueError(f"hybrid_override_pattern: unsupported layer type {block_type!r} "
                             f"(supported: {', '.join(_MIXERS)})")
        self.block_type = block_type
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = _MIXERS[block_type](config)

    def forward(self, x: torch.Tensor, cache: MambaCache | KVCache | None = None,
                rows: LanguageRows | None = None) -> torch.Tensor:
        if self.block_type == "-":  # the norm is applied by the mixer, with its first projection
            return self.mixer(x, residual=x, norm=self.norm)
        return self.mixer(x, cache, rows, residual=x, norm=self.norm)


# The streaming step of each block kind as a function of tensors (layers.layer_step): compiled once
# per kind and stamped out for the other layers. The cache objects are made here, around the tensors.


@layer_step
def _mamba_step(block: NemotronHBlock, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                rows: LanguageRows) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba block's step: ``ssm_state`` is updated in place; returns the output and the conv state."""
    cache = MambaCache(conv_state, ssm_state)
    return block(x, cache, rows), cache.conv_state


@layer_step
def _attention_step(block: NemotronHBlock, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    rows: LanguageRows) -> torch.Tensor:
    """An attention block's step: each row's key and value are written in place at its position."""
    return block(x, KVCache(keys, values), rows)


@layer_step
def _mlp_step(block: NemotronHBlock, x: torch.Tensor) -> torch.Tensor:
    return block(x)


# --------------------------------------------------------------------------------------
# The model


class NemotronHModel(nn.Module):
    """Nemotron-H without token embeddings (``stt_model.llm``): fused input embeddings -> final hidden."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(NemotronHBlock(config, t) for t in config.hybrid_override_pattern)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def new_cache(self, batch: int = 1, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> LanguageCache:
        """Empty caches, one per layer. ``dtype`` (default: the model's) is the conv/KV buffers'
        initial dtype; docs/parity.md, "Nemotron-H's state dtypes", says how other dtypes promote them."""
        cfg = self.config
        device = self.norm_f.weight.device if device is None else device
        dtype = self.norm_f.weight.dtype if dtype is None else dtype
        layers: list[MambaCache | KVCache | None] = []
        for block_type in cfg.hybrid_override_pattern:
            if block_type == "M":
                layers.append(MambaCache(
                    torch.zeros(batch, cfg.conv_kernel - 1, cfg.mamba_conv_dim, device=device, dtype=dtype),
                    torch.zeros(batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size,
                                device=device, dtype=torch.float32)))
            elif block_type == "*":
                shape = (batch, cfg.num_key_value_heads, KV_BLOCK, cfg.head_dim)
                layers.append(KVCache(torch.zeros(shape, device=device, dtype=dtype),
                                      torch.zeros(shape, device=device, dtype=dtype),
                                      limit=cfg.max_position_embeddings))
            else:
                layers.append(None)
        return LanguageCache(layers)

    def forward(self, inputs_embeds: torch.Tensor, cache: LanguageCache | None = None) -> torch.Tensor:
        """``[B, T, hidden]`` -> ``[B, T, hidden]`` after ``norm_f``. Without a cache the pass is causal
        over T from an empty state; with one it continues from the cache and advances it by T."""
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(f"inputs_embeds must be [batch, time, {self.config.hidden_size}], "
                             f"got {list(inputs_embeds.shape)}")
        if cache is not None:
            self._check_cache(cache, inputs_embeds.shape[0])
        h = inputs_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.offset += inputs_embeds.shape[1]
        return self.norm_f(h)

    def forward_step(self, inputs_embeds: torch.Tensor, cache: LanguageCache, rows: LanguageRows) -> torch.Tensor:
        """The streaming step: one position per row ``[B, 1, hidden]``, each row at its own
        ``rows.positions`` (sessions of different lengths side by side; a lone session is one row), no
        host syncs; ``cache``'s offsets are left to the caller. :meth:`forward` continues a cache by any
        number of positions (a prompt's prefill)."""
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[1] != 1:
            raise ValueError(f"forward_step takes one position per row, [batch, 1, {self.config.hidden_size}], "
                             f"got {list(inputs_embeds.shape)}")
        self._check_cache(cache, inputs_embeds.shape[0])
        h = inputs_embeds
        for layer, entry in zip(self.layers, cache.layers):
            if isinstance(entry, MambaCache):
                h, entry.conv_state = _mamba_step(layer, h, entry.conv_state, entry.ssm_state, rows)
            elif isinstance(entry, KVCache):
                h = _attention_step(layer, h, entry.keys, entry.values, rows)
            else:
                h = _mlp_step(layer, h)
        return self.norm_f(h)

    def _check_cache(self, cache: LanguageCache, batch: int) -> None:
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"cache has {len(cache.layers)} layers, the model {len(self.layers)}: "
                             "make it with this model's new_cache()")
        for i, (layer, entry) in enumerate(zip(self.layers, cache.layers)):
            expected = {"M": MambaCache, "*": KVCache, "-": type(None)}[layer.block_type]
            if not isinstance(entry, expected):
                raise ValueError(f"cache layer {i} is {type(entry).__name__}, layer {i} ({layer.block_type!r}) "
                                 f"needs {expected.__name__}: make it with this model's new_cache()")
        first = next((c for c in cache.layers if c is not None), None)
        cached_batch = None if first is None else (
            first.ssm_state if isinstance(first, MambaCache) else first.keys).shape[0]
        if cached_batch is not None and cached_batch != batch:
            raise ValueError(f"inputs_embeds has batch {batch}, the cache batch {cached_batch}")

    def fuse(self) -> None:
        """Post-load transforms (outputs unchanged): each attention layer's q/k/v as one matmul
        (:class:`FusedNemotronHAttention`), each Mamba layer's ``A`` precomputed (:class:`FusedMamba2Mixer`)."""
        swap_modules(self, NemotronHAttention, FusedNemotronHAttention)
        swap_modules(self, NemotronHMamba2Mixer, FusedMamba2Mixer)
