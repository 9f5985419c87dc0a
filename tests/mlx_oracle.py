"""The MLX reference as a test oracle.

Writes tiny, random, structurally faithful NemotronLabs VoiceChat checkpoints in the
mlx-community on-disk layout *with the MLX reference itself* (mlx-vlm builds the model,
quantizes it with its own quantizer, and the shards are converted to the on-disk
PyTorch/NeMo layout, the inverse of mlx-vlm's ``Model.sanitize``), and runs the reference on
them. Needs the ``parity`` extra (mlx, mlx-vlm, mlx-audio); nothing here is copied from those
packages, it only calls them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from nvchat_torch.models.config import FULL_SIZE_TEXT_CONFIG as REAL_TEXT_CONFIG
from nvchat_torch.tiny import RNNT_VOCABULARY as RNNT_VOCAB
from nvchat_torch.tiny import special_tokens, tiny_config_dict, write_tokenizer

VOCAB_MODULES = ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head")


@dataclass
class TinySpec:
    """What to build. ``bits``: None (float), 2..8 (affine) or 4/8 with ``mode`` mx/nv fp."""

    seed: int = 0
    bits: int | None = None
    mode: str = "affine"
    group_size: int = 64
    dtype: str = "float32"  # of every float tensor (and of scales/biases, unless scales_dtype says otherwise)
    # "float32": quantize from float32 weights and keep the scales/biases float32, everything else in
    # ``dtype``: the layout of the real 4-bit and 8-bit cards (their sizes fit float32 scales).
    scales_dtype: str = "same"
    preset: str = "tiny"  # "deep": tiny widths, real depths
    pattern: str = "M-M*-MM-"
    hidden: int = 64
    vocab: int = 320
    tokenizer_size: int = 300
    max_shard_kb: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)  # module path -> {bits, group_size[, mode]} | False
    control_codes: tuple[int, ...] = (8, 1020, 1023)
    rnnt_blank_boost: float = 2.0
    conformer_bias: bool = False
    specials: int = 21  # 23: the tokenizer has the tool-call markers <SPECIAL_20..22>

    def key(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, default=str)


# --------------------------------------------------------------------------------------
# Writing checkpoints


def tiny_config(spec: TinySpec) -> dict:
    config = tiny_config_dict(spec.preset, hidden=spec.hidden, vocab=spec.vocab,
                              pattern=None if spec.pattern == "M-M*-MM-" else spec.pattern)
    config["audio_config"]["encoder"]["use_bias"] = spec.conformer_bias
    return config


def _randomize(model, seed: int, tok_vocab: dict, spec: TinySpec) -> None:
    rng = np.random.default_rng(seed)
    mods = dict(model.named_modules())
    new = []
    for key, v in tree_flatten(model.parameters()):
        owner, _, name = key.rpartition(".")
        shape = tuple(v.shape)
        if not mx.issubdtype(v.dtype, mx.floating):
            new.append((key, v))
            continue
        n = rng.standard_normal(shape).astype(np.float32)
        base = np.array(v, dtype=np.float32)
        if "A_log" in key:
            val = base
        elif v.ndim == 0:
            val = np.abs(base + 0.1 * n) if "variance" in key else base + 0.1 * n
        elif v.ndim == 1:
            if name in ("weight", "D", "dt_bias"):
                val = base + 0.1 * n
            elif name in ("gate", "bos_emb", "null_emb"):
                val = 0.5 * n
            else:
                val = 0.1 * n
        elif isinstance(mods.get(owner), nn.Embedding) or name == "Aria":
            val = 0.5 * n
        elif key.endswith("rvq_embs"):
            val = n * (0.8 ** np.arange(shape[0]))[:, None, None]
        elif ".prvq.mus_list." in key:
            val = n * 0.8 ** int(key.rsplit(".", 1)[1])
        elif name in ("low_mat", "pos_bias_u", "pos_bias_v"):
            val = n / np.sqrt(shape[-1])
        else:
            val = n / np.sqrt(float(np.prod(shape[1:])))
        new.append((key, mx.array(val).astype(v.dtype)))
    model.update(tree_unflatten(new))

    tts = model.tts_model
    sub = tts.tts_model.embed_subword
    cont = np.zeros(sub.subword_flag_emb.is_continuation.shape, np.int32)
    specials = set(special_tokens(spec.specials))
    for tok, idx in tok_vocab.items():
        if tok not in specials and not tok.startswith("\u0120"):
            cont[idx] = 1
    sub.subword_flag_emb.is_continuation = mx.array(cont)
    flags = np.zeros(sub.bos_eos_emb.special_flags.shape, np.int32)
    flags[1], flags[2] = 1, 2
    sub.bos_eos_emb.special_flags = mx.array(flags)
    tts.control_codes = mx.array(list(spec.control_codes), dtype=mx.int32)
    out_layer = model.stt_model.rnnt_joint.joint_net[2]  # favour blank: a sparse transcript
    out_layer.bias = out_layer.bias + mx.array(
        np.eye(out_layer.bias.shape[0], dtype=np.float32)[-1] * spec.rnnt_blank_boost)
    r = tts.audio_codec.waveform_to_token_ratio
    codes = tts.audio_codec.encode(mx.zeros((1, 1, 2 * r)))
    tts.codec_silence_tokens = codes[0, :, -1].astype(mx.int32)
    mx.eval(model.parameters())


def _is_codec_transpose(sub: str, blocks_per_stage: int, n_stages: int) -> bool:
    index = int(sub.split(".")[2])
    width = blocks_per_stage + 1
    return index < width * n_stages and index % width == 0 and "dwconv" not in sub


def to_disk_layout(params: dict, config, lstm_bias_split) -> dict:
    """MLX in-memory parameters -> the on-disk (NeMo/PyTorch) layout (inverse of ``Model.sanitize``)."""
    out = {}
    codec_cfg = config.codec_config
    for key, v in params.items():
        if key.startswith("stt_model.rnnt_decoder.") and ".dec_rnn.lstm." in key:
            stem, rest = key.rsplit(".dec_rnn.lstm.", 1)
            layer, name = rest.split(".")
            base = f"{stem}.dec_rnn.lstm."
            if name == "Wx":
                out[f"{base}weight_ih_l{layer}"] = v
            elif name == "Wh":
                out[f"{base}weight_hh_l{layer}"] = v
            else:
                out[f"{base}bias_ih_l{layer}"], out[f"{base}bias_hh_l{layer}"] = lstm_bias_split(v)
            continue
        if key == "tts_model.control_codes":
            out["tts_model._control_codes"] = v
            continue
        if key.startswith("tts_model.audio_codec."):
            sub = key[len("tts_model.audio_codec."):].replace("prvq.variance_list.", "prvq._variance_list.")
            if sub.endswith(".weight") and v.ndim == 3:
                if sub.startswith("decoder.layers.") and _is_codec_transpose(
                        sub, codec_cfg.blocks_per_stage, len(codec_cfg.downsample_rates)):
                    v = v.transpose(2, 0, 1)
                else:
                    v = v.transpose(0, 2, 1)
            out["tts_model.audio_codec." + sub] = v
            continue
        if key.startswith("stt_model.perception.") and v.ndim == 4:
            v = v.transpose(0, 3, 1, 2)
        elif v.ndim == 3 and (key.startswith("stt_model.perception.")
                              or ("stt_model.llm." in key and ".conv1d.weight" in key)):
            v = v.transpose(0, 2, 1)
        out[key] = v
    pre = config.audio_config.preprocessor  # NeMo featurizer buffers, dropped by the reference
    out["stt_model.perception.preprocessor.featurizer.window"] = mx.zeros((pre.win_length,), dtype=mx.float32)
    out["stt_model.perception.preprocessor.featurizer.fb"] = mx.zeros((1, pre.features, pre.n_fft // 2 + 1),
                                                                       dtype=mx.float32)
    return out


def write_safetensors(out: Path, weights: dict, max_shard_bytes: int | None) -> list[str]:
    keys = sorted(weights)
    shards, cur, size = [], {}, 0
    for k in keys:
        nb = weights[k].nbytes
        if max_shard_bytes and cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = weights[k]
        size += nb
    shards.append(cur)
    n = len(shards)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if n > 1 else "model.safetensors"
    index = {"metadata": {"total_size": int(sum(w.nbytes for w in weights.values()))}, "weight_map": {}}
    for i, shard in enumerate(shards):
        name = fmt.format(i + 1, n)
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        for k in shard:
            index["weight_map"][k] = name
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [fmt.format(i + 1, n) for i in range(n)]


def build_tiny_checkpoint(out: Path, spec: TinySpec) -> Path:
    """Write a random VoiceChat checkpoint described by ``spec`` into ``out`` (with the MLX reference).

    The configuration and tokenizer are nvchat_torch's tiny presets; the weights are made, quantized
    and saved by MLX (mlx-vlm's model, its quantizer, ``mx.save_safetensors``)."""
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig
    from mlx_vlm.quant_utils import quantize_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = write_tokenizer(out, spec.tokenizer_size, spec.specials)
    config = tiny_config(spec)
    mx.random.seed(spec.seed)
    model = Model(ModelConfig.from_dict(config))
    _randomize(model, spec.seed, tok_vocab, spec)
    def cast_floats(skip_scales: bool) -> None:
        dt, cast = getattr(mx, spec.dtype), model.cast_predicate
        model.update(tree_unflatten([
            (k, v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating)
             and not (skip_scales and k.endswith((".scales", ".biases"))) else v)
            for k, v in tree_flatten(model.parameters())]))

    scales_f32 = spec.scales_dtype == "float32" and spec.dtype != "float32" and spec.bits is not None
    if spec.dtype != "float32" and not scales_f32:
        cast_floats(skip_scales=False)
    if spec.bits is not None:
        def predicate(path, module):
            if path in spec.overrides:
                return spec.overrides[path]
            return path.startswith("stt_model.llm.") or path in VOCAB_MODULES
        model, config = quantize_model(model, config, spec.group_size, spec.bits, mode=spec.mode,
                                       quant_predicate=predicate)
    if scales_f32:
        cast_floats(skip_scales=True)
    params = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(spec.seed + 1)

    def split_bias(b):  # torch's LSTM keeps two biases; the reference sums them
        half = mx.array(rng.standard_normal(b.shape).astype(np.float32) * 0.05).astype(b.dtype)
        return b - half, half

    disk = to_disk_layout(params, model.config, split_bias)
    mx.eval(disk)
    write_safetensors(out, disk, spec.max_shard_kb * 1024 or None)
    _dump(out / "config.json", config)
    (out / "rnnt_tokenizer").mkdir(exist_ok=True)
    _dump(out / "rnnt_tokenizer" / "vocab.json", {t: i for i, t in enumerate(RNNT_VOCAB)})
    return out


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------
# Running the reference


class Reference:
    """The MLX reference loaded from a checkpoint folder by ``mlx_vlm.utils.load``."""

    def __init__(self, path: str | Path, deterministic: bool = True):
        from mlx_vlm.utils import load

        self.path = Path(path)
        self.model, self.processor = load(str(path))
        self.session = self.model.create_session(self.processor)
        self.tokenizer = self.session.tokenizer
        tcfg = self.model.tts_model.tts_model.config
        if deterministic:  # the most likely MoG component, no noise
            tcfg.noise_scale, tcfg.top_p = 0.0, 1e-9

    def params(self) -> dict[str, np.ndarray]:
        """Every parameter after the reference's own sanitize, as numpy (float32 for floats)."""
        out = {}
        for k, v in tree_flatten(self.model.parameters()):
            out[k] = np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
        return out


def to_np(x) -> np.ndarray:
    if isinstance(x, mx.array):
        if mx.issubdtype(x.dtype, mx.floating) and x.dtype != mx.float32:
            x = x.astype(mx.float32)
        return np.array(x)
    return np.asarray(x)


def synth_audio(seconds: float, seed: int = 1234, sr: int = 16000) -> np.ndarray:
    """Deterministic test signal: tone bursts + a chirp + low noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sr)), dtype=np.float64) / sr
    x = np.zeros_like(t)
    for i, f in enumerate((220.0, 440.0, 660.0, 880.0)):
        seg = (t >= 0.2 + 0.45 * i) & (t < 0.55 + 0.45 * i)
        x[seg] += 0.3 * np.sin(2 * np.pi * f * t[seg])
    f0, f1 = 200.0, 3000.0
    x += 0.15 * np.sin(2 * np.pi * (f0 * t + 0.5 * (f1 - f0) / seconds * t * t))
    x += 0.01 * rng.standard_normal(t.shape)
    return x.astype(np.float32)


# --------------------------------------------------------------------------------------
# Full-size manifests (key -> shape, dtype), built lazily by mlx-vlm: no weight materialized


_MANIFESTS: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}


def full_size_manifest(kind: str = "bf16") -> dict[str, tuple[tuple[int, ...], str]]:
    """On-disk key -> (shape, dtype) of the full-size 11B checkpoint; ``kind`` in bf16, 8bit, 4bit.

    The model is instantiated lazily by mlx-vlm from its defaults plus the Nemotron-Nano-9B-v2
    text config, quantized ("LLM + vocabulary heads") by mlx-vlm's own quantizer, and converted
    to the on-disk layout; nothing is evaluated, so this takes seconds.
    """
    if kind in _MANIFESTS:
        return _MANIFESTS[kind]
    from mlx_vlm.models.nemotron_voicechat import Model, ModelConfig
    from mlx_vlm.quant_utils import quantize_model

    # The RNNT sizes must be explicit: from an empty audio_config mlx-vlm would take mlx-audio's
    # stand-alone ASR default (13087 classes), while VoiceChat's RNNT has 1024 pieces + blank.
    cfg = {"model_type": "nemotron_voicechat", "text_config": dict(REAL_TEXT_CONFIG),
           "audio_config": {"decoder": {"vocab_size": 1024}, "joint": {"num_classes": 1024}},
           "rnnt_vocabulary": [f"tok{i}" for i in range(1024)]}
    model = Model(ModelConfig.from_dict(cfg))
    cast = model.cast_predicate
    model.update(tree_unflatten([(k, v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating)
                                  else v) for k, v in tree_flatten(model.parameters())]))
    if kind != "bf16":
        bits = {"8bit": 8, "4bit": 4}[kind]
        model, _ = quantize_model(model, dict(cfg), 64, bits, mode="affine",
                                  quant_predicate=lambda p, m: p.startswith("stt_model.llm.") or p in VOCAB_MODULES)
    params = dict(tree_flatten(model.parameters()))
    disk = to_disk_layout(params, model.config, lambda b: (b, b))
    out = {}
    for k, v in disk.items():
        dt = str(v.dtype).replace("mlx.core.", "")
        if ".preprocessor." in k:
            dt = "bfloat16"
        out[k] = (tuple(v.shape), dt)
    _MANIFESTS[kind] = out
    return out
