"""Make an mlx-community style card from NVIDIA's release: ``python -m nvchat_torch.convert SRC OUT --bits 4``.

OUT gets what the mlx-community cards hold, which both this package and mlx-vlm load. Tensors are
converted one at a time as they are read, so the conversion holds one tensor at a time.
Design: docs/checkpoints.md, "Making your own card".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, TextIO

import torch

from .loading.checkpoint import CheckpointError, resolve_checkpoint
from .loading.nvidia_release import ReleaseCheckpoint, base_config, is_release_folder, resolve_tokenizer
from .model import build_model, mlx_community_specs

__all__ = ["convert", "write_safetensors", "main"]

_ITEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U32": 4, "U8": 1, "BOOL": 1}
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CARD_FILES = ("config.json", "model.safetensors.index.json", *TOKENIZER_NAMES)
DEFAULT_SHARD_BYTES = 5 * 10**9


def tensor_bytes(shape: Iterable[int], dtype: str) -> int:
    return math.prod(shape) * _ITEM_BYTES[dtype]


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], str]],
                      read: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file of ``entries`` (key, shape, safetensors dtype), asking ``read(key)`` for each
    tensor only when its bytes are written: the header is known from the shapes, so no more than one
    tensor is ever held. Written to ``path``.partial, then renamed."""
    header: dict[str, object] = {}
    offset = 0
    for key, shape, dtype in entries:
        size = tensor_bytes(shape, dtype)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shape, dtype in entries:
            t = read(key)
            if tuple(t.shape) != tuple(shape) or tensor_bytes(shape, dtype) != t.numel() * t.element_size():
                raise CheckpointError(f"{path}: '{key}' came out {t.dtype} {list(t.shape)}, its header says "
                                      f"{dtype} {list(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
    os.replace(partial, path)


class Progress:
    """The read of the release in GB, on one line that a terminal rewrites (a log gets a line per 5 %)."""

    def __init__(self, total_bytes: int, stream: TextIO | None):
        self.total, self.done, self.stream = total_bytes, 0, stream
        self.tty = bool(stream is not None and stream.isatty())
        self.start, self.shown = time.monotonic(), -1

    def add(self, n_bytes: int, what: str) -> None:
        self.done += n_bytes
        if self.stream is None:
            return
        percent = int(100 * self.done / max(self.total, 1))
        if not self.tty and percent // 5 == self.shown // 5 and self.done < self.total:
            return
        self.shown = percent
        line = (f"read {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB ({percent}%) in "
                f"{time.monotonic() - self.start:.0f} s: {what}")
        self.stream.write(("\r\033[K" + line) if self.tty else line + "\n")
        if self.tty and self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out}: exists and is not empty; pass --force to overwrite the card in it")
        for p in out.glob("model*.safetensors*"):
            p.unlink()
        for name in CARD_FILES:
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "rnnt_tokenizer", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def _plan_shards(entries: list[tuple[str, tuple[int, ...], str]], max_bytes: int) -> list[list[tuple[str, tuple[int, ...], str]]]:
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for entry in entries:
        n = tensor_bytes(entry[1], entry[2])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def _copy_tokenizer(tokenizer: Path, release: Path, out: Path) -> None:
    for name in TOKENIZER_NAMES:
        if (tokenizer / name).exists():
            shutil.copy2(tokenizer / name, out / name)
    if not (out / "tokenizer.json").exists():
        raise CheckpointError(f"{tokenizer}: no tokenizer.json (--tokenizer must name the Nemotron-Nano-9B-v2 "
                              "tokenizer, a folder or a Hub repo id)")
    config_path = out / "tokenizer_config.json"
    if config_path.exists():  # as mlx-vlm's converter writes it
        values = json.loads(config_path.read_text())
        values["fix_mistral_regex"] = True
        config_path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")
    rnnt = release / "rnnt_tokenizer"
    if rnnt.is_dir():
        (out / "rnnt_tokenizer").mkdir(exist_ok=True)
        for p in rnnt.iterdir():
            if p.is_file():
                shutil.copy2(p, out / "rnnt_tokenizer" / p.name)


def convert(source: str | os.PathLike, out: str | os.PathLike, bits: int | None, *,
            tokenizer: str | os.PathLike | None = None, group_size: int = 64, force: bool = False,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: TextIO | None = None) -> Path:
    """Write the card made from NVIDIA's release ``source`` (folder or Hub repo id) into ``out``; ``bits``:
    4, 8 (or another MLX affine width), or None for bf16. Refuses a non-empty ``out`` unless ``force``.
    ``progress``: a stream that shows the read (the command line's is stderr)."""
    folder = resolve_checkpoint(source)
    if not is_release_folder(folder):
        raise CheckpointError(f"{folder}: not NVIDIA's release layout (its config.json is not the nested NeMo one); "
                              "an mlx-community card needs no conversion")
    out = Path(out)
    tokenizer_folder = resolve_tokenizer(tokenizer)
    ckpt = ReleaseCheckpoint(folder, base_config(tokenizer_folder))
    specs = mlx_community_specs(build_model(ckpt.config), bits, group_size) if bits else {}
    ckpt.as_card(specs, torch.bfloat16)
    _prepare_out(out, force)
    with ckpt:
        entries = [(key, ckpt.shape(key), ckpt.stored_dtype(key)) for key in ckpt.keys()]
        sources = {ckpt.source_key(key) for key, _, _ in entries}
        bar = Progress(sum(tensor_bytes(ckpt.shape_of_source(k), ckpt.dtype_of_source(k)) for k in sources), progress)
        counted: set[str] = set()

        def read(key: str) -> torch.Tensor:
            t = ckpt.get(key)
            source_key = ckpt.source_key(key)
            if source_key not in counted:
                counted.add(source_key)
                bar.add(tensor_bytes(ckpt.shape_of_source(source_key), ckpt.dtype_of_source(source_key)), key)
            return t

        shards = _plan_shards(entries, max_shard_bytes)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / name, shard, read, {"format": "mlx"})
            weight_map.update({key: name for key, _, _ in shard})
        index = {"metadata": {"total_size": sum(tensor_bytes(s, d) for _, s, d in entries)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (out / "config.json").write_text(json.dumps(ckpt.card_config(), indent=2, ensure_ascii=False,
                                                    allow_nan=False) + "\n")
        ckpt.audit.warn()
    _copy_tokenizer(tokenizer_folder, folder, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvchat_torch.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="SRC", help="NVIDIA's release: a folder or a Hub repo id")
    parser.add_argument("out", metavar="OUT", type=Path, help="the card's folder (created)")
    parser.add_argument("--bits", required=True, choices=["4", "8", "none"],
                        help="quantize the LLM and vocabulary matrices to 4 or 8 bits, or keep them bf16")
    parser.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    parser.add_argument("--tokenizer", default=None, metavar="DIR_OR_ID",
                        help="the LLM tokenizer (and its config.json): default nvidia/NVIDIA-Nemotron-Nano-9B-v2")
    parser.add_argument("--force", action="store_true", help="overwrite a card already in OUT")
    args = parser.parse_args(argv)
    try:
        out = convert(args.source, args.out, None if args.bits == "none" else int(args.bits),
                      tokenizer=args.tokenizer, group_size=args.group_size, force=args.force, progress=sys.stderr)
    except (CheckpointError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
