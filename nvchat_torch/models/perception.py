"""``stt_model.perception``: the streaming log-mel front end, the FastConformer encoder and the
projection to the LLM's width, as one module (the checkpoint's tree)."""

from __future__ import annotations

import torch
from torch import nn

from .config import AudioConfig
from .conformer import ConformerCache, ConformerRows, FastConformer
from .layers import Linear
from .mel import LogMel

__all__ = ["Perception"]


class _Featurizer(nn.Module):
    """NeMo's featurizer buffers as stored in the checkpoint (``window``, ``fb``).

    The reference drops them and rebuilds the front end from the config (:class:`LogMel`), so
    they are loaded for a strict state dict but never used.
    """

    def __init__(self, n_fft: int, win_length: int, features: int):
        super().__init__()
        self.register_buffer("window", torch.zeros(win_length))
        self.register_buffer("fb", torch.zeros(1, features, n_fft // 2 + 1))


class Perception(nn.Module):
    """``stt_model.perception``: FastConformer + ``proj`` (d_model -> LLM width).

    ``forward(mel)`` / ``forward_step(mel_frames, cache)`` return ``(projected, encoded)``:
    ``encoded`` feeds the RNNT transcript, ``projected`` the language model.
    """

    def __init__(self, config: AudioConfig):
        super().__init__()
        pre, enc = config.preprocessor, config.encoder
        self.preprocessor = nn.Module()
        self.preprocessor.featurizer = _Featurizer(pre.n_fft, pre.win_length, pre.features)
        self.encoder = FastConformer(enc)
        self.proj = Linear(enc.d_model, config.output_dim, bias=True)
        # One encoder frame = hop * subsampling input samples (1280 = 80 ms).
        self.frame_samples = pre.hop_length * enc.subsampling_factor
        self.log_mel = LogMel(pre, lookahead_samples=self.frame_samples)
        # The reference's uncached fallback recomputes over the last left + right + 1 frames of audio.
        self.uncached_window_frames = max(2, enc.left_context + enc.right_context + 1)

    def init_constants(self, device: torch.device | str | None = None) -> None:
        self.log_mel.init_constants(device)
        self.encoder.init_constants(device)

    def fuse(self) -> None:
        self.encoder.fuse()

    def new_cache(self, batch: int = 1) -> ConformerCache:
        return self.encoder.new_cache(batch)

    def forward(self, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.encoder(mel)
        return self.proj(encoded), encoded

    def forward_step(self, mel: torch.Tensor, cache: ConformerCache,
                     rows: ConformerRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One encoder frame per stream (:meth:`FastConformer.forward_step`), projected."""
        encoded = self.encoder.forward_step(mel, cache, rows)
        return self.proj(encoded), encoded

    def silence(self) -> torch.Tensor:
        """NVIDIA's input for a step that hears no audio (a step off the clock): the first projected frame
        of one second of zeros, run offline (``_create_silence_embedding_cache`` in NeMo's VoiceChat
        inference wrapper). ``[1, 1, H]``."""
        mel = self.log_mel
        zeros = torch.zeros(mel.config.sample_rate, dtype=torch.float32, device=next(self.parameters()).device)
        return self(mel(zeros))[0][:, :1]

    def uncached_frame(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's cache-free path: mel + encoder over the last window of ``samples`` (the
        audio so far), keeping encoder frame -2 (the last one sees the STFT's right-edge padding).
        Returns ``(projected [1, 1, H], encoded [1, 1, d])``."""
        window = samples.reshape(-1)[-self.uncached_window_frames * self.frame_samples:]
        encoded = self.encoder(self.log_mel(window))
        if encoded.shape[1] < 2:
            raise ValueError(f"Perception.uncached_frame: {window.shape[0]} samples give {encoded.shape[1]} "
                             "encoder frame(s); at least 2 are needed")
        encoded = encoded[:, -2:-1]
        return self.proj(encoded), encoded
