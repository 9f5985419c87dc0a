"""Layers that compute as the MLX reference does, with every weight kept in its stored dtype.

torch refuses mixed dtypes in ``F.linear``/``conv``/``layer_norm``, and its bf16 elementwise kernels
round differently from MLX's, so the networks use these instead. In float32 every helper is the
plain torch op, so a float32 model pays nothing for them.
Design: docs/parity.md, "The dtype flow: the port's design rule" and "The promoting layers".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
import torch.utils._pytree
from torch import nn

from . import cpu_kernels

__all__ = ["RowTensor", "RowCache", "RecurrentCache", "RowValue", "REDUCED", "promoted", "linear", "matmul", "Linear", "Conv1d", "Conv2d", "LayerNorm", "scalar", "sigmoid", "silu",
           "gelu_tanh", "gelu_erf", "softplus", "squared_norms", "rsqrt", "mean_last", "var_last", "pointwise", "rms_norm", "RMSNorm", "OffsetRMSNorm", "PrecomputedOffsetRMSNorm",
           "adopt", "swap_modules", "add_linear", "FusedOnCpu", "FusedNorm", "register_float32", "norm_linear",
           "ACTIVATIONS", "KV_BLOCK", "grown_capacity", "fused_cpu_paths", "layer_step", "layer_step_input", "window_tail"]

REDUCED = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types``, decided once per pair of dtypes: a frame's ops then look it up on the
    host instead of dispatching a promotion each (a few thousand per frame)."""
    return torch.promote_types(a, b)


def promoted(x: torch.Tensor, *others: torch.Tensor | None) -> torch.dtype:
    """The dtype MLX computes ``x op others`` in."""
    dtype = x.dtype
    for t in others:
        if t is not None and t.dtype != dtype:
            dtype = promote(dtype, t.dtype)
    return dtype


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _linear_in_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), _as(bias, torch.float32))


@torch.library.custom_op("nvchat::linear_float32", mutates_args=())
def _linear_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear_in_float32(x, weight, bias)


@_linear_float32.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in the promoted dtype; bf16/fp16 accumulate in float32, one rounding.

    A bf16/fp16 weight is upcast for each call and the copy freed after it. Under ``torch.compile`` that
    call is one opaque op (``nvchat::linear_float32``, the same two torch ops): inductor otherwise merges
    the upcasts of a weight that a frame reads several times (the MoG head's layers, once per draw) into
    one kernel and keeps each float32 copy alive until its last use, which held ~150 MB more at the
    full size's peak (docs/performance.md, "Full-size memory")."""
    dtype = promoted(x, weight, bias)
    if weight.dtype in REDUCED and torch.compiler.is_compiling():
        return _linear_float32(x, weight, bias).to(dtype)
    if dtype in REDUCED:
        return _linear_in_float32(x, weight, bias).to(dtype)
    return F.linear(_as(x, dtype), _as(weight, dtype), _as(bias, dtype))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the promoted dtype; bf16/fp16 accumulate in float32, one rounding."""
    dtype = promoted(a, b)
    if dtype in REDUCED:
        return torch.matmul(a.float(), b.float()).to(dtype)
    return torch.matmul(_as(a, dtype), _as(b, dtype))


def add_linear(x: torch.Tensor, module: nn.Module, h: torch.Tensor, alpha: float = 1.0,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x + alpha * module(h)`` for a linear ``module``: a residual and the projection that feeds it as
    one ``addmm`` (one kernel) for a bias-free ``nn.Linear`` (or a given ``weight`` [out, in]) on one
    position per row ``[B, 1, d]``, as the streaming steps have; otherwise the projection, then the sum."""
    w = module.weight if weight is None and isinstance(module, nn.Linear) else weight
    if w is not None and module.bias is None and x.dim() == 3 and x.shape[1] == 1:
        dtype, rows = promoted(x, h, w), x.shape[0]
        return torch.addmm(x.view(rows, -1), h.reshape(rows, -1).to(dtype), w.to(dtype).t(), alpha=alpha).view_as(x)
    y = module(h) if weight is None else linear(h, weight, module.bias)
    return torch.add(x, y, alpha=alpha)



KV_BLOCK = 256  # key/value caches grow by whole blocks of this many slots (MLX KVCache.step)


def grown_capacity(capacity: int, needed: int, limit: int | None = None) -> int:
    """The next length of a key/value buffer that holds ``capacity`` positions and must hold ``needed``:
    whole ``KV_BLOCK``s, at least 1.5 times the old length (so the copies of a whole session add up to
    O(positions): a buffer grows about a dozen times in an hour), and not past ``limit`` unless
    ``needed`` is."""
    size = -(-max(needed, capacity * 3 // 2) // KV_BLOCK) * KV_BLOCK
    if limit is not None:
        size = min(size, limit)
    return max(size, needed)


S = TypeVar("S")


def layer_step(step: S) -> S:
    """Mark ``step``, one layer's streaming step, as a nested compile region: under ``torch.compile``
    (the compiled frame step) a kind of layer is traced and compiled once and stamped out for its
    other layers (52 LLM, 24 Conformer and 28 TTS layers at full size); that bounds the frame step's
    compile time. Eager, it is a plain call. torch reuses a region only if it is a function of its
    arguments: tensors, modules, constants and :func:`layer_step_input` dataclasses in, tensors out, and no
    Python object it did not make changed (a cache's tensors are written in place, and a tensor a
    cache would rebind is returned for the caller to store)."""
    region = torch.compiler.nested_compile_region(step)

    @functools.wraps(step)
    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        # eager, the step itself: the region's wrapper costs ~5 us a call, and a frame makes ~150
        return region(*args, **kwargs) if torch.compiler.is_compiling() else step(*args, **kwargs)

    return call  # type: ignore[return-value]


def window_tail(window: torch.Tensor, state: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """A convolution state's next value: ``window`` (``cat((state, new), dim)``) less its first ``new``'s
    length, as long as ``state``. Eager, a view of the window (no kernel). While compiling, its own cat:
    torch 2.13's inductor returns a view into a nested region's (:func:`layer_step`) intermediate with its
    offset applied twice (garbage, or a double free), and drops a copy of it that has its layout."""
    n, keep = new.shape[dim], state.shape[dim]
    if torch.compiler.is_compiling() and n < keep:
        return torch.cat((state.narrow(dim, n, keep - n), new), dim)
    return window.narrow(dim, window.shape[dim] - keep, keep)


# A cache tensor with its batch axis and the slices each row holds there (the TTS keeps two per row:
# conditional and unconditional).
RowTensor = tuple[torch.Tensor, int, int]


class RowCache:
    """The batch operations of a streaming cache whose tensors hold a slice per row (a conversation), as
    a frame step calls them when rows join, leave and sit a step out. A cache lists its tensors in
    :meth:`batched` and, of those, the ones a step replaces or updates whole (its recurrent state) in
    :meth:`carried`; :meth:`rebind` and :meth:`rebind_carried` take new tensors in the same order."""

    def batched(self) -> list[RowTensor]:
        raise NotImplementedError

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def carried(self) -> list[RowTensor]:
        return []

    def rebind_carried(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            raise NotImplementedError

    def resize(self, batch: int) -> None:
        """``batch`` rows: rows added at the end (zeros), or the last ones dropped (freed)."""
        out = []
        for t, axis, per in self.batched():
            have = t.shape[axis] // per
            if batch > have:
                shape = list(t.shape)
                shape[axis] = (batch - have) * per
                t = torch.cat([t, t.new_zeros(shape)], dim=axis)
            elif batch < have:
                t = t.narrow(axis, 0, batch * per).clone()
            out.append(t)
        self.rebind(out)

    def zero_row(self, row: int) -> None:
        for t, axis, per in self.batched():
            t.narrow(axis, row * per, per).zero_()

    def saved(self) -> list[torch.Tensor]:
        """Copies of the carried state, for :meth:`put_back`."""
        return [t.clone() for t, _, _ in self.carried()]

    def put_back(self, saved: list[torch.Tensor], keep: torch.Tensor) -> None:
        """The rows not in ``keep`` (``[B]`` bool: the rows that advanced) get their carried state back as
        ``saved``."""
        out = []
        for (t, axis, per), before in zip(self.carried(), saved):
            rows = keep.repeat_interleave(per).view([-1 if a == axis else 1 for a in range(before.dim())])
            out.append(torch.where(rows, t, before))
        self.rebind_carried(out)

    def keep_buffers(self, buffers: list[torch.Tensor]) -> None:
        """The carried state copied into ``buffers`` (what :meth:`carried` gave before the step), which the
        cache holds again: a compiled step's buffers stay its own, which is what CUDA graphs replay."""
        out = []
        for (new, _, _), buffer in zip(self.carried(), buffers):
            if new is not buffer and new.dtype == buffer.dtype:
                buffer.copy_(new)
                new = buffer
            out.append(new)
        self.rebind_carried(out)


class RecurrentCache(RowCache):
    """A row cache whose every tensor is recurrent state: a step replaces or updates all of it."""

    def carried(self) -> list[RowTensor]:
        return self.batched()

    def rebind_carried(self, tensors: list[torch.Tensor]) -> None:
        self.rebind(tensors)


@dataclass
class RowValue(RecurrentCache):
    """One tensor a step leaves for the next, a row per conversation along axis 0 (the ids fed back, the
    last codes, the turn-taking policy's reason codes)."""

    tensor: torch.Tensor

    def batched(self) -> list[RowTensor]:
        return [(self.tensor, 0, 1)]

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        (self.tensor,) = tensors


def layer_step_input(cls: type[S]) -> type[S]:
    """Register a step's per-row dataclass (positions, slots, masks) as a pytree node, so that a
    :func:`layer_step` can take it: the compiler sees its tensors and constants."""
    torch.utils._pytree.register_dataclass(cls)
    return cls


class FusedOnCpu:
    """A module with a fused CPU step (:mod:`~nvchat_torch.models.cpu_kernels`): ``prepare()`` calls
    :meth:`use_cpu_kernels` on a float32 CPU model, and the module then takes its fused op on the
    activations that op accepts (float32, contiguous CPU tensors), the composite code otherwise."""

    fused_on_cpu = False

    def use_cpu_kernels(self) -> None:
        self.fused_on_cpu = True


def fused_cpu_paths(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Each CPU-only path ``prepare()`` switched on, as (module, flag): a fused op (``fused_on_cpu``) and the
    log-mel's real FFT (``real_fft``). Setting a flag False gives that module the composite code, which
    is what MPS and CUDA run (a compiled step, and the doctor's audit of what MPS would run)."""
    return [(m, flag) for m in model.modules() for flag in ("fused_on_cpu", "real_fft") if getattr(m, flag, False)]


def register_float32(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """``module.<name>``: ``tensor`` as the fused CPU kernels take it, float32 (a non-persistent buffer;
    the same tensor if it is float32 already, else an exact upcast of a small bf16 vector, which the
    composite code promoted on every call against float32 activations)."""
    module.register_buffer(name, None if tensor is None else tensor.detach().float(), persistent=False)


class FusedNorm(FusedOnCpu):
    """A norm whose fused CPU kernel also takes the projection that reads it (:func:`norm_linear`,
    where torch's BLAS is reachable from the kernels: :func:`~nvchat_torch.models.cpu_kernels.blas`)."""

    def norm_spec(self) -> tuple:
        """``(kind, weight, bias, eps)`` as ``torch.ops.nvchat_cpu.norm_linear`` takes the norm."""
        raise NotImplementedError


def relu_square(x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x)
    return h * h  # .square() is pow(h, 2), the same products, but it dispatches a result_type each


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (a fused gate-up projection's output)."""
    gate, up = x.chunk(2, dim=-1)
    return gelu_tanh(gate) * up


# What norm_linear applies after the projection, by the fused kernel's names: the composite forms.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "": lambda h: h, "silu": F.silu, "relu_square": relu_square, "gelu_tanh_mul": gelu_tanh_mul}


def norm_linear(norm: nn.Module | None, x: torch.Tensor, projection: nn.Module, activation: str = "",
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """``activation(projection(norm(x)))``: a pre-norm, the projection that reads it and the activation
    after it (:data:`ACTIVATIONS`). With the norm's fused CPU kernel in use (a float32 CPU model) and
    float32 operands, one kernel (``nvchat_cpu.norm_linear``: the norm, the BLAS product torch's linear
    makes, the activation on the output in cache); otherwise those ops. ``weight``: the projection's
    ``[out, in]`` matrix where ``projection`` is not a linear (a kernel-1 conv's); its bias is used."""
    if isinstance(norm, FusedNorm) and norm.fused_on_cpu and cpu_kernels.blas():
        # a packed or quantized projection has no float32 ``weight``: the composite ops
        w, bias = getattr(projection, "weight", None) if weight is None else weight, projection.bias
        if isinstance(w, torch.Tensor) and cpu_kernels.usable(x, w) and (bias is None or cpu_kernels.usable(bias)):
            return torch.ops.nvchat_cpu.norm_linear(x, *norm.norm_spec(), w, bias, activation)
    h = x if norm is None else norm(x)
    return ACTIVATIONS[activation](projection(h) if weight is None else linear(h, weight, projection.bias))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint keys) computing with :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _conv(conv: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """MLX's conv layers: the convolution in the promoted dtype, then ``+ bias``. In reduced precision
    each is rounded (the convolution accumulates in float32); in float32 torch adds the bias in-kernel."""
    dtype = promoted(x, conv.weight, conv.bias)
    if dtype not in REDUCED:
        return conv._conv_forward(_as(x, dtype), _as(conv.weight, dtype), _as(conv.bias, dtype))
    y = conv._conv_forward(x.float(), conv.weight.float(), None).to(dtype)
    return y if conv.bias is None else y + conv.bias.view(-1, *[1] * (y.dim() - 2))


def pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A kernel-1 conv (``weight [out, in]``) on channel-last ``x``: as :func:`_conv`, as a matmul."""
    if promoted(x, weight, bias) not in REDUCED:
        return linear(x, weight, bias)
    y = linear(x, weight)
    return y if bias is None else y + bias


class Conv1d(nn.Conv1d, FusedOnCpu):
    """``nn.Conv1d`` computed as MLX's (see :func:`_conv`). A depthwise conv over exactly its kernel's
    width (a streaming step's window, one output frame) in float32 is a batched matmul over the
    channels instead, ``bias + window . weight`` per channel, one kernel either way: torch's CPU conv
    (oneDNN) spends ~180 us setting up each such call against ~10 us for the matmul (measured,
    docs/performance.md), and the step has one per Mamba and Conformer layer. On a float32 CPU model
    any unpadded depthwise conv is one fused kernel (the codec's, over a step's window)."""

    def use_cpu_kernels(self) -> None:
        """A depthwise conv's float32 taps ``[C, K]`` and bias, for its fused op and for the fused steps
        that contain it (the Mamba step, the Conformer convolution module)."""
        c, k = self.in_channels, self.kernel_size[0]
        if self.groups == c == self.out_channels:
            register_float32(self, "taps", self.weight.view(c, k))
            register_float32(self, "bias_f32", self.bias)
            self.fused_on_cpu = self.padding == (0,) and self.stride == (1,) and self.dilation == (1,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, k = self.in_channels, self.kernel_size[0]
        if self.fused_on_cpu and x.dim() == 3 and x.shape[-1] >= k and cpu_kernels.usable(x):
            return torch.ops.nvchat_cpu.depthwise_conv1d(x, self.taps, self.bias_f32)
        if self.groups == c == self.out_channels and x.shape[-1] == k and self.padding == (0,) \
                and promoted(x, self.weight, self.bias) == torch.float32:
            window = x.permute(1, 0, 2)  # [C, B, K]
            weight = _as(self.weight, torch.float32).view(c, k, 1)
            if self.bias is None:
                return torch.bmm(window, weight).permute(1, 0, 2)
            return torch.baddbmm(_as(self.bias, torch.float32).view(c, 1, 1), window, weight).permute(1, 0, 2)
        return _conv(self, x)


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` computed as MLX's (see :func:`_conv`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _conv(self, x)


class LayerNorm(nn.LayerNorm, FusedNorm):
    """``nn.LayerNorm`` in the promoted dtype of the input and its affine parameters."""

    def use_cpu_kernels(self) -> None:  # fused into the projection after it (norm_linear)
        register_float32(self, "weight_f32", self.weight)
        register_float32(self, "bias_f32", self.bias)
        self.fused_on_cpu = True

    def norm_spec(self) -> tuple:
        return "layer", self.weight_f32, self.bias_f32, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = promoted(x, self.weight, self.bias)
        return F.layer_norm(_as(x, dtype), self.normalized_shape, _as(self.weight, dtype), _as(self.bias, dtype),
                            self.eps)


def scalar(value: float, dtype: torch.dtype) -> float:
    """``value`` as MLX uses it with an array of ``dtype``: rounded to that dtype (a host computation, once;
    under torch.compile a constant of the graph, computed when it is traced)."""
    if dtype not in REDUCED:
        return value
    return _rounded(value, dtype) if torch.compiler.is_compiling() else _rounded_once(value, dtype)


def _rounded(value: float, dtype: torch.dtype) -> float:
    return torch.tensor(value, dtype=dtype).item()


_rounded_once = functools.lru_cache(maxsize=None)(_rounded)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """MLX's sigmoid: ``y = 1 / (1 + exp(|x|))`` (exp rounded to x's dtype, the rest in float32), then
    ``y`` for negative x and ``1 - y`` otherwise, rounded once."""
    if x.dtype not in REDUCED:
        return torch.sigmoid(x)
    y = 1.0 / (1.0 + torch.exp(x.abs()).float())
    return torch.where(x < 0, y, 1.0 - y).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``; in bf16 MLX's two roundings (its :func:`sigmoid`, then the product)."""
    if x.dtype not in REDUCED:
        return F.silu(x)
    return x * sigmoid(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``; in bf16 one rounding per op (``x^3`` once)."""
    if x.dtype not in REDUCED:
        return F.gelu(x, approximate="tanh")
    dt = x.dtype
    cube = x.float().pow(3).to(dt)
    inner = torch.tanh(scalar(math.sqrt(2.0 / math.pi), dt) * (x + scalar(0.044715, dt) * cube))
    return scalar(0.5, dt) * x * (1.0 + inner)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """``x (1 + erf(x / sqrt 2)) / 2``; in bf16 one rounding per op."""
    if x.dtype not in REDUCED:
        return F.gelu(x)
    return x * (1.0 + torch.erf(x / scalar(math.sqrt(2.0), x.dtype))) / 2.0


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))`` as MLX's ``logaddexp(x, 0)``: ``max + log1p(exp(min - max))``, each op rounded."""
    if x.dtype not in REDUCED:
        return F.softplus(x)
    high, low = x.clamp(min=0), x.clamp(max=0)
    return high + torch.log1p(torch.exp(low - high))


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last axis, kept: MLX sums in float32, rounds, then multiplies by ``1 / n`` in x's dtype."""
    if x.dtype not in REDUCED:
        return x.mean(-1, keepdim=True)
    return x.sum(-1, keepdim=True, dtype=torch.float32).to(x.dtype) * scalar(1.0 / x.shape[-1], x.dtype)


def squared_norms(rows: torch.Tensor) -> torch.Tensor:
    """``sum(e * e)`` over the last axis as MLX forms it in the rows' dtype (bf16: rounded products,
    float32 accumulation, one rounding), returned in float32 (the codebook distance searches)."""
    return (rows * rows).sum(-1, dtype=torch.float32).to(rows.dtype).float()


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)``; in bf16 as MLX's CPU kernel: the square root rounded, then the reciprocal rounded."""
    if x.dtype not in REDUCED:
        return torch.rsqrt(x)
    return 1.0 / torch.sqrt(x)


def var_last(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Biased variance over the last axis, kept, given its :func:`mean_last`: ``mean((x - mean)^2)``."""
    centred = x - mean
    return mean_last(centred * centred)


# --------------------------------------------------------------------------------------
# RMS norms: the plain one (Nemotron-H) and the offset one (Gemma, the TTS's character encoder,
# fusion and MoG head), whose weight is stored as an offset from one


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """MLX ``fast.rms_norm``: normalise in float32, round to x's dtype, then scale (promoting; in
    bf16 the product is rounded again). In float32 with a float32 weight that is one fused op."""
    if weight is None or (weight.dtype == x.dtype and x.dtype not in REDUCED):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return y if weight is None else y * weight


class RMSNorm(nn.Module, FusedNorm):
    """``x / rms(x) * weight`` as :func:`rms_norm` (Nemotron-H)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def use_cpu_kernels(self) -> None:  # one pass, not torch's CPU composite of 13 ops
        register_float32(self, "weight_f32", self.weight)
        self.fused_on_cpu = True

    def norm_spec(self) -> tuple:
        return "rms", self.weight_f32, None, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_on_cpu and cpu_kernels.usable(x):  # float32 activations (a bf16 weight promotes exactly)
            return torch.ops.nvchat_cpu.rms_norm(x, self.weight_f32, self.eps)
        return rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
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

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (Gemma's post-norms)."""
        return residual + self(x)


class PrecomputedOffsetRMSNorm(OffsetRMSNorm, FusedNorm):
    """``prepare()``'s swap for :class:`OffsetRMSNorm`: ``1 + weight`` computed once for activations of
    ``dtype``, the same values stored in the dtype they are used in (float32, or in the fast mode's
    bf16 the Gemma norm's own sum)."""

    def __init__(self, norm: OffsetRMSNorm, dtype: torch.dtype):
        adopt(self, norm)
        scale = norm.offset_weight().detach()
        self.register_buffer("scale", scale.to(torch.promote_types(scale.dtype, dtype)), persistent=False)

    def offset_weight(self) -> torch.Tensor:
        return self.scale

    def use_cpu_kernels(self) -> None:  # one pass, not torch's CPU composite of 13 ops
        self.fused_on_cpu = self.scale.dtype == torch.float32

    def norm_spec(self) -> tuple:
        return "rms", self.scale, None, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_on_cpu and cpu_kernels.usable(x):
            return torch.ops.nvchat_cpu.rms_norm(x, self.scale, self.eps)
        return super().forward(x)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.fused_on_cpu and cpu_kernels.usable(residual, x):  # one fused kernel
            return torch.ops.nvchat_cpu.add_rms_norm(residual, x, self.scale, self.eps)
        return residual + self(x)



# --------------------------------------------------------------------------------------
# Post-load transforms as module swaps

M = TypeVar("M", bound=nn.Module)


def adopt(module: nn.Module, original: nn.Module) -> None:
    """Start ``module``, an instance of a swap class (a subclass of ``type(original)``), as a shallow
    copy of ``original``: the same attributes, parameters, buffers and children, no tensor copied.
    The swap class's ``__init__`` then changes what its transform changes."""
    module.__dict__.update({key: value.copy() if isinstance(value, (dict, set)) else value
                            for key, value in vars(original).items()})


def swap_modules(root: nn.Module, original: type[M], make: Callable[[M], nn.Module]) -> int:
    """Replace every submodule of ``root`` whose type is exactly ``original`` by ``make(module)``.

    The post-load transforms (``VoiceChatModel.prepare``) are such swaps: each swap class sits beside
    the class it replaces and overrides only the methods its precomputed layout speeds up. Returns
    the number of modules swapped."""
    count = 0
    for name, module in list(root.named_modules()):
        if name and type(module) is original:
            parent, _, attribute = name.rpartition(".")
            setattr(root.get_submodule(parent), attribute, make(module))
            count += 1
    return count
