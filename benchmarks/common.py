"""What the benchmarks share: the test signal, the generated checkpoints and the machine's line."""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

import nvchat_torch as nv

PROMPT = "you are a helpful assistant"
FRAME = 1280


def test_signal(seconds: float, seed: int = 1234) -> np.ndarray:
    """Tone bursts, a chirp and a little noise at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    x = 0.15 * np.sin(2 * np.pi * (200 * t + 1400 / seconds * t * t))
    for i, f in enumerate((220.0, 440.0, 660.0, 880.0)):
        x = x + 0.3 * np.sin(2 * np.pi * f * t) * ((t % 2.0 >= 0.45 * i) & (t % 2.0 < 0.45 * i + 0.35))
    return (x + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def generated_checkpoint(preset: str, bits: int | None, seed: int = 0) -> Path:
    """A random ``preset`` model saved as an mlx-community checkpoint (cached by its parameters)."""
    from nvchat_torch.tiny import random_model, save_checkpoint

    root = Path(os.environ.get("NVCHAT_BENCH_CACHE", Path(tempfile.gettempdir()) / "nvchat_torch_bench"))
    folder = root / f"{preset}-{bits or 'float'}bit-seed{seed}-v{nv.__version__}"
    if not (folder / "config.json").exists():
        save_checkpoint(random_model(preset, seed), folder, bits=bits)
    return folder


def machine() -> str:
    threads = torch.get_num_threads()
    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, torch {torch.__version__} "
            f"({threads} threads, {torch.backends.cpu.get_cpu_capability()}), Python {platform.python_version()}")
