"""Tiny, structurally faithful VoiceChat configurations and their tokenizer.

Used for the embedded default model of ``python -m nvchat_torch.stream`` (random weights, built
deterministically in code, no download), by the benchmarks (the ``deep`` preset: tiny widths
but the real depth of every network, so a frame runs as many kernels as the 11B model), and by
the tests, whose MLX oracle writes checkpoints of these configurations.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from .config import FULL_SIZE_TEXT_CONFIG

__all__ = ["SPECIAL_TOKENS", "special_tokens", "WORDS", "RNNT_VOCABULARY", "tiny_config_dict", "build_tokenizer",
           "write_tokenizer", "random_model", "load_tiny_model", "save_checkpoint"]


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
        owner, _, leaf = name.rpartition(".")
        noise = torch.randn(p.shape, generator=g, device=device)
        if leaf == "A_log":
            continue
        if p.dim() == 0:
            value = (p + 0.1 * noise).abs() if leaf == "variance" else p + 0.1 * noise
        elif p.dim() == 1:
            if leaf in ("gate", "bos_emb", "null_emb"):
                value = 0.5 * noise
            elif leaf in ("weight", "D", "dt_bias"):
                value = p + 0.1 * noise
            else:
                value = 0.1 * noise
        elif owner in embeddings or leaf == "Aria":
            value = 0.5 * noise
        elif leaf == "rvq_embs":
            value = noise * 0.8 ** torch.arange(p.shape[0], device=device).view(-1, 1, 1)
        elif ".mus_list" in name:
            value = noise * 0.8 ** int(leaf)
        elif leaf in ("low_mat", "pos_bias_u", "pos_bias_v"):
            value = noise / math.sqrt(p.shape[-1])
        else:
            value = noise / math.sqrt(p[0].numel())
        p.copy_(value)
    tts = model.tts_model
    sub = tts.tts_model.embed_subword
    vocabulary = vocabulary or build_tokenizer().get_vocab()
    cont = torch.zeros_like(sub.subword_flag_emb.is_continuation)
    for token, idx in vocabulary.items():
        if token not in SPECIAL_TOKENS and not token.startswith("\u0120"):
            cont[idx] = 1
    sub.subword_flag_emb.is_continuation.copy_(cont)
    flags = torch.zeros_like(sub.bos_eos_emb.special_flags)
    flags[model.config.bos_token_id], flags[model.config.eos_token_id] = 1, 2
    sub.bos_eos_emb.special_flags.copy_(flags)
    tts._control_codes.copy_(torch.tensor([8, 1020, 1023], dtype=torch.int32))
    joint_out = model.stt_model.rnnt_joint.joint_net[2]
    joint_out.bias[-1] += 2.0
    silence = torch.zeros(1, 1, 2 * tts.audio_codec.samples_per_frame, device=device)
    tts.codec_silence_tokens.copy_(tts.audio_codec.encode(silence)[0, :, -1].to(torch.int32))


def random_model(preset: str = "tiny", seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, **config_kwargs):
    """A VoiceChatModel with random weights (unprepared), with its tokenizer.

    ``preset``: "tiny", "deep" (tiny widths, real depths) or "full" (the 11B configuration: about
    44 GB while it is initialised in float32 on ``device``, then ``dtype``; meant for a large GPU).
    """
    from .config import VoiceChatConfig
    from .model import VoiceChatModel

    if preset == "full":
        config = VoiceChatConfig.full_size()
    else:
        config = VoiceChatConfig.from_dict(tiny_config_dict(preset, **config_kwargs))
    with torch.device(device), torch.no_grad():
        model = VoiceChatModel(config)
    tokenizer = _hf_tokenizer()
    randomize_(model, seed, tokenizer.get_vocab())
    if dtype is not None:
        model = model.to(dtype)
    model.eval().requires_grad_(False)
    model.set_tokenizer(tokenizer)
    model.source = f"embedded {preset} model (random weights, seed {seed})"
    return model


def load_tiny_model(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                    preset: str = "tiny", seed: int = 0, prepare: bool = True):
    """The embedded default: a tiny VoiceChat with random weights, built deterministically in code.

    Its outputs are noise, but every stage of the real pipeline runs, so it shows the API, the
    command line and the frame loop without a download.
    """
    from .model import default_device, default_dtype

    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    model = random_model(preset, seed).to(device=device, dtype=dtype)  # made on the CPU: same weights anywhere
    model.set_activation_dtype(dtype or torch.float32)
    model.init_constants(device)
    return model.prepare() if prepare else model


def save_checkpoint(model, folder: str | Path, bits: int | None = None, group_size: int = 64,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write an unprepared VoiceChatModel as an mlx-community checkpoint folder (what mlx-vlm reads).

    ``bits`` quantizes what the real checkpoints quantize (every Linear/Embedding of the LLM and the
    vocabulary matrices, MLX affine, ``group_size``); other float tensors are stored in ``dtype``.
    """
    import json

    from safetensors.torch import save_file

    from .model import mlx_community_specs
    from .quant import quantize_affine

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
    return folder
