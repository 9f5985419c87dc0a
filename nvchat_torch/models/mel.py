"""NeMo log-mel front end (``AudioToMelSpectrogramPreprocessor`` at inference), offline and streaming.

The STFT is a matmul with windowed real DFT bases, so it runs on CPU, CUDA and MPS with no complex
tensors, FFT or float64. A prepared float32 CPU model takes torch's real FFT instead.
Design: docs/api.md, "What each network computes" (the log-mel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import PreprocessorConfig
from .layers import FusedOnCpu, RecurrentCache, RowTensor

__all__ = ["LogMel", "MelCache", "slaney_mel_filterbank"]

OFFLINE_CHUNK = 4096  # mel frames per piece of an offline pass (41 s of audio)


def _hz_to_slaney_mel(hz: float) -> float:
    """Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    if hz < 1000.0:
        return hz / (200.0 / 3.0)
    return 15.0 + math.log(hz / 1000.0) / (math.log(6.4) / 27.0)


def _lerp_grid(start: float, stop: float, n: int, device) -> torch.Tensor:
    """``n`` evenly spaced float32 points as ``(1 - t) * start + t * stop``, the reference's rounding.

    The filter feet are tiny weights on strong neighbouring bins, so the grid's last-bit rounding
    shows in the low-energy mel bins; this form reproduces the reference's grid bit for bit.
    """
    t = torch.arange(n, dtype=torch.float32, device=device) / (n - 1)
    return (1.0 - t) * start + t * stop


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, device=None) -> torch.Tensor:
    """Slaney-normalised triangular mel filters ``[n_mels, n_fft // 2 + 1]`` over 0..sample_rate/2.

    Built in float32 as the reference does (librosa builds the same matrix in float64; the two
    differ by about 1e-6).
    """
    bin_hz = _lerp_grid(0.0, sample_rate // 2, n_fft // 2 + 1, device)
    mels = _lerp_grid(0.0, _hz_to_slaney_mel(sample_rate / 2), n_mels + 2, device)
    log_step = math.log(6.4) / 27.0
    edges_hz = torch.where(mels >= 15.0, 1000.0 * torch.exp(log_step * (mels - 15.0)), (200.0 / 3.0) * mels)
    widths = edges_hz[1:] - edges_hz[:-1]  # [n_mels + 1]
    offsets = edges_hz[None, :] - bin_hz[:, None]  # [bins, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    triangles = torch.clamp(torch.minimum(rising, falling), min=0.0)
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    return (triangles * area_norm).T.contiguous()


@dataclass
class MelCache(RecurrentCache):
    """Streaming state of :meth:`LogMel.forward_step`: ``B`` streams, each pushing whole 80 ms frames.
    ``samples`` holds enough for the next frame's windows and the preemphasis predecessor; ``frames``
    says where each stream starts inside the buffer, for the reflect padding."""

    samples: torch.Tensor  # [B, kept] each row's last raw samples (zeros before its start)
    frames: torch.Tensor  # [B] long: frames each row has pushed, so where its stream starts (a batched caller's per step)

    def batched(self) -> list[RowTensor]:
        return [(self.samples, 0, 1)]

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        (self.samples,) = tensors


class LogMel(nn.Module, FusedOnCpu):
    """``forward(audio [N] or [1, N]) -> [1, N // hop + 1, features]`` float32 log-mel.

    Streaming: :meth:`forward_step` takes whole ``lookahead_samples`` frames (1280 = 80 ms) per stream
    and emits the hop-aligned frames whose centres trail the input edge by that much (the reference
    session's rule): 1, 8, 8, ... frames, equal to the offline result's.
    """

    def __init__(self, config: PreprocessorConfig, lookahead_samples: int = 1280):
        super().__init__()
        config.validate()
        if lookahead_samples < config.n_fft // 2:
            raise ValueError(f"LogMel: lookahead_samples {lookahead_samples} must cover half the STFT window "
                             f"({config.n_fft // 2} samples)")
        self.config = config
        self.n_fft = config.n_fft
        self.hop = config.hop_length
        self.win_length = config.win_length
        self.features = config.features
        self.preemph = float(config.preemph or 0.0)
        self.log_guard = float(config.log_zero_guard_value)
        self.lookahead = lookahead_samples
        self.init_constants()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        n_fft, n_bins = self.n_fft, self.n_fft // 2 + 1
        left = (n_fft - self.win_length) // 2
        window = torch.zeros(n_fft, dtype=torch.float32, device=device)
        window[left:left + self.win_length] = torch.hann_window(
            self.win_length, periodic=False, dtype=torch.float32, device=device)
        # Real DFT bases; n*k is reduced mod n_fft in integers so the angles stay exact in float32.
        n = torch.arange(n_fft, device=device)
        phase = (n[:, None] * torch.arange(n_bins, device=device)[None, :]) % n_fft
        angle = phase.to(torch.float32) * (2.0 * math.pi / n_fft)
        basis = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1) * window[:, None]  # [n_fft, 2 * bins]
        self.register_buffer("window", window, persistent=False)
        self.register_buffer("dft_basis", basis, persistent=False)
        self.register_buffer("filterbank", slaney_mel_filterbank(
            self.config.sample_rate, n_fft, self.features, device=device), persistent=False)

    real_fft = False  # the STFT by torch's real FFT instead of the DFT matmul (a prepared float32 CPU model)

    def use_cpu_kernels(self) -> None:  # a float32 CPU model: the STFT by torch's real FFT, not the DFT matmul
        self.real_fft = True

    # ---- shared math

    def _power(self, windows: torch.Tensor) -> torch.Tensor:
        """``|STFT|^2`` of unwindowed frames ``[..., n_fft]`` -> ``[..., bins]``."""
        if self.real_fft and windows.is_cpu:
            spectrum = torch.view_as_real(torch.fft.rfft(windows * self.window, dim=-1))
            return (spectrum * spectrum).sum(dim=-1)  # not .square(): pow dispatches a result_type
        spectrum = (windows @ self.dft_basis).unflatten(-1, (2, -1))
        return (spectrum * spectrum).sum(dim=-2)

    def _preemphasize(self, x: torch.Tensor) -> torch.Tensor:
        """``y[n] = x[n] - a*x[n-1]`` along the last axis, with ``y[0] = x[0]`` (only meaningful when x
        starts the signal)."""
        if self.preemph <= 0.0:
            return x
        return torch.cat([x[..., :1], x[..., 1:] - self.preemph * x[..., :-1]], dim=-1)

    def _log_mel(self, padded: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Log-mel of ``count`` frames whose windows start at ``padded[first + i*hop]`` -> [1, count, F]."""
        segment = padded[first:first + (count - 1) * self.hop + self.n_fft]
        frames = segment.unfold(0, self.n_fft, self.hop)  # [count, n_fft], a strided view
        mel = self._power(frames) @ self.filterbank.T
        return torch.log(mel + self.log_guard).unsqueeze(0)

    def _check_audio(self, audio: torch.Tensor, where: str) -> torch.Tensor:
        if audio.dim() == 2 and audio.shape[0] == 1:
            audio = audio[0]
        if audio.dim() != 1:
            raise ValueError(f"LogMel.{where}: expected mono audio [N] or [1, N], got shape {tuple(audio.shape)}")
        return audio.to(device=self.dft_basis.device, dtype=torch.float32)

    # ---- offline

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        audio = self._check_audio(audio, "forward")
        pad = self.n_fft // 2
        if audio.shape[0] <= pad:
            raise ValueError(f"LogMel.forward: {audio.shape[0]} samples is too short for the centred STFT "
                             f"(reflect padding needs at least {pad + 1})")
        y = self._preemphasize(audio)
        padded = torch.cat([y[1:pad + 1].flip(0), y, y[-pad - 1:-1].flip(0)])
        count = audio.shape[0] // self.hop + 1
        if count <= OFFLINE_CHUNK:
            return self._log_mel(padded, 0, count)
        # Frames are independent: pieces keep the [frames, n_fft] windows and spectra of long audio small.
        return torch.cat([self._log_mel(padded, first * self.hop, min(OFFLINE_CHUNK, count - first))
                          for first in range(0, count, OFFLINE_CHUNK)], dim=1)

    # ---- streaming: many streams, whole frames

    def new_cache(self, batch: int = 1) -> MelCache:
        """Zero history for ``batch`` streams that push ``lookahead`` samples per call."""
        kept = self.lookahead - self.hop + self.n_fft // 2 + 1
        device = self.dft_basis.device
        return MelCache(torch.zeros(batch, kept, device=device), torch.zeros(batch, dtype=torch.long, device=device))

    def forward_step(self, frames: torch.Tensor, cache: MelCache) -> torch.Tensor:
        """The streaming step: one frame per stream ``[B, lookahead]`` -> ``[B, lookahead // hop, features]``,
        the frames whose centres trail the stream's edge by ``lookahead`` (8 for 80 ms), equal to those
        of the offline pass; a stream's first push completes only 1, so its row holds that one last and
        7 frames of no meaning before it. ``cache.frames`` advances (the engine sets it for rows that sit
        out)."""
        step, hop, pad = self.lookahead, self.hop, self.n_fft // 2
        if frames.dim() != 2 or frames.shape[1] != step or step % hop:
            raise ValueError(f"LogMel.forward_step: expected frames [B, {step}] (a multiple of hop {hop}), "
                             f"got {tuple(frames.shape)}")
        count = step // hop
        buffer = torch.cat([cache.samples, frames.to(torch.float32)], dim=1)  # [B, N]
        cache.samples.copy_(buffer[:, step:])
        y = self._preemphasize(buffer)  # rows start with zeros, so a stream's first sample keeps its value
        # Local index j holds absolute sample j - origin. Frame f = count (t - 1) + 1 + i (t frames pushed
        # before) starts at f * hop - pad, local 1 + i * hop; absolute samples before 0 are the reflection
        # of the ones after it (the centred STFT's padding), read by one gather.
        origin = pad + 1 - (count * (cache.frames - 1) + 1) * hop  # [B]
        j = torch.arange(y.shape[1], device=y.device)
        mirrored = torch.where(j < origin[:, None], 2 * origin[:, None] - j, j).clamp(max=y.shape[1] - 1)
        y = y.gather(1, mirrored)
        windows = y[:, 1:].unfold(1, self.n_fft, hop)[:, :count]  # [B, count, n_fft]
        mel = self._power(windows) @ self.filterbank.T
        cache.frames = cache.frames + 1
        return torch.log(mel + self.log_guard)
