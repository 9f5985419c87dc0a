"""Typed configuration for NemotronLabs VoiceChat, read from mlx-vlm's ``config.json``.

The schema is the one mlx-vlm's converter writes (``text_config``, ``audio_config``,
``tts_config``, ``codec_config`` plus top-level token ids, rates and ``quantization``).
Defaults are those of the reference code; the Nemotron-H sizes have no defaults there,
so a missing one is an error naming the key. Unknown keys are ignored, as the
reference ignores them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import network_config
from .network_config import (
    AudioConfig,
    CharacterEncoderConfig,
    CodecConfig,
    ConfigError,
    ConformerConfig,
    MoGConfig,
    PreprocessorConfig,
    RnntDecoderConfig,
    RnntJointConfig,
    TextConfig,
    TTSConfig,
    from_mapping,
    require,
    require_positive,
)

__all__ = [*network_config.__all__, "QuantSpec", "VoiceChatConfig", "FULL_SIZE_TEXT_CONFIG"]


# --------------------------------------------------------------------------------------
# Quantization


_AFFINE_BITS = (2, 3, 4, 5, 6, 8)
_FP_MODES = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}


@dataclass(frozen=True)
class QuantSpec:
    """How one module is packed: MLX ``mode`` with ``bits`` per element and ``group_size``."""

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"

    def validate(self, where: str) -> None:
        if self.mode == "affine":
            if self.bits not in _AFFINE_BITS:
                raise ConfigError(f"{where}: unsupported affine bit width {self.bits} "
                                  f"(supported: {', '.join(map(str, _AFFINE_BITS))})")
            if self.group_size not in (32, 64, 128):
                raise ConfigError(f"{where}: unsupported affine group size {self.group_size} (supported: 32, 64, 128)")
        elif self.mode in _FP_MODES:
            bits, gs = _FP_MODES[self.mode]
            if (self.bits, self.group_size) != (bits, gs):
                raise ConfigError(f"{where}: mode {self.mode} needs bits={bits}, group_size={gs}; "
                                  f"got bits={self.bits}, group_size={self.group_size}")
        else:
            raise ConfigError(f"{where}: unknown quantization mode {self.mode!r} "
                              f"(supported: affine, {', '.join(_FP_MODES)})")

    @property
    def has_biases(self) -> bool:
        return self.mode == "affine"


# --------------------------------------------------------------------------------------
# The whole model


FULL_SIZE_TEXT_CONFIG: dict[str, Any] = {
    # NVIDIA-Nemotron-Nano-9B-v2, the LLM of VoiceChat 11B (mlx-vlm has no defaults for it).
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4480,
    "intermediate_size": 15680,
    "num_hidden_layers": 56,
    "max_position_embeddings": 131072,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "attention_bias": False,
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "mamba_proj_bias": False,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "n_groups": 8,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "head_dim": 128,
}


@dataclass
class VoiceChatConfig:
    text_config: TextConfig
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TTSConfig = field(default_factory=TTSConfig)
    codec_config: CodecConfig = field(default_factory=CodecConfig)
    model_type: str = "nemotron_voicechat"
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 12
    silence_token_id: int = 11
    rnnt_blank_id: int = 1024
    input_sample_rate: int = 16_000
    output_sample_rate: int = 22_050
    frame_duration: float = 0.08
    function_channel_weight: float = 2.0
    default_system_prompt: str = ""
    speaker: str = "Aria"
    rnnt_vocabulary: list = field(default_factory=list)
    # As in config.json: {"group_size", "bits", ["mode"], "<module path>": {...} | false}; None if unquantized.
    quantization: dict | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, validate: bool = True) -> "VoiceChatConfig":
        if not isinstance(values, Mapping):
            raise ConfigError(f"config must be a JSON object, got {type(values).__name__}")
        model_type = values.get("model_type", "nemotron_voicechat")
        if model_type != "nemotron_voicechat":
            raise ConfigError(f"config key 'model_type': expected 'nemotron_voicechat', got {model_type!r}")
        if "text_config" not in values or values["text_config"] is None:
            raise ConfigError("config key 'text_config' is required but missing")
        quant = values.get("quantization", values.get("quantization_config"))
        top = {f.name for f in dataclasses.fields(cls)} - {
            "text_config", "audio_config", "tts_config", "codec_config", "quantization"}
        cfg = cls(
            text_config=TextConfig.from_dict(values["text_config"]),
            audio_config=AudioConfig.from_dict(values.get("audio_config")),
            tts_config=TTSConfig.from_dict(values.get("tts_config")),
            codec_config=from_mapping(CodecConfig, values.get("codec_config"), "codec_config."),
            quantization=None if quant in (None, False) else dict(quant),
            **{k: v for k, v in values.items() if k in top},
        )
        if validate:
            cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "VoiceChatConfig":
        path = Path(path)
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json (is this a NemotronLabs VoiceChat checkpoint folder?)")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(values)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def full_size(cls) -> "VoiceChatConfig":
        """The configuration of the real 11B model (reference defaults + the Nemotron-Nano-9B-v2 LLM)."""
        return cls.from_dict({"text_config": dict(FULL_SIZE_TEXT_CONFIG),
                              "rnnt_vocabulary": [f"tok{i}" for i in range(1024)]})

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.quantization is None:
            out.pop("quantization")
        else:
            out["quantization_config"] = out["quantization"]
        return out

    # ---- derived values
    @property
    def input_frame_samples(self) -> int:
        """User samples per 80 ms frame: 1280 at 16 kHz."""
        return int(round(self.input_sample_rate * self.frame_duration))

    @property
    def output_frame_samples(self) -> int:
        """Assistant samples per frame: the codec's 1764 at 22.05 kHz."""
        return self.codec_config.samples_per_frame

    def quant_spec(self, module_path: str, *, stored: bool) -> QuantSpec | None:
        """The packing of ``module_path`` per ``quantization``: a per-module override wins
        (``false`` = unquantized); otherwise the global spec if the checkpoint ``stored``
        a ``.scales`` for it (mlx-vlm's rule), else None."""
        q = self.quantization
        if not q:
            return None
        override = q.get(module_path)
        if override is None and module_path.startswith("language_model."):
            override = q.get(module_path[len("language_model."):])
        if override is False or (isinstance(override, dict) and not override):
            return None
        base = {"bits": q.get("bits", 4), "group_size": q.get("group_size", 64), "mode": q.get("mode", "affine")}
        if isinstance(override, dict):
            base.update({k: override[k] for k in ("bits", "group_size", "mode") if k in override})
            if "mode" not in override:
                base["mode"] = "affine"
        elif not stored:
            return None
        spec = QuantSpec(bits=int(base["bits"]), group_size=int(base["group_size"]), mode=str(base["mode"]))
        spec.validate(f"quantization of '{module_path}'")
        return spec

    def validate(self) -> None:
        self.text_config.validate()
        self.audio_config.validate()
        self.tts_config.validate()
        self.codec_config.validate()
        require_positive(self, "", "input_sample_rate", "output_sample_rate", "frame_duration")
        require(self.function_channel_weight == self.function_channel_weight, "function_channel_weight", "is NaN")
        require(isinstance(self.speaker, str) and self.speaker.isidentifier(), "speaker",
               f"names the prompt latents' checkpoint key (audio_prompt_latents.<speaker>), got {self.speaker!r}")
        hop = self.audio_config.preprocessor.hop_length
        sub = self.audio_config.encoder.subsampling_factor
        require(self.input_frame_samples == hop * sub, "frame_duration",
               f"{self.frame_duration} s = {self.input_frame_samples} samples must equal "
               f"hop {hop} x subsampling {sub} = {hop * sub} (one encoder frame per frame)")
        require(self.input_sample_rate == self.audio_config.preprocessor.sample_rate, "input_sample_rate",
               f"{self.input_sample_rate} != audio_config.preprocessor.sample_rate "
               f"{self.audio_config.preprocessor.sample_rate}")
        require(self.output_sample_rate == self.codec_config.sample_rate, "output_sample_rate",
               f"{self.output_sample_rate} != codec_config.sample_rate {self.codec_config.sample_rate}")
        require(abs(self.output_frame_samples - self.output_sample_rate * self.frame_duration) < 1,
               "codec_config.downsample_rates",
               f"{self.output_frame_samples} samples per codec frame != {self.output_sample_rate} Hz x "
               f"{self.frame_duration} s")
        t = self.tts_config
        require((t.num_quantizers, t.codebook_size) == (self.codec_config.num_quantizers,
                                                       self.codec_config.codebook_size),
               "tts_config.num_quantizers", "num_quantizers/codebook_size must equal the codec's")
        n_rnnt = self.audio_config.decoder.vocab_size
        require(self.audio_config.joint.num_classes == n_rnnt, "audio_config.joint.num_classes",
               f"{self.audio_config.joint.num_classes} != decoder.vocab_size {n_rnnt}")
        require(self.rnnt_blank_id == n_rnnt, "rnnt_blank_id",
               f"{self.rnnt_blank_id} must equal the RNNT vocabulary size {n_rnnt} (blank is the last class)")
        require(isinstance(self.rnnt_vocabulary, list) and len(self.rnnt_vocabulary) == n_rnnt, "rnnt_vocabulary",
               f"must list {n_rnnt} pieces, got {len(self.rnnt_vocabulary) if isinstance(self.rnnt_vocabulary, list) else type(self.rnnt_vocabulary).__name__}")
        vocab = self.text_config.vocab_size
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id"):
            value = getattr(self, key)
            require(isinstance(value, int) and 0 <= value < vocab, key, f"{value!r} is outside the vocabulary [0, {vocab})")
        if self.quantization is not None:
            q = self.quantization
            for key in ("bits", "group_size"):
                require(key in q, f"quantization.{key}", "is required when 'quantization' is set")
            QuantSpec(bits=int(q["bits"]), group_size=int(q["group_size"]),
                      mode=str(q.get("mode", "affine"))).validate("config key 'quantization'")
