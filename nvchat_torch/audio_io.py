"""WAV input/output, pcm16, resampling (soxr) and input validation (no torchaudio)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

__all__ = ["read_wav", "write_wav", "resample", "StreamResampler", "pcm16_decode", "pcm16_encode", "pcm16_values",
           "g711_decode", "g711_encode", "G711_RATE", "prepare_input", "as_mono_float32"]


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

    pcm = np.frombuffer(pcm16_encode(samples), dtype="<i2")
    sf.write(os.fspath(path), pcm, sample_rate, subtype="PCM_16")


def resample(x: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """Resample ``x [..., N]`` (float32) with soxr's high-quality filter, the library audio tools use.
    Output length ``round(N * new_sr / orig_sr)``."""
    x = np.asarray(x, dtype=np.float32)
    if orig_sr == new_sr:
        return x
    import soxr

    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n).T  # soxr takes [frames, channels]
    out = soxr.resample(np.ascontiguousarray(rows), orig_sr, new_sr, quality="HQ")
    return np.ascontiguousarray(out.T.reshape(*lead, -1), dtype=np.float32)


class StreamResampler:
    """Resample a mono stream chunk by chunk (soxr ``ResampleStream``): the concatenated output of
    the chunks, with ``last=True`` on the final one, is one resampling of the whole stream.
    Passes chunks through unchanged when the rates are equal."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None
        if in_rate != out_rate:
            import soxr

            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, chunk: np.ndarray, last: bool = False) -> np.ndarray:
        chunk = np.asarray(chunk, dtype=np.float32)
        if self._stream is None:
            return chunk
        out = self._stream.resample_chunk(chunk, last=last)
        if last:  # ready for a new stream
            self._stream.clear()
        return out


def pcm16_decode(data: bytes) -> np.ndarray:
    """Little-endian 16-bit PCM to float32: ``int16 / 32768``."""
    if len(data) % 2:
        raise ValueError(f"pcm16 audio must have an even number of bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def pcm16_values(samples: np.ndarray) -> np.ndarray:
    """Float samples as 16-bit values ``round(clip(x, -1, 1) * 32767)`` (int16; pcm16 and G.711 encode these)."""
    return np.round(np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


def pcm16_encode(samples: np.ndarray) -> bytes:
    """Float samples to little-endian 16-bit PCM (:func:`pcm16_values`)."""
    return pcm16_values(samples).astype("<i2").tobytes()


G711_RATE = 8000  # G.711 (ITU-T) is narrowband telephone audio: 8 kHz, one byte per sample


def _g711_tables() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{law: (decode [256] int16, encode [65536] uint8 indexed by int16 + 32768)}`` for G.711
    μ-law ("pcmu") and A-law ("pcma"), as the ITU reference (Sun's g711.c) computes them:
    the encoders truncate to the segment's step, the decoders return the step's midpoint."""
    code = np.arange(256)
    # μ-law: the byte is inverted; magnitude ((mantissa << 3) + 0x84) << exponent, less the bias 0x84
    u = ~code & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u >> 4) & 7)
    ulaw = np.where(u & 0x80, 0x84 - t, t - 0x84)
    # A-law: even bits inverted (0x55); segment 0 is linear, the sign bit set means positive
    a = code ^ 0x55
    seg, t = (a >> 4) & 7, (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    alaw = np.where(a & 0x80, t, -t)
    pcm = np.arange(-32768, 32768)
    # μ-law encode: 14-bit magnitude, clipped, biased, then its segment and 4 mantissa bits
    mag = np.minimum(np.abs(pcm >> 2), 8159) + (0x84 >> 2)
    seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), mag)
    # (the clipped top, past the last segment, is the largest code: 0x7F before the sign mask)
    ulaw_code = np.where(seg < 8, (seg << 4) | ((mag >> np.minimum(seg + 1, 8)) & 0x0F), 0x7F) ^ \
        np.where(pcm >> 2 < 0, 0x7F, 0xFF)
    # A-law encode: 13-bit magnitude (one's complement for negatives), its segment and mantissa
    v = pcm >> 3
    mag = np.where(v >= 0, v, -v - 1)
    seg = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), mag)
    mantissa = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0x0F
    alaw_code = ((seg << 4) | mantissa) ^ np.where(v >= 0, 0xD5, 0x55)
    return {"pcmu": (ulaw.astype(np.int16), ulaw_code.astype(np.uint8)),
            "pcma": (alaw.astype(np.int16), alaw_code.astype(np.uint8))}


_G711: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _g711(law: str) -> tuple[np.ndarray, np.ndarray]:
    if law not in ("pcmu", "pcma"):
        raise ValueError(f"G.711 law must be 'pcmu' (μ-law) or 'pcma' (A-law), got {law!r}")
    if not _G711:
        _G711.update(_g711_tables())
    return _G711[law]


def g711_decode(data: bytes, law: str) -> np.ndarray:
    """G.711 bytes (``law`` "pcmu": μ-law, "pcma": A-law) to float32: the 16-bit value ``/ 32768``, as pcm16."""
    return _g711(law)[0][np.frombuffer(data, dtype=np.uint8)].astype(np.float32) / 32768.0


def g711_encode(samples: np.ndarray, law: str) -> bytes:
    """Float samples to G.711 bytes: :func:`pcm16_values`, then the law's code."""
    return _g711(law)[1][pcm16_values(samples).astype(np.int32) + 32768].tobytes()


_OK_DTYPES = ("float32", "float64", "float16", "int16")
FLOAT_PEAK_LIMIT = 4.0  # float audio is in [-1, 1]; resampling may overshoot a little, int16 values do not fit


def as_mono_float32(samples: Any, sample_rate: int, expected_rate: int) -> np.ndarray:
    """Validate a user chunk and return it as contiguous float32 mono ``[N]``.

    Accepts numpy arrays, torch tensors (bfloat16 and float16 included) and Python lists or tuples;
    float samples in [-1, 1], or int16 PCM (/ 32768), which a list of ints is taken to be.
    Raises ``ValueError`` naming what is wrong: the sample rate, more than one channel, NaN/Inf, the
    dtype, ints outside int16, float samples far outside [-1, 1] (int16 values stored as floats).
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ValueError(f"sample_rate must be an int, got {sample_rate!r}")
    if sample_rate != expected_rate:
        raise ValueError(f"expected {expected_rate} Hz audio, got sample_rate={sample_rate}; resample it first "
                         "(nvchat_torch.audio_io.resample)")
    if isinstance(samples, torch.Tensor):
        samples = samples.detach()
        if samples.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16; float32 holds both exactly
            samples = samples.float()
        samples = samples.cpu().numpy()
    if isinstance(samples, (list, tuple)):
        try:
            arr = np.asarray(samples)
        except ValueError as e:
            raise ValueError(f"audio given as a list must be a flat list of numbers ({e})") from None
        if arr.dtype.kind in "iu":  # Python ints: int16 PCM values
            if arr.size and (arr.min() < -32768 or arr.max() > 32767):
                raise ValueError(f"a list of ints is taken as int16 PCM, but its values span {arr.min()}..{arr.max()}, "
                                 "outside -32768..32767")
            arr = arr.astype(np.int16)
        elif arr.dtype.kind not in "f" and arr.size == 0:
            arr = arr.astype(np.float32)
    else:
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
    peak = float(np.abs(arr).max()) if arr.size else 0.0
    if peak > FLOAT_PEAK_LIMIT:
        raise ValueError(f"float audio must lie in [-1, 1], but its peak is {peak:g}: these are probably int16 "
                         "values stored as floats; pass them as int16, or divide by 32768")
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
