"""Tiny, structurally faithful VoiceChat configurations and their tokenizer.

Used for the embedded default model of ``python -m nvchat_torch.stream`` (random weights, built
deterministically in code, no download), by the benchmarks (the ``deep`` preset: tiny widths
but the real depth of every network, so a frame runs as many kernels as the 11B model), and by
the tests, whose MLX oracle writes checkpoints of these configurations.
"""

from __future__ import annotations

import copy
import math
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .models.config import FULL_SIZE_TEXT_CONFIG

__all__ = ["SPECIAL_TOKENS", "special_tokens", "WORDS", "RNNT_VOCABULARY", "tiny_config_dict", "build_tokenizer",
           "write_tokenizer", "random_model", "random_packed_model", "pack_affine", "load_tiny_model", "save_checkpoint"]

if TYPE_CHECKING:
    from .model import VoiceChatModel


def special_tokens(count: int = 21) -> list[str]:
    """``<unk>``, ``<s>``, ``</s>``, then ``<SPECIAL_3>`` .. ``<SPECIAL_{count - 1}>`` (11 silence, 12 pad,
    20 start of a tool call); 23 adds the tool-call markers ``<SPECIAL_21>`` and ``<SPECIAL_22>``."""
    return ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, count)]


SPECIAL_TOKENS = special_tokens(21)
WORDS = ["hello", "the", "world", "voice", "chat", "you", "are", "helpful",
         "assistant", "nemotron", "speak", "in", "and", "to"]
RNNT_VOCABULARY = ["<unk>", "<en-US>"] + [f"\u2581{w}" for w in WORDS] + list("abcdehlnorstuw")
CHAR_VOCAB_SIZE = 257  # the byte-level alphabet (256 one-character tokens) + pad


def tiny_config_dict(preset: str = "tiny", *, hidden: int = 64, vocab: int = 320,
                     pattern: str | None = None) -> dict[str, Any]:
    """A config.json dict. ``preset``: "tiny" (2 Conformer, 8 LLM, 2 TTS layers) or "deep"
    (24 Conformer layers, the real 56-layer LLM pattern, 28 TTS layers, 3 codec blocks per stage)."""
    if preset not in ("tiny", "deep"):
        raise ValueError(f"preset must be 'tiny' or 'deep', got {preset!r}")
    deep = preset == "deep"
    pattern = pattern or (FULL_SIZE_TEXT_CONFIG["hybrid_override_pattern"] if deep else "M-M*-MM-")
    text = copy.deepcopy(FULL_SIZE_TEXT_CONFIG)
    text.update(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                ssm_state_size=16, conv_kernel=4, hybrid_override_pattern=pattern,
                num_hidden_layers=len(pattern))  # max_position_embeddings as the real model: 131072
    n_rnnt = len(RNNT_VOCABULARY)
    return {
        "model_type": "nemotron_voicechat",
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "text_config": text,
        "audio_config": {
            "preprocessor": {"sample_rate": 16000, "features": 128, "n_fft": 512, "window_size": 0.025,
                             "window_stride": 0.01, "window": "hann", "preemph": 0.97, "dither": 1e-05,
                             "normalize": "NA", "pad_to": 0, "pad_value": 0.0},
            "encoder": {"feat_in": 128, "n_layers": 24 if deep else 2, "d_model": 32, "n_heads": 4,
                        "ff_expansion_factor": 4, "subsampling_factor": 8, "subsampling_conv_channels": 16,
                        "conv_kernel_size": 9, "causal_downsampling": True, "conv_context_size": "causal",
                        "conv_norm_type": "layer_norm", "self_attention_model": "rel_pos",
                        "att_context_style": "chunked_limited", "att_context_size": [[70, 0]],
                        "pos_emb_max_len": 5000, "use_bias": False, "xscaling": False},
            "decoder": {"pred_hidden": 16, "pred_rnn_layers": 2, "vocab_size": n_rnnt, "blank_as_pad": True},
            "joint": {"joint_hidden": 24, "activation": "relu", "encoder_hidden": 32, "pred_hidden": 16,
                      "num_classes": n_rnnt},
            "output_dim": hidden,
            "max_symbols": 10,
        },
        "tts_config": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 28 if deep else 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 7500,
            "sliding_window_pattern": 6 if deep else 2, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256.0,
            "rope_global_base_freq": 1000000.0, "rope_local_base_freq": 10000.0, "latent_size": 16,
            "num_quantizers": 31, "codebook_size": 1024, "num_delay_speech_tokens": 2, "num_iterations": 8,
            "exponent": 3.0, "guidance_scale": 0.2, "top_p": 0.95, "noise_scale": 0.001,
            "disable_eos_prediction": True, "use_gated_fusion_for_text_audio": True,
            "use_subword_flag_emb": True, "use_bos_eos_emb": True, "use_audio_prompt_frozen_projection": True,
            "audio_prompt_duration": 3.0,
            "character_encoder": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                                  "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256.0,
                                  "attn_logit_softcapping": 50.0, "rope_base": 10000.0,
                                  "char_vocab_size": CHAR_VOCAB_SIZE},
            "mog_head": {"intermediate_size": 128, "low_rank": 4, "min_log_std": -4.0, "num_layers": 3,
                         "num_predictions": 16, "eps": 1e-6},
        },
        "codec_config": {"sample_rate": 22050, "base_channels": 8, "channel_multipliers": [1, 2, 4],
                         "downsample_rates": [7, 7, 9], "blocks_per_stage": 3 if deep else 2,
                         "block_kernel_size": 7, "latent_dim": 16, "n_fft": 16, "hop_length": 4,
                         "num_quantizers": 31, "codebook_size": 1024},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 12, "silence_token_id": 11,
        "rnnt_blank_id": n_rnnt, "input_sample_rate": 16000, "output_sample_rate": 22050,
        "frame_duration": 0.08, "function_channel_weight": 2.0, "default_system_prompt": "",
        "speaker": "Aria", "rnnt_vocabulary": list(RNNT_VOCABULARY),
    }


def build_tokenizer(size: int = 300, specials: int = 21):
    """A byte-level BPE ``tokenizers.Tokenizer``: ids 0..specials-1 special tokens, then the 256 byte
    characters (so the character encoder has its 256 + 1 characters), then merges of WORDS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    special = special_tokens(specials)
    vocab = {t: i for i, t in enumerate(special)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    for word in WORDS:
        for w in ("\u0120" + word, word):
            cur = w[0]
            for ch in w[1:]:
                if len(vocab) >= size:
                    break
                new = cur + ch
                if new not in vocab:
                    vocab[new] = len(vocab)
                    merges.append((cur, ch))
                cur = new
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "pad_token": "<SPECIAL_12>", "add_bos_token": False, "add_eos_token": False,
    "clean_up_tokenization_spaces": False, "model_max_length": 131072, "fix_mistral_regex": True,
}
SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<SPECIAL_12>"}


def write_tokenizer(folder: Path, size: int = 300, specials: int = 21) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the vocabulary."""
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(size, specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS_MAP, indent=2) + "\n")
    return tok.get_vocab()


# --------------------------------------------------------------------------------------
# Random-weight models and writing them as mlx-community checkpoints


def _hf_tokenizer(size: int = 300):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(size), **SPECIAL_TOKENS_MAP)


def _random_value(name: str, p: torch.Tensor, noise: torch.Tensor, embedding: bool) -> torch.Tensor | None:
    """The random value of parameter ``name`` (initial value ``p``) from standard normal ``noise``;
    None for A_log, which keeps log(1..H). ``embedding``: its module is an ``nn.Embedding``."""
    leaf = name.rpartition(".")[2]
    if leaf == "A_log":
        return None
    if p.dim() == 0:
        return (p + 0.1 * noise).abs() if leaf == "variance" else p + 0.1 * noise
    if p.dim() == 1:
        if leaf in ("gate", "bos_emb", "null_emb"):
            return 0.5 * noise
        if leaf in ("weight", "D", "dt_bias"):
            return p + 0.1 * noise
        return 0.1 * noise
    if embedding or leaf == "Aria":
        return 0.5 * noise
    if leaf == "rvq_embs":
        return noise * 0.8 ** torch.arange(p.shape[0], device=noise.device).view(-1, 1, 1)
    if ".mus_list" in name:
        return noise * 0.8 ** int(leaf)
    if leaf in ("low_mat", "pos_bias_u", "pos_bias_v"):
        return noise / math.sqrt(p.shape[-1])
    return noise / math.sqrt(p[0].numel())


def _set_tts_buffers_(tts, config, vocabulary: dict[str, int]) -> None:
    """The checkpoint buffers of a SpeechDecoder (float32 weights): continuation and BOS/EOS flags from
    ``vocabulary``, control codes, and the codec's own silence codes."""
    sub = tts.tts_model.embed_subword
    cont = torch.zeros_like(sub.subword_flag_emb.is_continuation)
    for token, idx in vocabulary.items():
        if token not in SPECIAL_TOKENS and not token.startswith("\u0120"):
            cont[idx] = 1
    sub.subword_flag_emb.is_continuation.copy_(cont)
    flags = torch.zeros_like(sub.bos_eos_emb.special_flags)
    flags[config.bos_token_id], flags[config.eos_token_id] = 1, 2
    sub.bos_eos_emb.special_flags.copy_(flags)
    tts._control_codes.copy_(torch.tensor([8, 1020, 1023], dtype=torch.int32))
    silence = torch.zeros(1, 1, 2 * tts.audio_codec.samples_per_frame, device=cont.device)
    tts.codec_silence_tokens.copy_(tts.audio_codec.encode(silence)[0, :, -1].to(torch.int32))


@torch.no_grad()
def randomize_(model, seed: int = 0, vocabulary: dict[str, int] | None = None) -> None:
    """Give ``model`` (a VoiceChatModel on the CPU) reproducible random weights of sensible scale.

    Matrices get N(0, 1/fan_in), embeddings and speaker latents 0.5 N(0, 1), norms and other vectors
    their initial value + 0.1 N(0, 1), codebooks N(0, 0.8^q), A_log keeps log(1..H); then the
    checkpoint buffers: continuation and BOS/EOS flags from ``vocabulary``, control codes, the codec's
    own silence codes, and a bias towards the RNNT blank (a sparse transcript).
    """
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    embeddings = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, device=device)
        value = _random_value(name, p, noise, name.rpartition(".")[0] in embeddings)
        if value is not None:
            p.copy_(value)
    _set_tts_buffers_(model.tts_model, model.config, vocabulary or build_tokenizer().get_vocab())
    model.stt_model.rnnt_joint.joint_net[2].bias[-1] += 2.0


def random_model(preset: str = "tiny", seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, *, bits: int | None = None, group_size: int = 64,
                 **config_kwargs):
    """A VoiceChatModel with random weights (unprepared), with its tokenizer.

    ``preset``: "tiny", "deep" (tiny widths, real depths) or "full" (the 11B configuration).

    Without ``bits`` every weight is float32 (then ``dtype``), initialised on ``device`` all at once:
    for "full" that is 44 GB, for a large GPU. With ``bits`` the model has the layout of the
    mlx-community cards, as :func:`~nvchat_torch.load_model` returns it unprepared (see
    :func:`random_packed_model`): 4-bit "full" peaks near its packed size of about 9 GB.
    """
    from .model import VoiceChatModel
    from .models.config import VoiceChatConfig

    if preset == "full":
        config = VoiceChatConfig.full_size()
    else:
        config = VoiceChatConfig.from_dict(tiny_config_dict(preset, **config_kwargs))
    tokenizer = _hf_tokenizer()
    if bits is not None:
        model = random_packed_model(config, bits, group_size, seed, tokenizer.get_vocab(), device, dtype)
    else:
        with torch.device(device), torch.no_grad():
            model = VoiceChatModel(config)
        randomize_(model, seed, tokenizer.get_vocab())
        if dtype is not None:
            model = model.to(dtype)
        model.eval().requires_grad_(False)
    model.set_tokenizer(tokenizer)
    model.source = f"embedded {preset} model (random weights, seed {seed}{f', {bits}-bit' if bits else ''})"
    return model


# --------------------------------------------------------------------------------------
# Packed random models, one module at a time

PACK_ELEMENTS = 1 << 22  # float32 elements quantized at once: bounds the packing temporaries (~50 MB)


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per tensor, so a tensor's values do not depend on the order the model is built in.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def pack_affine(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant.quantize_affine``'s encoding (same codes, scales and biases), packing whole bytes for
    2, 4 and 8 bits instead of a bit stream: ~7x faster, which matters for 9.5 B weights."""
    from .models.quant import affine_codes, quantize_affine

    *lead, n_in = w.shape
    if 8 % bits or n_in % group_size or (n_in * bits) % 32:
        return quantize_affine(w, bits, group_size)
    q, scale, lo = affine_codes(w, bits, group_size)
    q = q.reshape(*lead, n_in * bits // 8, 8 // bits)
    packed = q[..., 0]
    for j in range(1, 8 // bits):  # element j of a byte in its bits [j*bits, (j+1)*bits): LSB first
        packed = packed | (q[..., j] << (j * bits))
    words = packed.reshape(*lead, n_in * bits // 32, 4).contiguous().view(torch.int32).squeeze(-1).view(torch.uint32)
    return words, scale.to(w.dtype), lo.to(w.dtype)


def _pack_rows(rows, n_rows: int, n_in: int, spec) -> dict[str, torch.Tensor]:
    """``weight``/``scales``/``biases`` (float32) of the matrix whose rows ``rows(start, stop)`` gives,
    quantized PACK_ELEMENTS at a time."""
    step = max(1, PACK_ELEMENTS // n_in)
    parts = [pack_affine(rows(i, min(i + step, n_rows)), spec.bits, spec.group_size) for i in range(0, n_rows, step)]
    return {name: torch.cat([p[k] for p in parts]) for k, name in enumerate(("weight", "scales", "biases"))}


@torch.no_grad()
def _assign_unit(model, prefix: str, twin: torch.nn.Module, specs: dict, seed: int, stored: torch.dtype,
                 device: torch.device, finish=None) -> None:
    """Randomize ``twin`` (module ``prefix`` of ``model``, built on the CPU by its own constructor, so
    its buffers and initial values are real), then move its tensors into the meta ``model`` in
    checkpoint layout: the ``specs`` modules packed with float32 scales, other floats in ``stored``
    (A_log float32). Each float32 tensor is dropped as soon as it is converted."""
    from .loading.checkpoint import KEEP_FLOAT32

    embeddings = {name for name, m in twin.named_modules() if isinstance(m, torch.nn.Embedding)}
    for name, p in twin.named_parameters():
        full = f"{prefix}.{name}"
        value = _random_value(full, p, torch.randn(p.shape, generator=_generator(seed, full)),
                              name.rpartition(".")[0] in embeddings)
        if value is not None:
            p.copy_(value)
    if finish is not None:
        finish(twin)
    packed = {path[len(prefix) + 1:]: spec for path, spec in specs.items() if path.startswith(prefix + ".")}
    state = {}
    for key, t in twin.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        if owner in packed and leaf == "weight":
            w = t.detach()
            tensors = _pack_rows(lambda i, j: w[i:j], w.shape[0], w.shape[1], packed[owner])
            state.update({f"{owner}.{k}": v.to(device) for k, v in tensors.items()})
        elif t.is_floating_point():
            keep32 = leaf in KEEP_FLOAT32
            state[key] = t.detach().to(device, torch.float32 if keep32 else stored, copy=True)
        else:
            state[key] = t.detach().to(device, copy=True)
        t.data = t.data.new_empty(0)
    model.get_submodule(prefix).load_state_dict(state, strict=True, assign=True)


@torch.no_grad()
def _assign_packed_matrix(model, path: str, spec, seed: int, device: torch.device) -> None:
    """A packed vocabulary matrix, made PACK_ELEMENTS random values at a time (never whole in float32)."""
    from .models.quant import QuantizedEmbedding

    module = model.get_submodule(path)
    if isinstance(module, QuantizedEmbedding):
        n_rows, n_in, std = module.num_embeddings, module.embedding_dim, 0.5
    else:
        n_rows, n_in, std = module.out_features, module.in_features, 1 / math.sqrt(module.in_features)
    g = _generator(seed, f"{path}.weight")
    tensors = _pack_rows(lambda i, j: torch.randn(j - i, n_in, generator=g) * std, n_rows, n_in, spec)
    state = {k: v.to(device) for k, v in tensors.items()}
    if getattr(module, "bias", None) is not None:
        state["bias"] = torch.zeros(n_rows, device=device)
    module.load_state_dict(state, strict=True, assign=True)


@torch.no_grad()
def random_packed_model(config, bits: int = 4, group_size: int = 64, seed: int = 0,
                        vocabulary: dict[str, int] | None = None, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None):
    """A random ``config`` model in the layout of the mlx-community ``bits`` cards, as
    :func:`~nvchat_torch.load_model` returns it with ``prepare=False``: LLM and vocabulary matrices
    packed (MLX affine, float32 scales), every other float weight bf16 (A_log float32), float32
    activations; with ``dtype``, other weights and activations in ``dtype`` instead.

    Built one module at a time, as a checkpoint loads: the tree is made on ``meta``, then each LLM
    layer (and each other network) is made on the CPU by its own constructor, randomized per tensor
    as :func:`randomize_` does (deterministic by ``seed``), packed or cast, and assigned into the
    tree. No more than one module is ever in float32 (the TTS, about 4 GB for the 11B shapes, before
    anything else exists), so the 11B model peaks near its packed size.
    """
    from .model import build_model, mlx_community_specs
    from .models.nemotron_h import NemotronHBlock, RMSNorm
    from .models.perception import Perception
    from .models.quant import QuantizedEmbedding
    from .models.rnnt import RnntDecoder, RnntJoint
    from .models.tts import SpeechDecoder

    device = torch.device(device)
    specs = mlx_community_specs(build_model(config), bits, group_size)
    model = build_model(config, "meta", specs, dtype)
    vocabulary = vocabulary or build_tokenizer().get_vocab()
    text, audio = config.text_config, config.audio_config
    stored = dtype or torch.bfloat16

    def unit(prefix: str, make, finish=None) -> None:
        with torch.device("cpu"):
            twin = make()
        _assign_unit(model, prefix, twin, specs, seed, stored, device, finish)

    def boost_blank(joint) -> None:  # a sparse transcript, as randomize_
        joint.joint_net[2].bias[-1] += 2.0

    unit("tts_model", lambda: SpeechDecoder(config.tts_config, config.codec_config,
                                            pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id),
         lambda tts: _set_tts_buffers_(tts, config, vocabulary))
    unit("stt_model.perception", lambda: Perception(audio))
    unit("stt_model.rnnt_decoder", lambda: RnntDecoder(audio.decoder))
    unit("stt_model.rnnt_joint", lambda: RnntJoint(audio.joint), boost_blank)
    for i, block_type in enumerate(text.hybrid_override_pattern):
        unit(f"stt_model.llm.layers.{i}", lambda: NemotronHBlock(text, block_type))
    unit("stt_model.llm.norm_f", lambda: RMSNorm(text.hidden_size, text.layer_norm_epsilon))
    for path in ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"):
        if path in specs:
            _assign_packed_matrix(model, path, specs[path], seed, device)
        else:
            unit(path, lambda: copy.deepcopy(model.get_submodule(path)).to_empty(device="cpu"))
    for module in model.modules():  # MLX dequantizes to the scales' dtype (as load_model)
        if dtype is None and isinstance(module, QuantizedEmbedding):
            module.output_dtype = module.scales.dtype
    model.set_activation_dtype(dtype or torch.float32)
    model.init_constants(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"random_packed_model left {len(left)} tensor(s) unmade, e.g. {', '.join(left[:3])}")
    return model.eval().requires_grad_(False)


def load_tiny_model(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    preset: str = "tiny", seed: int = 0, prepare: bool = True,
                    compile: bool | str = False) -> "VoiceChatModel":
    """The embedded default: a tiny VoiceChat with random weights, built deterministically in code.

    Its outputs are noise, but every stage of the real pipeline runs, so it shows the API, the
    command line and the frame loop without a download. ``compile``: as :func:`~nvchat_torch.load_model`'s.
    """
    from .model import check_dtype, compiled, default_device

    device = default_device() if device is None else torch.device(device)
    check_dtype(dtype)
    model = random_model(preset, seed).to(device=device, dtype=dtype)  # made on the CPU: same weights anywhere
    model.set_activation_dtype(dtype or torch.float32)
    model.init_constants(device)
    return compiled(model.prepare() if prepare else model, compile)


def save_checkpoint(model, folder: str | Path, bits: int | None = None, group_size: int = 64,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write an unprepared VoiceChatModel as an mlx-community checkpoint folder (what mlx-vlm reads).

    ``bits`` quantizes what the real checkpoints quantize (every Linear/Embedding of the LLM and the
    vocabulary matrices, MLX affine, ``group_size``); other float tensors are stored in ``dtype``.
    """
    import json

    from safetensors.torch import save_file

    from .model import mlx_community_specs
    from .models.quant import quantize_affine

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    quantized = set(mlx_community_specs(model, bits, group_size)) if bits else set()
    tensors = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        t = t.detach().cpu()
        if owner in quantized and leaf == "weight":
            wq, scales, biases = quantize_affine(t.to(dtype), bits, group_size)
            tensors[key], tensors[f"{owner}.scales"], tensors[f"{owner}.biases"] = wq, scales, biases
        else:
            keep32 = leaf == "A_log"
            tensors[key] = t.to(torch.float32 if keep32 else dtype) if t.is_floating_point() else t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {k: "model.safetensors" for k in sorted(tensors)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_card_files(model, folder, bits, group_size)
    return folder


def write_card_files(model, folder: str | Path, bits: int | None = None, group_size: int = 64) -> None:
    """A card's files beside its shards: the flat ``config.json`` (with the quantization map when
    ``bits``), the LLM tokenizer and ``rnnt_tokenizer/vocab.json``."""
    import json

    folder = Path(folder)
    config = model.config.to_dict()
    if bits:
        config["quantization"] = config["quantization_config"] = {"group_size": group_size, "bits": bits,
                                                                  "mode": "affine"}
    config["architectures"] = ["NemotronVoiceChatForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.tokenizer.save_pretrained(str(folder))
    rnnt = folder / "rnnt_tokenizer"
    rnnt.mkdir(exist_ok=True)
    (rnnt / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(model.config.rnnt_vocabulary)},
                                                ensure_ascii=False, indent=1) + "\n")
