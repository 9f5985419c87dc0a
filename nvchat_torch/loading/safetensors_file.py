"""One tensor of a safetensors file at a time, read into memory the tensor owns.

safetensors' ``safe_open`` leaves every page it touched mapped, and counted in resident memory, until
the file is closed. Here each tensor is read with positioned reads straight into its own storage,
and nothing of the file stays mapped.
Why, with measurements: docs/checkpoints.md, "Reading safetensors without a map".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["SafetensorsFile", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

_HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header


class SafetensorsFile:
    """The header of one ``.safetensors`` file, and :meth:`read` for one tensor. Raises ``ValueError``
    naming the file for a header that is not the format (the caller adds what it was loading)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < length <= min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"{self.path}: not a safetensors file (header length {length}, file {size} bytes)")
            try:
                header: dict[str, Any] = json.loads(f.read(length))
            except ValueError as e:
                raise ValueError(f"{self.path}: the safetensors header is not JSON ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + length
        self.entries = header
        for key, entry in header.items():
            start, end = entry["data_offsets"]
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{self.path}: '{key}' has dtype {entry['dtype']}, which torch cannot hold")
            if not 0 <= start <= end <= size - self.data_start:
                raise ValueError(f"{self.path}: '{key}' lies past the end of the file (bytes {start}..{end} of "
                                 f"{size - self.data_start}): truncated?")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def dtype_name(self, key: str) -> str:
        """The stored dtype as safetensors names it (``F32``, ``BF16``, ``U32`` ...)."""
        return self.entries[key]["dtype"]

    def read(self, key: str) -> torch.Tensor:
        """``key`` as a CPU tensor with its own storage (the file's bytes, little-endian, as stored)."""
        first, _ = self._span(key)
        out = torch.empty(self.entries[key]["shape"], dtype=SAFETENSORS_DTYPES[self.entries[key]["dtype"]])
        self._read_into(out, first, key)
        return out

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of ``key`` (along its first axis), read alone: a 44 GB float32 release is
        read a few MB at a time, never mapped (a map of the whole file is refused outright where it
        exceeds memory under Linux's overcommit heuristic)."""
        entry = self.entries[key]
        shape = entry["shape"]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{self.path}: '{key}' of shape {shape} has no rows {start}:{stop}")
        first, row_bytes = self._span(key)
        out = torch.empty([stop - start, *shape[1:]], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
        self._read_into(out, first + start * row_bytes, key)
        return out

    def _span(self, key: str) -> tuple[int, int]:
        """Where ``key``'s data starts, and the bytes of one row along its first axis (of the whole
        tensor for a scalar); checks that its shape and dtype fill its stored bytes."""
        entry = self.entries[key]
        first, end = entry["data_offsets"]
        shape = entry["shape"]
        row_bytes = SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        for size in shape[1:]:
            row_bytes *= size
        need = row_bytes * shape[0] if shape else row_bytes
        if need != end - first:
            raise ValueError(f"{self.path}: '{key}' is {end - first} bytes, its shape {shape} and dtype "
                             f"{entry['dtype']} need {need}")
        return first, row_bytes

    def _read_into(self, out: torch.Tensor, offset: int, key: str) -> None:
        """Fill ``out``'s bytes from the data section at ``offset`` (positioned reads, nothing mapped)."""
        if out.numel() == 0:
            return
        view = out.reshape(-1).view(torch.uint8).numpy().data  # the tensor's bytes, writable
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + offset)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{self.path}: '{key}' ends early ({done} of {len(view)} bytes): truncated?")
                done += n
