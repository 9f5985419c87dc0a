"""The speech codec: 31 x 1024 residual VQ codes <-> 22.05 kHz waveform through a 16-point iSTFT.

Checkpoint prefix ``tts_model.audio_codec``. No complex tensors and no ``torch.fft``, so it runs on
MPS too. ``decode_step`` returns one sample-continuous frame of 1764 samples per call, equal to the
offline decode delayed by 8 samples. The encoder only encodes the silent warmup prompt.
Design: docs/api.md, "What each network computes" (the codec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .config import CodecConfig
from .layers import (
    REDUCED,
    Conv1d,
    FusedOnCpu,
    RecurrentCache,
    RowTensor,
    adopt,
    gelu_erf,
    mean_last,
    pointwise,
    rsqrt,
    scalar,
    softplus,
    squared_norms,
    swap_modules,
    var_last,
)

__all__ = ["Codec", "CodecCache", "ConvNeXtBlock", "AudioEncoder", "AudioDecoder", "ResidualVectorQuantizer",
           "StackedCodebooks"]

MAX_MAGNITUDE = 100.0  # the spectral head's magnitude ceiling: |X| = 100 * sigmoid(logit - ln 100)
ENVELOPE_FLOOR = 1e-10  # guard of the window-square overlap-add normalisation
DECODE_CHUNK = 256  # code frames per piece of an offline decode (bounded memory on long audio)


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the last axis (biased variance). In bf16 the reference's own formula, each op
    rounded: ``(x - mean) * rsqrt(var + eps) * weight + bias``; in float32 torch's fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in REDUCED:
            return super().forward(x)
        mean = mean_last(x)
        normalized = (x - mean) * rsqrt(var_last(x, mean) + scalar(self.eps, x.dtype))
        return normalized * self.weight + self.bias


class ConvNeXtBlock(nn.Module, FusedOnCpu):
    """``x + pwconv2(gelu(pwconv1(norm(dwconv(causal_pad(x))))))`` on ``[B, C, T]``.

    The depthwise conv is causal: ``kernel - 1`` zero frames on the left, or, when streaming,
    the last ``kernel - 1`` input frames of the previous call. The norm is a LayerNorm over
    channels (biased variance, eps 1e-6); the kernel-1 convs are linears over channels, so the
    norm and the MLP run channel-last. On a float32 CPU model the block is one fused op
    (``convnext_block``: seven kernels, and oneDNN's and the LayerNorm's set-up per row, in one).
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.context = kernel_size - 1
        self.dwconv = Conv1d(channels, channels, kernel_size, groups=channels)
        self.norm = ChannelLayerNorm(channels, eps=1e-6)
        self.pwconv1 = nn.Conv1d(channels, 4 * channels, 1)
        self.pwconv2 = nn.Conv1d(4 * channels, channels, 1)

    def use_cpu_kernels(self) -> None:
        """The fused block where its weights are float32 already (no second copy of the pointwise convs),
        and torch's BLAS is reachable for them."""
        self.fused_on_cpu = cpu_kernels.blas() and all(p.dtype == torch.float32 for p in self.parameters())

    def forward(self, x: torch.Tensor, states: list[torch.Tensor] | None = None, index: int = 0) -> torch.Tensor:
        """``states[index]``: ``[B, C, kernel - 1]`` previous input frames (None: zeros), replaced by this
        call's last ones (a view of the window: one ``cat`` a step, no copy)."""
        if self.fused_on_cpu and cpu_kernels.usable(x):
            state = x.new_zeros(x.shape[0], x.shape[1], self.context) if states is None else states[index]
            if cpu_kernels.usable(state):
                out, state = torch.ops.nvchat_cpu.convnext_block(
                    x, state, self.dwconv.taps, self.dwconv.bias_f32, self.norm.weight, self.norm.bias, self.norm.eps,
                    self.pwconv1.weight.squeeze(-1), self.pwconv1.bias, self.pwconv2.weight.squeeze(-1), self.pwconv2.bias)
                if states is not None:
                    states[index] = state
                return out
        if states is None:
            padded = F.pad(x, (self.context, 0))
        else:
            padded = torch.cat([states[index], x], dim=-1)
            states[index] = padded[..., -self.context:]
        h = self.norm(self.dwconv(padded).transpose(1, 2))
        h = gelu_erf(pointwise(h, self.pwconv1.weight.squeeze(-1), self.pwconv1.bias))  # exact erf GELU
        h = pointwise(h, self.pwconv2.weight.squeeze(-1), self.pwconv2.bias)
        return x + h.transpose(1, 2)


def _stage_channels(config: CodecConfig) -> list[int]:
    return [config.base_channels * m for m in config.channel_multipliers]


class AudioEncoder(nn.Module):
    """``[B, stft_channels, N]`` spectrogram -> ``[B, latent_dim, N / prod(rates)]`` latents.

    ``layers``: Conv1d(18 -> C0, k1), then per stage ``blocks_per_stage`` ConvNeXt blocks and a
    Conv1d with kernel = stride = the stage's downsample rate into the next stage's width.
    """

    def __init__(self, config: CodecConfig):
        super().__init__()
        channels = _stage_channels(config)
        widths_out = channels[1:] + [config.latent_dim]
        layers: list[nn.Module] = [nn.Conv1d(config.stft_channels, channels[0], 1, bias=False)]
        for width, width_out, rate in zip(channels, widths_out, config.downsample_rates):
            layers += [ConvNeXtBlock(width, config.block_kernel_size) for _ in range(config.blocks_per_stage)]
            layers.append(nn.Conv1d(width, width_out, rate, stride=rate, bias=False))
        self.layers = nn.ModuleList(layers)

    def forward(self, spectrogram: torch.Tensor) -> torch.Tensor:
        x = spectrogram.float()
        for layer in self.layers:
            # The reference's float32 input promotes each layer to float32: upcast the weights.
            params = {name: p.float() for name, p in layer.named_parameters()}
            x = torch.func.functional_call(layer, params, (x,))
        return x


class Upsample(nn.ConvTranspose1d, FusedOnCpu):
    """A ConvTranspose1d whose kernel is its stride, without bias (the decoder's upsampling; its weight
    ``[in, out, k]``): on a float32 CPU model one fused op (``upsample_conv1d``: a BLAS product per row,
    where oneDNN's set-up grows with the rows)."""

    def use_cpu_kernels(self) -> None:
        self.fused_on_cpu = (cpu_kernels.blas() and self.bias is None and self.weight.dtype == torch.float32
                            and self.kernel_size == self.stride and self.padding == (0,) and self.groups == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.fused_on_cpu and x.dim() == 3 and cpu_kernels.usable(x):
            return torch.ops.nvchat_cpu.upsample_conv1d(x, self.weight)
        return super().forward(x)


class AudioDecoder(nn.Module):
    """``[B, latent_dim, T]`` latents -> ``[B, stft_channels, T * prod(rates)]`` spectral features.

    ``layers``: per stage (widest first) a ConvTranspose1d with kernel = stride = the rate (its
    weight stored ``[in, out, k]``) and ``blocks_per_stage`` ConvNeXt blocks; then Conv1d(C0 -> 18, k1).
    """

    def __init__(self, config: CodecConfig):
        super().__init__()
        channels = _stage_channels(config)[::-1]
        widths_in = [config.latent_dim] + channels[:-1]
        layers: list[nn.Module] = []
        for width_in, width, rate in zip(widths_in, channels, config.downsample_rates[::-1]):
            layers.append(Upsample(width_in, width, rate, stride=rate, bias=False))
            layers += [ConvNeXtBlock(width, config.block_kernel_size) for _ in range(config.blocks_per_stage)]
        layers.append(Conv1d(channels[-1], config.stft_channels, 1, bias=False))
        self.layers = nn.ModuleList(layers)

    @property
    def blocks(self) -> list[ConvNeXtBlock]:
        return [layer for layer in self.layers if isinstance(layer, ConvNeXtBlock)]

    def forward(self, latents: torch.Tensor, states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``states``: one ``[B, C, kernel - 1]`` tensor per ConvNeXt block (streaming), else None."""
        block = 0
        for layer in self.layers:
            if isinstance(layer, ConvNeXtBlock):
                latents = layer(latents, states, block)
                block += 1
            else:
                latents = layer(latents)
        return latents


class ScalarVariance(nn.Module):
    """``prvq._variance_list.{q}.variance``: stored by the checkpoint, unused at inference."""

    def __init__(self):
        super().__init__()
        self.variance = nn.Parameter(torch.ones(()))


class ResidualVectorQuantizer(nn.Module):
    """The codec's 31 codebooks ``mus_list.{q}`` ``[codebook_size, latent_dim]`` (not the TTS's ``rvq_embs``)."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.codebook_size = config.codebook_size
        self.num_quantizers = config.num_quantizers
        self.mus_list = nn.ParameterList(
            [torch.zeros(config.codebook_size, config.latent_dim) for _ in range(config.num_quantizers)])
        self._variance_list = nn.ModuleList([ScalarVariance() for _ in range(config.num_quantizers)])

    def codebook(self, q: int) -> torch.Tensor:
        """Codebook ``q``, ``[codebook_size, latent_dim]``."""
        return self.mus_list[q]

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, Q', T]`` codes -> their codebook rows ``[B, Q', T, D]``."""
        return torch.stack([self.mus_list[q][codes[:, q]] for q in range(codes.shape[1])], dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, Q', T]`` codes (Q' <= Q) -> ``[B, T, D]`` latents, the sum of each frame's codebook rows,
        in the codebook dtype."""
        rows = self.rows(codes)
        if rows.dtype in REDUCED:  # the reference adds the rows one at a time, each sum rounded
            total = rows[:, 0]
            for q in range(1, rows.shape[1]):
                total = total + rows[:, q]
            return total
        return rows.sum(1)  # [B, Q', T, D] -> [B, T, D]: one reduction, so stacked and separate agree bit for bit

    def encode(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` latents -> ``[B, Q, T]`` codes: greedy nearest codebook row of the residual, per
        quantizer in turn, in float32 (distance ``|r|^2 - 2 r.e + |e|^2``, as the reference)."""
        residual = latents.float()
        codes = []
        for q in range(self.num_quantizers):
            stored = self.codebook(q)
            means = stored.float()
            distances = ((residual * residual).sum(-1, keepdim=True) - 2.0 * (residual @ means.T)
                         + squared_norms(stored))  # |e|^2 in the codebook's dtype, as the reference
            index = distances.argmin(-1)
            codes.append(index)
            residual = residual - means[index]
        return torch.stack(codes, dim=1)


class StackedCodebooks(ResidualVectorQuantizer):
    """``prepare()``'s swap for :class:`ResidualVectorQuantizer`: the codebooks as one ``[Q, K, D]``
    parameter (``codebooks``, in place of ``mus_list``; the same bytes), so a frame's rows are one
    gather instead of one per quantizer."""

    def __init__(self, rvq: ResidualVectorQuantizer):
        adopt(self, rvq)
        stacked = torch.stack([p.detach() for p in rvq.mus_list])
        del self.mus_list
        self.codebooks = nn.Parameter(stacked, requires_grad=False)
        self.register_buffer("code_offsets", torch.arange(self.num_quantizers, device=stacked.device)[:, None]
                             * self.codebook_size, persistent=False)

    def codebook(self, q: int) -> torch.Tensor:
        return self.codebooks[q]

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codebooks.flatten(0, 1)[codes + self.code_offsets[:codes.shape[1]]]


@dataclass
class CodecCache(RecurrentCache):
    """Streaming state of one decode stream, fixed-size. ``blocks`` are in the model dtype, and each
    step replaces them. ``spectrum`` holds real parts, then imaginary parts: the overlap of the next
    call's iSTFT."""

    blocks: list[torch.Tensor]  # per ConvNeXt block, its last kernel - 1 inputs [B, C, 6]
    spectrum: torch.Tensor  # last 4 spectral frames [B, 2 * bins, 4], float32

    @property
    def batch(self) -> int:
        return self.spectrum.shape[0]

    def batched(self) -> list[RowTensor]:
        return [(self.spectrum, 0, 1)] + [(t, 0, 1) for t in self.blocks]

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        self.spectrum, *blocks = tensors
        self.blocks[:] = blocks  # the same list: a step's caller may hold it

    def clear(self) -> None:
        """Back to the start of a stream (zero history), keeping the buffers."""
        for state in self.blocks:
            state.zero_()
        self.spectrum.zero_()


def _hann_periodic(n: int) -> list[float]:
    return [0.5 * (1.0 - math.cos(2.0 * math.pi * i / n)) for i in range(n)]


def _dft_tables(n_fft: int, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(2 pi k n / N)`` and ``sin(...)`` as float32 ``[bins, n_fft]``; the Nyquist sin row is set to
    exactly zero (``sin(pi n)`` rounds to ~1e-16), so DC and Nyquist are real as in rfft/irfft."""
    bins = n_fft // 2 + 1
    angles = [[2.0 * math.pi * ((k * i) % n_fft) / n_fft for i in range(n_fft)] for k in range(bins)]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float32, device=device)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float32, device=device)
    if n_fft % 2 == 0:
        sin[-1] = 0.0
    return cos, sin


class Codec(nn.Module, FusedOnCpu):
    """The 22.05 kHz, 31-codebook codec (``tts_model.audio_codec``)."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        if config.n_fft % config.hop_length or config.n_fft <= config.hop_length:
            raise ValueError(f"codec n_fft {config.n_fft} must be a larger multiple of hop_length {config.hop_length}")
        self.config = config
        self.encoder: AudioEncoder | None = AudioEncoder(config)  # None once released (release_encoder)
        self.decoder = AudioDecoder(config)
        self.prvq = ResidualVectorQuantizer(config)
        self.samples_per_frame = config.samples_per_frame
        self.bins = config.n_fft // 2 + 1
        # Offline trim of the overlap-add output (the STFT's padding): 6 / 6 samples.
        self.trim_left = (config.n_fft - config.hop_length) // 2
        self.trim_right = config.n_fft - config.hop_length - self.trim_left
        # Streaming: previous spectral frames that overlap the first new samples (4), and the
        # samples their extra overlap-add output spans on each side (8).
        half = math.ceil(self.trim_left / config.hop_length)
        self.spectrum_context = 2 * half
        self.sample_delay = half * config.hop_length
        self.init_constants()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        """(Re)create the float32 constants: window, DFT bases, overlap-add kernel, streaming envelope."""
        n_fft = self.config.n_fft
        window = torch.tensor(_hann_periodic(n_fft), dtype=torch.float32, device=device)
        cos, sin = _dft_tables(n_fft, device)
        # rfft of the windowed frame: spectrum[k] = sum_n w[n] x[n] (cos - i sin)(2 pi k n / N).
        analysis = torch.cat([cos, -sin]) * window
        # irfft (c2r): x[n] = sum_k c_k (re_k cos - im_k sin) / N with c = 1 at DC and Nyquist, else 2.
        weight = torch.full((self.bins, 1), 2.0, device=device)
        weight[0] = 1.0
        if n_fft % 2 == 0:
            weight[-1] = 1.0
        synthesis = torch.cat([cos * weight, -sin * weight]).T / n_fft
        self.register_buffer("window", window, persistent=False)
        self.register_buffer("analysis_basis", analysis.T.contiguous(), persistent=False)  # [n_fft, 2 * bins]
        self.register_buffer("synthesis_basis", synthesis.contiguous(), persistent=False)  # [n_fft, 2 * bins]
        # Overlap-add of windowed frames as a transposed conv: channel n of a frame lands at offset n.
        self.register_buffer("ola_kernel", torch.diag(window)[:, None, :].contiguous(), persistent=False)
        step_frames = self.samples_per_frame // self.config.hop_length + self.spectrum_context
        self.register_buffer("step_envelope", self._envelope(step_frames), persistent=False)

    def fuse(self) -> None:
        """Post-load transform: the codebooks stacked (:class:`StackedCodebooks`); outputs and memory unchanged."""
        swap_modules(self, ResidualVectorQuantizer, StackedCodebooks)

    # ---- spectral head and iSTFT (float32)

    def _envelope(self, num_frames: int) -> torch.Tensor:
        """``max(sum of overlapped w^2, 1e-10)`` over the ``(num_frames - 1) * hop + n_fft`` samples."""
        ones = torch.ones(1, 1, num_frames, device=self.window.device)
        squared = (self.window * self.window).view(1, 1, -1)
        return F.conv_transpose1d(ones, squared, stride=self.config.hop_length).clamp_min(ENVELOPE_FLOOR)

    def _spectrum(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, 2 * bins, N]`` decoder features (magnitude logits, phases) -> float32 ``[re; im]``.

        Computed in the decoder dtype, as the reference, then float32 for the iSTFT. The reference writes
        the magnitude as ``100 exp(-softplus(ln 100 - logit))``: in bf16 that exact formula, op by op; in
        float32 the equal ``100 sigmoid(logit - ln 100)``, in fewer kernels.
        """
        logits, phase = features.split(self.bins, dim=1)
        if features.dtype in REDUCED:
            dt = features.dtype
            magnitude = scalar(MAX_MAGNITUDE, dt) * torch.exp(-softplus(-logits + scalar(math.log(MAX_MAGNITUDE), dt)))
        else:
            magnitude = MAX_MAGNITUDE * torch.sigmoid(logits - math.log(MAX_MAGNITUDE))
        return torch.cat([magnitude * phase.cos(), magnitude * phase.sin()], dim=1).float()

    def istft(self, spectrum: torch.Tensor, envelope: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, 2 * bins, N]`` float32 spectra (real parts, then imaginary parts) -> ``[B, 1, (N-1)*hop + n_fft]``.

        Inverse real DFT per frame (the imaginary parts of DC and Nyquist are ignored), each frame
        clamped to ``[-w, w]`` and multiplied by the periodic Hann window ``w``, overlap-added at
        the hop, and divided by the window-square envelope (``envelope``: precomputed for N frames).
        """
        frames = torch.matmul(self.synthesis_basis, spectrum)  # [B, n_fft, N]
        if envelope is None:
            envelope = self._envelope(spectrum.shape[-1])
        if self.fused_on_cpu and cpu_kernels.usable(frames, envelope):  # clamp, window, overlap-add, divide: one op
            return torch.ops.nvchat_cpu.overlap_add(frames, self.window, envelope, self.config.hop_length)
        bound = self.window[:, None]
        frames = torch.clamp(frames, -bound, bound)
        return F.conv_transpose1d(frames, self.ola_kernel, stride=self.config.hop_length) / envelope

    # ---- decoding

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] > self.config.num_quantizers or codes.shape[2] == 0:
            raise ValueError(f"codes must have shape [batch, quantizers <= {self.config.num_quantizers}, frames >= 1], "
                             f"got {list(codes.shape)}")
        if codes.is_floating_point() or codes.is_complex():
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, T, latent_dim]`` latents -> ``[B, 1, samples_per_frame * T]`` float32 waveform."""
        spectrum = self._spectrum(self.decoder(latents.transpose(1, 2)))
        waveform = self.istft(spectrum)
        return waveform[..., self.trim_left: waveform.shape[-1] - self.trim_right]

    def decode(self, codes: torch.Tensor, chunk: int = DECODE_CHUNK) -> torch.Tensor:
        """``[B, 31, T]`` codes -> ``[B, 1, 1764 * T]`` float32 waveform (offline; checks the code range).

        Long inputs decode ``chunk`` code frames at a time, in bounded memory, to the same waveform:
        the ConvNeXt blocks carry their last ``kernel - 1`` input frames from piece to piece (as
        streaming does), and each piece's iSTFT starts 3 spectral frames early, so that its samples
        get every overlapping frame, and the window-square envelope they saw in one pass."""
        self._check_codes(codes)
        low, high = (bound.item() for bound in torch.aminmax(codes))
        if low < 0 or high >= self.config.codebook_size:
            raise ValueError(f"codes must lie in [0, {self.config.codebook_size}), got values in [{low}, {high}]")
        latents = self.prvq.decode(codes)
        frames = latents.shape[1]
        if frames <= chunk:
            return self.decode_latents(latents)
        hop = self.config.hop_length
        overlap = self.config.n_fft // hop - 1  # earlier spectral frames that reach a piece's first sample
        states = [block.new_zeros(block.shape) for block in self.new_cache(latents.shape[0]).blocks]
        previous, pieces = None, []
        for start in range(0, frames, chunk):
            features = self.decoder(latents[:, start:start + chunk].transpose(1, 2), states)
            spectrum = self._spectrum(features)
            context = 0 if previous is None else overlap
            waveform = self.istft(spectrum if previous is None else torch.cat([previous, spectrum], dim=-1))
            # samples [hop * first frame, hop * end frame) of the whole sequence; the last piece keeps its tail
            last = start + chunk >= frames
            end = waveform.shape[-1] if last else context * hop + spectrum.shape[-1] * hop
            pieces.append(waveform[..., context * hop:end])
            previous = spectrum[..., -overlap:]
        waveform = torch.cat(pieces, dim=-1)
        return waveform[..., self.trim_left: waveform.shape[-1] - self.trim_right]

    def new_cache(self, batch: int = 1) -> CodecCache:
        """A zeroed streaming cache on the codec's device."""
        first = self.prvq.codebook(0)
        blocks = [torch.zeros(batch, block.dwconv.in_channels, block.context, dtype=first.dtype, device=first.device)
                  for block in self.decoder.blocks]
        spectrum = torch.zeros(batch, 2 * self.bins, self.spectrum_context, device=first.device)
        return CodecCache(blocks, spectrum)

    def decode_step(self, codes: torch.Tensor, cache: CodecCache) -> torch.Tensor:
        """One code frame ``[B, 31, 1]`` -> the next ``[B, 1, 1764]`` samples of the stream.

        The cache's ConvNeXt frames and spectral frames are prepended, so the output continues
        the previous call's exactly (it equals the offline decode delayed by 8 samples). No host sync.
        """
        self._check_codes(codes)
        if codes.shape[2] != 1 or codes.shape[0] != cache.batch:
            raise ValueError(f"decode_step takes one frame of codes [{cache.batch}, <= {self.config.num_quantizers}, 1] "
                             f"(the cache's batch), got {list(codes.shape)}")
        features = self.decoder(self.prvq.decode(codes).transpose(1, 2), cache.blocks)
        spectrum = torch.cat([cache.spectrum, self._spectrum(features)], dim=-1)
        cache.spectrum.copy_(spectrum[..., -self.spectrum_context:])
        waveform = self.istft(spectrum, self.step_envelope)
        start = self.trim_left + self.sample_delay
        return waveform[..., start: start + self.samples_per_frame]

    forward = decode
    forward_step = decode_step

    # ---- encoding (the warmup prompt)

    def _spectrogram(self, waveform: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` -> ``[B, 2 * bins, N]`` float32 STFT (zero pad 6/6, periodic Hann, hop 4, no centring)."""
        padded = F.pad(waveform.float(), (self.trim_left, self.trim_right))
        frames = padded.unfold(-1, self.config.n_fft, self.config.hop_length)  # [B, N, n_fft]
        return torch.matmul(frames, self.analysis_basis).transpose(1, 2)

    def encode_latents(self, waveform: torch.Tensor) -> torch.Tensor:
        """``[B, 1, S]`` (or ``[B, S]``) waveform -> ``[B, S // 1764, latent_dim]`` float32 latents."""
        if waveform.dim() == 3:
            if waveform.shape[1] != 1:
                raise ValueError(f"waveform must be mono [batch, 1, samples], got {list(waveform.shape)}")
            waveform = waveform[:, 0]
        if waveform.dim() != 2:
            raise ValueError(f"waveform must have shape [batch, 1, samples], got {list(waveform.shape)}")
        if waveform.shape[-1] < self.samples_per_frame:
            raise ValueError(f"waveform has {waveform.shape[-1]} samples; encoding needs at least one codec frame "
                             f"({self.samples_per_frame} samples)")
        if self.encoder is None:
            raise RuntimeError("the codec's encoder was released by the model's prepare() (streaming uses it only "
                               "for the speaker prompt, made there); to encode audio (training labels), load the "
                               "model with prepare=False")
        return self.encoder(self._spectrogram(waveform)).transpose(1, 2)

    def release_encoder(self) -> None:
        """Free the encoder's weights (175 MiB bf16 at full size): a streaming model needs it only for the
        speaker prompt, which the model's ``prepare()`` makes first."""
        self.encoder = None

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """``[B, 1, S]`` waveform -> ``[B, 31, S // 1764]`` codes (long)."""
        return self.prvq.encode(self.encode_latents(waveform))
