"""Teacher-forced training of the two halves NVIDIA trained apart (NeMo branch ``nemotron-labs-voicechat``,
``nemo/collections/speechlm2``): speech-to-text and EAR-TTS, each in one pass over a whole conversation
through the networks' ``forward``s. :func:`stt_forward` and :func:`tts_forward` give the logits and the
MoG head's outputs, :func:`teacher_forced_codes` the inference pass and a deterministic session's codes,
:func:`stt_loss` and :func:`tts_loss` NeMo's losses; every random draw comes from the ``generator``
passed in. docs/training.md, "The objectives", has the design and the NeMo lines."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from ..models.language_heads import fused_input, language_heads
from ..runtime.prompt import prompt_ids
from .labels import function_marker_ids

if TYPE_CHECKING:
    from ..networks import VoiceChatNetworks

__all__ = ["STTOutput", "TTSOutput", "STTLossConfig", "TTSLossConfig", "prompt_ids", "user_frames",
           "stt_forward", "tts_forward", "teacher_forced_codes", "stt_loss", "tts_loss", "masking_rate", "quantizer_masks"]


@dataclass
class STTOutput:
    text_logits: torch.Tensor  # [B, T, vocab]
    function_logits: torch.Tensor  # [B, T, vocab]
    prompt_length: int  # LLM positions before the first frame


@dataclass
class TTSOutput:
    """The MoG head's outputs per step ``[B, S, ...]`` (NeMo's ``MoGHead.forward``, ear_tts_model.py 616-639)."""

    logits: torch.Tensor  # [B, S, components]: the mixture weights
    mus: torch.Tensor  # [B, S, components, low_rank]
    mu_res: torch.Tensor  # [B, S, latent]
    log_std: torch.Tensor  # [B, S, 1], clamped at min_log_std
    src_mask: torch.Tensor  # [B, S, Q] bool: quantizers given to the head (the rest are predicted)
    tgt_mask: torch.Tensor  # [B, S, Q] bool
    codes: torch.Tensor | None = None  # [B, S, Q] long: teacher_forced_codes' picks


def user_frames(model: VoiceChatNetworks, audio_16k: torch.Tensor, frames: int) -> torch.Tensor:
    """The projected encoder frames ``[B, frames, H]`` of 16 kHz audio ``[B, N]`` (log-mel and Conformer
    over the whole waveform, row by row; the streaming encoder's frames up to rounding)."""
    perception = model.stt_model.perception
    audio = torch.as_tensor(audio_16k, dtype=torch.float32, device=model.device)
    audio = audio[None] if audio.dim() == 1 else audio
    need = frames * model.config.input_frame_samples
    if audio.dim() != 2 or audio.shape[1] < need:
        raise ValueError(f"audio_16k: {frames} frames need [B, >= {need}] samples at 16 kHz, "
                         f"got shape {list(audio.shape)}")
    rows = [perception(perception.log_mel(wave))[0][:, :frames] for wave in audio]
    return torch.cat(rows, dim=0)


def _ids(x: torch.Tensor | Sequence[int], device: torch.device, name: str) -> torch.Tensor:
    ids = torch.as_tensor(x, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2:
        raise ValueError(f"{name} must be [T] or [B, T] ids, got shape {list(ids.shape)}")
    return ids


def _previous(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Frame t's fed-back id: frame t - 1's, PAD at the first (NeMo's ``[:, :-1]`` inputs, label_prep.py 316)."""
    return F.pad(ids[:, :-1], (1, 0), value=pad)


def stt_forward(model: VoiceChatNetworks, audio_16k: torch.Tensor, text_ids: torch.Tensor | Sequence[int],
                function_ids: torch.Tensor | Sequence[int], system_prompt: str | None = None,
                tools: Sequence[dict] | None = None) -> STTOutput:
    """Per-frame logits of the text and function channels ``[B, T, vocab]``, teacher-forced.

    ``text_ids``/``function_ids`` ``[T]`` or ``[B, T]``: each frame's ids (the labels); the LLM's input at
    frame ``t`` is the user audio's frame ``t`` plus frame ``t - 1``'s ids (PAD at the first), NeMo's shift
    (label_prep.py 316-317, duplex_stt_model.py 2107-2150), fused as ``E(text) + audio + w E(function)``.
    The system prompt (as :func:`prompt_ids`) comes first, on the user channel with both outputs at PAD.
    """
    cfg, device = model.config, model.device
    text, function = _ids(text_ids, device, "text_ids"), _ids(function_ids, device, "function_ids")
    if text.shape != function.shape:
        raise ValueError(f"text_ids {list(text.shape)} and function_ids {list(function.shape)} differ in shape")
    b, t = text.shape
    audio = user_frames(model, audio_16k, t)
    if audio.shape[0] != b:
        raise ValueError(f"audio_16k has {audio.shape[0]} rows, the ids {b}")
    stt = model.stt_model
    pad = cfg.pad_token_id
    fused = fused_input(stt.embed_tokens, _previous(text, pad), audio, _previous(function, pad),
                        cfg.function_channel_weight)
    prompt = prompt_ids(model, system_prompt, tools)
    if prompt:
        ids = torch.tensor([prompt] * b, device=device)
        pads = torch.full_like(ids, pad)
        user = stt.embed_tokens(ids)
        fused = torch.cat([fused_input(stt.embed_tokens, pads, user, pads, cfg.function_channel_weight).to(fused.dtype),
                           fused], dim=1)
    hidden = stt.llm(fused)[:, len(prompt):]
    heads = language_heads(hidden, *model.vocabulary_heads())
    return STTOutput(heads.text_logits, heads.function_logits, len(prompt))


# --------------------------------------------------------------------------------------
# STT loss


@dataclass
class STTLossConfig:
    """NeMo's STT loss options (duplex_stt_model.py 2232-2264, 2432-2459, 2593-2602). NVIDIA's values for the
    release are not published: the defaults are the code's."""

    text_loss_weight: float = 3.0  # the text loss's weight; 3 is s2s_duplex_stt.yaml:16
    function_loss_weight: float = 1.0  # the function loss's weight
    # Per text label, by NeMo's keys ``pad``, ``bos``, ``eos``, ``text``; None: all 1.
    token_weights: dict[str, float] | None = None
    # Per function label, by NeMo's keys ``pad``, ``sotc``, ``eotc``, ``eotr``, ``call``; None: all 1.
    function_token_weights: dict[str, float] | None = None


def _weights(labels: torch.Tensor, table: Sequence[tuple[int, float]], default: float) -> torch.Tensor:
    out = torch.full(labels.shape, default, dtype=torch.float32, device=labels.device)
    for token, weight in table:
        out = torch.where(labels == token, weight, out)
    return out


def stt_loss(model: VoiceChatNetworks, out: STTOutput, text_labels: torch.Tensor, function_labels: torch.Tensor,
             function_mask: torch.Tensor | None = None, frame_mask: torch.Tensor | None = None,
             config: STTLossConfig | None = None) -> dict[str, torch.Tensor]:
    """``text_loss_weight * text + function_loss_weight * function``, each ``sum(CE * scale) / frames``
    (duplex_stt_model.py 2366-2372, 2462-2469): ``scale`` is ``frame_mask`` (default all frames) times the
    token weights; the function channel's also times ``function_mask`` (NeMo's loss mask: no loss on tool
    results) and its token weights (pad 0.1, sotc 10, eotc 10, eotr 1, call 5 when given, 2436-2456)."""
    config = config or STTLossConfig()
    cfg = model.config
    text_labels = _ids(text_labels, out.text_logits.device, "text_labels")
    function_labels = _ids(function_labels, out.text_logits.device, "function_labels")
    frames = torch.ones(text_labels.shape, device=text_labels.device) if frame_mask is None else \
        _ids(frame_mask, text_labels.device, "frame_mask").float()
    text_scale = frames
    if config.token_weights:
        w = config.token_weights
        text_scale = frames * _weights(text_labels, [(cfg.eos_token_id, w.get("eos", 1.0)),
                                                     (cfg.bos_token_id, w.get("bos", 1.0)),
                                                     (cfg.pad_token_id, w.get("pad", 1.0))], w.get("text", 1.0))
    function_scale = frames if function_mask is None else frames * _ids(function_mask, frames.device, "function_mask")
    if config.function_token_weights:
        w = config.function_token_weights
        start, end, result_end = function_marker_ids(model.tokenizer)
        function_scale = function_scale * _weights(function_labels, [
            (cfg.pad_token_id, w.get("pad", 0.1)), (start, w.get("sotc", 10.0)), (end, w.get("eotc", 10.0)),
            (result_end, w.get("eotr", 1.0))], w.get("call", 5.0))
    count = frames.sum().clamp(min=1)
    text = (F.cross_entropy(out.text_logits.flatten(0, 1).float(), text_labels.flatten(), reduction="none")
            * text_scale.flatten()).sum() / count
    function = (F.cross_entropy(out.function_logits.flatten(0, 1).float(), function_labels.flatten(), reduction="none")
                * function_scale.flatten()).sum() / count
    loss = config.text_loss_weight * text + config.function_loss_weight * function
    return {"loss": loss, "text_loss": text, "function_loss": function}


# --------------------------------------------------------------------------------------
# TTS


@dataclass
class TTSLossConfig:
    """EAR-TTS's training options (nemotron_voicechat_nano9b.yaml 124-129, ear_tts_model.py 1169-1205,
    1232-1293). NeMo's release trains with no EOS head (``disable_eos_prediction``) and no random target
    masking."""

    max_training_rate: float = 0.8  # the masking rate is ``U(0, max_training_rate)`` through the schedule
    exponent: float = 3.0  # the masking schedule's exponent (:func:`masking_rate`)
    # With this probability the input codes keep only a uniform number of first quantizers.
    quantizer_dropout: float = 0.5
    p_uncond: float = 0.1  # per conversation, the probability the text condition is dropped to ``null_emb``
    label_smoothing: float = 0.01  # of the posterior over components


def masking_rate(rate: torch.Tensor, exponent: float) -> torch.Tensor:
    """``get_masking_rate`` (ear_tts_model.py 263-279): ``(1 - rate**e)**(1/e)``."""
    return (1 - rate.pow(exponent)).pow(1 / exponent)


def quantizer_masks(shape: tuple[int, int], quantizers: int, config: TTSLossConfig,
                    generator: torch.Generator | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``prepare_training_inputs`` without random target masking (ear_tts_model.py 1169-1205): the head's
    known quantizers (the first ``Q - ceil(masking_rate(U(0, max_rate)) Q)``) and the input's kept ones
    (all, or with probability ``quantizer_dropout`` the first ``randint(0, Q + 1)``), ``[B, S, Q]`` bool."""
    b, s = shape
    q = torch.arange(quantizers, device=device)
    rate = torch.rand((b, s), generator=generator, device=device) * config.max_training_rate
    masked = torch.ceil(masking_rate(rate, config.exponent) * quantizers).long()
    src = q < (quantizers - masked).clamp(min=0)[..., None]
    drop = torch.rand((b, s, 1), generator=generator, device=device) < config.quantizer_dropout
    keep = torch.where(drop, torch.randint(0, quantizers + 1, (b, s, 1), generator=generator, device=device),
                       quantizers)
    return src, q < keep


def _with_mask_code(codes: torch.Tensor, keep: torch.Tensor, mask_code: int) -> torch.Tensor:
    return torch.where(keep, codes, mask_code)


def tts_forward(model: VoiceChatNetworks, text_ids: torch.Tensor | Sequence[int], codes: torch.Tensor, *,
                generator: torch.Generator | None = None, config: TTSLossConfig | None = None,
                eos_resets: bool = True) -> TTSOutput:
    """The MoG head's outputs at every TTS step ``[B, S, ...]``, teacher-forced after the speaker warmup:
    NeMo's training pass (``forward`` with ``training=True``, ear_tts_model.py 1340-1470): input quantizer
    dropout, the text condition dropped with ``p_uncond``, the head given ``embed_code`` of the known
    quantizers; all draws from ``generator``.

    ``text_ids [S]`` / ``[B, S]``: each step's text id (the LLM's text output of its frame); ``codes
    [B, S, Q]``: each step's codes. Step ``s``'s input is step ``s - 1``'s codes (the warmup's mask codes
    before the first), replaced by the silence codes where its text id is EOS, as the session resets them
    (``eos_resets=False``: no reset, as NeMo's training feeds the shifted codes, ear_tts_model.py 1364-1365).
    """
    config = config or TTSLossConfig()
    tts = model.tts_model.tts_model
    text, codes, previous = _tts_steps(model, text_ids, codes, eos_resets)
    b, s = text.shape
    src, keep = quantizer_masks((b, s), tts.config.num_quantizers, config, generator, model.device)
    code_embed, cond, warm_len = _tts_inputs(model, text, _with_mask_code(previous, keep, tts.config.mask_code))
    null = tts.null_emb.to(cond.dtype).expand_as(cond)
    dropped = torch.rand((b, 1, 1), generator=generator, device=model.device) < config.p_uncond
    fused = tts.gated_fusion_audio_text(code_embed, torch.where(dropped, null, cond))
    hidden = tts.backbone(fused)[:, warm_len:]
    x = hidden + tts.embed_code(tts.depth_sum(_with_mask_code(codes, src, tts.config.mask_code)).to(hidden.dtype))
    logits, mus, mu_res, log_std = tts.mog_head.distribution(tts.mog_head.features(x))
    return TTSOutput(logits, mus, mu_res, log_std, src, torch.ones_like(src))


def teacher_forced_codes(model: VoiceChatNetworks, text_ids: torch.Tensor | Sequence[int], codes: torch.Tensor, *,
                         eos_resets: bool = True) -> TTSOutput:
    """The inference pass at every TTS step at once, teacher-forced as :func:`tts_forward` is: the
    conditional and unconditional rows with guidance, and the head fed the *target* codes quantizer by
    quantizer as the schedule (``EarTTS.generate_codes``, deterministic) decides them. Returns the head's
    outputs at each step's first draw and, in ``codes``, its picks: a deterministic session's codes
    wherever the targets are."""
    tts = model.tts_model.tts_model
    text, codes, previous = _tts_steps(model, text_ids, codes, eos_resets)
    code_embed, cond, warm_len = _tts_inputs(model, text, previous)
    null = tts.null_emb.to(cond.dtype).expand_as(cond)
    fused = tts.gated_fusion_audio_text(code_embed.repeat_interleave(2, 0),  # each conversation's two rows
                                        torch.stack([cond, null], dim=1).flatten(0, 1))
    hidden = tts.backbone(fused)[:, warm_len:]
    b, s, q = codes.shape
    # hidden [2B, S, H] (each conversation's conditional, then unconditional row) -> rows (conversation, step,
    # conditional / unconditional), the pairs generate_codes takes
    flat = hidden.unflatten(0, (b, 2)).transpose(1, 2).reshape(b * s * 2, -1)
    head = tts.mog_head
    picked, outputs = [], []
    decided = None
    for start, count in tts.schedule:
        x = flat if decided is None else flat + tts.embed_code(decided.repeat_interleave(2, 0).to(flat.dtype))
        mean, _ = head(x, tts.config.guidance_scale, tts.config.top_p, None, True)
        index, _ = tts.assign(mean.float(), start, count, None, False)
        picked += index
        outputs.append(head.features(x).view(b, s, 2, -1)[:, :, 0])
        target = codes.reshape(b * s, q)[:, start:start + count]
        rows = tts.codebooks()[0][torch.arange(start, start + count, device=codes.device), target].sum(-2)
        decided = rows if decided is None else decided + rows
    logits, mus, mu_res, log_std = head.distribution(outputs[0])
    ones = torch.ones_like(codes, dtype=torch.bool)
    return TTSOutput(logits, mus, mu_res, log_std, ~ones, ones, torch.cat(picked, dim=-1).view(b, s, q))


def _tts_steps(model: VoiceChatNetworks, text_ids: torch.Tensor | Sequence[int], codes: torch.Tensor,
               eos_resets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The steps' text ids ``[B, S]``, codes ``[B, S, Q]`` and each step's input codes (the previous
    step's; the warmup's last before the first; silence after an EOS where ``eos_resets``)."""
    speech = model.tts_model
    quantizers = speech.tts_model.config.num_quantizers
    text = _ids(text_ids, model.device, "text_ids")
    codes = torch.as_tensor(codes, device=model.device).long()
    codes = codes[None] if codes.dim() == 2 else codes
    b, s = text.shape
    if codes.shape != (b, s, quantizers):
        raise ValueError(f"codes must be [B, S, {quantizers}] for text_ids {list(text.shape)}, got {list(codes.shape)}")
    first = model.tts_prompt().codes[:, -1:].clone().expand(b, 1, -1)  # the prompt was made under inference_mode
    previous = torch.cat([first, codes[:, :-1]], dim=1)
    if eos_resets:
        previous = torch.where((text == speech.eos_token_id)[..., None], speech.silence_codes(torch.long), previous)
    return text, codes, previous


def _tts_inputs(model: VoiceChatNetworks, text: torch.Tensor,
                previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The backbone's code embeddings and text conditioning ``[B, F + S, H]``: the speaker warmup's (with
    the speaker latents themselves, trainable if asked), then the steps'; and ``F``."""
    speech = model.tts_model
    tts = speech.tts_model
    prompt = model.tts_prompt()  # made under inference_mode: its tensors are cloned before autograd sees them
    prompt = dataclasses.replace(prompt, codes=prompt.codes.clone(), subword_ids=prompt.subword_ids.clone(),
                                 subword_mask=prompt.subword_mask.clone(), audio_mask=prompt.audio_mask.clone())
    warm, warm_text = tts.warmup_inputs(prompt, speech.audio_prompt_latents.latents())
    b = text.shape[0]
    steps = tts.embed_code(tts.depth_sum(previous).to(tts.activation_dtype))
    step_text = tts.embed_subword(text)
    code_embed = torch.cat([warm.expand(b, -1, -1), steps], dim=1)
    cond = torch.cat([warm_text.expand(b, -1, -1).to(step_text.dtype), step_text], dim=1)
    return code_embed, cond, warm.shape[1]


def tts_loss(model: VoiceChatNetworks, out: TTSOutput, codes: torch.Tensor, step_mask: torch.Tensor | None = None,
             config: TTSLossConfig | None = None) -> dict[str, torch.Tensor]:
    """``c_loss + k_loss`` (ear_tts_model.py 1232-1293; ``lm_loss`` is off in the release). The target is the
    depth sum of the codes the head was not given (``tgt & ~src``, on the steps of ``step_mask``); under each
    mixture component its log-likelihood ``logp_k = (-log(2 pi)/2 - log s) D - |L_k m_k - (y - r)/s|^2 / 2``;
    ``q = softmax(logp) (1 - ls) + ls / K`` (detached); ``c = -sum q logp``, ``k = KL(q || softmax(logits))``,
    both summed over steps with a target and divided by the number of target codes."""
    config = config or TTSLossConfig()
    tts = model.tts_model.tts_model
    head = tts.mog_head
    codes = torch.as_tensor(codes, device=out.logits.device).long()
    codes = codes[None] if codes.dim() == 2 else codes
    target = out.tgt_mask & ~out.src_mask
    if step_mask is not None:
        target = target & torch.as_tensor(step_mask, device=codes.device).bool().view(*codes.shape[:2], 1)
    steps = target.any(-1).float()
    y = tts.depth_sum(_with_mask_code(codes, target, tts.config.mask_code)).float()
    log_std, mus, mu_res = out.log_std.float(), out.mus.float(), out.mu_res.float()
    distance = head.distance(mus, (y - mu_res) * torch.exp(-log_std))
    logp = (-0.5 * math.log(2 * math.pi) - log_std) * tts.config.latent_size - 0.5 * distance
    k = head.num_predictions
    q = (torch.softmax(logp, -1) * (1 - config.label_smoothing) + config.label_smoothing / k).detach()
    count = target.sum().clamp(min=1)
    c_loss = (-(q * logp).sum(-1) * steps).sum() / count
    k_loss = ((q * (torch.log(q + 1e-8) - F.log_softmax(out.logits.float(), -1))).sum(-1) * steps).sum() / count
    return {"loss": c_loss + k_loss, "c_loss": c_loss, "k_loss": k_loss}
