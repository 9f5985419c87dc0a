"""MLX's packed weight formats in PyTorch: dequantization and modules that keep weights packed.

The formats are MLX 0.32's ``affine``, ``mxfp4``, ``mxfp8`` and ``nvfp4``, bit-exact to ``mx.dequantize``.
``QuantizedLinear`` / ``QuantizedEmbedding`` hold the checkpoint's tensors as stored, under its keys.
``quantize_modules(model, specs)`` is the gpt-fast style module swap that puts them in place of plain
``nn.Linear``/``nn.Embedding``, so the model code itself stays plain.
Design: docs/checkpoints.md, "Quantization" and "Two ways to hold the weights".
"""

from __future__ import annotations

import warnings
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..diagnostics import return_freed_memory
from .config import QuantSpec
from .int4pack import Int4Kernel, int4_kernel
from .layers import REDUCED, Linear

__all__ = [
    "QuantSpec",
    "unpack_codes",
    "dequantize",
    "packed_shapes",
    "QuantizedLinear",
    "QuantizedEmbedding",
    "Int4PackedLinear",
    "quantize_modules",
    "pack_int4",
    "int4pack_available",
    "self_test_kernel",
    "concat_linears",
    "fuse_linears",
]

# E2M1 values for codes 0..15 (OCP MX spec; -0 kept as 0).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# --------------------------------------------------------------------------------------
# Unpacking and dequantization


def unpack_codes(wq: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack MLX's uint32 words ``[..., in*bits/32]`` into integer codes ``[..., in]`` (uint8).

    Each row is an LSB-first bit stream over its little-endian bytes: element j occupies bits
    ``[j*bits, (j+1)*bits)``. For bits <= 8 an element spans at most two bytes.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"unpack_codes: bits must be in 1..8, got {bits}")
    lead = wq.shape[:-1]
    nbytes = wq.shape[-1] * 4
    data = wq.contiguous().view(torch.uint8).reshape(*lead, nbytes)
    if bits == 8:
        return data
    if bits == 4:
        lo = data & 0x0F
        hi = data >> 4
        return torch.stack((lo, hi), dim=-1).reshape(*lead, nbytes * 2)
    if bits in (1, 2):
        per = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=wq.device)
        mask = (1 << bits) - 1
        return ((data.unsqueeze(-1) >> shifts) & mask).reshape(*lead, nbytes * per)
    # 3, 5, 6, 7 bits: elements straddle bytes; read 16-bit windows.
    n = nbytes * 8 // bits
    bit = torch.arange(n, device=wq.device, dtype=torch.int64) * bits
    byte = bit // 8
    shift = (bit % 8).to(torch.int32)
    padded = torch.cat((data, torch.zeros(*lead, 1, dtype=torch.uint8, device=wq.device)), dim=-1).to(torch.int32)
    window = padded[..., byte] | (padded[..., byte + 1] << 8)
    return ((window >> shift) & ((1 << bits) - 1)).to(torch.uint8)


def _e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 powers of two ``2**(s-127)``; s=0 is 2**-127 and s=255 is +inf (as MLX)."""
    s = scales.to(torch.int32)
    out = (s << 23).view(torch.float32)
    return torch.where(s == 0, torch.full_like(out, 2.0**-127), out)


def _fp_elements(codes: torch.Tensor, mode: str) -> torch.Tensor:
    if mode in ("mxfp4", "nvfp4"):
        table = torch.tensor(_E2M1, dtype=torch.float32, device=codes.device)
        return table[codes.long()]
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)  # mxfp8: the bytes are E4M3FN


def dequantize(
    weight: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor | None,
    spec: QuantSpec,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dequantize an MLX-packed tensor exactly as ``mx.dequantize`` does, then cast to ``dtype``.

    Affine results are computed in the scales' dtype T as ``T(T(scale*q) + bias)``; mx/nv fp
    results as ``T(v) * T(scale)`` with T = ``dtype`` (bfloat16 when None, MLX's default).
    """
    codes = unpack_codes(weight, spec.bits)
    *lead, n_in = codes.shape
    gs = spec.group_size
    if n_in % gs or scales.shape[-1] != n_in // gs:
        raise ValueError(f"packed weight {tuple(weight.shape)} with {spec.bits}-bit codes has {n_in} columns, "
                         f"which does not match scales {tuple(scales.shape)} at group size {gs}")
    grouped = codes.reshape(*lead, n_in // gs, gs)
    if spec.mode == "affine":
        if biases is None:
            raise ValueError("affine quantization needs biases")
        t = scales.dtype
        w = scales.unsqueeze(-1) * grouped.to(t)
        w = w + biases.unsqueeze(-1)
        w = w.reshape(*lead, n_in)
        return w if dtype is None else w.to(dtype)
    out_dtype = dtype or torch.bfloat16
    values = _fp_elements(grouped, spec.mode).to(out_dtype)
    if spec.mode == "nvfp4":
        scale = scales.contiguous().view(torch.float8_e4m3fn).to(out_dtype)
    else:
        scale = _e8m0_to_float(scales).to(out_dtype)
    return (values * scale.unsqueeze(-1)).reshape(*lead, n_in)


def packed_shapes(out_features: int, in_features: int, spec: QuantSpec) -> dict[str, tuple[int, ...]]:
    """Shapes of the stored tensors of a ``[out, in]`` weight packed with ``spec``."""
    if (in_features * spec.bits) % 32 or in_features % spec.group_size:
        raise ValueError(f"in_features {in_features} cannot be packed at {spec.bits} bits, group {spec.group_size}")
    shapes = {"weight": (out_features, in_features * spec.bits // 32),
              "scales": (out_features, in_features // spec.group_size)}
    if spec.has_biases:
        shapes["biases"] = shapes["scales"]
    return shapes


# --------------------------------------------------------------------------------------
# Modules


class _Packed(nn.Module):
    """Shared storage of a packed ``[rows, cols]`` matrix: the checkpoint's tensors as buffers."""

    def __init__(self, rows: int, cols: int, spec: QuantSpec, scale_dtype: torch.dtype, device=None):
        super().__init__()
        self.spec = spec
        shapes = packed_shapes(rows, cols, spec)
        sdt = scale_dtype if spec.mode == "affine" else torch.uint8
        self.register_buffer("weight", torch.zeros(shapes["weight"], dtype=torch.uint32, device=device))
        self.register_buffer("scales", torch.zeros(shapes["scales"], dtype=sdt, device=device))
        if spec.has_biases:
            self.register_buffer("biases", torch.zeros(shapes["biases"], dtype=sdt, device=device))
        else:
            self.biases = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Scales/biases keep the checkpoint's dtype (fp32, bf16 or fp16): adopt it before copying.
        for name in ("scales", "biases"):
            src = state_dict.get(prefix + name)
            buf = getattr(self, name, None)
            if src is not None and buf is not None and src.dtype != buf.dtype and src.shape == buf.shape:
                setattr(self, name, torch.empty_like(buf, dtype=src.dtype))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized(self, dtype: torch.dtype | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        w, s, b = self.weight, self.scales, self.biases
        if rows is not None:
            w, s = w[rows], s[rows]
            b = None if b is None else b[rows]
        if dtype == torch.float32 and self.spec.mode == "affine" and s.dtype != torch.float32:
            # MLX's quantized matmul with fp32 activations uses the unrounded s*q+b.
            s, b = s.float(), b.float()
        return dequantize(w, s, b, self.spec, dtype)


def sequential_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as MLX's CPU quantized matmul computes it in bf16/fp16: one input
    column at a time, each product and each sum rounded (bitwise, see ``tests/test_layouts.py``).
    2 ops per input feature: only bf16-*scale* checkpoints need it, and only while bf16 activations
    flow through the LLM (the prompt prefill); a float32 activation takes the plain matmul."""
    acc = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    for k in range(x.shape[-1]):
        acc = acc + x[..., k:k + 1] * weight[:, k]
    return acc if bias is None else acc + bias


class QuantizedLinear(_Packed):
    """``nn.Linear`` whose weight stays in MLX's packed format (keys ``weight``, ``scales``, ``biases``, ``bias``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec,
                 scale_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__(out_features, in_features, spec, scale_dtype, device)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.fallback: str | None = None  # why pack_int4 left it here, when a fused kernel was meant to run it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.dtype in REDUCED and self.scales.dtype == x.dtype:
            return sequential_linear(x, w, bias)
        return F.linear(x, w, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.spec.mode}, bits={self.spec.bits}, group_size={self.spec.group_size}")


class QuantizedEmbedding(_Packed):
    """``nn.Embedding`` kept packed; a lookup dequantizes only the rows it reads."""

    def __init__(self, num_embeddings: int, embedding_dim: int, spec: QuantSpec,
                 scale_dtype: torch.dtype = torch.bfloat16, device=None, dtype: torch.dtype = torch.float32):
        super().__init__(num_embeddings, embedding_dim, spec, scale_dtype, device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.output_dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.dequantized(self.output_dtype, rows=flat)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.spec.mode}, bits={self.spec.bits}, "
                f"group_size={self.spec.group_size}")


# --------------------------------------------------------------------------------------
# Fused 4-bit kernels (a layout transform applied after loading, as gpt-fast does)


def int4pack_available(device: torch.device | str) -> bool:
    """Whether this torch build has a fused int4 weight-only matmul for ``device``. On the CPU it is
    vectorised for every capability torch dispatches to (AVX2 and AVX-512 alike); whether it computes
    right on this machine is the one-time self-test's to say (:func:`pack_int4`), not a list of CPUs."""
    kernel = int4_kernel(torch.device(device).type)
    return kernel is not None and kernel.available()


class Int4PackedLinear(nn.Module):
    """MLX affine 4-bit linear in a torch int4pack layout, run by that layout's ``_weight_int4pack_mm*``.

    torch computes ``(q - 8)*scale + zero``; MLX computes ``scale*q + bias``; so
    ``zero = bias + 8*scale`` (computed in fp32). Built by :func:`pack_int4` from a
    :class:`QuantizedLinear`, whose packed codes it replaces (not a second copy). ``kernel``
    (default: the one of the weights' device) picks the layout and the op: see
    :mod:`nvchat_torch.models.int4pack`, whose stand-ins run the MPS and CUDA layouts on a CPU.
    """

    def __init__(self, src: QuantizedLinear, dtype: torch.dtype, kernel: Int4Kernel | None = None,
                 in_place: bool = False):
        super().__init__()
        spec = src.spec
        self.in_features, self.out_features, self.group_size = src.in_features, src.out_features, spec.group_size
        self.dtype = dtype
        kernel = kernel or int4_kernel(src.weight.device.type)
        if kernel is None:
            raise ValueError(f"Int4PackedLinear: no int4pack kernel for {src.weight.device.type}")
        self.kernel = kernel
        # The kernels want N % 16 == 0: pad with zero rows (their outputs are sliced away, a view).
        pad = -src.out_features % 16
        words = src.weight if not pad else F.pad(src.weight.view(torch.int32), (0, 0, 0, pad)).view(torch.uint32)
        s, b = F.pad(src.scales.float(), (0, 0, 0, pad)), F.pad(src.biases.float(), (0, 0, 0, pad))
        sz = torch.stack((s, b + 8.0 * s), dim=-1).transpose(0, 1).contiguous()  # [K/gs, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(dtype))
        # in_place (a verified kernel): src's codes become the packed layout where it is the same size; src is spent
        self.register_buffer("packed", kernel.pack(words, self.in_features, in_place=in_place and not pad))
        self.bias = src.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xin = x.reshape(-1, self.in_features).to(self.dtype)
        y = self.kernel.mm(xin, self.packed, self.group_size, self.scales_and_zeros)
        y = y[:, :self.out_features].to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"kernel={self.kernel.name}")


def _int4_eligible(m: nn.Module) -> bool:
    # float32 scales only: a bf16-scale layer needs the reference's sequential bf16 sum in the prefill
    return (isinstance(m, QuantizedLinear) and m.spec.mode == "affine" and m.spec.bits == 4
            and m.scales.dtype == torch.float32
            and m.spec.group_size in (32, 64, 128) and m.in_features % 64 == 0)


def _kernel_self_test(packed: Int4PackedLinear, source: QuantizedLinear) -> str | None:
    """One-time check on the device that the fused kernel computes MLX's ``scale*q + bias`` matmul
    (the MPS/CUDA layouts were derived from PyTorch's sources, and run here only through their
    stand-ins): a random input against the dequantized weights. Returns None when it agrees, else
    why it is not used."""
    x = torch.randn(2, packed.in_features, device=source.weight.device, dtype=packed.dtype,
                    generator=torch.Generator(device=source.weight.device).manual_seed(0))
    rows = torch.arange(min(source.out_features, 1024), device=source.weight.device)  # not a 4.7 GB float32 copy
    try:
        got = packed(x)[:, :len(rows)].float()
    except RuntimeError as e:
        return f"{packed.kernel.op} failed its self-test ({str(e).splitlines()[0]})"
    want = F.linear(x.float(), source.dequantized(torch.float32, rows=rows),
                    None if source.bias is None else source.bias[rows].float())
    tol = 2e-2 if packed.dtype != torch.float32 else 1e-4
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    return None if err <= tol else f"{packed.kernel.op} failed its self-test (relative error {err:.2g} > {tol:g})"


def self_test_kernel(kernel: Int4Kernel, dtype: torch.dtype, device: torch.device | str | None = None) -> str | None:
    """The self-test :func:`pack_int4` runs, on a random 4-bit ``256 -> 200`` linear on ``device``
    (default: the kernel's own; a stand-in runs on the CPU): None if it passes, else why not."""
    device = torch.device(device or ("cpu" if kernel.stand_in else kernel.device_type))
    if not kernel.available():
        return f"this torch build has no {kernel.op}"
    if dtype not in kernel.activation_dtypes:
        return f"{kernel.op} takes {', '.join(map(str, kernel.activation_dtypes))} activations, not {dtype}"
    g = torch.Generator().manual_seed(0)
    words, scales, biases = quantize_affine(torch.randn(200, 256, generator=g), 4, 64)
    source = QuantizedLinear(256, 200, True, QuantSpec(4, 64), torch.float32, device)
    source.load_state_dict({"weight": words, "scales": scales, "biases": biases, "bias": torch.randn(200, generator=g)})
    try:
        packed = Int4PackedLinear(source, dtype, kernel)
    except RuntimeError as e:
        return f"{kernel.op} could not pack the weights ({str(e).splitlines()[0]})"
    return _kernel_self_test(packed, source)


def pack_int4(model: nn.Module, dtype: torch.dtype | None = None, kernel: Int4Kernel | None = None) -> int:
    """Swap every eligible 4-bit :class:`QuantizedLinear` for an :class:`Int4PackedLinear`.

    ``dtype`` is the compute dtype of the kernel (bfloat16 is the fast path on CPU and the only
    one on CUDA). ``kernel`` is the layout and op to use (default: the weights' device's,
    :func:`~nvchat_torch.models.int4pack.int4_kernel`; a stand-in runs the MPS or CUDA branch on a CPU).
    Returns the number of modules swapped: none if the device lacks the kernel, the kernel does not
    take ``dtype``, or its one-time self-test on the device fails; the modules then dequantize per
    call (still correct), each says why in ``fallback`` (shown by ``model.describe()``), and one
    warning names the op, the device and the cost. The state_dict of a swapped module is no
    longer in checkpoint layout (a documented post-load transform, like fusing QKV).
    """
    swapped, verified, eligible = 0, {}, 0
    # Smallest first: the kernel is self-tested on the first, and every later one is packed over its own
    # codes (the fused vocabulary heads last, with no second copy). An entry is dropped once done: the
    # list would otherwise keep each replaced source alive until the end (the packed LLM twice over).
    entries: list[tuple[nn.Module, str, QuantizedLinear] | None] = sorted(
        ((m, name, c) for m in model.modules() for name, c in m.named_children() if _int4_eligible(c)),
        key=lambda entry: entry[2].weight.numel())
    for i, entry in enumerate(entries):
        assert entry is not None
        (module, child_name, child), entries[i], entry = entry, None, None
        eligible += 1
        device = child.weight.device
        chosen = kernel or int4_kernel(device.type)
        kdt = dtype or (chosen.activation_dtypes[0] if chosen else None)
        key = (device.type, chosen.name if chosen else None, kdt)
        if chosen is None or not chosen.available():
            verified[key] = f"this torch build has no {chosen.op if chosen else 'int4pack kernel'} for {device.type}"
        elif kdt not in chosen.activation_dtypes:
            verified[key] = (f"{chosen.op} takes {', '.join(map(str, chosen.activation_dtypes))} activations, "
                             f"not {kdt}")
        else:
            assert kdt is not None
            # Once the kernel passed its self-test, the others are packed over their own codes.
            packed = Int4PackedLinear(child, kdt, chosen, in_place=verified.get(key, "") is None)
            if key not in verified:
                verified[key] = _kernel_self_test(packed, child)
            if verified[key] is None:
                setattr(module, child_name, packed)
                del child, packed
                swapped += 1
                return_freed_memory()  # the source's scales, and the converter's temporaries: not kept for reuse
                continue
        child.fallback = verified[key]
    failures = {key: why for key, why in verified.items() if why is not None}
    if failures and swapped < eligible:
        (device_type, _, kdt), why = next(iter(failures.items()))
        warnings.warn(f"4-bit linears on {device_type}{f' ({kdt} activations)' if kdt else ''}: {why}; "
                      f"{eligible - swapped} of them dequantize their weights on every call instead, which is "
                      "correct but several times slower on a large model (see model.describe())",
                      RuntimeWarning, stacklevel=2)
    return swapped


# --------------------------------------------------------------------------------------
# Module swap


def quantize_modules(model: nn.Module, specs: Mapping[str, QuantSpec], scale_dtypes: Mapping[str, torch.dtype] | None = None,
                     *, embedding_dtype: torch.dtype | None = None) -> list[str]:
    """Replace ``nn.Linear``/``nn.Embedding`` at each path in ``specs`` by its packed counterpart.

    Works on any device, including ``meta`` (to get the checkpoint's shapes without weights).
    Returns the swapped paths. A path that is not a Linear/Embedding, or whose width cannot be
    packed with its spec, raises ``ValueError`` naming it.
    """
    scale_dtypes = scale_dtypes or {}
    done = []
    for path, spec in specs.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name, None)
        sdt = scale_dtypes.get(path, torch.bfloat16)
        if not isinstance(old, (nn.Linear, nn.Embedding)):
            raise ValueError(f"'{path}' is quantized in the checkpoint but is a {type(old).__name__}, "
                             "not a Linear or Embedding")
        try:
            if isinstance(old, nn.Linear):
                new = QuantizedLinear(old.in_features, old.out_features, old.bias is not None, spec, sdt,
                                      old.weight.device)
            else:
                new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, spec, sdt, old.weight.device,
                                         dtype=embedding_dtype or old.weight.dtype)
        except ValueError as e:  # a width the spec cannot pack
            raise ValueError(f"'{path}': {e}") from None
        setattr(parent, name, new)
        done.append(path)
    return done


def concat_linears(linears: list[nn.Module], release: bool = False) -> nn.Module:
    """One linear computing ``cat([l(x) for l in linears], -1)``: the fused-QKV / gate-up transform.

    Works for ``nn.Linear`` and for ``QuantizedLinear`` of one spec (packed rows concatenate,
    so the fused module is exactly as accurate as the separate ones). ``release``: the sources are
    discarded after (their tensors are dropped as each is copied in), so the peak is the fused module
    plus one source, not two copies of everything (the 11B's fused vocabulary heads: 0.7 GB less).
    """
    first = linears[0]
    if not all(l.in_features == first.in_features for l in linears):
        raise ValueError("concat_linears: all linears need the same in_features")
    has_bias = [l.bias is not None for l in linears]
    out = sum(l.out_features for l in linears)
    if all(isinstance(l, nn.Linear) for l in linears):
        fused = Linear(first.in_features, out, bias=False, device="meta")  # no weight made, none initialised
        fused.weight = nn.Parameter(_stacked(linears, "weight", release), requires_grad=False)
    elif all(isinstance(l, QuantizedLinear) and l.spec == first.spec for l in linears):
        fused = QuantizedLinear(first.in_features, out, False, first.spec, first.scales.dtype, "meta")
        fused.weight = _stacked(linears, "weight", release)
        fused.scales = _stacked(linears, "scales", release)
        fused.biases = None if first.biases is None else _stacked(linears, "biases", release)
    else:
        raise TypeError("concat_linears: mix of linear kinds or quantization specs: "
                        + ", ".join(type(l).__name__ for l in linears))
    if any(has_bias):
        ref = next(l.bias for l in linears if l.bias is not None)
        fused.bias = nn.Parameter(torch.cat([
            l.bias.data if l.bias is not None else torch.zeros(l.out_features, dtype=ref.dtype, device=ref.device)
            for l in linears]), requires_grad=False)
    return fused


def _stacked(linears: list[nn.Module], name: str, release: bool) -> torch.Tensor:
    """The linears' tensors ``name`` stacked along rows, copied into one new tensor; with ``release``,
    each source's tensor is dropped from its module once copied (a linear listed twice is kept)."""
    first = getattr(linears[0], name)
    out = first.new_empty((sum(getattr(l, name).shape[0] for l in linears), *first.shape[1:]))
    del first
    row = 0
    for i, linear in enumerate(linears):
        part = getattr(linear, name).detach()
        out[row:row + part.shape[0]] = part
        row += part.shape[0]
        if release and all(l is not linear for l in linears[i + 1:]):
            setattr(linear, name, None)
    return out


def fuse_linears(module: nn.Module, names: list[str], fused: str) -> None:
    """Replace ``module``'s linears ``names`` by one, ``fused``, that computes their outputs concatenated."""
    setattr(module, fused, concat_linears([getattr(module, name) for name in names], release=True))
    for name in names:
        delattr(module, name)
    return_freed_memory()  # the sources' memory: a fused matrix is larger than any of them, so never reuses it


def affine_codes(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The affine codes of ``w [..., in]`` per group of ``group_size``: ``(codes uint8 [..., in], scales,
    biases)``, the scales and biases float32: min/max per group, ``q = round((w - min) / scale)``."""
    *lead, n_in = w.shape
    g = w.float().reshape(*lead, n_in // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)), 0, levels).to(torch.uint8)
    return q.reshape(*lead, n_in), scale, lo


def quantize_affine(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack ``w [..., in]`` in MLX's affine format: ``(weight uint32, scales, biases)`` in ``w``'s dtype.

    Min/max per group, ``q = round((w - min) / scale)``; readable by MLX and by :func:`dequantize`.
    (MLX's own quantizer also snaps the group edge; both are valid encodings of the format.)
    """
    spec = QuantSpec(bits, group_size)
    spec.validate("quantize_affine")
    *lead, n_in = w.shape
    if n_in % group_size or (n_in * bits) % 32:
        raise ValueError(f"quantize_affine: last dim {n_in} cannot be packed at {bits} bits, group {group_size}")
    q, scale, lo = affine_codes(w, bits, group_size)
    q = q.to(torch.int64)
    # LSB-first bit stream per row, little-endian bytes -> uint32 words.
    shifts = torch.arange(bits, dtype=torch.int64, device=w.device)
    stream = ((q.unsqueeze(-1) >> shifts) & 1).reshape(*lead, n_in * bits)
    byte_bits = stream.reshape(*lead, n_in * bits // 8, 8) << torch.arange(8, device=w.device)
    packed = byte_bits.sum(-1).to(torch.uint8).reshape(*lead, n_in * bits // 32, 4)
    words = packed.contiguous().view(torch.int32).squeeze(-1).view(torch.uint32)
    return words, scale.to(w.dtype), lo.to(w.dtype)
