"""WAV input/output, band-limited resampling and input validation (no torchaudio)."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np
import torch

__all__ = ["read_wav", "write_wav", "resample", "prepare_input", "as_mono_float32"]


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Read an audio file as float32 ``[frames, channels]`` and its sample rate (soundfile)."""
    import soundfile as sf

    try:
        data, sr = sf.read(os.fspath(path), dtype="float32", always_2d=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot read audio ({e})") from None
    if data.shape[0] == 0:
        raise ValueError(f"{path}: the file holds no samples")
    return data, int(sr)


def write_wav(path: str | os.PathLike, samples: np.ndarray, sample_rate: int) -> None:
    """Write mono float samples as 16-bit PCM: ``round(clip(x, -1, 1) * 32767)`` (the reference's encoding)."""
    import soundfile as sf

    pcm = np.round(np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    sf.write(os.fspath(path), pcm, sample_rate, subtype="PCM_16")


def resample(x: np.ndarray, orig_sr: int, new_sr: int, zeros: int = 16, rolloff: float = 0.95) -> np.ndarray:
    """Band-limited resampling of ``x [..., N]`` with a Hann-windowed sinc, as a strided polyphase conv.

    Output sample j sits at input time ``j * orig_sr / new_sr``; the low-pass cut-off is ``rolloff`` times
    the lower of the two Nyquist frequencies, and the kernel spans ``zeros`` zero crossings each side.
    Output length ``ceil(N * new_sr / orig_sr)``.
    """
    if orig_sr == new_sr:
        return np.asarray(x, dtype=np.float32)
    ratio = Fraction(new_sr, orig_sr)
    up, down = ratio.numerator, ratio.denominator
    cutoff = min(1.0, up / down) * rolloff  # in cycles per input sample, relative to Nyquist
    half = zeros / cutoff  # kernel half-width in input samples
    taps = int(math.ceil(half))
    # Kernel for output phase p at input offset i (tap t = i + taps): h(p*down/up - i).
    i = torch.arange(-taps, taps + down + 1, dtype=torch.float32)
    t = torch.arange(up, dtype=torch.float32)[:, None] * down / up - i[None, :]
    window = torch.where(t.abs() <= half, 0.5 + 0.5 * torch.cos(math.pi * t / half), torch.zeros(()))
    kernel = cutoff * torch.special.sinc(cutoff * t) * window  # [up, taps]; conv1d correlates, as wanted
    src = torch.as_tensor(np.asarray(x, dtype=np.float32))
    lead, n = src.shape[:-1], src.shape[-1]
    src = torch.nn.functional.pad(src.reshape(-1, 1, n), (taps, taps + down))
    out = torch.nn.functional.conv1d(src, kernel[:, None, :], stride=down)  # [B, up, frames]
    n_out = int(math.ceil(n * up / down))
    out = out.transpose(1, 2).reshape(out.shape[0], -1)[:, :n_out]
    return out.reshape(*lead, n_out).numpy()


_OK_DTYPES = ("float32", "float64", "int16")


def as_mono_float32(samples, sample_rate: int, expected_rate: int) -> np.ndarray:
    """Validate a user chunk and return it as contiguous float32 mono ``[N]``.

    Accepts numpy arrays, torch tensors and lists; float32/float64 in [-1, 1] or int16 PCM (/ 32768).
    Raises ``ValueError`` naming what is wrong: the sample rate, more than one channel, NaN/Inf, the dtype.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ValueError(f"sample_rate must be an int, got {sample_rate!r}")
    if sample_rate != expected_rate:
        raise ValueError(f"expected {expected_rate} Hz audio, got sample_rate={sample_rate}; resample it first "
                         "(nvchat_torch.audio_io.resample)")
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    arr = np.asarray(samples)
    if arr.dtype.name not in _OK_DTYPES:
        raise ValueError(f"unsupported sample dtype {arr.dtype}: pass float32, float64 or int16 PCM")
    if arr.ndim == 2 and 1 in arr.shape:
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise ValueError(f"audio must be mono: got shape {tuple(arr.shape)} (more than one channel); downmix first")
    if arr.dtype == np.int16:
        return arr.astype(np.float32) / 32768.0
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"audio contains NaN or Inf (first at sample {bad})")
    return np.ascontiguousarray(arr, dtype=np.float32)


def prepare_input(path: str | os.PathLike, target_sr: int) -> tuple[np.ndarray, list[str]]:
    """Read a WAV, downmix to mono and resample to ``target_sr``; return the samples and what was done."""
    data, sr = read_wav(path)
    notes = []
    if data.shape[1] > 1:
        notes.append(f"downmixed {data.shape[1]} channels to mono")
        data = data.mean(axis=1, keepdims=True)
    mono = data[:, 0]
    if sr != target_sr:
        notes.append(f"resampled {sr} Hz to {target_sr} Hz")
        mono = resample(mono, sr, target_sr)
    return np.ascontiguousarray(mono, dtype=np.float32), notes
