"""The per-network sections of ``config.json`` (``audio_config``, ``text_config``, ``tts_config``,
``codec_config``) as typed dataclasses, and the checks that name a bad key. ``nvchat_torch.models.config``
assembles them into :class:`~nvchat_torch.models.config.VoiceChatConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "ConfigError",
    "PreprocessorConfig",
    "ConformerConfig",
    "RnntDecoderConfig",
    "RnntJointConfig",
    "AudioConfig",
    "TextConfig",
    "CharacterEncoderConfig",
    "MoGConfig",
    "TTSConfig",
    "CodecConfig",
]


T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A config.json key is missing or holds an impossible value; the message names it."""


def require(cond: bool, key: str, msg: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``cond`` (the config checks of every network)."""
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def require_positive(obj: Any, prefix: str, *names: str) -> None:
    """Each of ``obj``'s fields ``names`` is a positive number (``prefix`` names where it sits)."""
    for name in names:
        value = getattr(obj, name)
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
               f"{prefix}{name}", f"must be a positive number, got {value!r}")


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, prefix: str, required: tuple[str, ...] = ()) -> T:
    """Build dataclass ``cls`` from ``values``, ignoring unknown keys, requiring ``required``."""
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"config key '{prefix.rstrip('.')}': expected an object, got {type(values).__name__}")
    for key in required:
        if key not in values or values[key] is None:
            raise ConfigError(f"config key '{prefix}{key}' is required but missing")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


# --------------------------------------------------------------------------------------
# Perception: log-mel front end, FastConformer, RNNT


@dataclass
class PreprocessorConfig:
    """NeMo ``AudioToMelSpectrogramPreprocessor`` settings (``audio_config.preprocessor``)."""

    sample_rate: int = 16000
    features: int = 128
    n_fft: int = 512
    window_size: float = 0.025
    window_stride: float = 0.01
    window: str = "hann"
    preemph: float = 0.97
    dither: float = 1e-5  # parsed but never applied, as in the reference
    normalize: str = "NA"
    log_zero_guard_value: float = 2.0**-24
    pad_to: int = 0
    pad_value: float = 0.0
    pad_mode: str = "reflect"

    @property
    def win_length(self) -> int:
        return int(self.window_size * self.sample_rate)  # int() truncation, as NeMo

    @property
    def hop_length(self) -> int:
        return int(self.window_stride * self.sample_rate)

    def validate(self, prefix: str = "audio_config.preprocessor.") -> None:
        require_positive(self, prefix, "sample_rate", "features", "n_fft", "window_size", "window_stride")
        require(self.win_length <= self.n_fft, f"{prefix}window_size",
               f"window of {self.win_length} samples exceeds n_fft {self.n_fft}")
        require(self.hop_length > 0, f"{prefix}window_stride", "hop length rounds to 0 samples")
        require(self.window == "hann", f"{prefix}window", f"only 'hann' is supported, got {self.window!r}")
        require(self.normalize in ("NA", "None", None, "none"), f"{prefix}normalize",
               f"only 'NA' (no normalisation) is supported, got {self.normalize!r}")
        require(self.pad_to == 0, f"{prefix}pad_to", "must be 0 (the streaming front end cannot pad)")


@dataclass
class ConformerConfig:
    """Cache-aware FastConformer encoder (``audio_config.encoder``)."""

    feat_in: int = 128
    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 8
    ff_expansion_factor: int = 4
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    conv_kernel_size: int = 9
    causal_downsampling: bool = True
    conv_context_size: Any = "causal"
    conv_norm_type: str = "layer_norm"
    self_attention_model: str = "rel_pos"
    att_context_style: str = "chunked_limited"
    att_context_size: list = field(default_factory=lambda: [[70, 0]])
    pos_emb_max_len: int = 5000
    use_bias: bool = False
    xscaling: bool = False

    def __post_init__(self) -> None:
        ctx = self.att_context_size
        if ctx and isinstance(ctx[0], int):  # [70, 0] -> [[70, 0]], as the reference does
            self.att_context_size = [list(ctx)]

    @property
    def left_context(self) -> int:
        return int(self.att_context_size[0][0])

    @property
    def right_context(self) -> int:
        return int(self.att_context_size[0][1])

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_subsampling_stages(self) -> int:
        return int(round(math.log2(self.subsampling_factor)))

    def validate(self, prefix: str = "audio_config.encoder.") -> None:
        require_positive(self, prefix, "feat_in", "n_layers", "d_model", "n_heads", "ff_expansion_factor",
                  "subsampling_conv_channels", "conv_kernel_size", "pos_emb_max_len")
        require(self.d_model % self.n_heads == 0, f"{prefix}n_heads",
               f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        sf = self.subsampling_factor
        require(isinstance(sf, int) and sf >= 2 and sf & (sf - 1) == 0, f"{prefix}subsampling_factor",
               f"must be a power of two >= 2, got {sf!r}")
        require(self.conv_kernel_size % 2 == 1, f"{prefix}conv_kernel_size",
               f"must be odd, got {self.conv_kernel_size}")
        require(self.self_attention_model == "rel_pos", f"{prefix}self_attention_model",
               f"only 'rel_pos' is supported, got {self.self_attention_model!r}")
        require(self.conv_norm_type == "layer_norm", f"{prefix}conv_norm_type",
               f"only 'layer_norm' is supported, got {self.conv_norm_type!r}")
        require(self.conv_context_size in ("causal", None) or
               list(self.conv_context_size) == [self.conv_kernel_size - 1, 0],
               f"{prefix}conv_context_size", f"only causal convolution is supported, got {self.conv_context_size!r}")
        require(self.causal_downsampling is True, f"{prefix}causal_downsampling", "must be true")
        ctx = self.att_context_size
        require(bool(ctx) and len(ctx[0]) == 2 and ctx[0][0] > 0 and ctx[0][1] == 0,
               f"{prefix}att_context_size", f"must be [[left > 0, 0]] (no look-ahead), got {ctx!r}")


@dataclass
class RnntDecoderConfig:
    """RNNT prediction network (``audio_config.decoder``)."""

    pred_hidden: int = 640
    pred_rnn_layers: int = 2
    vocab_size: int = 1024
    blank_as_pad: bool = True

    def validate(self, prefix: str = "audio_config.decoder.") -> None:
        require_positive(self, prefix, "pred_hidden", "pred_rnn_layers", "vocab_size")
        require(self.blank_as_pad is True, f"{prefix}blank_as_pad", "must be true")


@dataclass
class RnntJointConfig:
    """RNNT joint network (``audio_config.joint``)."""

    joint_hidden: int = 640
    activation: str = "relu"
    encoder_hidden: int = 1024
    pred_hidden: int = 640
    num_classes: int = 1024

    def validate(self, prefix: str = "audio_config.joint.") -> None:
        require_positive(self, prefix, "joint_hidden", "encoder_hidden", "pred_hidden", "num_classes")
        require(self.activation == "relu", f"{prefix}activation", f"only 'relu' is supported, got {self.activation!r}")


@dataclass
class AudioConfig:
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    decoder: RnntDecoderConfig = field(default_factory=RnntDecoderConfig)
    joint: RnntJointConfig = field(default_factory=RnntJointConfig)
    output_dim: int = 4480
    max_symbols: int = 10

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "AudioConfig":
        values = dict(values or {})
        return cls(
            preprocessor=from_mapping(PreprocessorConfig, values.get("preprocessor"), "audio_config.preprocessor."),
            encoder=from_mapping(ConformerConfig, values.get("encoder"), "audio_config.encoder."),
            decoder=from_mapping(RnntDecoderConfig, values.get("decoder"), "audio_config.decoder."),
            joint=from_mapping(RnntJointConfig, values.get("joint"), "audio_config.joint."),
            output_dim=values.get("output_dim", 4480),
            max_symbols=values.get("max_symbols", 10),
        )

    def validate(self) -> None:
        self.preprocessor.validate()
        self.encoder.validate()
        self.decoder.validate()
        self.joint.validate()
        require_positive(self, "audio_config.", "output_dim", "max_symbols")
        require(self.encoder.feat_in == self.preprocessor.features, "audio_config.encoder.feat_in",
               f"{self.encoder.feat_in} != preprocessor.features {self.preprocessor.features}")
        require(self.joint.encoder_hidden == self.encoder.d_model, "audio_config.joint.encoder_hidden",
               f"{self.joint.encoder_hidden} != encoder.d_model {self.encoder.d_model}")
        require(self.joint.pred_hidden == self.decoder.pred_hidden, "audio_config.joint.pred_hidden",
               f"{self.joint.pred_hidden} != decoder.pred_hidden {self.decoder.pred_hidden}")


# --------------------------------------------------------------------------------------
# Language model: Nemotron-H


_TEXT_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "mamba_num_heads", "mamba_head_dim", "conv_kernel", "hybrid_override_pattern",
)


@dataclass
class TextConfig:
    """Nemotron-H (``text_config``). The reference code has no defaults for the sizes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    conv_kernel: int
    n_groups: int
    hybrid_override_pattern: str
    head_dim: int | None = None
    layer_norm_epsilon: float = 1e-5
    attention_bias: bool = False
    mamba_proj_bias: bool = False
    mlp_bias: bool = False
    use_bias: bool = False
    use_conv_bias: bool = True
    num_hidden_layers: int | None = None
    max_position_embeddings: int = 131072
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    model_type: str = "nemotron_h"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "TextConfig":
        if values is None:
            raise ConfigError("config key 'text_config' is required but missing")
        values = dict(values)
        # Aliases written by some Nemotron-H exports (the converter accepts them too).
        if values.get("ssm_state_size") is None and "mamba_state_dim" in values:
            values["ssm_state_size"] = values["mamba_state_dim"]
        if values.get("n_groups") is None and "mamba_num_groups" in values:
            values["n_groups"] = values["mamba_num_groups"]
        pattern = values.get("hybrid_override_pattern")
        if pattern is None and values.get("layers_block_type"):
            chars = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
            values["hybrid_override_pattern"] = "".join(chars.get(t, "?") for t in values["layers_block_type"])
        elif isinstance(pattern, (list, tuple)):
            values["hybrid_override_pattern"] = "".join(pattern)
        limit = values.get("time_step_limit")
        if limit is None:
            values["time_step_limit"] = (0.0, math.inf)
        else:  # transformers writes infinities as tagged JSON objects
            values["time_step_limit"] = tuple(
                float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
        return from_mapping(cls, values, "text_config.", _TEXT_REQUIRED + ("ssm_state_size", "n_groups"))

    def __post_init__(self) -> None:
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def layer_types(self) -> str:
        return self.hybrid_override_pattern

    def validate(self) -> None:
        p = "text_config."
        require_positive(self, p, "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                  "conv_kernel", "n_groups", "head_dim", "layer_norm_epsilon")
        bad = sorted(set(self.hybrid_override_pattern) - set("M*-"))
        require(bool(self.hybrid_override_pattern) and not bad, p + "hybrid_override_pattern",
               f"must be a non-empty string of 'M', '*', '-' (got characters {bad})" if bad else "must not be empty")
        if self.num_hidden_layers is not None:
            require(self.num_hidden_layers == len(self.hybrid_override_pattern), p + "num_hidden_layers",
                   f"{self.num_hidden_layers} != len(hybrid_override_pattern) = {len(self.hybrid_override_pattern)}")
        require(self.num_attention_heads % self.num_key_value_heads == 0, p + "num_key_value_heads",
               f"num_attention_heads {self.num_attention_heads} is not a multiple of {self.num_key_value_heads}")
        require(self.mamba_num_heads % self.n_groups == 0, p + "n_groups",
               f"mamba_num_heads {self.mamba_num_heads} is not a multiple of n_groups {self.n_groups}")
        lo, hi = self.time_step_limit
        require(0.0 <= lo <= hi, p + "time_step_limit", f"must satisfy 0 <= lo <= hi, got {self.time_step_limit}")


# --------------------------------------------------------------------------------------
# Speech: EAR-TTS and codec


@dataclass
class CharacterEncoderConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float = 50.0
    rope_base: float = 10_000.0
    char_vocab_size: int = 257


@dataclass
class MoGConfig:
    intermediate_size: int = 4608
    low_rank: int = 64
    min_log_std: float = -4.0
    num_layers: int = 3
    num_predictions: int = 1024
    eps: float = 1e-6


@dataclass
class TTSConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    num_delay_speech_tokens: int = 2  # in the NeMo config, not modelled by the reference
    num_iterations: int = 8
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    exponent: float = 3.0
    disable_eos_prediction: bool = True
    use_gated_fusion_for_text_audio: bool = True
    use_subword_flag_emb: bool = True
    use_bos_eos_emb: bool = True
    use_audio_prompt_frozen_projection: bool = True
    audio_prompt_duration: float = 3.0
    character_encoder: CharacterEncoderConfig = field(default_factory=CharacterEncoderConfig)
    mog_head: MoGConfig = field(default_factory=MoGConfig)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "TTSConfig":
        values = dict(values or {})
        values["character_encoder"] = from_mapping(
            CharacterEncoderConfig, values.get("character_encoder"), "tts_config.character_encoder.")
        values["mog_head"] = from_mapping(MoGConfig, values.get("mog_head"), "tts_config.mog_head.")
        return from_mapping(cls, values, "tts_config.")

    @property
    def mask_code(self) -> int:
        return self.codebook_size

    def validate(self) -> None:
        p = "tts_config."
        require_positive(self, p, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern",
                  "rms_norm_eps", "query_pre_attn_scalar", "latent_size", "num_quantizers", "codebook_size",
                  "num_iterations", "exponent")
        require(self.num_attention_heads % self.num_key_value_heads == 0, p + "num_key_value_heads",
               f"num_attention_heads {self.num_attention_heads} is not a multiple of {self.num_key_value_heads}")
        require(0.0 < self.top_p <= 1.0, p + "top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.noise_scale >= 0.0, p + "noise_scale", f"must be >= 0, got {self.noise_scale}")
        ce = self.character_encoder
        require_positive(ce, p + "character_encoder.", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "char_vocab_size")
        # The flag/special embeddings are built at the char-encoder width and added to the TTS width.
        require(ce.hidden_size == self.hidden_size, p + "character_encoder.hidden_size",
               f"{ce.hidden_size} must equal tts_config.hidden_size {self.hidden_size}")
        require_positive(self.mog_head, p + "mog_head.", "intermediate_size", "low_rank", "num_layers", "num_predictions")


@dataclass
class CodecConfig:
    sample_rate: int = 22_050
    base_channels: int = 384
    channel_multipliers: tuple = (1, 2, 4)
    downsample_rates: tuple = (7, 7, 9)
    blocks_per_stage: int = 3
    block_kernel_size: int = 7
    latent_dim: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024

    def __post_init__(self) -> None:
        self.channel_multipliers = tuple(self.channel_multipliers)
        self.downsample_rates = tuple(self.downsample_rates)

    @property
    def samples_per_frame(self) -> int:
        """Output samples per codec frame (``waveform_to_token_ratio``): 4*7*7*9 = 1764."""
        ratio = self.hop_length
        for rate in self.downsample_rates:
            ratio *= rate
        return ratio

    @property
    def stft_channels(self) -> int:
        return 2 * (self.n_fft // 2 + 1)

    def validate(self) -> None:
        p = "codec_config."
        require_positive(self, p, "sample_rate", "base_channels", "blocks_per_stage", "block_kernel_size",
                  "latent_dim", "n_fft", "hop_length", "num_quantizers", "codebook_size")
        require(len(self.channel_multipliers) == len(self.downsample_rates) > 0, p + "channel_multipliers",
               f"needs one entry per downsample rate {self.downsample_rates}, got {self.channel_multipliers}")
        require(self.n_fft % self.hop_length == 0 and self.n_fft > self.hop_length, p + "hop_length",
               f"n_fft {self.n_fft} must be a larger multiple of hop_length {self.hop_length}")
