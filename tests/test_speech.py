"""EAR-TTS and the speech decoder against the MLX reference, on tiny random float32 checkpoints."""

from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_oracle import full_size_manifest, to_np
from torch.utils._python_dispatch import TorchDispatchMode

from nvchat_torch.loading.checkpoint import Checkpoint
from nvchat_torch.models.config import VoiceChatConfig
from nvchat_torch.models.tts import EarTTS, SpeechDecoder, TTSPrompt, sample_component

PAD, EOS, BOS, SILENCE = 12, 2, 1, 11


def load_speech(path) -> SpeechDecoder:
    with Checkpoint(path) as ckpt:
        cfg = ckpt.config
        state = {k[len("tts_model."):]: v for k, v in ckpt.iter_tensors(dtype=torch.float32)
                 if k.startswith("tts_model.")}
    model = SpeechDecoder(cfg.tts_config, cfg.codec_config, pad_token_id=cfg.pad_token_id,
                          eos_token_id=cfg.eos_token_id)
    model.load_state_dict(state, strict=True)
    return model.eval()


def text_ids(tokenizer) -> list[int]:
    """PAD and EOS runs, real words, BOS/silence, ids past the tokenizer (< the LLM's 320), EOS mid-speech."""
    words = tokenizer.encode(" hello world you are helpful", add_special_tokens=False)[:10]
    ids = [PAD, PAD, EOS, *words[:5], 310, SILENCE, BOS, EOS, *words[5:], 299, PAD, 317, 45, 46, EOS, PAD]
    return (ids + [30 + i for i in range(32)])[:32]


def prompt_from_reference(ref_prompt) -> TTSPrompt:
    codes, ids, subword_mask, audio_mask, latents = (to_np(x) for x in ref_prompt)
    return TTSPrompt(torch.from_numpy(codes).long(), torch.from_numpy(ids).long(), torch.from_numpy(subword_mask),
                     torch.from_numpy(audio_mask), torch.from_numpy(latents))


@pytest.fixture(scope="module")
def speech(ckpt_f32, reference):
    ref = reference(ckpt_f32)
    model = load_speech(ckpt_f32)
    model.tts_model.set_vocabulary(ref.tokenizer.get_vocab())
    return ref, model


def reference_run(ref_tts, ref_prompt, ids, silence):
    """Warmup and one step per id, resetting to silence on EOS as the reference session does."""
    warm, cache = ref_tts.warmup(*ref_prompt[:-1], audio_prompt_latent=ref_prompt[-1], guidance=True)
    prev = ref_prompt[0][:, -1:]
    hiddens, codes = [], []
    for t in ids:
        if t == EOS:
            prev = mx.broadcast_to(silence[None, None, :], prev.shape)
        out = ref_tts.step(prev, mx.array([[t]], dtype=mx.int32), mx.ones((1, 1), dtype=mx.bool_), cache,
                           guidance=True)
        prev = out.codes
        hiddens.append(to_np(out.hidden_states))
        codes.append(to_np(out.codes))
    return to_np(warm), np.stack(hiddens), np.concatenate(codes, axis=1)


@pytest.fixture(scope="module")
def ref_run(speech):
    ref, _ = speech
    ids = text_ids(ref.tokenizer)
    ref_prompt = ref.session._tts_prompt()
    warm, hiddens, codes = reference_run(ref.model.tts_model.tts_model, ref_prompt, ids,
                                         ref.model.tts_model.codec_silence_tokens)
    return dict(ids=ids, prompt=ref_prompt, warm=warm, hiddens=hiddens, codes=codes)


def run_tts(model: SpeechDecoder, tts: EarTTS, prompt: TTSPrompt, ids: list[int]):
    """Our warmup + deterministic steps: (warmup hidden, per-step hidden [S, 2, 1, H], codes [1, S, Q])."""
    with torch.no_grad():
        cache = tts.new_cache()
        warm = tts.warmup(prompt, cache)
        prev = prompt.codes[:, -1:]
        hiddens, codes = [], []
        for t in ids:
            text = torch.tensor([t])
            hidden = tts.forward_step(model.reset_on_eos(prev, text), text, cache)
            prev = tts.generate_codes(hidden, deterministic=True)
            hiddens.append(hidden)
            codes.append(prev)
    return warm.numpy(), torch.stack(hiddens).numpy(), torch.cat(codes, dim=1).numpy()


# --------------------------------------------------------------------------------------
# Parity with the reference


def test_prompt_matches_reference(speech, ref_run):
    _, model = speech
    with torch.no_grad():
        ours = model.prompt()
    ref = prompt_from_reference(ref_run["prompt"])
    assert torch.equal(ours.codes, ref.codes)  # the codec's encoding of silence, masked at 0 and F-1
    assert (ours.codes[0, [0, -1]] == 1024).all() and (ours.codes[0, 1:-1] < 1024).all()
    for name in ("subword_ids", "subword_mask", "audio_mask", "latents"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_char_encoder_matches_reference(speech):
    ref, model = speech
    ids = np.arange(320)[None]  # every tokenizer id (0..299) and ids the tokenizer lacks (300..319)
    mask = (np.arange(320) % 3 != 1)[None]
    expected = to_np(ref.model.tts_model.tts_model.embed_subword(mx.array(ids, dtype=mx.int32), mx.array(mask)))
    with torch.no_grad():
        ours = model.tts_model.embed_subword(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert np.abs(ours - expected).max() <= 1e-4
    assert np.abs(expected[0, 300:]).max() > 0  # empty spellings still carry the flag embeddings


def test_warmup_and_steps_match_reference(speech, ref_run):
    _, model = speech
    warm, hiddens, codes = run_tts(model, model.tts_model, prompt_from_reference(ref_run["prompt"]), ref_run["ids"])
    assert warm.shape == ref_run["warm"].shape == (2, 37, 64)
    assert np.abs(warm - ref_run["warm"]).max() <= 1e-4
    assert hiddens.shape == ref_run["hiddens"].shape
    assert np.abs(hiddens - ref_run["hiddens"]).max() <= 1e-4
    assert codes.shape == (1, 32, 31)
    np.testing.assert_array_equal(codes, ref_run["codes"])
    assert len({tuple(c) for c in codes[0]}) == 32  # every frame differs: the comparison is not vacuous


def test_speech_decoder_steps_match_reference(speech, ref_run):
    """start() (our own prompt) + step() with the EOS reset on the device give the reference's codes."""
    _, model = speech
    codes = []
    with torch.no_grad():
        cache, prev = model.start()
        assert cache.offset == 37 and torch.equal(prev, torch.full((1, 1, 31), 1024))
        for t in ref_run["ids"]:
            prev = model.step(prev, torch.tensor([t]), cache, deterministic=True)
            codes.append(prev)
    assert cache.offset == 37 + len(ref_run["ids"])
    np.testing.assert_array_equal(torch.cat(codes, dim=1).numpy(), ref_run["codes"])


def test_replace_control_codes_matches_reference(speech):
    ref, model = speech
    rng = np.random.default_rng(3)
    control, silence = model._control_codes.numpy(), model.codec_silence_tokens.numpy()
    codes = rng.integers(0, 1024, size=(1, 40, 31))
    codes = np.where(rng.random(codes.shape) < 0.2, rng.choice(control, size=codes.shape), codes)
    is_control = np.isin(codes, control)
    assert is_control.sum() > 100
    ours = model.replace_control_codes(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(ours, np.where(is_control, silence[None, None, :], codes))
    np.testing.assert_array_equal(ours, to_np(ref.session._replace_control_codes(mx.array(codes, dtype=mx.int32))))


def test_sliding_window_ring_matches_reference(speech, ref_run):
    """A window of 5 (< the 37 warmup positions): the warmup mask, the ring's wrap and its bound."""
    from mlx_vlm.models.nemotron_voicechat.tts import RVQEARTTSModel

    ref, model = speech
    window, ids = 5, ref_run["ids"][:12]
    ref_tts = ref.model.tts_model.tts_model
    ref_cfg = copy.copy(ref_tts.config)
    ref_cfg.sliding_window = window
    small_ref = RVQEARTTSModel(ref_cfg)
    small_ref.update(ref_tts.parameters())
    small_ref.set_vocabulary(ref.tokenizer.get_vocab())
    expected = reference_run(small_ref, ref_run["prompt"], ids, ref.model.tts_model.codec_silence_tokens)

    small = EarTTS(dataclasses.replace(model.config, sliding_window=window))
    small.load_state_dict(model.tts_model.state_dict(), strict=True)
    small.set_vocabulary(ref.tokenizer.get_vocab())
    prompt = prompt_from_reference(ref_run["prompt"])
    warm, hiddens, codes = run_tts(model, small, prompt, ids)
    assert np.abs(warm - expected[0]).max() <= 1e-4
    assert np.abs(hiddens - expected[1]).max() <= 1e-4
    np.testing.assert_array_equal(codes, expected[2])
    assert np.abs(hiddens - ref_run["hiddens"][:12]).max() > 1e-3  # the window changed the result

    with torch.no_grad():
        cache = small.new_cache()
        small.warmup(prompt, cache)
        for _ in range(3):
            small.step(prompt.codes[:, -1:], torch.tensor([PAD]), cache, deterministic=True)
    assert cache.windows == [window, None]
    assert cache.keys[0].shape[2] == cache.values[0].shape[2] == window  # sliding: bounded
    assert cache.keys[1].shape[2] >= 40  # global: every position


# --------------------------------------------------------------------------------------
# Sampling


def sample_codes(model: SpeechDecoder, seed: int, ids=(PAD, 40, 41, EOS, PAD)) -> torch.Tensor:
    """Codes ``[1, len(ids), Q]`` sampled from a fresh session with a generator seeded ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        cache, prev = model.start()
        for t in ids:
            prev = model.step(prev, torch.tensor([t]), cache, generator=generator)
            out.append(prev)
    return torch.cat(out, dim=1)


def test_sampling_is_seeded_and_in_range(speech):
    _, model = speech
    first, again, other = sample_codes(model, 1), sample_codes(model, 1), sample_codes(model, 2)
    assert first.dtype == torch.long and first.shape == (1, 5, 31)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert ((first >= 0) & (first < 1024)).all() and ((other >= 0) & (other < 1024)).all()


def test_sample_component_follows_top_p_and_softmax():
    """Gumbel-max frequencies equal the (top-p renormalised) component probabilities."""
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(40_000, 4)
    generator = torch.Generator().manual_seed(0)
    for top_p, expected in [(1.0, probs), (0.7, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8),
                            (1e-9, torch.tensor([0.0, 1.0, 0.0, 0.0]))]:
        drawn = sample_component(logits, top_p, generator)
        freq = torch.bincount(drawn, minlength=4).float() / drawn.numel()
        assert (freq - expected).abs().max() < 0.012, (top_p, freq)


# --------------------------------------------------------------------------------------
# fuse(), the full-size layout, streaming hygiene, bad input


def test_fuse_keeps_outputs(ckpt_f32, speech, ref_run):
    ref, model = speech
    fused = load_speech(ckpt_f32)
    fused.tts_model.set_vocabulary(ref.tokenizer.get_vocab())
    fused.fuse()
    layer = fused.tts_model.backbone.layers[0]
    assert layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
    assert layer.mlp.gate_up_proj is not None and fused.tts_model.mog_head.proj_heads is not None
    prompt = prompt_from_reference(ref_run["prompt"])
    plain = run_tts(model, model.tts_model, prompt, ref_run["ids"][:10])
    merged = run_tts(fused, fused.tts_model, prompt, ref_run["ids"][:10])
    np.testing.assert_allclose(merged[0], plain[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(merged[1], plain[1], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(merged[2], plain[2])
    with torch.no_grad():
        assert torch.equal(fused.prompt().codes, prompt.codes)
    assert torch.equal(sample_codes(fused, 7), sample_codes(model, 7))


def test_full_size_layout_matches_checkpoint():
    cfg = VoiceChatConfig.full_size()
    with torch.device("meta"):
        model = SpeechDecoder(cfg.tts_config, cfg.codec_config)
    ours = {f"tts_model.{k}": v for k, v in model.state_dict().items()}
    manifest = {k: v for k, v in full_size_manifest("bf16").items() if k.startswith("tts_model.")}
    assert sorted(ours) == sorted(manifest)
    for key, (shape, dtype) in manifest.items():
        assert tuple(ours[key].shape) == shape, key
        assert (ours[key].dtype == torch.int32) == (dtype == "int32"), key


class _NoHostReads(TorchDispatchMode):
    """Fails on any op that reads device data on the host or has a data-dependent shape
    (boolean-mask indexing included)."""

    FORBIDDEN = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique",
                 "aten.unique", "aten.item", "aten.equal", "aten.is_nonzero")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) else ()
        boolean_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        if name.startswith(self.FORBIDDEN) or boolean_index:
            raise AssertionError(f"host read in a step: {name}")
        return func(*args, **(kwargs or {}))


def test_step_has_no_host_reads(speech):
    _, model = speech
    with torch.no_grad():
        cache, prev = model.start()
        generator = torch.Generator().manual_seed(0)
        with _NoHostReads():
            for t, deterministic in ((EOS, True), (40, False), (PAD, True)):
                prev = model.step(prev, torch.tensor([t]), cache, generator=generator, deterministic=deterministic)
            model.replace_control_codes(prev)
    assert prev.shape == (1, 1, 31)


def test_bad_input_is_reported(ckpt_f32, speech):
    _, model = speech
    with torch.no_grad():
        cache, prev = model.start()
        with pytest.raises(ValueError, match=r"prev_codes must have shape \[1, 1, 31\], got \[1, 31\]"):
            model.step(prev[0], torch.tensor([PAD]), cache)
        with pytest.raises(ValueError, match="prev_codes must be an integer tensor"):
            model.step(prev.float(), torch.tensor([PAD]), cache)
        with pytest.raises(ValueError, match=r"text_id must have shape \[1\]"):
            model.step(prev, torch.tensor([[PAD]]), cache)
        with pytest.raises(ValueError, match="already holds 37 positions"):
            model.tts_model.warmup(model.prompt(), cache)
    fresh = load_speech(ckpt_f32)
    with pytest.raises(RuntimeError, match="set_vocabulary"):
        fresh.start()
    with pytest.raises(ValueError, match="one-character tokens"):
        fresh.tts_model.set_vocabulary({"a": 0, "b": 1, "ab": 2})


def test_the_speaker_names_the_prompt_latents():
    from nvchat_torch.model import VoiceChatModel
    from nvchat_torch.models.config import ConfigError
    from nvchat_torch.tiny import tiny_config_dict

    values = {**tiny_config_dict(), "speaker": "Nova"}
    model = VoiceChatModel(VoiceChatConfig.from_dict(values))
    assert "tts_model.audio_prompt_latents.Nova" in model.state_dict()
    assert not any(key.endswith("Aria") for key in model.state_dict())
    assert model.tts_model.audio_prompt_latents.latents().shape == (1, 37, values["tts_config"]["hidden_size"])
    with pytest.raises(ConfigError, match="'speaker'"):
        VoiceChatConfig.from_dict({**values, "speaker": "two words"})


def test_prepare_makes_the_speaker_prompt_and_releases_the_codec_encoder(ckpt_f32):
    """A prepared model's codec encoder is freed (streaming runs it only for the speaker prompt, which
    prepare() makes first): its prompt equals the unprepared model's, and encoding audio then says why it
    cannot, where an unprepared model (training labels) still encodes."""
    import nvchat_torch as nv

    plain = nv.load_model(ckpt_f32, device="cpu", prepare=False)
    codec = plain.tts_model.audio_codec
    assert any(".audio_codec.encoder." in name for name, _ in plain.named_parameters())
    wave = torch.zeros(1, 1, 2 * codec.samples_per_frame)
    with torch.no_grad():
        codes = codec.encode(wave)
    assert codes.shape == (1, plain.config.tts_config.num_quantizers, 2)
    prepared = plain.prepare()
    assert prepared.tts_model.audio_codec.encoder is None
    assert not any(".audio_codec.encoder." in name for name, _ in prepared.named_parameters())
    reference = nv.load_model(ckpt_f32, device="cpu", prepare=False).tts_prompt()
    ours = prepared.tts_prompt()
    for field in dataclasses.fields(TTSPrompt):
        assert torch.equal(getattr(ours, field.name), getattr(reference, field.name)), field.name
    with pytest.raises(RuntimeError, match="encoder was released by the model's prepare"):
        prepared.tts_model.audio_codec.encode(wave)
    session = prepared.create_streaming_session(system_prompt="hi", deterministic=True)
    assert session.push_audio(np.zeros(2 * 1280, np.float32), 16000)  # streams without the encoder
