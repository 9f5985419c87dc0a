"""Fine-tuning (issue 33): teacher-forced forwards against a deterministic streaming session, NeMo's
labels on cases worked from its code (branch ``nemotron-labs-voicechat``, file and lines cited per case),
the losses on small cases computed independently, gradients, overfitting, and LoRA adapters."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

import nvchat_torch as nv
from nvchat_torch.models.quant import QuantizedLinear
from nvchat_torch.tiny import SPECIAL_TOKENS_MAP, build_tokenizer, random_model, save_checkpoint
from nvchat_torch.training import adapters
from nvchat_torch.training import labels as tl
from nvchat_torch.training import objectives as tr

FRAME = 1280


def _model(layout: str):
    """The tiny model in a card's layout, as load_model returns it unprepared: float32, bf16 weights
    (float32 activations), or the mlx-community 4-bit / 8-bit packing; its tokenizer has the tool-call
    markers <SPECIAL_20..22>."""
    model = _layout(layout)
    model.set_tokenizer(PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(300, specials=23),
                                                **SPECIAL_TOKENS_MAP))
    return model


def _layout(layout: str):
    if layout == "f32":
        return random_model("tiny", seed=1)
    if layout == "q4-prepared":  # as load_model returns a card: fused layouts, int4pack, fused CPU kernels
        return random_model("tiny", seed=1, bits=4).prepare()
    if layout == "bf16":
        model = random_model("tiny", seed=1, dtype=torch.bfloat16)
        model.set_activation_dtype(torch.float32)
        model.init_constants("cpu")
        return model
    return random_model("tiny", seed=1, bits={"q4": 4, "q8": 8}[layout])


@pytest.fixture(scope="module")
def wave():
    rng = np.random.default_rng(0)
    return (rng.standard_normal(FRAME * 24) * 0.1).astype(np.float32)


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def _session_run(model, wave, prompt, tools=None):
    """A deterministic session fed 80 ms at a time: each frame's (text, function) ids and codes."""
    options = nv.StreamingOptions(system_prompt=prompt, deterministic=True, tools=tools, tool_hold=None)
    session = model.create_streaming_session(options)
    ids, codes = [], []
    for i in range(len(wave) // FRAME):
        events = session.push_audio(wave[i * FRAME:(i + 1) * FRAME], 16000)
        ids.append(session.last_ids)
        codes.append(next(e.audio_codes for e in events if e.kind == "audio"))
    return torch.tensor(ids), torch.from_numpy(np.stack(codes)).long()


@pytest.mark.parametrize("layout", ["f32", "bf16", "q4", "q8", "q4-prepared", "mlx-card-q4"])
def test_forwards_give_the_sessions_ids_and_codes(layout, wave, request):
    if layout == "mlx-card-q4":  # the 4-bit card MLX itself writes (tests/conftest.py), loaded for training
        model = nv.load_model(request.getfixturevalue("ckpt_q4"), device="cpu", weights="packed", prepare=False)
        assert any(isinstance(m, QuantizedLinear) for m in model.modules())
    else:
        model = _model(layout)
    # a prompt, NVIDIA's function-calling prompt (711 tokens here, each a TTS step of the prefill: on one
    # layout), none (the TTS check below takes the run without a prompt)
    runs = [("Be brief.", None)] + [("Be brief.", TOOLS)] * (layout == "q4-prepared") + [("", None)]
    for prompt, tools in runs:
        ids, codes = _session_run(model, wave, prompt, tools)
        with torch.no_grad():
            out = tr.stt_forward(model, torch.from_numpy(wave), ids[:, 0], ids[:, 1], system_prompt=prompt,
                                 tools=tools)
        assert out.text_logits.shape == (1, len(ids), model.config.text_config.vocab_size)
        assert torch.equal(out.text_logits[0].argmax(-1), ids[:, 0]), layout
        assert torch.equal(out.function_logits[0].argmax(-1), ids[:, 1]), layout
        assert out.prompt_length == (0 if prompt == "" else len(tr.prompt_ids(model, prompt, tools)))
        assert (out.prompt_length > 60) == (tools is not None)
    # Frame 0 runs no TTS (timeline position 0); the steps are frames 1.. (no prompt, so no prompt steps).
    # The events carry the codes with the codec's control codes replaced by silence; the session fed back
    # the raw ones. Teacher-force with the clean codes, then put back the raw picks wherever they clean to
    # the event's codes, and run again: the picks must then clean to the events' codes at every step.
    steps = codes[1:]
    with torch.no_grad():
        for _ in range(2):
            tts = tr.teacher_forced_codes(model, ids[1:, 0], steps)
            picks = tts.codes[0]
            clean = model.tts_model.replace_control_codes(picks)
            steps = torch.where(clean == codes[1:], picks, codes[1:])
    assert torch.equal(clean, codes[1:]), layout
    assert tts.logits.shape[:2] == (1, len(ids) - 1)


def test_stt_forward_batches_rows_and_checks_shapes(wave):
    model = _model("f32")
    ids = torch.randint(0, 300, (2, 10))
    audio = torch.from_numpy(np.stack([wave[:FRAME * 10], wave[FRAME * 10:FRAME * 20]]))
    with torch.no_grad():
        both = tr.stt_forward(model, audio, ids, ids.flip(1), system_prompt="")
        one = tr.stt_forward(model, audio[1], ids[1], ids[1].flip(0), system_prompt="")
    torch.testing.assert_close(both.text_logits[1], one.text_logits[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"audio_16k: 11 frames need \[B, >= 14080\]"):
        tr.stt_forward(model, audio[:, :FRAME * 10], torch.zeros(2, 11, dtype=torch.long), torch.zeros(2, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="differ in shape"):
        tr.stt_forward(model, audio, ids, ids[:, :5])
    with pytest.raises(ValueError, match=r"codes must be \[B, S, 31\]"):
        tr.tts_forward(model, ids[0], torch.zeros(10, 7, dtype=torch.long))


# --------------------------------------------------------------------------------------
# Labels: cases worked by hand from NeMo's code (NeMo itself does not install for CPU tests:
# it needs lhotse, hydra, megatron and a GPU-era torch stack).


def test_num_frames_is_lhotses_rounding():
    # lhotse compute_num_frames, called by build_token_channel (s2s_dataset.py 2261, 2274, 2281):
    # round(t * 16000) samples, hop 1280, (samples + 640) // 1280.
    assert [tl.num_frames(t) for t in (0.0, 0.039, 0.04, 0.08, 0.119, 0.12, 1.0)] == [0, 0, 1, 1, 1, 2, 13]


def test_agent_channel_worked_cases():
    # build_token_channel (s2s_dataset.py 2257-2351): BOS + subwords at num_frames(start), cut to
    # num_frames(end) - pos frames (2289-2294), EOS at num_frames(end) if inside (2337-2340).
    P, B, E = 0, 1, 2
    turns = [(0.16, 0.64, [10, 11, 12]),   # frames 2 .. 8: BOS 10 11 12 at 2-5, EOS at 8
             (0.72, 0.96, [20, 21, 22, 23]),  # 9 .. 12: 3 frames of text (BOS 20 21), EOS at 12
             (1.6, 2.0, [30])]  # starts at frame 20 >= 16 frames: skipped (2262-2266)
    got = tl.agent_channel(turns, 16, bos=B, eos=E, pad=P)
    assert got == [P, P, B, 10, 11, 12, P, P, E, B, 20, 21, E, P, P, P]
    # EOS past the end is dropped; text running past the end is cut (2322-2330)
    assert tl.agent_channel([(0.08, 2.0, [5, 6, 7, 8])], 4, bos=B, eos=E, pad=P) == [P, B, 5, 6]
    # end <= start: no text, but the EOS is still placed (2295-2297, 2337-2340)
    assert tl.agent_channel([(0.4, 0.4, [5])], 8, bos=B, eos=E, pad=P) == [P] * 5 + [E] + [P] * 2
    # The TTS data's channel (duplex_ear_tts_dataset.py 888-925): the text is not cut at the turn's end, whose
    # EOS is written over it (923-925); times round at the cut's 22,050 Hz (1764-sample hop).
    assert tl.agent_channel([(0.08, 0.24, [5, 6, 7, 8])], 8, bos=B, eos=E, pad=P, tts=True, rate=22050) == \
        [P, B, 5, E, 7, 8, P, P]
    assert tl.num_frames(0.12, rate=22050) == 2 and tl.num_frames(0.119, rate=22050) == 1  # (2646 + 882) // 1764


def test_shifts_and_delays_worked_cases():
    P, B, E = 0, 1, 2
    ch = [P, B, 5, 6, E, P, B, 7, P, E]
    # advance_text_channel_by (label_prep.py 124-158): drop the first frames, PAD the end
    assert tl.shift_channel(ch, pad=P, eos=E, bos=B, advance=2) == [5, 6, E, P, B, 7, P, E, P, P]
    # delay_text_channel_by (168-209): an EOS in the last 2 frames moves to frame -2, then PAD the start
    assert tl.shift_channel(ch, pad=P, eos=E, bos=B, delay=2) == [P, P, P, B, 5, 6, E, P, B, 7]
    # delay_eos (22-61): each EOS 3 later unless out of bounds or onto an EOS; original becomes PAD
    assert tl.delay_eos([E, P, P, P, E, P, E], E, P, 3) == [P, P, P, E, E, P, E]  # 4 -> 7, 6 -> 9: out of bounds
    assert tl.delay_eos([E, P, P, E, P], E, P, 3) == [E, P, P, E, P]  # 0 -> 3 is an EOS, 3 -> 6 out: both stay
    assert tl.shift_channel(ch, pad=P, eos=E, bos=B, delay_bos_by=1) == [P, P, B, 6, E, P, P, B, P, E]


def test_function_channel_and_insertions_worked_case():
    # _build_function_calling_channel (duplex_stt_model.py 998-1080) for a 6-frame timeline, one call at
    # frame 2 (ids 40 41) whose result (ids 50) comes at frame 4: events in order, PAD (with loss)
    # between them measured in original frames, the channel grows by the inserted frames.
    P, S, C, R = 0, 90, 91, 92
    fn = tl.function_channel([(2, [40, 41], 4, [50])], 6, pad=P, start=S, end=C, result_end=R)
    assert fn.ids == [P, P, S, 40, 41, C, P, P, 50, R, P, P]
    assert fn.loss_mask == [True, True, True, True, True, True, True, True, False, True, True, True]
    assert fn.insertions == [(2, 4), (4, 1), (4, 1)]
    # _expand_channels_with_insertions (1566-1588): PAD / silence at each insertion, later ones offset
    assert tl.insert_frames([1, 2, 3, 4, 5, 6], fn.insertions, 0) == [1, 2, 0, 0, 0, 0, 3, 4, 0, 0, 5, 6]
    # with a system prompt the steps are offset by its length (1000-1006); no result: call only
    fn = tl.function_channel([(1, [40], -1, [])], 5, pad=P, start=S, end=C, result_end=R, prompt_frames=2)
    assert fn.ids == [P, P, P, S, 40, C, P, P] and all(fn.loss_mask)


def test_manifest_and_example(tmp_path):
    from nvchat_torch.audio_io import write_wav
    model = _model("f32")
    write_wav(tmp_path / "user.wav", np.zeros(FRAME * 20, np.float32), 16000)
    write_wav(tmp_path / "agent.wav", np.zeros(1764 * 12, np.float32) + 0.01, 22050)
    entry = {"id": "a", "user_audio": "user.wav", "agent_audio": "agent.wav", "system_prompt": "Hi.",
             "turns": [{"start": 0.16, "end": 0.96, "text": "hello world"}],
             "tool_calls": [{"time": 0.4, "call": {"name": "f"}, "result": "ok", "result_time": 0.8}]}
    (tmp_path / "m.jsonl").write_text(json.dumps(entry) + "\n")
    [conv] = tl.read_manifest(tmp_path / "m.jsonl")
    assert conv.turns[0].text == "hello world" and conv.tool_calls[0].call == '{"name": "f"}'
    ex = tl.build_example(model, conv)
    words = model.tokenizer.encode("hello world", add_special_tokens=False)
    call = model.tokenizer.encode('{"name": "f"}', add_special_tokens=False)
    grown = 20 - 1 + len(call) + 2 + len(model.tokenizer.encode("ok", add_special_tokens=False)) + 1
    assert len(ex.text) == len(ex.function) == len(ex.function_mask) == grown
    assert len(ex.audio) == (grown + 1) * FRAME
    assert ex.text[1:1 + len(words) + 1] == [model.config.bos_token_id, *words]  # channel frame 2 = label 1
    assert ex.codes.shape == (19, model.config.tts_config.num_quantizers) and len(ex.tts_text) == 19
    (tmp_path / "bad.jsonl").write_text(json.dumps({"user_audio": "user.wav", "turns": [{"start": 1}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 turns\[0\]: missing key 'end'"):
        tl.read_manifest(tmp_path / "bad.jsonl")
    write_wav(tmp_path / "u8.wav", np.zeros(800, np.float32), 8000)
    (tmp_path / "rate.jsonl").write_text(json.dumps({"user_audio": "u8.wav", "turns": []}) + "\n")
    with pytest.raises(ValueError, match="user_audio must be 16000 Hz, got 8000 Hz"):
        tl.read_manifest(tmp_path / "rate.jsonl")


# --------------------------------------------------------------------------------------
# Losses on small cases, computed independently


def test_stt_loss_formula():
    model = _model("f32")
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    v = cfg.text_config.vocab_size
    out = tr.STTOutput(torch.randn(1, 4, v, generator=g), torch.randn(1, 4, v, generator=g), 0)
    text = torch.tensor([[cfg.pad_token_id, 7, cfg.eos_token_id, 9]])
    fn = torch.tensor([[cfg.pad_token_id, 5, 6, cfg.pad_token_id]])
    mask = torch.tensor([[1, 1, 0, 1]])
    frames = torch.tensor([[1, 1, 1, 0]])
    conf = tr.STTLossConfig(text_loss_weight=3.0, function_loss_weight=2.0, token_weights={"pad": 0.5, "eos": 4.0})

    def nll(logits, label):
        return -(logits[label] - math.log(sum(math.exp(x) for x in logits.tolist())))

    tw = [0.5, 1.0, 4.0, 1.0]
    text_ref = sum(nll(out.text_logits[0, t], text[0, t]) * tw[t] * frames[0, t] for t in range(4)) / 3
    fn_ref = sum(nll(out.function_logits[0, t], fn[0, t]) * mask[0, t] * frames[0, t] for t in range(4)) / 3
    got = tr.stt_loss(model, out, text, fn, mask, frames, conf)
    assert got["text_loss"].item() == pytest.approx(float(text_ref), rel=1e-5)
    assert got["function_loss"].item() == pytest.approx(float(fn_ref), rel=1e-5)
    assert got["loss"].item() == pytest.approx(3 * float(text_ref) + 2 * float(fn_ref), rel=1e-5)


def test_tts_loss_formula():
    """c_loss and k_loss from the Gaussian mixture written out per component (full means ``L_k m_k``)."""
    model = _model("f32")
    tts = model.tts_model.tts_model
    head, q = tts.mog_head, tts.config.num_quantizers
    k, r, d = head.num_predictions, head.low_rank, tts.config.latent_size
    g = torch.Generator().manual_seed(3)
    s = 2
    out = tr.TTSOutput(torch.randn(1, s, k, generator=g), torch.randn(1, s, k, r, generator=g),
                       torch.randn(1, s, d, generator=g), torch.randn(1, s, 1, generator=g).clamp(min=-4),
                       torch.arange(q)[None, None].expand(1, s, q) < torch.tensor([[[3], [q]]]),
                       torch.ones(1, s, q, dtype=torch.bool))
    codes = torch.randint(0, tts.config.codebook_size, (1, s, q), generator=g)
    ls = 0.01
    got = tr.tts_loss(model, out, codes, config=tr.TTSLossConfig(label_smoothing=ls))
    # step 0: quantizers 3.. are the target; step 1 knows all quantizers: no target
    y = sum(tts.rvq_embs[i, codes[0, 0, i]] for i in range(3, q)).double()
    logs = out.log_std[0, 0, 0].double()
    logp = []
    for c in range(k):
        mean = head.low_mat[c].double() @ out.mus[0, 0, c].double()
        z = (y - out.mu_res[0, 0].double()) * torch.exp(-logs)
        logp.append((-0.5 * math.log(2 * math.pi) - logs) * d - 0.5 * ((mean - z) ** 2).sum())
    logp = torch.stack(logp)
    post = torch.softmax(logp, 0) * (1 - ls) + ls / k
    count = q - 3
    c_ref = -(post * logp).sum() / count
    k_ref = (post * (torch.log(post + 1e-8) - torch.log_softmax(out.logits[0, 0].double(), 0))).sum() / count
    assert got["c_loss"].item() == pytest.approx(c_ref.item(), rel=1e-4)
    assert got["k_loss"].item() == pytest.approx(k_ref.item(), rel=1e-4, abs=1e-6)


def test_quantizer_masks_follow_the_schedule_and_the_generator():
    conf = tr.TTSLossConfig()
    a = tr.quantizer_masks((4, 500), 31, conf, torch.Generator().manual_seed(1), torch.device("cpu"))
    b = tr.quantizer_masks((4, 500), 31, conf, torch.Generator().manual_seed(1), torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    src, keep = a
    known = src.sum(-1)
    # rate < 0.8 -> masked = ceil((1 - r^3)^(1/3) * 31) in [ceil(0.7874 * 31), 31] = [25, 31]: known in [0, 6]
    assert known.min() == 0 and known.max() == 6
    assert torch.equal(src, torch.arange(31) < known[..., None])  # a prefix
    kept = keep.sum(-1)
    assert 0.4 < (kept < 31).float().mean() < 0.6  # dropout 0.5 (randint can also give 31)
    assert torch.equal(keep, torch.arange(31) < kept[..., None])


# --------------------------------------------------------------------------------------
# Gradients, overfitting


def _example(model, frames=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(frames * FRAME, generator=g) * 0.1
    text = torch.randint(0, 300, (frames,), generator=g)
    fn = torch.full((frames,), model.config.pad_token_id)
    codes = torch.randint(0, model.config.tts_config.codebook_size, (frames, model.config.tts_config.num_quantizers),
                          generator=g)
    return audio, text, fn, codes


def _losses(model, example, generator):
    audio, text, fn, codes = example
    stt = tr.stt_loss(model, tr.stt_forward(model, audio, text, fn, system_prompt=""), text, fn)
    tts = tr.tts_loss(model, tr.tts_forward(model, text, codes, generator=generator), codes)
    return stt["loss"], tts["loss"]


@pytest.mark.parametrize("layout", ["f32", "bf16"])
def test_gradients_are_finite_and_only_on_trainables(layout):
    from nvchat_torch.training.finetune import set_trainable
    model = _model(layout).train()
    trainable = set(set_trainable(model, ["stt", "tts"]))  # NVIDIA's freezing: never the codec
    stt, tts = _losses(model, _example(model), torch.Generator().manual_seed(0))
    (stt + tts).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    used = [n for n, g in grads.items() if g is not None]
    assert set(used) <= trainable and not any(n.startswith("tts_model.audio_codec.") for n in used)
    assert all(torch.isfinite(grads[n]).all() and grads[n].dtype == dict(model.named_parameters())[n].dtype
               for n in used)
    for prefix in ("stt_model.llm.", "stt_model.perception.encoder.", "stt_model.lm_head", "stt_model.function_head",
                   "tts_model.tts_model.backbone.", "tts_model.tts_model.mog_head.", "tts_model.tts_model.embed_subword."):
        assert any(n.startswith(prefix) and grads[n].abs().sum() > 0 for n in used), prefix


def test_one_conversation_overfits():
    """Both losses fall by at least half within 100 steps on the tiny model (AdamW, full fine-tuning)."""
    torch.manual_seed(0)
    model = _model("f32").train()
    model.requires_grad_(True)
    model.tts_model.audio_codec.requires_grad_(False)
    example = _example(model, frames=8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    first = last = None
    for step in range(100):
        stt, tts = _losses(model, example, g)
        if first is None:
            first = (stt.item(), tts.item())
        opt.zero_grad()
        (stt + tts).backward()
        opt.step()
        last = (stt.item(), tts.item())
        if last[0] < first[0] / 2 and last[1] < first[1] / 2:
            break
    assert last[0] < first[0] / 2 and last[1] < first[1] / 2, (first, last, step)


# --------------------------------------------------------------------------------------
# Adapters


def _outputs(model, example):
    audio, text, fn, codes = example
    with torch.no_grad():
        stt = tr.stt_forward(model, audio, text, fn, system_prompt="Be brief.")
        tts = tr.tts_forward(model, text, codes, generator=torch.Generator().manual_seed(5))
    return torch.cat([stt.text_logits.flatten(), stt.function_logits.flatten(), tts.logits.flatten(),
                      tts.mu_res.flatten()])


def _train_adapter(model, example, steps=3):
    opt = torch.optim.AdamW(adapters.lora_parameters(model), lr=1e-2)
    for _ in range(steps):
        stt, tts = _losses(model, example, torch.Generator().manual_seed(0))
        opt.zero_grad()
        (stt + tts).backward()
        opt.step()


@pytest.mark.parametrize("layout", ["f32", "q4"])
def test_lora_zero_init_save_load_and_merge(layout, tmp_path):
    model = _model(layout)
    example = _example(model, frames=6)
    base = _outputs(model, example)
    # On the 4-bit card the adapters sit on the packed LLM (its TTS weights are bf16: a merge into them is
    # rounded to bf16, as peft's merge into a bf16 base is).
    targets = adapters.LLM_TARGETS if layout == "q4" else [adapters.LLM_TARGETS, adapters.TTS_TARGETS]
    names = adapters.add_lora(model, r=4, alpha=8, targets=targets, generator=torch.Generator().manual_seed(0))
    assert any(n.startswith("stt_model.llm.") for n in names)
    assert any(n.startswith("tts_model.") for n in names) == (layout == "f32")
    assert torch.equal(_outputs(model, example), base)  # B = 0: the adapter changes nothing
    frozen = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    _train_adapter(model, example)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in frozen.items())  # the base stays as it was
    if layout == "q4":  # and packed
        assert all(isinstance(m.base_layer, QuantizedLinear) for m in adapters.lora_modules(model).values())
    tuned = _outputs(model, example)
    assert not torch.allclose(tuned, base)
    adapters.save_adapter(model, tmp_path / "adapter")
    fresh = _model(layout)
    adapters.load_adapter(fresh, tmp_path / "adapter")
    assert torch.equal(_outputs(fresh, example), tuned)  # saved and loaded: identical
    adapters.merge_lora(fresh)
    assert not adapters.lora_modules(fresh)
    torch.testing.assert_close(_outputs(fresh, example), tuned, rtol=1e-4, atol=1e-4)  # merged == unmerged


def test_merged_card_loads(tmp_path):
    model = _model("f32")
    example = _example(model, frames=6)
    adapters.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(0))
    _train_adapter(model, example, steps=2)
    tuned = _outputs(model, example)
    adapters.save_merged(model, tmp_path / "card")
    loaded = nv.load_model(tmp_path / "card", device="cpu", dtype=torch.float32, prepare=False)
    torch.testing.assert_close(_outputs(loaded, example), tuned, rtol=1e-4, atol=1e-4)


def test_merged_4bit_card_holds_the_requantized_sum(tmp_path):
    """Merging into the 4-bit card: each adapted layer is stored as MLX's 4-bit quantization of W + (a/r) B A
    (with the layer's own group size), every other tensor as it was."""
    from nvchat_torch.models.quant import dequantize, quantize_affine
    model = _model("q4")
    example = _example(model, frames=4)
    untouched = {k: v.clone() for k, v in model.stt_model.lm_head.state_dict().items()}
    names = adapters.add_lora(model, r=2, alpha=4, targets=adapters.LLM_TARGETS,
                              generator=torch.Generator().manual_seed(0))
    adapters.freeze_packed(model)
    _train_adapter(model, example, steps=1)
    name = names[0]
    layer = adapters.lora_modules(model)[name]
    expected = layer.base_layer.dequantized(torch.float32) + layer.delta()
    assert isinstance(model.stt_model.lm_head, adapters.FrozenPacked)  # on the gradients' path, no adapter
    adapters.save_merged(model, tmp_path / "card")
    loaded = nv.load_model(tmp_path / "card", device="cpu", weights="packed", prepare=False)
    got = loaded.get_submodule(name)
    assert isinstance(got, QuantizedLinear) and got.spec.bits == 4
    wq, scales, biases = quantize_affine(expected, 4, got.spec.group_size)
    assert torch.equal(got.dequantized(torch.float32), dequantize(wq, scales, biases, got.spec, torch.float32))
    assert all(torch.equal(v, loaded.stt_model.lm_head.state_dict()[k]) for k, v in untouched.items())


def test_lora_over_the_int4pack_kernel_trains_like_the_mlx_packing():
    """QLoRA on torch's int4pack kernel (``--int4pack``): the adapters' gradients are those of the same
    adapters over the MLX-packed layers (the same 4-bit weights, another matmul)."""
    from nvchat_torch.models.quant import Int4PackedLinear, pack_int4
    grads = []
    for int4 in (False, True):
        model = _model("q4")
        if int4:
            assert pack_int4(model, dtype=torch.float32) > 0
        adapters.add_lora(model, r=2, alpha=4, targets=adapters.LLM_TARGETS, generator=torch.Generator().manual_seed(0))
        adapters.freeze_packed(model)
        for m in adapters.lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B.weight, std=0.1, generator=torch.Generator().manual_seed(1))
        assert any(isinstance(m.base_layer, Int4PackedLinear) for m in adapters.lora_modules(model).values()) == int4
        stt, _ = _losses(model, _example(model, frames=4), torch.Generator().manual_seed(0))
        stt.backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapters.lora_parameters(model)]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)


def test_lora_dropout_draws_from_the_generator():
    model = _model("f32")
    example = _example(model, frames=4)
    adapters.add_lora(model, r=2, alpha=4, dropout=0.5, targets=adapters.TTS_TARGETS,
                      generator=torch.Generator().manual_seed(0))
    for m in adapters.lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_outputs(model, example), _outputs(model, example))  # eval: no dropout
    model.train()
    runs = []
    for seed in (3, 3, 4):
        for m in adapters.lora_modules(model).values():
            m.generator = torch.Generator().manual_seed(seed)
        runs.append(_outputs(model, example))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("kind", ["mlx", "int4pack"])
def test_packed_base_backward_is_the_dense_one(kind):
    """QLoRA's backward: the input gradient through a frozen 4-bit base equals the dense matmul's, with
    nothing dense saved for it."""
    from nvchat_torch.models.quant import Int4PackedLinear, QuantSpec, quantize_affine
    g = torch.Generator().manual_seed(0)
    base = QuantizedLinear(128, 48, bias=True, spec=QuantSpec(4, 64), scale_dtype=torch.float32)
    wq, s, b = quantize_affine(torch.randn(48, 128, generator=g), 4, 64)
    base.weight.copy_(wq), base.scales.copy_(s), base.biases.copy_(b)
    dense = base.dequantized(torch.float32)
    if kind == "int4pack":
        base = Int4PackedLinear(base, torch.float32)
    layer = adapters.LoRALinear(base, r=2, alpha=2, generator=g)
    torch.nn.init.normal_(layer.lora_B.weight, generator=g)
    x = torch.randn(3, 128, generator=g, requires_grad=True)
    layer(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.linear(x2, dense, base.bias) + layer.scaling * (x2 @ layer.lora_A.weight.t()) @ layer.lora_B.weight.t()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)


def test_peft_reads_our_adapter(tmp_path):
    """peft (the ``train`` extra) loads a saved adapter onto the dense model and computes the same outputs."""
    import peft  # the train extra, which .ci/run installs
    model = _model("f32")
    example = _example(model, frames=6)
    adapters.add_lora(model, r=4, alpha=8, targets=adapters.TTS_TARGETS, generator=torch.Generator().manual_seed(0))
    _train_adapter(model, example, steps=2)
    adapters.save_adapter(model, tmp_path / "adapter")
    ours = _outputs(model, example)
    other = _model("f32")
    config = peft.LoraConfig.from_pretrained(str(tmp_path / "adapter"))
    peft.inject_adapter_in_model(config, other)
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    result = peft.set_peft_model_state_dict(other, {k.removeprefix("base_model.model."): v for k, v in state.items()})
    assert not result.unexpected_keys
    torch.testing.assert_close(_outputs(other, example), ours, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# The command line


def test_finetune_command_line(tmp_path):
    from nvchat_torch.audio_io import write_wav
    from nvchat_torch.training import finetune
    rng = np.random.default_rng(1)
    write_wav(tmp_path / "user.wav", (rng.standard_normal(FRAME * 12) * 0.1).astype(np.float32), 16000)
    write_wav(tmp_path / "agent.wav", (rng.standard_normal(1764 * 12) * 0.1).astype(np.float32), 22050)
    entry = {"user_audio": "user.wav", "agent_audio": "agent.wav",
             "turns": [{"start": 0.08, "end": 0.8, "text": "hello you"}]}
    (tmp_path / "m.jsonl").write_text(json.dumps(entry) + "\n")
    out = tmp_path / "run"
    assert finetune.main(["--data", str(tmp_path / "m.jsonl"), "--out", str(out), "--steps", "3", "--lr", "1e-3",
                          "--merge"]) == 0
    log = [json.loads(line) for line in (out / "loss_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3]
    assert all(math.isfinite(e[k]) for e in log for k in ("loss", "stt_loss", "tts_loss", "c_loss", "k_loss"))
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    merged = nv.load_model(out / "model", device="cpu", dtype=torch.float32)  # the merged card loads
    assert merged.config.text_config.vocab_size == 320
    card = save_checkpoint(_model("q4"), tmp_path / "card4", bits=4, group_size=64)  # a 4-bit card: QLoRA
    assert finetune.main(["--data", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "q"), "--model", str(card),
                          "--steps", "2", "--objectives", "stt", "--lora-targets", "llm"]) == 0
    config = json.loads((tmp_path / "q" / "train_config.json").read_text())
    reference = _model("q4")
    adapters.add_lora(reference, r=8, targets=adapters.LLM_TARGETS)
    assert config["weights"] == "packed"
    assert config["trainable_parameters"] == sum(p.numel() for p in adapters.lora_parameters(reference))
    full = tmp_path / "full"
    assert finetune.main(["--data", str(tmp_path / "m.jsonl"), "--out", str(full), "--steps", "2", "--full",
                          "--objectives", "stt"]) == 0
    assert (full / "model" / "model.safetensors").exists() and not (full / "adapter").exists()


def test_full_fine_tuning_freezes_as_nvidia_does():
    from nvchat_torch.training.finetune import set_trainable
    model = _model("f32")
    names = set_trainable(model, ["stt", "tts"])
    assert not any(n.startswith(("tts_model.audio_codec.", "stt_model.rnnt_")) for n in names)
    assert "tts_model.tts_model.rvq_embs" not in names
    assert any(n.startswith("stt_model.llm.") for n in names) and any(n.startswith("tts_model.tts_model.backbone.") for n in names)
    stt_only = set_trainable(model, ["stt"], freeze=[r"stt_model\.perception\..+"])
    assert not any(n.startswith(("tts_model.", "stt_model.perception.")) for n in stt_only)
    tts_and_head = set_trainable(model, ["tts"], keep=[r"stt_model\.lm_head\.weight"])  # prevent_freeze_params
    assert "stt_model.lm_head.weight" in tts_and_head and not any(n.startswith("stt_model.llm.") for n in tts_and_head)
    assert all(p.requires_grad == (n in tts_and_head) for n, p in model.named_parameters())


def test_eos_resets_the_previous_codes_to_silence():
    """At an EOS step the session feeds the silence codes instead of the previous frame's; NeMo's training
    input does not (``eos_resets=False``): the two differ from that step on, not before."""
    model = _model("f32")
    _, text, _, codes = _example(model, frames=6)
    text[3] = model.config.eos_token_id
    text[:3] = torch.where(text[:3] == model.config.eos_token_id, 5, text[:3])
    with torch.no_grad():
        on = tr.tts_forward(model, text, codes, generator=torch.Generator().manual_seed(0))
        off = tr.tts_forward(model, text, codes, generator=torch.Generator().manual_seed(0), eos_resets=False)
    assert torch.equal(on.mu_res[:, :3], off.mu_res[:, :3]) and not torch.allclose(on.mu_res[:, 3], off.mu_res[:, 3])


# --------------------------------------------------------------------------------------
# Many processes (torchrun)


def _two_conversations(folder) -> Path:
    from nvchat_torch.audio_io import write_wav
    rng = np.random.default_rng(2)
    lines = []
    for i in range(2):
        write_wav(folder / f"user{i}.wav", (rng.standard_normal(FRAME * 10) * 0.1).astype(np.float32), 16000)
        write_wav(folder / f"agent{i}.wav", (rng.standard_normal(1764 * 10) * 0.1).astype(np.float32), 22050)
        lines.append(json.dumps({"user_audio": f"user{i}.wav", "agent_audio": f"agent{i}.wav",
                                 "turns": [{"start": 0.08 * (i + 1), "end": 0.7, "text": ["hello you", "fine"][i]}]}))
    (folder / "m.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "m.jsonl"


def test_two_processes_train_as_one_with_twice_the_accumulation(tmp_path):
    """torchrun with 2 CPU processes (gloo) and --accumulate 1 takes the same global batch per step as one
    process with --accumulate 2, and every random draw is keyed by (seed, step, conversation): the losses
    and the adapters are the same within float tolerance. Rank 0 writes every file."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from nvchat_torch.training import finetune
    manifest = _two_conversations(tmp_path)
    common = ["--data", str(manifest), "--steps", "2", "--lr", "1e-3", "--lora-dropout", "0.1", "--seed", "3"]
    assert finetune.main([*common, "--out", str(tmp_path / "one"), "--accumulate", "2"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "nvchat_torch.finetune", *common, "--out", str(tmp_path / "two"), "--accumulate", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [[json.loads(line) for line in (tmp_path / run / "loss_log.jsonl").read_text().splitlines()]
            for run in ("one", "two")]
    assert [e["step"] for e in logs[1]] == [1, 2]
    for a, b in zip(*logs):
        for key in ("loss", "stt_loss", "tts_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (key, a, b)
    one, two = (load_file(str(tmp_path / run / "adapter" / "adapter_model.safetensors")) for run in ("one", "two"))
    assert one.keys() == two.keys() and one
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6)
    assert json.loads((tmp_path / "two" / "train_config.json").read_text())["global_batch"] == 2
    # A global batch larger than the conversations is refused before any work, naming both.
    with pytest.raises(SystemExit, match="2 conversation.*fewer than the global batch of 3"):
        finetune.main([*common, "--out", str(tmp_path / "three"), "--accumulate", "3"])


def test_a_resumed_run_equals_an_uninterrupted_one_on_another_number_of_processes(tmp_path):
    """Stopped after 2 steps (its checkpoint) and resumed to 4 on 2 processes, a run gives the uninterrupted
    4-step run's losses and adapters, and its loss log goes on in the same file. --resume without a
    checkpoint, or with another setting, is refused, naming it."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from nvchat_torch.training import finetune
    manifest = _two_conversations(tmp_path)
    common = ["--data", str(manifest), "--lr", "1e-3", "--seed", "5"]
    assert finetune.main([*common, "--out", str(tmp_path / "whole"), "--steps", "4", "--accumulate", "2"]) == 0
    run = tmp_path / "stopped"
    assert finetune.main([*common, "--out", str(run), "--steps", "2", "--accumulate", "2", "--save-every", "2"]) == 0
    assert (run / "checkpoint.pt").exists()
    with pytest.raises(SystemExit, match="was written with lr=0.001; this run has lr=0.002"):
        finetune.main(["--data", str(manifest), "--lr", "2e-3", "--seed", "5", "--out", str(run), "--steps", "4",
                       "--accumulate", "2", "--resume"])
    with pytest.raises(SystemExit, match="checkpoint.pt does not exist"):
        finetune.main([*common, "--out", str(tmp_path / "empty"), "--steps", "4", "--resume"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "nvchat_torch.finetune", *common, "--out", str(run), "--steps", "4", "--accumulate",
                           "1", "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [[json.loads(line) for line in (tmp_path / name / "loss_log.jsonl").read_text().splitlines()]
            for name in ("whole", "stopped")]
    assert [e["step"] for e in logs[1]] == [1, 2, 3, 4]
    for a, b in zip(*logs):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)
    whole, resumed = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors"))
                      for name in ("whole", "stopped"))
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=1e-4, atol=1e-6)


def test_full_fine_tuning_sharded_on_two_processes_equals_one(tmp_path):
    """--full --fsdp on 2 processes (FSDP2 over gloo: each trained Nemotron-H block, TTS layer and Conformer
    layer its own unit) gives one process's --full run: its losses and the merged card, which loads; a
    sharded run stopped and resumed gives the uninterrupted one. --fsdp outside torchrun, or without
    --full, is refused before any work."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from nvchat_torch.training import finetune
    manifest = _two_conversations(tmp_path)
    common = ["--data", str(manifest), "--steps", "2", "--lr", "1e-4", "--seed", "3", "--full"]
    assert finetune.main([*common, "--out", str(tmp_path / "one"), "--accumulate", "2"]) == 0
    with pytest.raises(SystemExit, match="--fsdp shards over processes: run it under torchrun"):
        finetune.main([*common, "--out", str(tmp_path / "x"), "--fsdp"])
    with pytest.raises(SystemExit, match="--fsdp shards full fine-tuning: add --full"):
        finetune.main(["--data", str(manifest), "--out", str(tmp_path / "x"), "--fsdp"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "nvchat_torch.finetune", *common, "--fsdp", "--out", str(tmp_path / "two"),
                           "--accumulate", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [[json.loads(line) for line in (tmp_path / run / "loss_log.jsonl").read_text().splitlines()]
            for run in ("one", "two")]
    for a, b in zip(*logs, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)
    one, two = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("one", "two"))
    assert one.keys() == two.keys()
    before = nv.load_tiny_model("cpu", torch.float32, prepare=False).state_dict()  # the command's start
    assert any(not torch.equal(one[k], before[k]) for k in one if k in before)  # the run trained something
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6)
    nv.load_model(tmp_path / "two" / "model", device="cpu", dtype=torch.float32)  # the sharded run's card loads
    # Stopped after 1 step (its shards in DIR/checkpoint/, torch.distributed.checkpoint) and resumed to 2:
    # the uninterrupted sharded run's card.
    for steps, more in (("1", []), ("2", ["--resume"])):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "nvchat_torch.finetune", *common[:2], "--steps", steps, *common[4:], "--fsdp",
                               "--out", str(tmp_path / "stopped"), "--accumulate", "1", "--save-every", "1", *more],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "stopped" / "checkpoint" / "run.pt").exists()
    resumed = load_file(str(tmp_path / "stopped" / "model" / "model.safetensors"))
    for name in two:
        torch.testing.assert_close(resumed[name], two[name], rtol=1e-5, atol=1e-7)
