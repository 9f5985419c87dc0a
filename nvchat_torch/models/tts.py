"""EAR-TTS: the assistant's speech tokens, 31 residual-VQ codes per 80 ms frame.

Checkpoint prefix ``tts_model``: ``tts_model.tts_model`` is :class:`EarTTS`, ``tts_model.audio_codec``
the :class:`~nvchat_torch.models.codec.Codec`, plus the prompt and silence buffers held by :class:`SpeechDecoder`.
A session starts with a 37-position warmup that fills the key/value caches; then :meth:`EarTTS.step`
runs one frame. Nothing in a step reads a tensor on the host.
Design: docs/api.md, "What each network computes" (EAR-TTS).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from . import cpu_kernels
from .codec import Codec
from .config import CodecConfig, TTSConfig
from .gemma import (
    FusedGatedMLP,
    FusedGemmaAttention,
    GatedMLP,
    GemmaAttention,
    GemmaBackbone,
    Rotary,
    TTSCache,
    TTSRows,
)
from .layers import (
    FusedOnCpu,
    Linear,
    OffsetRMSNorm,
    PrecomputedOffsetRMSNorm,
    adopt,
    layer_step,
    squared_norms,
    swap_modules,
)
from .mog import Draws, FusedMoGHead, Generators, MoGHead, sample_component
from .subword import (
    CharAwareSubwordEncoder,
    CharEncoderAttention,
    FusedCharEncoderAttention,
    FusedGatedFusion,
    GatedFusion,
)

__all__ = [
    "TTSCache",
    "sample_component",
    "EarTTS",
    "FusedEarTTS",
    "TTSPrompt",
    "PromptLatents",
    "SpeechDecoder",
]

PROMPT_FRAMES = 37  # frames of the speaker prompt latents (3 s)


def _check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], integer: bool = False) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if integer and (x.is_floating_point() or x.is_complex()):
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")


# --------------------------------------------------------------------------------------
# EAR-TTS


@dataclass
class TTSPrompt:
    """The speaker warmup: ``F`` positions of codes, text and the prompt latents (batch 1)."""

    codes: torch.Tensor  # [1, F, Q] long; the mask code (codebook_size) where nothing is known
    subword_ids: torch.Tensor  # [1, F] long
    subword_mask: torch.Tensor  # [1, F] bool: positions whose text goes through the char encoder
    audio_mask: torch.Tensor  # [1, F] bool: positions of real audio (its first one gets bos_emb)
    latents: torch.Tensor  # [1, F, H]: the code embedding before the first audio position

    def to(self, device: torch.device) -> TTSPrompt:
        return TTSPrompt(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def _draw_schedule(config: TTSConfig) -> list[tuple[int, int]]:
    """(first quantizer, count) of each MoG draw of a frame: the reference's unmasking schedule
    ``masked_i = ceil((1 - (i / n) ** e) ** (1 / e) * Q)``, draws of no quantizer dropped
    (n=8, e=3, Q=31: counts 1, 1, 3, 4, 22)."""
    n, e, q = config.num_iterations, config.exponent, config.num_quantizers
    masked = [math.ceil(((1.0 - (i / n) ** e) ** (1.0 / e)) * q) for i in range(n)] + [0]
    draws, start = [], 0
    for i in range(n):
        count = masked[i] - masked[i + 1]
        if count:
            draws.append((start, count))
            start += count
    return draws


class EarTTS(nn.Module):
    """EAR-TTS (``tts_model.tts_model``): previous codes + current text id -> the next 31 codes.

    :meth:`warmup` primes a :class:`TTSCache` with the speaker prompt; :meth:`step` =
    :meth:`forward_step` (backbone hidden state ``[2, 1, H]``, rows conditional and unconditional)
    + :meth:`generate_codes`. Call :meth:`set_vocabulary` once with the LLM tokenizer's vocabulary.
    """

    def __init__(self, config: TTSConfig):
        super().__init__()
        self.config = config
        hidden, latent = config.hidden_size, config.latent_size
        self.backbone = GemmaBackbone(config)
        self.bos_emb = nn.Parameter(torch.zeros(hidden))
        self.null_emb = nn.Parameter(torch.zeros(hidden))
        self.embed_code = Linear(latent, hidden, bias=False)
        self.embed_subword = CharAwareSubwordEncoder(config.character_encoder, hidden)
        self.gated_fusion_audio_text = GatedFusion(hidden, config.num_quantizers, config.rms_norm_eps)
        # Projects prompt codes when no speaker latents are given; the reference always gives them.
        self.audio_prompt_projection_W = nn.Parameter(torch.zeros(hidden, hidden))
        self.mog_head = MoGHead(hidden, latent, config.mog_head)
        self.rvq_embs = nn.Parameter(torch.zeros(config.num_quantizers, config.codebook_size, latent))
        self.schedule = _draw_schedule(config)
        # The reference runs the backbone, MoG head and distances in float32 whatever the weights'
        # dtype (its float32 code sums promote them); the opt-in fast mode sets bf16/fp16 here.
        self.activation_dtype = torch.float32
        self.init_constants()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        """(Re)create the computed constants (quantizer index, rotary tables) on ``device``."""
        self.register_buffer("quantizer_index", torch.arange(self.config.num_quantizers, device=device),
                             persistent=False)
        for module in self.modules():
            if isinstance(module, Rotary):
                module.init_constants(device, module.cos.shape[0])

    def set_vocabulary(self, vocabulary: Mapping[str, int]) -> None:
        self.embed_subword.set_vocabulary(vocabulary)

    def new_cache(self) -> TTSCache:
        return self.backbone.new_cache(self.activation_dtype)

    # ---- inputs

    def depth_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """``[..., Q]`` codes -> ``[..., latent]`` float32 sum of ``rvq_embs[q, code_q]``; the mask
        code (``codebook_size``) adds nothing."""
        mask_code = self.config.codebook_size
        rows = self.rvq_embs[self.quantizer_index, codes.clamp(max=mask_code - 1)]
        return torch.where((codes != mask_code)[..., None], rows, 0.0).sum(-2, dtype=torch.float32)

    def _fuse_inputs(self, code_embed: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Guidance doubling (the unconditional row's text is ``null_emb``) and gated fusion:
        ``[1, ..., H]`` each -> ``[2, ..., H]``."""
        cond = torch.cat([text, self.null_emb.to(text.dtype).expand_as(text)], dim=0)
        return self.gated_fusion_audio_text(code_embed, cond)

    def warmup(self, prompt: TTSPrompt, cache: TTSCache | None = None) -> torch.Tensor:
        """Run the speaker prompt from position 0, filling the empty ``cache``; -> hidden ``[2, F, H]``.

        Code embeddings are those of the previous position's codes (zeros before the first),
        replaced by the prompt latents before the first audio position, plus ``bos_emb`` there.
        """
        F_, H, Q = prompt.latents.shape[1], self.config.hidden_size, self.config.num_quantizers
        _check_shape("prompt.codes", prompt.codes, (1, F_, Q), integer=True)
        _check_shape("prompt.latents", prompt.latents, (1, F_, H))
        for name in ("subword_ids", "subword_mask", "audio_mask"):
            _check_shape(f"prompt.{name}", getattr(prompt, name), (1, F_))
        code_embed, text = self.warmup_inputs(prompt)
        return self.backbone(self._fuse_inputs(code_embed, text), cache)

    def warmup_inputs(self, prompt: TTSPrompt, latents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The warmup's code embeddings and text conditioning ``[1, F, H]`` each: the previous position's
        codes embedded (zeros before the first), the prompt latents (``latents``, default the prompt's)
        before the first audio position, plus ``bos_emb`` there. Training feeds the same."""
        dtype = self.activation_dtype
        latents = prompt.latents if latents is None else latents
        shifted = torch.cat([torch.zeros_like(prompt.codes[:, :1]), prompt.codes[:, :-1]], dim=1)
        code_embed = self.embed_code(self.depth_sum(shifted).to(dtype))
        audio = prompt.audio_mask
        bos = audio & ~torch.cat([torch.zeros_like(audio[:, :1]), audio[:, :-1]], dim=1)
        before_bos = (bos.cumsum(1) == 0)[..., None]
        code_embed = torch.where(before_bos, latents.to(dtype), code_embed) + bos[..., None] * self.bos_emb
        return code_embed, self.embed_subword(prompt.subword_ids, prompt.subword_mask)

    forward = warmup

    def forward_step(self, prev_codes: torch.Tensor, text_id: torch.Tensor, cache: TTSCache,
                     rows: TTSRows | None = None) -> torch.Tensor:
        """Previous codes ``[B, 1, Q]`` and this step's text ids ``[B]`` -> hidden ``[2B, 1, H]`` (each
        session's conditional and unconditional rows next to each other), each session at its own
        position (``rows``: the engine's sessions side by side); without ``rows`` one session (``B`` = 1)
        at ``cache.offset``, which advances."""
        b = 1 if rows is None else rows.positions.shape[0] // 2
        _check_shape("prev_codes", prev_codes, (b, 1, self.config.num_quantizers), integer=True)
        _check_shape("text_id", text_id, (b,), integer=True)
        code_embed = self.embed_code(self.depth_sum(prev_codes.view(b, -1)).to(self.activation_dtype))
        text = self.embed_subword(text_id.view(b, 1)).view(b, -1)
        cond = torch.stack([text, self.null_emb.to(text.dtype).expand_as(text)], dim=1)  # [B, 2, H]
        fused = self.gated_fusion_audio_text(code_embed[:, None], cond)
        return self.backbone.forward_step(fused.view(2 * b, 1, -1), cache, rows)

    # ---- codes

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codebooks in float32 ``[Q, K, latent]`` and their squared norms ``[Q, K]`` (see :func:`_squared_norms`)."""
        return self.rvq_embs.float(), squared_norms(self.rvq_embs)

    def generate_codes(self, hidden: torch.Tensor, generator: Generators | Draws = None,
                       deterministic: bool | torch.Tensor = False, batched: bool = False) -> torch.Tensor:
        """Hidden ``[2B, 1, H]`` -> codes ``[B, 1, Q]`` (long) by the iterative MoG schedule (``B`` sessions,
        each with its own generator: a list of them, see :func:`~nvchat_torch.models.mog.draw`; or the step's
        random numbers drawn already, :meth:`draws`). ``batched``: the same ops whatever ``B`` (the
        engine's steps; one session's step has a cheaper path for ``B`` = 1).

        Each draw sees the embedding of the codes decided so far; its proposal (plus Gaussian noise
        ``* noise_scale``) is assigned greedily to the draw's quantizers, starting afresh at the
        first undecided one. ``deterministic``: the most likely component and no noise (the parity
        mode); otherwise top-p + Gumbel-max with ``generator``'s uniform and normal draws.
        """
        config = self.config
        b = hidden.shape[0] // 2
        _check_shape("hidden", hidden, (2 * b, 1, config.hidden_size))
        hidden = hidden.view(2 * b, -1)
        sampling = deterministic is not True
        draws = generator if isinstance(generator, Draws) or not sampling else self.draws(generator, b, hidden.device)
        decided: torch.Tensor | None = None  # float32 [B, latent]: sum of the chosen codebook rows
        picked: list[torch.Tensor] = []
        for step, (start, count) in enumerate(self.schedule):
            x = hidden
            if decided is not None:  # hidden + embed_code(decided), both rows, as one addmm
                rows = decided.repeat_interleave(2, dim=0) if batched else decided.expand(2, -1)
                x = torch.addmm(hidden, rows.to(hidden.dtype), self.embed_code.weight.to(hidden.dtype).t())
            uniform = draws.uniform[step] if sampling else None
            mean, std = self.mog_head(x, config.guidance_scale, config.top_p, uniform, deterministic)
            residual = mean.float()
            if sampling and draws.normal is not None:  # deterministic rows drew 0
                residual = torch.addcmul(residual, std.float(), draws.normal[step], value=config.noise_scale)
            index, decided = self.assign(residual, start, count, decided, step < len(self.schedule) - 1)
            picked += index
        return torch.cat(picked, dim=-1).view(b, 1, config.num_quantizers)

    def draws(self, generator: Generators, batch: int, device: torch.device) -> Draws:
        """A step's random numbers for ``batch`` sessions, from their generator(s) (see :class:`Draws`)."""
        config = self.config
        return Draws.take(generator, batch, len(self.schedule), self.mog_head.num_predictions,
                          self.mog_head.out_size, config.noise_scale > 0, device)

    def assign(self, residual: torch.Tensor, start: int, count: int, decided: torch.Tensor | None,
               accumulate: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """A draw's greedy assignment of quantizers ``start .. start + count - 1``: each takes the codebook
        row nearest the residual ``[B, latent]`` (float32), which then loses it. Returns the indices (``[B,
        n]`` pieces, ``count`` columns in all) and, if ``accumulate``, ``decided`` plus the chosen rows in
        order (else ``decided``)."""
        books, sq_norms = self.codebooks()
        picked = []
        for q in range(start, start + count):
            index, row = _nearest_row(residual, books[q], sq_norms[q])
            picked.append(index[:, None])
            if q + 1 < start + count:
                residual = residual - row
            if accumulate:
                decided = row if decided is None else decided + row
        return picked, decided

    def step(self, prev_codes: torch.Tensor, text_id: torch.Tensor, cache: TTSCache,
             generator: Generators | Draws = None, deterministic: bool | torch.Tensor = False,
             rows: TTSRows | None = None) -> torch.Tensor:
        """One frame: previous codes ``[B, 1, Q]``, text ids ``[B]`` -> codes ``[B, 1, Q]`` (``B`` = 1 unless
        ``rows``)."""
        return self.generate_codes(self.forward_step(prev_codes, text_id, cache, rows), generator, deterministic,
                                   batched=rows is not None)


# Compiled, one quantizer's search is a nested region (layers.layer_step): compiled once for all 31,
# where each quantizer's own kernels would differ only in their codebook's offset (~30 C++ kernels).
@layer_step
def _nearest_row(residual: torch.Tensor, book: torch.Tensor, sq_norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codebook row nearest each residual (``[B, latent]`` float32): its index ``[B]`` and the row."""
    index = torch.addmm(sq_norms, residual, book.t(), alpha=-2.0).argmin(-1)
    return index, book.index_select(0, index)


class FusedEarTTS(EarTTS, FusedOnCpu):
    """``prepare()``'s swap for :class:`EarTTS`: the codebooks kept in float32 with a zero row for the
    mask code appended (``rvq_float [Q, K + 1, latent]``: the depth sum is then a plain gather and
    sum), and their squared norms. ``rvq_embs`` becomes a view of it, so there is one copy: bf16
    codebooks are stored upcast (exactly; 2 more bytes per entry, 33 MB at full size)."""

    def __init__(self, tts: EarTTS):
        adopt(self, tts)
        books = self.rvq_embs.detach()
        padded = books.new_zeros(books.shape[0], books.shape[1] + 1, books.shape[2], dtype=torch.float32)
        padded[:, :-1] = books
        self.register_buffer("rvq_sq_norms", squared_norms(books), persistent=False)
        self.rvq_embs.data = padded[:, :-1]
        self.register_buffer("rvq_float", padded, persistent=False)

    def depth_sum(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_float[self.quantizer_index, codes].sum(-2)  # row mask_code is zeros

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rvq_float[:, :-1], self.rvq_sq_norms

    def use_cpu_kernels(self) -> None:  # fused on a CPU: a draw's assignment as one kernel
        self.fused_on_cpu = cpu_kernels.blas() and cpu_kernels.usable(self.rvq_float, self.rvq_sq_norms)

    def assign(self, residual: torch.Tensor, start: int, count: int, decided: torch.Tensor | None,
               accumulate: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        if not (self.fused_on_cpu and cpu_kernels.usable(residual) and (decided is None or cpu_kernels.usable(decided))):
            return super().assign(residual, start, count, decided, accumulate)
        index, total = torch.ops.nvchat_cpu.rvq_assign(residual, self.rvq_float, self.rvq_sq_norms, decided,
                                                       start, count)
        return [index], total if accumulate else decided


# --------------------------------------------------------------------------------------
# Speech decoder: prompt, silence and control codes around EAR-TTS and the codec


class PromptLatents(nn.Module):
    """``audio_prompt_latents.<speaker>``: the speaker's prompt latents ``[1, 37, H]``, stored under the
    speaker's name (``config.speaker``, "Aria" in the released checkpoints)."""

    def __init__(self, hidden_size: int, speaker: str, frames: int = PROMPT_FRAMES):
        super().__init__()
        if not speaker.isidentifier():
            raise ValueError(f"speaker must be a name usable as a checkpoint key, got {speaker!r}")
        self.speaker = speaker
        self.register_parameter(speaker, nn.Parameter(torch.zeros(1, frames, hidden_size)))

    def latents(self) -> torch.Tensor:
        return self.get_parameter(self.speaker)


class SpeechDecoder(nn.Module):
    """``tts_model``: EAR-TTS, the codec, the speaker prompt, silence and control codes.

    A session calls :meth:`start` (warmed cache, first previous codes), then :meth:`step` per frame
    with the LLM's text id, and decodes ``replace_control_codes(codes)`` with the codec.
    """

    def __init__(self, tts_config: TTSConfig, codec_config: CodecConfig, *,
                 pad_token_id: int = 12, eos_token_id: int = 2, speaker: str = "Aria"):
        super().__init__()
        self.config = tts_config
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.audio_codec = Codec(codec_config)
        self.tts_model = EarTTS(tts_config)
        self.register_buffer("_control_codes", torch.zeros(3, dtype=torch.int32))
        self.register_buffer("codec_silence_tokens", torch.zeros(tts_config.num_quantizers, dtype=torch.int32))
        self.audio_prompt_latents = PromptLatents(tts_config.hidden_size, speaker)

    def init_constants(self, device: torch.device | str | None = None) -> None:
        self.tts_model.init_constants(device)
        self.audio_codec.init_constants(device)

    def fuse(self) -> None:
        """The post-load transforms of EAR-TTS and the codec, as module swaps (outputs unchanged): one
        matmul for q/k/v, gate/up and the MoG heads, the norms' ``1 + w`` and the fusion gates
        precomputed in the activation dtype, the codebooks kept in float32 with their squared norms,
        the codec's codebooks stacked; and the silence codes stored as the long codes a step compares
        and returns (no conversion per step)."""
        dtype = self.tts_model.activation_dtype
        swap_modules(self, OffsetRMSNorm, lambda norm: PrecomputedOffsetRMSNorm(norm, dtype))
        swap_modules(self, GatedMLP, FusedGatedMLP)
        swap_modules(self, GemmaAttention, lambda attention: FusedGemmaAttention(attention, dtype))
        swap_modules(self, CharEncoderAttention, FusedCharEncoderAttention)
        swap_modules(self, GatedFusion, lambda fusion: FusedGatedFusion(fusion, dtype))
        swap_modules(self, MoGHead, FusedMoGHead)
        swap_modules(self, EarTTS, FusedEarTTS)
        self.audio_codec.fuse()
        self.codec_silence_tokens = self.codec_silence_tokens.long()

    def prompt(self) -> TTSPrompt:
        """The speaker warmup: codes of ``F + 1`` silent codec frames, the first and last of the
        first ``F`` set to the mask code; PAD text, encoded at the last two positions; audio at the last."""
        latents = self.audio_prompt_latents.latents()
        frames, device = latents.shape[1], latents.device
        silence = torch.zeros(1, 1, (frames + 1) * self.audio_codec.samples_per_frame, device=device)
        codes = self.audio_codec.encode(silence).transpose(1, 2)
        _check_shape("codec codes of the silent prompt", codes, (1, frames + 1, self.config.num_quantizers))
        codes = codes[:, :frames].clone()
        codes[:, [0, frames - 1]] = self.config.mask_code
        subword_ids = torch.full((1, frames), self.pad_token_id, dtype=torch.long, device=device)
        positions = torch.arange(frames, device=device)[None]
        return TTSPrompt(codes, subword_ids, positions >= frames - 2, positions == frames - 1, latents)

    def start(self, prompt: TTSPrompt | None = None) -> tuple[TTSCache, torch.Tensor]:
        """A cache warmed with the speaker prompt (``prompt``: :meth:`prompt`'s, computed once by the
        caller, or made here) and the first previous codes ``[1, 1, Q]``: all mask, a zero code embedding."""
        prompt = self.prompt() if prompt is None else prompt
        cache = self.tts_model.new_cache()
        self.tts_model.warmup(prompt, cache)
        return cache, prompt.codes[:, -1:].clone()

    def reset_on_eos(self, prev_codes: torch.Tensor, text_id: torch.Tensor) -> torch.Tensor:
        """``prev_codes [B, 1, Q]``, or the silence codes where ``text_id [B]`` is EOS (on the device)."""
        _check_shape("prev_codes", prev_codes, (text_id.shape[0], 1, self.config.num_quantizers), integer=True)
        _check_shape("text_id", text_id, (prev_codes.shape[0],), integer=True)
        return torch.where((text_id == self.eos_token_id).view(-1, 1, 1), self.silence_codes(prev_codes.dtype), prev_codes)

    def silence_codes(self, dtype: torch.dtype) -> torch.Tensor:
        """The silence codes in ``dtype``."""
        return self.codec_silence_tokens.to(dtype)

    def step(self, prev_codes: torch.Tensor, text_id: torch.Tensor, cache: TTSCache,
             generator: Generators | Draws = None, deterministic: bool | torch.Tensor = False,
             rows: TTSRows | None = None) -> torch.Tensor:
        """One frame of codes ``[B, 1, Q]`` (long) from the previous codes and this step's text ids ``[B]``
        (``B`` = 1 unless ``rows``: the batched engine's sessions, each at its own position)."""
        return self.tts_model.step(self.reset_on_eos(prev_codes, text_id), text_id, cache, generator, deterministic,
                                   rows)

    def replace_control_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """``[..., Q]`` codes with every control code replaced by its quantizer's silence code."""
        is_control = (codes[..., None] == self._control_codes).any(-1)
        return torch.where(is_control, self.silence_codes(codes.dtype), codes)
