"""torch's fused int4 weight-only matmul, per device, and CPU stand-ins for the ones a CPU lacks.

``aten::_weight_int4pack_mm`` exists only for MPS and CUDA; a CPU has the ``_for_cpu`` pair instead.
Which one a model uses is an :class:`Int4Kernel`, chosen when the weights are packed
(:func:`nvchat_torch.models.quant.pack_int4`). The pure-torch models below let a CPU test run the
MPS and CUDA layouts (``int4_kernel("mps", stand_in=True)``).
The layouts, read from PyTorch's sources: docs/checkpoints.md, "The int4pack kernels and their layouts".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["Int4Kernel", "int4_kernel", "INT4_DEVICE_TYPES", "mps_convert_weight_to_int4pack",
           "mps_weight_int4pack_mm", "cuda_convert_weight_to_int4pack", "cuda_weight_int4pack_mm",
           "unpack_int4pack"]

INT4_DEVICE_TYPES = ("cpu", "mps", "cuda")
_TILE_OFFSETS = (0, 8, 16, 24, 1, 9, 17, 25)  # CUDA: the k of nibble i within a lane's two k-tiles


def _check_convert(w: Tensor, inner_k_tiles: int, op: str) -> tuple[int, int]:
    if w.dim() != 2 or w.dtype != torch.uint8:
        raise RuntimeError(f"{op}: expect weight to be a 2D uint8 tensor [N, K/2], got {w.dtype} {list(w.shape)}")
    if inner_k_tiles not in (2, 4, 8):
        raise RuntimeError(f"{op}: innerKTiles need to be 2, 4, or 8, got {inner_k_tiles}")
    n, k = w.shape[0], w.shape[1] * 2
    if k % (16 * inner_k_tiles):
        raise RuntimeError(f"{op}: K = {k} is not a multiple of 16 * innerKTiles = {16 * inner_k_tiles}")
    return n, k


def _check_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor, op: str,
              dtypes: tuple[torch.dtype, ...]) -> tuple[int, int]:
    if x.dtype not in dtypes or x.dim() != 2 or not x.is_contiguous():
        raise RuntimeError(f"{op}: expect A to be a contiguous 2D tensor of {', '.join(map(str, dtypes))}, "
                           f"got {x.dtype} {list(x.shape)}")
    if packed.dtype != torch.int32 or packed.dim() != 4 or not packed.is_contiguous():
        raise RuntimeError(f"{op}: expect B to be a contiguous 4D int32 tensor, got {packed.dtype} {list(packed.shape)}")
    if group_size not in (32, 64, 128, 256):
        raise RuntimeError(f"{op}: expect qGroupSize to be 32, 64, 128 or 256, got {group_size}")
    n = packed.shape[0] * 8
    if scales_and_zeros.dim() != 3 or scales_and_zeros.shape[1:] != (n, 2):
        raise RuntimeError(f"{op}: expect qScaleAndZeros to be 3d tensor with sizes [:, {n}, 2]")
    return n, x.shape[1]


# --------------------------------------------------------------------------------------
# MPS


def mps_convert_weight_to_int4pack(w: Tensor, inner_k_tiles: int) -> Tensor:
    """``_convert_weight_to_int4pack`` as the MPS kernel ``weight_to_int4pack`` computes it: the
    ``[N, K/2]`` bytes kept in order with their nibbles swapped, in the 4-D int32 "fake shape"."""
    n, k = _check_convert(w, inner_k_tiles, "_convert_weight_to_int4pack_mps")
    swapped = ((w & 0x0F) << 4) | (w >> 4)
    return swapped.contiguous().view(torch.int32).reshape(n // 8, k // (16 * inner_k_tiles), 32, inner_k_tiles // 2)


def _mps_codes(packed: Tensor, n: int, k: int) -> Tensor:
    data = packed.contiguous().view(torch.uint8).reshape(n, k // 2)  # the kernel's B: bytes [N, K/2]
    return torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(n, k)  # ushort LE: k in bits 0-3, k+1 in 4-7


def mps_weight_int4pack_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """``_weight_int4pack_mm`` as the MPS kernel ``int4pack_mm`` computes it (up to summation order)."""
    n, k = _check_mm(x, packed, group_size, scales_and_zeros, "_weight_int4pack_mm_mps",
                     (torch.float32, torch.float16, torch.bfloat16))
    if scales_and_zeros.dtype != x.dtype:  # the kernel binds both buffers as T: another dtype is misread
        raise RuntimeError(f"_weight_int4pack_mm_mps: qScaleAndZeros must be {x.dtype} like A, "
                           f"got {scales_and_zeros.dtype}")
    codes = _mps_codes(packed, n, k).float()
    scale, zero = scales_and_zeros[..., 0], scales_and_zeros[..., 1]
    shifted_zero = (zero - scale * 8).float()  # `zeros - scale * T(8)` in T
    w = (codes.view(n, k // group_size, group_size) * scale.t().float().unsqueeze(-1)).view(n, k)
    a = x.float()
    y = a @ w.t() + a.view(-1, k // group_size, group_size).sum(-1) @ shifted_zero
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------
# CUDA


def _cuda_tile_index(n_tiles: int, k_outer: int, inner_k_tiles: int, device) -> tuple[Tensor, Tensor]:
    """For every nibble of ``out[nt][ko][lane][j]`` (nibble 0 lowest): its row n and column k."""
    nt = torch.arange(n_tiles, device=device).view(-1, 1, 1, 1, 1)
    ko = torch.arange(k_outer, device=device).view(1, -1, 1, 1, 1)
    lane = torch.arange(32, device=device).view(1, 1, -1, 1, 1)
    j = torch.arange(inner_k_tiles // 2, device=device).view(1, 1, 1, -1, 1)
    offsets = torch.tensor(_TILE_OFFSETS, device=device).view(1, 1, 1, 1, -1)
    first_k_tile = ko * inner_k_tiles + 2 * j
    k = first_k_tile * 16 + 2 * (lane % 4) + offsets
    n = nt * 8 + lane // 4
    return torch.broadcast_tensors(n, k)


def cuda_convert_weight_to_int4pack(w: Tensor, inner_k_tiles: int) -> Tensor:
    """``_convert_weight_to_int4pack`` as CUDA's ``matrix_to_m16n8k16_Bint4_layout`` computes it."""
    n, k = _check_convert(w, inner_k_tiles, "_convert_weight_to_int4pack_cuda")
    n_tiles, k_outer = -(-n // 8), k // (16 * inner_k_tiles)
    codes = torch.stack((w >> 4, w & 0x0F), dim=-1).reshape(n, k)  # even k in the high nibble
    codes = torch.cat((codes, codes.new_zeros(n_tiles * 8 - n, k)))  # rows past N read as 0
    rows, cols = _cuda_tile_index(n_tiles, k_outer, inner_k_tiles, w.device)
    nibbles = codes[rows, cols].to(torch.int64) << (4 * torch.arange(8, device=w.device))
    words = nibbles.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _cuda_codes(packed: Tensor, k: int) -> Tensor:
    n_tiles, k_outer, _, half_tiles = packed.shape
    rows, cols = _cuda_tile_index(n_tiles, k_outer, half_tiles * 2, packed.device)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8, device=packed.device))) & 0x0F
    codes = torch.zeros(n_tiles * 8, k, dtype=torch.uint8, device=packed.device)
    codes[rows.reshape(-1), cols.reshape(-1)] = nibbles.reshape(-1).to(torch.uint8)
    return codes


def cuda_weight_int4pack_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """``_weight_int4pack_mm`` as CUDA's tinygemm kernel computes it (up to summation order)."""
    n, k = _check_mm(x, packed, group_size, scales_and_zeros, "_weight_int4pack_mm_cuda", (torch.bfloat16,))
    if packed.shape[1] * packed.shape[3] * 2 * 16 != k:
        raise RuntimeError(f"_weight_int4pack_mm_cuda: B holds K = {packed.shape[1] * packed.shape[3] * 32}, A has {k}")
    q = _cuda_codes(packed, k).to(torch.float64) - 8
    sz = scales_and_zeros.to(torch.bfloat16).to(torch.float64)  # read as bf16
    scale = sz[..., 0].t().repeat_interleave(group_size, dim=1)
    zero = sz[..., 1].t().repeat_interleave(group_size, dim=1)
    w = (q * scale + zero).to(torch.bfloat16)  # __hfma2: one rounding to bf16
    return (x.float() @ w.float().t()).to(torch.bfloat16)


def unpack_int4pack(packed: Tensor, device_type: str, n: int, k: int) -> Tensor:
    """The codes ``uint8 [n, k]`` (k in order, 0..15) that ``device_type``'s int4pack layout holds."""
    if device_type == "mps":
        return _mps_codes(packed, n, k)
    if device_type == "cuda":
        return _cuda_codes(packed, k)[:n]
    raise ValueError(f"unpack_int4pack: no layout model for {device_type!r} (mps, cuda)")


# --------------------------------------------------------------------------------------
# The kernel a model uses


@dataclass(frozen=True)
class Int4Kernel:
    """One device type's int4pack pair: the layout :meth:`pack` writes and the matmul that reads it.
    ``stand_in``: the pure-torch model of that device's kernel (runs anywhere, for tests)."""

    device_type: str  # "cpu", "mps" or "cuda"
    convert: Callable[[Tensor, int], Tensor]  # the layout converter: (weight, inner_k_tiles) -> packed
    mm: Callable[[Tensor, Tensor, int, Tensor], Tensor]  # the matmul that reads that layout
    activation_dtypes: tuple[torch.dtype, ...]  # the first is the default
    stand_in: bool = False

    @property
    def op(self) -> str:
        return "aten::_weight_int4pack_mm" + ("_for_cpu" if self.device_type == "cpu" else "")

    @property
    def name(self) -> str:
        return f"{self.op} ({self.device_type} layout{', pure-torch stand-in' if self.stand_in else ''})"

    def available(self) -> bool:
        """Whether this torch build has the op (a stand-in always runs)."""
        return self.stand_in or hasattr(torch.ops.aten, self.op.split("::")[1])

    def pack(self, words: Tensor, in_features: int, in_place: bool = False) -> Tensor:
        """MLX's 4-bit words ``uint32 [N, K/8]`` (N a multiple of 16) in this kernel's layout. ``in_place``
        (the CPU kernel, whose layout keeps each row's K/2 bytes in that row): the result overwrites
        ``words`` block by block, each block read before it is written, so packing needs no second copy
        (the 11B's fused vocabulary heads: 0.7 GB less at the load's peak); ``words`` is then spent."""
        if self.device_type == "cpu":
            # The CPU converter takes int32 codes, 8x the packed bytes (4.7 GB for the fused 11B heads):
            # convert 64-row blocks (the layout's unit, so the pieces concatenate), 16 MB of codes at a time.
            # Each block is written into the result as it is made: no list of blocks, no cat (at the full
            # size that was two more copies of the fused heads, 1.2 GB, at the peak of the load).
            step = 64 * max(1, (1 << 22) // (64 * in_features))
            raw = words.contiguous().view(torch.uint8)
            n, out = words.shape[0], None
            for i in range(0, n, step):
                block = self.convert(_lsb_first_codes(raw[i:i + step]).to(torch.int32), 2)
                if out is None:  # the layout keeps a row's bytes in its row ([N, K/2] uint8 in torch 2.13)
                    if block.shape[0] != min(step, n):
                        return torch.cat([block] + [self.convert(_lsb_first_codes(raw[j:j + step]).to(torch.int32), 2)
                                                    for j in range(step, n, step)])
                    same = in_place and block.dtype == raw.dtype and block.shape[1:] == raw.shape[1:]
                    out = raw if same else block.new_empty((n, *block.shape[1:]))
                out[i:i + block.shape[0]] = block
            assert out is not None  # N >= 16
            return out
        # MPS/CUDA converters take gpt-fast's byte (even k in the high nibble): swap MLX's nibbles.
        raw = words.contiguous().view(torch.uint8).reshape(words.shape[0], in_features // 2)
        return self.convert(((raw & 0x0F) << 4) | (raw >> 4), 2)


def _lsb_first_codes(raw: Tensor) -> Tensor:
    return torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(raw.shape[0], raw.shape[1] * 2)


def _call_aten(name: str, *args: Any) -> Tensor:
    return getattr(torch.ops.aten, name)(*args)


def _aten(name: str) -> Callable:
    return functools.partial(_call_aten, name)  # looked up when called (a build may lack it); picklable


@torch.library.custom_op("nvchat::int4pack_mm_cpu", mutates_args=())
def _int4pack_mm_cpu_opaque(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


@_int4pack_mm_cpu_opaque.register_fake
def _(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)  # its meta


def _cpu_int4pack_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """The CPU int4pack matmul. Under ``torch.compile``, as an op the compiler cannot see into: torch 2.13's
    inductor lowers ``_weight_int4pack_mm_for_cpu`` with its group size as a graph constant, and the
    full-size card's compiled step (the op inside the layers' nested regions) failed there ("group size
    must be a scalar"); called as an opaque op, the same kernel runs with the group size as given."""
    if torch.compiler.is_compiling():
        return _int4pack_mm_cpu_opaque(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def int4_kernel(device_type: str, stand_in: bool = False) -> Int4Kernel | None:
    """The int4pack kernel of ``device_type`` ("cpu", "mps", "cuda"; None for others), or with
    ``stand_in`` its pure-torch model (mps and cuda only: the CPU op runs on every CPU)."""
    dtypes = {"cpu": (torch.bfloat16, torch.float32, torch.float16),
              "mps": (torch.float32, torch.float16, torch.bfloat16),
              "cuda": (torch.bfloat16,)}.get(device_type)
    if dtypes is None:
        return None
    if device_type == "cpu":
        if stand_in:
            raise ValueError("int4_kernel: the CPU kernel needs no stand-in (every CPU build has it)")
        return Int4Kernel("cpu", _aten("_convert_weight_to_int4pack_for_cpu"), _cpu_int4pack_mm, dtypes)
    if stand_in:
        models = {"mps": (mps_convert_weight_to_int4pack, mps_weight_int4pack_mm),
                  "cuda": (cuda_convert_weight_to_int4pack, cuda_weight_int4pack_mm)}[device_type]
        return Int4Kernel(device_type, models[0], models[1], dtypes, stand_in=True)
    return Int4Kernel(device_type, _aten("_convert_weight_to_int4pack"), _aten("_weight_int4pack_mm"), dtypes)
