"""MLX's affine quantizer, reproduced exactly: the codes, scales and biases ``mx.quantize`` gives.

``nvchat_torch.models.quant.quantize_affine`` writes a valid MLX encoding (plain min/max per group),
but not the one MLX writes: ``mx.quantize`` snaps the group's edge. This is what lets a release
quantized here equal the card made from it by MLX.
The algorithm, step by step: docs/checkpoints.md, "MLX's quantizer, step by step".
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["mlx_quantize", "mlx_quantize_rows", "pack_codes", "QUANTIZE_CHUNK_ELEMENTS"]

QUANTIZE_CHUNK_ELEMENTS = 1 << 20  # weights quantized at once: ~20 MB of temporaries, mostly in cache
_EPS = 1e-7  # MLX's lower bound on a group's scale (a float32 constant there too)


def _check(n_in: int, bits: int, group_size: int) -> None:
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"mx.quantize supports 2, 3, 4, 5, 6 and 8 bits, got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"mx.quantize supports group sizes 32, 64 and 128, got {group_size}")
    if n_in % group_size or (n_in * bits) % 32:
        raise ValueError(f"a last dimension of {n_in} cannot be quantized at {bits} bits in groups of {group_size}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., n]`` (integers < 2^bits) as MLX's uint32 words ``[..., n * bits / 32]``: element j
    of a row takes bits ``[j*bits, (j+1)*bits)`` of the row's little-endian byte stream."""
    *lead, n = codes.shape
    if 8 % bits == 0:  # whole bytes: 8 // bits codes per byte
        per = 8 // bits
        q = codes.to(torch.uint8).reshape(*lead, n // per, per)
        stream = q[..., 0].clone()
        for j in range(1, per):
            stream |= q[..., j] << (j * bits)
    else:  # 3, 5, 6 bits: lcm(bits, 8) bits hold a whole number of codes and bytes
        per = math.lcm(bits, 8) // bits
        n_bytes = per * bits // 8
        q = codes.to(torch.int64).reshape(*lead, n // per, per)
        value = (q << (torch.arange(per, device=codes.device) * bits)).sum(-1, keepdim=True)
        stream = ((value >> (8 * torch.arange(n_bytes, device=codes.device))) & 0xFF).to(torch.uint8)
    words = stream.reshape(*lead, n * bits // 32, 4).contiguous()
    return words.view(torch.int32).squeeze(-1).view(torch.uint32)


def mlx_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mx.quantize(w, group_size, bits)`` (affine mode): ``(weight uint32, scales, biases)``, the
    scales and biases in ``w``'s dtype. Bit-identical for finite weights of dtype float32, bfloat16
    or float16."""
    *lead, n_in = w.shape
    _check(n_in, bits, group_size)
    n_bins = float((1 << bits) - 1)
    groups = w.reshape(*lead, n_in // group_size, group_size).float()
    w_min, w_max = torch.aminmax(groups, dim=-1)
    eps = torch.tensor(_EPS, dtype=torch.float32, device=w.device)
    edge_is_min = w_min.abs() > w_max.abs()
    scale = torch.maximum((w_max - w_min) / n_bins, eps)
    scale = torch.where(edge_is_min, scale, -scale)
    edge = torch.where(edge_is_min, w_min, w_max)
    q0 = torch.round(edge / scale)
    snapped = q0 != 0
    scale = torch.where(snapped, edge / q0, scale)
    bias = torch.where(snapped, edge, torch.zeros_like(edge))
    codes = torch.sub(groups, bias.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().clamp_(0, n_bins)
    wq = pack_codes(codes.to(torch.uint8).reshape(*lead, n_in), bits)
    return wq, scale.to(w.dtype), bias.to(w.dtype)


def mlx_quantize_rows(rows: Callable[[int, int], torch.Tensor], n_rows: int, n_in: int, bits: int,
                      group_size: int, dtype: torch.dtype = torch.float32,
                      chunk_elements: int = QUANTIZE_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mlx_quantize` of the ``[n_rows, n_in]`` matrix whose rows ``rows(start, stop)`` gives
    (in ``dtype``), a few million weights at a time: only the packed result and one chunk are ever
    held, never the whole matrix in ``dtype``."""
    _check(n_in, bits, group_size)
    wq = torch.empty(n_rows, n_in * bits // 32, dtype=torch.uint32)
    scales = torch.empty(n_rows, n_in // group_size, dtype=dtype)
    biases = torch.empty_like(scales)
    step = max(1, chunk_elements // n_in)
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        part = mlx_quantize(rows(start, stop), bits, group_size)
        wq[start:stop], scales[start:stop], biases[start:stop] = part
    return wq, scales, biases
