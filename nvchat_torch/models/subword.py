"""Text conditioning of EAR-TTS: the character-aware subword encoder with its subword-flag and
BOS/EOS embeddings (``tts_model.tts_model.embed_subword``), and the gated fusion of the code and
text embeddings (``tts_model.tts_model.gated_fusion_audio_text``).

Every op follows the reference's bf16 rounding (see ``nvchat_torch.models.layers``).
Design: docs/api.md, "What each network computes" (EAR-TTS); dtypes: docs/parity.md.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .config import CharacterEncoderConfig
from .gemma import AttentionProjections, FusedQKV, GatedMLP, Rotary
from .layers import Linear, OffsetRMSNorm, adopt, matmul, scalar, sigmoid

__all__ = ["CharEncoderAttention", "FusedCharEncoderAttention", "CharEncoder", "SubwordFlagEmbedding",
           "BOSEOSEmbedding", "CharAwareSubwordEncoder", "GatedFusion", "FusedGatedFusion"]

SUBWORD_VOCAB_SIZE = 131_072  # rows of the checkpoint's subword-flag tables (fixed by the reference)
# Padding keys get a finite score, not -inf: a subword with no real character (every key masked)
# then gets a uniform softmax instead of NaNs, as in the reference.
MASKED_SCORE = -1e30


class CharEncoderAttention(AttentionProjections):
    """Bidirectional attention over one subword's characters: RoPE at positions 0.., logits soft-capped
    (``tanh(s / cap) * cap``), padding keys filled with -1e30, float32 softmax."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         config.head_dim, config.query_pre_attn_scalar ** -0.5)
        self.softcap = config.attn_logit_softcapping

    def forward(self, x: torch.Tensor, batch: int, length: int, cos: torch.Tensor, sin: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        qk, v = self.qk_v(x, batch, length)
        q, k, v = self.split_heads(Rotary.apply(qk, cos, sin), v)
        if self.n_heads != self.n_kv_heads:
            repeats = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        # The reference's op sequence, each op rounded in a bf16 encoder: scale, / cap, tanh, * cap.
        dt = q.dtype
        scores = matmul(q, k.transpose(-1, -2)) * scalar(self.scale, dt)
        scores = torch.tanh(scores / scalar(self.softcap, dt)) * scalar(self.softcap, dt)
        scores = torch.where(valid[:, None, None, :], scores, MASKED_SCORE)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return self.output(matmul(probs, v))


class FusedCharEncoderAttention(FusedQKV, CharEncoderAttention):
    """``prepare()``'s swap for :class:`CharEncoderAttention`: one QKV matmul."""


class CharEncoderLayer(nn.Module):
    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = CharEncoderAttention(config)
        self.mlp = GatedMLP(dim, config.intermediate_size)
        self.pre_self_attn_layernorm = OffsetRMSNorm(dim, eps, fp32=True)
        self.post_self_attn_layernorm = OffsetRMSNorm(dim, eps, fp32=True)
        self.pre_feedforward_layernorm = OffsetRMSNorm(dim, eps, fp32=True)
        self.post_feedforward_layernorm = OffsetRMSNorm(dim, eps, fp32=True)

    def forward(self, x: torch.Tensor, batch: int, length: int, cos: torch.Tensor, sin: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.pre_self_attn_layernorm(x), batch, length, cos, sin, valid)
        x = x + self.post_self_attn_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(x, self.pre_feedforward_layernorm))


class CharEncoder(nn.Module):
    """The one-layer T5Gemma-style encoder over characters (``backbone.encoder``), on ``[N * L, dim]``."""

    def __init__(self, config: CharacterEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList([CharEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, fp32=True)

    def forward(self, x: torch.Tensor, batch: int, length: int, cos: torch.Tensor, sin: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, batch, length, cos, sin, valid)
        return self.norm(x)


def _flag_rows(table: torch.Tensor, oov: torch.Tensor, ids: torch.Tensor, first_oov: int) -> torch.Tensor:
    """``table[ids]``, with ids >= ``first_oov`` read at the checkpoint's ``oov`` index."""
    return table[torch.where(ids >= first_oov, oov, ids)]


class SubwordFlagEmbedding(nn.Module):
    """Adds ``cont_emb[is_continuation[id]]`` (checkpoint table; ids >= vocab read at ``pad_tensor``)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.register_buffer("pad_tensor", torch.tensor(vocab_size, dtype=torch.int32))
        self.register_buffer("is_continuation", torch.zeros(vocab_size + 1, dtype=torch.int32))
        self.cont_emb = nn.Embedding(2, hidden_size)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flags = _flag_rows(self.is_continuation, self.pad_tensor, ids, self.is_continuation.shape[0] - 1)
        return x + self.cont_emb(flags)


class BOSEOSEmbedding(nn.Module):
    """Adds ``special_emb[special_flags[id]]`` (0 plain, 1 BOS, 2 EOS; ids >= vocab read at ``pad_tensor``)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        # The checkpoint's out-of-vocabulary index is the last id (the source stored max(vocab.values())).
        self.register_buffer("pad_tensor", torch.tensor(vocab_size - 1, dtype=torch.int32))
        self.register_buffer("special_flags", torch.zeros(vocab_size, dtype=torch.int32))
        self.special_emb = nn.Embedding(3, hidden_size)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flags = _flag_rows(self.special_flags, self.pad_tensor, ids, self.special_flags.shape[0])
        return x + self.special_emb(flags)


class CharAwareSubwordEncoder(nn.Module):
    """Text id -> embedding from the characters of its token string (``embed_subword``).

    :meth:`set_vocabulary` turns the tokenizer's strings into per-id character tables
    (``char_ids [ids + 1, max_chars]``, padded with the pad character; the extra last row, all
    padding, serves ids beyond the vocabulary), so a step gathers one row instead of looping over
    characters. Each selected position: characters embedded and scaled by ``sqrt(hidden)`` (rounded
    to the activation dtype), one encoder layer, mean over the real characters, ``proj_embedding``;
    an empty string or an unselected position gives 0. Every position then adds its subword-flag
    and BOS/EOS embeddings.
    """

    def __init__(self, config: CharacterEncoderConfig, out_size: int, vocab_size: int = SUBWORD_VOCAB_SIZE):
        super().__init__()
        self.backbone = nn.Module()  # checkpoint nesting: backbone.encoder
        self.backbone.encoder = CharEncoder(config)
        self.embed_tokens = nn.Embedding(config.char_vocab_size, config.hidden_size)
        self.proj_embedding = Linear(config.hidden_size, out_size, bias=False)
        self.subword_flag_emb = SubwordFlagEmbedding(vocab_size, config.hidden_size)
        self.bos_eos_emb = BOSEOSEmbedding(vocab_size, config.hidden_size)
        self.pad_char = config.char_vocab_size - 1
        self.scale = config.hidden_size ** 0.5
        self.rope = Rotary(config.head_dim, config.rope_base, positions=64)
        self.register_buffer("char_ids", None, persistent=False)  # int16 [ids + 1, max_chars]
        self.register_buffer("char_counts", None, persistent=False)  # int32 [ids + 1]

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        """Build the character tables from ``tokenizer.get_vocab()`` (token string -> id).

        The one-character tokens, sorted by id, are the character vocabulary (ids 0..n-1, pad n);
        a token's characters missing from it are skipped.
        """
        chars = sorted((token for token in vocabulary if len(token) == 1), key=vocabulary.__getitem__)
        if len(chars) + 1 != self.embed_tokens.num_embeddings:
            raise ValueError(f"the tokenizer has {len(chars)} one-character tokens, so {len(chars) + 1} character "
                             f"ids with padding, but embed_subword.embed_tokens has "
                             f"{self.embed_tokens.num_embeddings} rows")
        char_of = {c: i for i, c in enumerate(chars)}
        rows = max(vocabulary.values()) + 2
        spelled: list[list[int]] = [[] for _ in range(rows)]
        for token, index in vocabulary.items():
            spelled[index] = [char_of[c] for c in token if c in char_of]
        width = max(1, max(len(s) for s in spelled))
        table = torch.tensor([s + [self.pad_char] * (width - len(s)) for s in spelled], dtype=torch.int16)
        device = self.embed_tokens.weight.device
        self.char_ids = table.to(device)
        self.char_counts = torch.tensor([len(s) for s in spelled], dtype=torch.int32, device=device)
        self.rope.reserve(width)  # now, not in a step

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``ids [B, T]`` (and the positions to encode, ``mask [B, T]``, default all) -> ``[B, T, out]``."""
        if self.char_ids is None:
            raise RuntimeError("call set_vocabulary(tokenizer.get_vocab()) on the TTS before running it")
        rows = ids.clamp(max=self.char_ids.shape[0] - 1)
        chars = self.char_ids[rows].flatten(0, 1)  # [N = B * T, max_chars]
        count, width = chars.shape
        valid = chars != self.pad_char
        x = self.embed_tokens(chars.int().flatten())
        x = x * scalar(self.scale, x.dtype)
        cos, sin = self.rope.table(0, width)
        hidden = self.backbone.encoder(x, count, width, cos[:, None], sin[:, None], valid)
        pooled = (hidden.view(count, width, -1) * valid[..., None]).sum(1)
        pooled = pooled / self.char_counts[rows].flatten().clamp(min=1)[:, None]
        out = self.proj_embedding(pooled).view(*ids.shape, -1)
        if mask is not None:
            out = torch.where(mask[..., None], out, 0.0)
        return self.bos_eos_emb(self.subword_flag_emb(out, ids), ids)


class GatedFusion(nn.Module):
    """``final_norm(s * (g * audio_proj(audio / Q) + (1 - g) * text_proj(text)))`` with
    ``g = sigmoid(gate)``, ``s = sigmoid(residual_scale)`` (``gated_fusion_audio_text``)."""

    def __init__(self, hidden_size: int, num_codebooks: int, eps: float):
        super().__init__()
        self.num_codebooks = num_codebooks
        self.audio_proj = Linear(hidden_size, hidden_size)
        self.text_proj = Linear(hidden_size, hidden_size)
        self.gate = nn.Parameter(torch.zeros(hidden_size))
        self.residual_scale = nn.Parameter(torch.tensor(0.5))
        self.final_norm = OffsetRMSNorm(hidden_size, eps, fp32=True)

    def mixing(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``g``, ``1 - g`` and ``s``: the sigmoids in the parameters' dtype (bf16 arithmetic for bf16
        weights), then cast to the activations' ``dtype``, where ``1 - g`` is formed."""
        gate = sigmoid(self.gate).to(dtype)
        return gate, 1.0 - gate, sigmoid(self.residual_scale).to(dtype)

    def forward(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        audio = self.audio_proj(audio / self.num_codebooks)
        gate, keep, scale = self.mixing(audio.dtype)
        return self.final_norm(scale * (gate * audio + keep * self.text_proj(text)))


class FusedGatedFusion(GatedFusion):
    """``prepare()``'s swap for :class:`GatedFusion`: ``g``, ``1 - g`` and ``s`` computed once for
    activations of ``dtype`` (one ``[3, H]`` buffer)."""

    def __init__(self, fusion: GatedFusion, dtype: torch.dtype):
        adopt(self, fusion)
        gate, keep, scale = fusion.mixing(dtype)
        self.register_buffer("mixed", torch.stack([gate, keep, scale.expand_as(gate)]).detach(), persistent=False)

    def mixing(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.mixed[0], self.mixed[1], self.mixed[2, 0]
