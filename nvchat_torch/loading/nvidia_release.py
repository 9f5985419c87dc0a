"""NVIDIA's own release, ``nvidia/NVIDIA-NemotronLabs-VoiceChat-11B``, read directly.

This module maps NeMo's nested config to the flat runtime config the cards carry
(:func:`runtime_config`), opens the float32 file as a :class:`ReleaseCheckpoint` (every key and shape
checked against the config before anything is read), and can present it as the card made from it
(:meth:`ReleaseCheckpoint.as_card`), converting each tensor as it is read.
Design: docs/checkpoints.md, "NVIDIA's release".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..models.config import FULL_SIZE_TEXT_CONFIG, ConfigError, QuantSpec, VoiceChatConfig
from ..networks import VoiceChatNetworks
from .checkpoint import (
    KEEP_FLOAT32,
    UNUSED_PREFIX,
    Checkpoint,
    CheckpointError,
    config_field,
    is_release_config,
    resolve_checkpoint,
)
from .quantize import mlx_quantize_rows

__all__ = ["NANO_9B_V2", "NANO_9B_V2_BASE", "TOKENIZER_FILES", "ReleaseCheckpoint", "runtime_config",
           "is_release_folder", "resolve_tokenizer", "base_config"]

NANO_9B_V2 = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"
# What is fetched of the tokenizer repo: its tokenizer and its config.json (the LLM sizes), not its weights.
TOKENIZER_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
# Nemotron-Nano-9B-v2's config.json, as far as the mapping reads it: used when the tokenizer folder has no
# config.json. mamba_state_dim / mamba_num_groups are the names the reference's mapping reads.
NANO_9B_V2_BASE: dict[str, Any] = {
    **{k: v for k, v in FULL_SIZE_TEXT_CONFIG.items() if k != "model_type"},
    "mamba_state_dim": FULL_SIZE_TEXT_CONFIG["ssm_state_size"],
    "mamba_num_groups": FULL_SIZE_TEXT_CONFIG["n_groups"],
}
_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings",
              "num_attention_heads", "num_key_value_heads", "mamba_num_heads", "mamba_head_dim", "conv_kernel")
_TTS_BACKBONE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "sliding_window")
_TTS_KEYS = ("latent_size", "num_quantizers", "codebook_size", "num_delay_speech_tokens", "exponent",
             "disable_eos_prediction", "use_gated_fusion_for_text_audio", "use_subword_flag_emb",
             "use_bos_eos_emb", "use_audio_prompt_frozen_projection")
# codec_config key <- NeMo codec_config key
_CODEC_KEYS = (("base_channels", "base_hidden_size"), ("channel_multipliers", "channel_mult"),
               ("downsample_rates", "rates"), ("blocks_per_stage", "num_blocks"), ("block_kernel_size", "kernel_size"),
               ("latent_dim", "latent_size"), ("n_fft", "n_fft"), ("hop_length", "hop_length"),
               ("num_quantizers", "num_quantizers"), ("codebook_size", "codebook_size"))
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32", torch.uint32: "U32", torch.uint8: "U8", torch.bool: "BOOL"}
_BASE_NOTE = (" (the LLM's sizes and layer pattern come from the base config: the config.json of the tokenizer "
              "folder or repo, else Nemotron-Nano-9B-v2's)")
READ_CHUNK_ELEMENTS = 1 << 22  # float32 weights read and converted at once


# --------------------------------------------------------------------------------------
# The config mapping


def _at(values: Mapping[str, Any], path: str, prefix: str = "", source: str = "") -> Any:
    """``values[path]`` (dotted); missing, a ConfigError naming ``prefix + path`` in ``source``."""
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(f"{source}config key '{prefix}{path}' is required but missing")
        node = node[part]
    return node


def _text_config(base: Mapping[str, Any]) -> dict[str, Any]:
    """The flat ``text_config`` from the base LLM's (Nemotron-Nano-9B-v2's) config.json."""
    where = "base LLM config.json: "
    pattern = base.get("hybrid_override_pattern")
    if pattern is None:
        raise ConfigError(f"{where}config key 'hybrid_override_pattern' is required but missing")
    text: dict[str, Any] = {"model_type": "nemotron_h"}
    for key in _TEXT_KEYS[:7]:
        text[key] = _at(base, key, source=where)
    text["attention_bias"] = base.get("attention_bias", False)
    for key in _TEXT_KEYS[7:9]:
        text[key] = _at(base, key, source=where)
    text["mamba_proj_bias"] = base.get("mamba_proj_bias", False)
    # The reference reads mamba_state_dim / mamba_num_groups when the HF names are absent (it needs them
    # present even then); here either name will do.
    for key, alias in (("ssm_state_size", "mamba_state_dim"), ("conv_kernel", None), ("n_groups", "mamba_num_groups")):
        text[key] = base[key] if key in base else _at(base, alias or key, source=where)
    text["mlp_bias"] = base.get("mlp_bias", False)
    text["layer_norm_epsilon"] = base.get("layer_norm_epsilon", base.get("rms_norm_eps", 1e-5))
    text["use_bias"] = base.get("use_bias", False)
    text["use_conv_bias"] = base.get("use_conv_bias", True)
    text["hybrid_override_pattern"] = pattern
    text["head_dim"] = base.get("head_dim")
    limit = base.get("time_step_limit")
    if limit is not None:
        finite = isinstance(limit, (list, tuple)) and len(limit) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) != float("inf") and v == v
            for v in limit)
        if not finite:
            raise ConfigError(f"{where}config key 'time_step_limit' must hold two finite numbers, got {limit!r}")
        text["time_step_limit"] = list(limit)
    return text


def runtime_config(source: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The flat runtime config (the cards' config.json) of NVIDIA's nested NeMo ``source`` config and the
    base LLM's ``base`` config: mlx-vlm's ``build_runtime_config``, key for key, except that
    ``rnnt_blank_id`` is the RNNT decoder's vocabulary size (blank is the last class; 1024 in the release)."""
    voicechat = _at(source, "model")
    stt = _at(source, "model.stt.model")
    speech = _at(source, "model.speech_generation.model")
    perception = _at(stt, "perception", "model.stt.model.")
    rnnt = _at(source, "_rnnt_merge_info")

    encoder = {k: v for k, v in _at(perception, "encoder", "model.stt.model.perception.").items() if k != "_target_"}
    context = encoder.get("att_context_size", [70, 0])
    if context and isinstance(context[0], int):
        encoder["att_context_size"] = [context]
    preprocessor = {k: v for k, v in _at(perception, "preprocessor", "model.stt.model.perception.").items()
                    if k != "_target_"}
    decoder_source = _at(rnnt, "decoder_config", "_rnnt_merge_info.")
    joint_source = _at(rnnt, "joint_config", "_rnnt_merge_info.")
    decoder = {**_at(decoder_source, "prednet", "_rnnt_merge_info.decoder_config."),
               "vocab_size": _at(decoder_source, "vocab_size", "_rnnt_merge_info.decoder_config."),
               "blank_as_pad": decoder_source.get("blank_as_pad", True)}
    joint = {**_at(joint_source, "jointnet", "_rnnt_merge_info.joint_config."),
             "num_classes": _at(joint_source, "num_classes", "_rnnt_merge_info.joint_config.")}

    tts = _at(speech, "tts_config", "model.speech_generation.model.")
    w = "model.speech_generation.model.tts_config."
    backbone = _at(tts, "backbone_config", w)
    codec = _at(speech, "codec_config", "model.speech_generation.model.")
    data = _at(source, "data")
    speech_data = _at(voicechat, "speech_generation.data", "model.")
    config: dict[str, Any] = {
        "model_type": "nemotron_voicechat",
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "text_config": _text_config(base),
        "audio_config": {"preprocessor": preprocessor, "encoder": encoder, "decoder": decoder, "joint": joint,
                         "output_dim": _at(perception, "output_dim", "model.stt.model.perception."),
                         "max_symbols": 10},
        "tts_config": {
            **{k: _at(backbone, k, w + "backbone_config.") for k in _TTS_BACKBONE_KEYS},
            **{k: _at(tts, k, w) for k in _TTS_KEYS},
            "character_encoder": _at(tts, "cas_config.backbone_config.encoder", w),
            "mog_head": _at(tts, "mog_head_config", w),
            "guidance_scale": _at(speech, "inference_guidance_scale", "model.speech_generation.model."),
            "top_p": _at(speech, "inference_top_p_or_k", "model.speech_generation.model."),
            "noise_scale": _at(speech, "inference_noise_scale", "model.speech_generation.model."),
            "audio_prompt_duration": _at(speech_data, "audio_prompt_duration", "model.speech_generation.data."),
        },
        "codec_config": {"sample_rate": _at(speech_data, "target_sample_rate", "model.speech_generation.data."),
                         **{ours: _at(codec, theirs, "model.speech_generation.model.codec_config.")
                            for ours, theirs in _CODEC_KEYS}},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 12,
        "silence_token_id": 11,
        "rnnt_blank_id": decoder["vocab_size"],
        "input_sample_rate": _at(data, "source_sample_rate", "data."),
        "output_sample_rate": _at(data, "target_sample_rate", "data."),
        "frame_duration": _at(data, "frame_length", "data."),
        "function_channel_weight": _at(stt, "duplex_function_channel_weight", "model.stt.model."),
        "speaker": "Aria",
        "rnnt_vocabulary": joint_source.get("vocabulary", []),
    }
    quantization = source.get("mlx_conversion", {}).get("quantization")
    if quantization:
        flat = {"group_size": quantization["group_size"], "bits": quantization["bits"],
                **quantization.get("modules", {})}
        config["quantization"] = flat
        config["quantization_config"] = dict(flat)
    return config


def release_config(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse of :func:`runtime_config`, for writing test and benchmark releases: NeMo's nested config
    and the base LLM config.json whose mapping is ``flat`` (a card's config.json), up to the TTS keys
    the mapping leaves to the defaults. Training-only keys NeMo also writes are included, as noise."""
    audio, tts, codec = flat["audio_config"], flat["tts_config"], flat["codec_config"]
    encoder = {"_target_": "nemo.collections.asr.modules.ConformerEncoder", "dropout": 0.1, **audio["encoder"]}
    if len(encoder.get("att_context_size", [])) == 1:  # NeMo writes one context as a flat pair
        encoder["att_context_size"] = list(encoder["att_context_size"][0])
    decoder = {k: v for k, v in audio["decoder"].items() if k not in ("vocab_size", "blank_as_pad")}
    joint = {k: v for k, v in audio["joint"].items() if k != "num_classes"}
    nested = {
        "model": {
            "stt": {"model": {
                "perception": {"preprocessor": {"_target_": "nemo.collections.asr.modules."
                                                "AudioToMelSpectrogramPreprocessor", **audio["preprocessor"]},
                               "encoder": encoder, "output_dim": audio["output_dim"]},
                "duplex_function_channel_weight": flat["function_channel_weight"],
                "optimizer": {"lr": 1e-4}}},
            "speech_generation": {
                "model": {
                    "tts_config": {
                        "backbone_config": {k: tts[k] for k in _TTS_BACKBONE_KEYS},
                        **{k: tts[k] for k in _TTS_KEYS},
                        "cas_config": {"backbone_config": {"encoder": dict(tts["character_encoder"])}},
                        "mog_head_config": dict(tts["mog_head"])},
                    "codec_config": {theirs: codec[ours] for ours, theirs in _CODEC_KEYS},
                    "inference_guidance_scale": tts["guidance_scale"], "inference_top_p_or_k": tts["top_p"],
                    "inference_noise_scale": tts["noise_scale"]},
                "data": {"audio_prompt_duration": tts["audio_prompt_duration"],
                         "target_sample_rate": codec["sample_rate"]}}},
        "_rnnt_merge_info": {
            "decoder_config": {"prednet": decoder, "vocab_size": audio["decoder"]["vocab_size"],
                               "blank_as_pad": audio["decoder"].get("blank_as_pad", True)},
            "joint_config": {"jointnet": joint, "num_classes": audio["joint"]["num_classes"],
                             "vocabulary": list(flat["rnnt_vocabulary"])}},
        "data": {"source_sample_rate": flat["input_sample_rate"], "target_sample_rate": flat["output_sample_rate"],
                 "frame_length": flat["frame_duration"], "train_ds": {"batch_size": 4}},
    }
    text = dict(flat["text_config"])
    limit = text.get("time_step_limit")
    if limit is not None and not all(abs(v) != float("inf") for v in limit):
        del text["time_step_limit"]  # the unbounded default, which config.json does not spell (no Infinity)
    base = {**{k: v for k, v in text.items() if k != "model_type"}, "model_type": "nemotron_h",
            "architectures": ["NemotronHForCausalLM"], "mamba_state_dim": text["ssm_state_size"],
            "mamba_num_groups": text["n_groups"]}
    return nested, base


# --------------------------------------------------------------------------------------
# Locating the parts


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def is_release_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds NVIDIA's release layout (its config.json is NeMo's nested one)."""
    path = Path(folder) / "config.json"
    return path.exists() and is_release_config(_read_json(path))


def resolve_tokenizer(tokenizer: str | os.PathLike | None = None) -> Path:
    """The folder of the LLM tokenizer: a local folder, or a Hub repo id (only its tokenizer files and
    config.json are fetched); default ``nvidia/NVIDIA-Nemotron-Nano-9B-v2``."""
    try:
        return resolve_checkpoint(NANO_9B_V2 if tokenizer is None else tokenizer, TOKENIZER_FILES)
    except CheckpointError as e:
        raise CheckpointError(f"tokenizer: {e}") from None


def base_config(tokenizer_folder: str | os.PathLike) -> dict[str, Any]:
    """The base LLM's config the mapping reads: the tokenizer folder's config.json (Nemotron-Nano-9B-v2's,
    as the reference reads it; a card's flat config.json gives its ``text_config``), else
    :data:`NANO_9B_V2_BASE`."""
    path = Path(tokenizer_folder) / "config.json"
    if not path.exists():
        return dict(NANO_9B_V2_BASE)
    values = _read_json(path)
    if isinstance(values, dict) and values.get("model_type") == "nemotron_voicechat":
        values = values.get("text_config")
    if not isinstance(values, dict):
        raise CheckpointError(f"{path}: expected the base LLM's config (a JSON object)")
    return values


# --------------------------------------------------------------------------------------
# The checkpoint


class ReleaseCheckpoint(Checkpoint):
    """NVIDIA's release folder, read tensor by tensor.

    As opened, it holds the release's own tensors: float32 as stored, integer buffers in the model's
    dtype, NeMo featurizer buffers the model lacks dropped (as the reference's sanitize drops them).
    :meth:`as_card` makes it the mlx-community card made from it. Keys and shapes are checked against
    the config when it is opened.
    """

    layout_name = "NVIDIA release layout (NeMo nested config.json, float32 model.safetensors)"

    def __init__(self, folder: str | os.PathLike, base: Mapping[str, Any] | None = None):
        folder = Path(folder)
        source = _read_json(folder / "config.json")
        if not is_release_config(source):
            raise CheckpointError(f"{folder / 'config.json'}: not NVIDIA's nested NeMo config (it has a model_type "
                                  "or lacks model.stt / model.speech_generation)")
        try:
            self.runtime = runtime_config(source, NANO_9B_V2_BASE if base is None else base)
            config = VoiceChatConfig.from_dict(self.runtime)
        except ConfigError as e:
            raise ConfigError(f"{folder / 'config.json'} ({self.layout_name}): {e}") from None
        super().__init__(folder, config)
        with torch.device("meta"):
            self.expected = {k: (tuple(t.shape), t.dtype) for k, t in VoiceChatNetworks(config).state_dict().items()}
        self.dropped = sorted(k for k in self.key_to_file if k.startswith(UNUSED_PREFIX) and k not in self.expected)
        for key in self.dropped:
            del self.key_to_file[key]
        self._check_against_config()
        self.packed: dict[str, QuantSpec] = {}
        self.float_dtype: torch.dtype | None = None
        self._cached: tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._build_view()

    def _check_against_config(self) -> None:
        """Shapes first (they name the config field), then the keys either side lacks."""
        where = f"{self.folder} ({self.layout_name})"
        for key, (shape, dtype) in self.expected.items():
            if key not in self.key_to_file:
                continue
            got = super().shape(key)
            if got != shape:
                raise CheckpointError(f"{super().file_of(key)}: '{key}' has shape {list(got)}, but the config "
                                      f"({self.layout_name}) gives {list(shape)}: "
                                      f"{config_field(self.config, key, shape, got)}{_BASE_NOTE}")
            stored = super().stored_dtype(key)
            if dtype.is_floating_point != (stored in ("F32", "BF16", "F16", "F64")):
                raise CheckpointError(f"{super().file_of(key)}: '{key}' is stored as {stored}, the model expects "
                                      f"{dtype}")
        unexpected = sorted(set(self.key_to_file) - set(self.expected))
        if unexpected:
            raise CheckpointError(f"{where}: {len(unexpected)} unexpected tensor(s) the model has no place for: "
                                  f"{', '.join(unexpected[:10])}{_BASE_NOTE}")
        missing = sorted(set(self.expected) - set(self.key_to_file))
        if missing:
            raise CheckpointError(f"{where}: {len(missing)} tensor(s) the model needs are missing: "
                                  f"{', '.join(missing[:10])}{_BASE_NOTE}")

    # ---- the card view
    def as_card(self, specs: Mapping[str, QuantSpec] | None,
                float_dtype: torch.dtype | None = torch.bfloat16) -> "ReleaseCheckpoint":
        """Present the tensors as the mlx-community card made from the release: the ``specs`` modules
        quantized as ``mx.quantize`` quantizes their float32 weights (float32 scales and biases), every
        other float tensor in ``float_dtype`` (None: as stored; A_log stays float32)."""
        for path, spec in (specs or {}).items():
            spec.validate(f"quantization of '{path}'")
            if spec.mode != "affine" or len(self.expected.get(f"{path}.weight", ((),))[0]) != 2:
                raise ValueError(f"'{path}': only 2-D weights quantize, in affine mode (got {spec.mode})")
        self.packed = dict(specs or {})
        self.float_dtype = float_dtype
        specs_used = sorted({(s.bits, s.group_size) for s in self.packed.values()})
        if specs_used:
            bits, group = specs_used[0]
            quant: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
            quant.update({p: {"group_size": s.group_size, "bits": s.bits} for p, s in self.packed.items()
                          if (s.bits, s.group_size) != (bits, group)})
            self.config.quantization = quant
        else:
            self.config.quantization = None
        self._cached = None
        self._build_view()
        return self

    def card_config(self) -> dict[str, Any]:
        """The flat config.json of the card :meth:`as_card` presents (with its quantization)."""
        out = dict(self.runtime)
        if self.config.quantization:
            out["quantization"] = dict(self.config.quantization)
            out["quantization_config"] = dict(self.config.quantization)
        return out

    def _target_dtype(self, key: str) -> torch.dtype:
        shape, dtype = self.expected[key]
        if not dtype.is_floating_point:
            return dtype
        stored = self._source_dtype(key)
        if self.float_dtype is None or (key.endswith(KEEP_FLOAT32) and stored == torch.float32):
            return stored
        return self.float_dtype

    def shape_of_source(self, key: str) -> tuple[int, ...]:
        """The shape of release tensor ``key`` as stored (before :meth:`as_card` packs it)."""
        return super().shape(key)

    def dtype_of_source(self, key: str) -> str:
        """The safetensors dtype of release tensor ``key`` as stored (``F32`` in the release)."""
        return super().stored_dtype(key)

    def _source_dtype(self, key: str) -> torch.dtype:
        stored = super().stored_dtype(key)
        return next(t for t, name in _SAFETENSORS_DTYPES.items() if name == stored)

    def _build_view(self) -> None:
        view: dict[str, tuple[tuple[int, ...], str]] = {}
        for key in self.key_to_file:
            path, _, leaf = key.rpartition(".")
            shape = self.expected[key][0]
            if path in self.packed and leaf == "weight":
                spec, stored = self.packed[path], super().stored_dtype(key)
                view[key] = ((shape[0], shape[1] * spec.bits // 32), "U32")
                view[f"{path}.scales"] = view[f"{path}.biases"] = ((shape[0], shape[1] // spec.group_size), stored)
            else:
                view[key] = (shape, _SAFETENSORS_DTYPES[self._target_dtype(key)])
        self._view = view

    # ---- Checkpoint's interface, on the view
    def keys(self) -> list[str]:
        return sorted(self._view)

    def __contains__(self, key: str) -> bool:
        return key in self._view

    def source_key(self, key: str) -> str:
        path, _, leaf = key.rpartition(".")
        return f"{path}.weight" if path in self.packed and leaf in ("scales", "biases") else key

    def file_of(self, key: str) -> Path:
        return super().file_of(self.source_key(key))

    def shape(self, key: str) -> tuple[int, ...]:
        return self._view[key][0]

    def stored_dtype(self, key: str) -> str:
        return self._view[key][1]

    def get(self, key: str) -> torch.Tensor:
        if key not in self._view:
            raise CheckpointError(f"{self.folder} ({self.layout_name}): no tensor '{key}'")
        path, _, leaf = key.rpartition(".")
        if path in self.packed:
            return self._quantized(path)[("weight", "scales", "biases").index(leaf)]
        shape = self.expected[key][0]
        target = self._target_dtype(key)
        if not shape:
            scalar = super().get(key)
            self.audit.see(key, scalar)
            return self._check_range(key, scalar, target)
        out = torch.empty(shape, dtype=target)
        step = max(1, READ_CHUNK_ELEMENTS // max(1, out[0].numel()))
        rows = self._rows(key)
        for start in range(0, shape[0], step):
            stop = min(start + step, shape[0])
            out[start:stop] = self._check_range(key, rows(start, stop), target)
        return out

    def _rows(self, key: str) -> Callable[[int, int], torch.Tensor]:
        """``rows(start, stop)``: rows of source tensor ``key`` read from the file (positioned reads, never
        mapped), each piece checked for zeros and non-finite values."""
        file = super().file_of(key)
        source = self._files[self.key_to_file[key]]

        def rows(start: int, stop: int) -> torch.Tensor:
            try:
                t = source.read_rows(key, start, stop)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{file}: cannot read '{key}' (truncated or corrupt?): {e}") from None
            self.audit.see(key, t)
            return t

        return rows

    def _check_range(self, key: str, t: torch.Tensor, target: torch.dtype) -> torch.Tensor:
        if not t.is_floating_point() and target != t.dtype and t.numel():
            info = torch.iinfo(target)
            if int(t.min()) < info.min or int(t.max()) > info.max:
                raise CheckpointError(f"{super().file_of(key)}: '{key}' holds values outside {target} "
                                      f"([{int(t.min())}, {int(t.max())}])")
        return t.to(target)

    def _quantized(self, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed weight, scales and biases of ``path`` (the last module's are kept for its next key)."""
        if self._cached is None or self._cached[0] != path:
            self._cached = None  # free the previous module's before quantizing the next
            key, spec = f"{path}.weight", self.packed[path]
            n_rows, n_in = self.expected[key][0]
            packed = mlx_quantize_rows(self._rows(key), n_rows, n_in, spec.bits, spec.group_size,
                                       self._source_dtype(key))
            self._cached = (path, packed)
        return self._cached[1]

    def close(self) -> None:
        self._cached = None
        super().close()
