"""The VoiceChat session end to end against the MLX reference (deterministic mode, float32)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_oracle import full_size_manifest, synth_audio

import nvchat_torch as nv
from nvchat_torch.model import build_model

RAGGED = (777, 1013, 333, 2048, 1, 1280, 4001)
PROMPT = "you are a helpful assistant"


def chunks(wave: np.ndarray, sizes) -> list[np.ndarray]:
    out, pos, i = [], 0, 0
    while pos < len(wave):
        n = sizes[i % len(sizes)]
        out.append(wave[pos:pos + n])
        pos, i = pos + n, i + 1
    return out


def channel(events, kind: str) -> tuple[list, str]:
    """A text channel as ``(frame, token_id)`` per token and its final text. The reference's deltas do
    not add up where a character is split over tokens (U+FFFD); ours hold it back, so only the ids and
    the final text are compared with it (the final text being the reference's decode of them all)."""
    evs = [e for e in events if e.kind == kind]
    return [(e.frame_index, e.token_id) for e in evs if e.token_id is not None], (evs[-1].text if evs else "")


TEXT_CHANNELS = ("assistant_text_delta", "function_delta")


def as_reference_shows(events) -> list[tuple]:
    """The events (audio and done aside) as comparable with the MLX reference's: a text channel's
    event by its frame and token id (the reference streams U+FFFD where we hold a split character
    back, and we release the held text at the end in an event of no token), the rest whole; then
    each text channel's final text, which is the same (the decode of all its ids)."""
    shown = [(e.kind, e.frame_index, e.token_id) if e.kind in TEXT_CHANNELS else
             (e.kind, e.frame_index, e.token_id, e.delta, e.text) for e in events
             if e.kind not in ("audio", "done") and not (e.kind in TEXT_CHANNELS and e.token_id is None)]
    finals = [([e.text for e in events if e.kind == kind] or [""])[-1] for kind in TEXT_CHANNELS]
    return shown + [("final", kind, text) for kind, text in zip(TEXT_CHANNELS, finals)]


def run_reference_stream(ref, wave, prompt, sizes=RAGGED, **kwargs) -> dict:
    sess = ref.session.create_streaming_session(system_prompt=prompt, seed=0, **kwargs)
    events = []
    for c in chunks(wave, sizes):
        events += sess.push_audio(c)
    events += sess.flush()
    prompt_steps = len(sess._text_tokens) - sess.frame_index
    audio = [e for e in events if e.kind == "audio"]
    return {
        "text_ids": np.array(sess._text_tokens[prompt_steps:]),
        "function_ids": np.array(sess._function_tokens[prompt_steps:]),
        "codes": np.stack([np.array(e.audio_codes) for e in audio]),
        "audio": np.concatenate([np.array(e.samples) for e in audio]),
        "transcript": [(e.frame_index, e.delta, e.text) for e in events if e.kind == "user_transcript_delta"],
        "text": channel(events, "assistant_text_delta"),
        "function": channel(events, "function_delta"),
        "prompt_steps": prompt_steps,
    }


def run_stream(model, wave, prompt, sizes=RAGGED, **options) -> dict:
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=prompt, seed=0,
                                                                 deterministic=True, **options))
    events = []
    for c in chunks(wave, sizes):
        events += session.push_audio(c, 16000)
    events += session.flush()
    audio = [e for e in events if e.kind == "audio"]
    per_frame = {e.frame_index: e for e in events if e.kind == "assistant_text_delta"}
    assert [e.frame_index for e in audio] == list(range(len(audio)))
    assert events[-1].kind == "done" and events[-1].frame_index == len(audio)
    for kind, acc in (("assistant_text_delta", session._text), ("function_delta", session._function)):
        deltas = [e for e in events if e.kind == kind]
        joined = "".join(e.delta for e in deltas)  # what a client shows: the decode, exactly
        assert joined == model.tokenizer.decode(acc.tokens, skip_special_tokens=False)
        assert all(joined.startswith(e.text) and e.text.endswith(e.delta) for e in deltas)
    return {
        "events": events,
        "session": session,
        "codes": np.stack([e.audio_codes for e in audio]),
        "audio": np.concatenate([e.samples for e in audio]),
        "transcript": [(e.frame_index, e.delta, e.text) for e in events if e.kind == "user_transcript_delta"],
        "text": channel(events, "assistant_text_delta"),
        "function": channel(events, "function_delta"),
        "text_frames": per_frame,
    }


@pytest.fixture(scope="module")
def wave():
    return synth_audio(2.5)


@pytest.fixture(scope="module")
def tiny_model(ckpt_f32):
    return nv.load_model(ckpt_f32, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("kind", ["f32", "q8", "q4"])
@pytest.mark.parametrize("prompt", [PROMPT, ""], ids=["prompt", "no-prompt"])
def test_streaming_matches_reference(request, reference, wave, kind, prompt):
    path = request.getfixturevalue({"f32": "ckpt_f32", "q8": "ckpt_q8", "q4": "ckpt_q4"}[kind])
    ref = run_reference_stream(reference(path), wave, prompt)
    model = nv.load_model(path, device="cpu", dtype=torch.float32)
    ours = run_stream(model, wave, prompt)
    assert ours["session"].timeline_index - ours["session"].frame_index == ref["prompt_steps"]
    np.testing.assert_array_equal(ours["codes"], ref["codes"])
    assert ours["text"] == ref["text"]  # ids, deltas and cumulative text, frame by frame
    assert ours["function"] == ref["function"]
    assert ours["transcript"] == ref["transcript"]
    assert len(ref["text_ids"]) == len(ours["codes"])
    assert ours["audio"].shape == ref["audio"].shape == (len(ours["codes"]) * 1764,)
    np.testing.assert_allclose(ours["audio"], ref["audio"], atol=1e-3, rtol=0)
    # the control-code replacement and EOS paths are exercised by this input
    assert np.isin(ref["codes"], reference(path).model.tts_model.codec_silence_tokens).any()


@pytest.mark.parametrize("kind", ["f32", "q4"])
def test_offline_matches_reference(request, reference, wave, kind):
    path = request.getfixturevalue({"f32": "ckpt_f32", "q4": "ckpt_q4"}[kind])
    ref = reference(path)
    model = nv.load_model(path, device="cpu", dtype=torch.float32)
    for prompt in (PROMPT, ""):
        want = ref.session.generate(mx.array(wave), system_prompt=prompt, seed=0)
        got = model.generate(wave, system_prompt=prompt, seed=0, deterministic=True)
        assert_same_offline(got, want)
        np.testing.assert_allclose(got.audio, np.array(want.audio), atol=1e-3, rtol=0)


def assert_same_offline(got, want) -> None:
    """An offline turn's discrete outputs identical to the reference's ``generate``."""
    np.testing.assert_array_equal(got.text_ids, np.array(want.text_tokens))
    np.testing.assert_array_equal(got.function_ids, np.array(want.function_tokens))
    np.testing.assert_array_equal(got.audio_codes, np.array(want.audio_codes))
    assert got.text == want.text
    assert got.user_transcript == want.user_transcript
    assert got.audio.shape == (len(got.text_ids) * 1764,)


def test_uncached_paths_match_the_reference_and_the_cached_path(reference, ckpt_f32, tiny_model, wave):
    ref = run_reference_stream(reference(ckpt_f32), wave, PROMPT, use_perception_cache=False,
                               use_language_cache=False)
    uncached = run_stream(tiny_model, wave, PROMPT, use_perception_cache=False, use_language_cache=False)
    cached = run_stream(tiny_model, wave, PROMPT)
    for ours in (uncached, cached):
        np.testing.assert_array_equal(ours["codes"], ref["codes"])
        assert ours["text"] == ref["text"] and ours["function"] == ref["function"]
        assert ours["transcript"] == ref["transcript"]
    np.testing.assert_allclose(uncached["audio"], cached["audio"], atol=1e-4, rtol=0)


def test_1280_sample_pushes_give_the_same_events(tiny_model, wave):
    ragged = run_stream(tiny_model, wave, PROMPT)
    framed = run_stream(tiny_model, wave, PROMPT, sizes=(1280,))
    np.testing.assert_array_equal(ragged["codes"], framed["codes"])
    assert ragged["text"] == framed["text"] and ragged["transcript"] == framed["transcript"]
    np.testing.assert_array_equal(ragged["audio"], framed["audio"])


def test_chunk_boundaries_and_event_types(tiny_model, wave):
    session = tiny_model.create_streaming_session(nv.StreamingOptions(deterministic=True))
    counts = []
    pos = 0
    for n in (300, 1000, 1280, 2000):
        events = session.push_audio(wave[pos:pos + n], 16000)
        pos += n
        counts.append(sum(e.kind == "audio" for e in events))
        for e in events:
            if e.kind == "audio":
                assert isinstance(e.samples, np.ndarray) and e.samples.dtype == np.float32
                assert e.samples.shape == (1764,) and e.sample_rate == 22050
                assert isinstance(e.audio_codes, np.ndarray) and e.audio_codes.shape == (31,)
                assert ((0 <= e.audio_codes) & (e.audio_codes < 1024)).all()
    assert counts == [0, 1, 1, 1]
    assert session.frame_index == 3
    tail = session.flush(pad_partial=True)
    assert [e.kind for e in tail if e.kind in ("audio", "done")] == ["audio", "done"]
    assert tail[-1].frame_index == 4


def test_lifecycle(tiny_model, wave):
    session = tiny_model.create_streaming_session(nv.StreamingOptions())
    session.push_audio(wave[:2000], 16000)
    text = session.text
    events = session.flush(pad_partial=False)  # the 720-sample partial frame is dropped
    # (the text held back at the last frame, an incomplete character, is released first)
    assert [e.kind for e in events if e.kind not in TEXT_CHANNELS] == ["done"] and events[-1].frame_index == 1
    released = [e for e in events if e.kind == "assistant_text_delta"]
    assert all(e.token_id is None for e in events if e.kind in TEXT_CHANNELS)
    assert all(e.token_id is None for e in released)
    assert text + "".join(e.delta for e in released) == session.text == \
        tiny_model.tokenizer.decode(session._text.tokens, skip_special_tokens=False)
    assert session.closed
    with pytest.raises(RuntimeError, match="closed"):
        session.push_audio(wave[:1280], 16000)
    assert session.flush() == [] and session.cancel() == []

    session = tiny_model.create_streaming_session(nv.StreamingOptions())
    session.push_audio(wave[:3000], 16000)
    events = session.cancel()
    assert [(e.kind, e.frame_index) for e in events if e.kind not in TEXT_CHANNELS] == [("cancelled", 2)]
    assert all(e.token_id is None for e in events if e.kind in TEXT_CHANNELS)
    assert session.flush() == [] and session.cancel() == []


def test_context_limit(tiny_model, wave):
    session = tiny_model.create_streaming_session(nv.StreamingOptions(max_streaming_seconds=0.24))
    session.push_audio(wave[:2 * 1280], 16000)
    assert session.frame_index == 2
    with pytest.raises(nv.ContextLimit, match="max_streaming_seconds") as limit:
        session.push_audio(wave[:2 * 1280], 16000)  # the third frame runs, the fourth would pass the limit
    assert session.frame_index == 3
    assert [e.frame_index for e in limit.value.events if e.kind == "audio"] == [2]
    with pytest.raises(nv.ContextLimit):
        session.push_audio(wave[:1280], 16000)
    with pytest.raises(ValueError, match="max_streaming_seconds"):
        nv.StreamingOptions(max_streaming_seconds=0)


@pytest.mark.parametrize("bad,rate,match", [
    (np.zeros(1280, np.float32), 44100, "44100"),
    (np.zeros((2, 1280), np.float32), 16000, "mono"),
    (np.full(1280, np.nan, np.float32), 16000, "NaN"),
    (np.array([0.0, np.inf] * 640, np.float32), 16000, "Inf"),
    (np.zeros(1280, np.int32), 16000, "int32"),
])
def test_bad_input_is_rejected_and_leaves_the_session_unchanged(tiny_model, wave, bad, rate, match):
    clean = tiny_model.create_streaming_session(nv.StreamingOptions(deterministic=True))
    dirty = tiny_model.create_streaming_session(nv.StreamingOptions(deterministic=True))
    first = clean.push_audio(wave[:1000], 16000)
    assert dirty.push_audio(wave[:1000], 16000) == first == []
    with pytest.raises(ValueError, match=match):
        dirty.push_audio(bad, rate)
    a = clean.push_audio(wave[1000:4000], 16000)
    b = dirty.push_audio(wave[1000:4000], 16000)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.kind == y.kind and x.frame_index == y.frame_index and x.delta == y.delta
        if x.kind == "audio":
            np.testing.assert_array_equal(x.samples, y.samples)


def test_accepted_input_types_agree(tiny_model, wave):
    pcm16 = np.round(wave[:2560] * 32767).astype(np.int16)
    outputs = []
    for chunk in (pcm16.astype(np.float32) / 32768, pcm16.astype(np.float64) / 32768, pcm16,
                  torch.from_numpy(pcm16.astype(np.float32) / 32768)[None]):
        session = tiny_model.create_streaming_session(nv.StreamingOptions(deterministic=True))
        outputs.append(np.concatenate([e.samples for e in session.push_audio(chunk, 16000) if e.kind == "audio"]))
    for out in outputs[1:]:
        np.testing.assert_allclose(out, outputs[0], atol=1e-6)


def test_two_sessions_on_one_model_are_independent(tiny_model, wave):
    """Interleaved pushes into two sessions give what each gives alone (sampling mode, own seeds)."""
    inputs = {"a": (nv.StreamingOptions(system_prompt=PROMPT, seed=3), chunks(wave, RAGGED)),
              "b": (nv.StreamingOptions(seed=4), chunks(wave[::-1].copy(), (1280,)))}
    alone = {}
    for name, (options, pieces) in inputs.items():
        session = tiny_model.create_streaming_session(options)
        alone[name] = [e for c in pieces for e in session.push_audio(c, 16000)]
    sessions = {name: tiny_model.create_streaming_session(options) for name, (options, _) in inputs.items()}
    together = {"a": [], "b": []}
    for ca, cb in itertools.zip_longest(inputs["a"][1], inputs["b"][1]):
        for name, c in (("a", ca), ("b", cb)):
            if c is not None:
                together[name] += sessions[name].push_audio(c, 16000)
    for name in inputs:
        seq, inter = alone[name], together[name]
        assert [(e.kind, e.frame_index, e.delta) for e in seq] == [(e.kind, e.frame_index, e.delta) for e in inter]
        assert sum(e.kind == "audio" for e in seq) > 10
        for x, y in zip(seq, inter):
            if x.kind == "audio":
                np.testing.assert_array_equal(x.audio_codes, y.audio_codes)
                np.testing.assert_array_equal(x.samples, y.samples)


def test_sampling_mode_is_seeded(tiny_model, wave):
    def codes(seed):
        session = tiny_model.create_streaming_session(nv.StreamingOptions(seed=seed))
        return np.stack([e.audio_codes for e in session.push_audio(wave[:12800], 16000) if e.kind == "audio"])

    first, again, other = codes(1), codes(1), codes(2)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first[1:], other[1:])  # frame 0 is the silence code either way
    assert ((0 <= first) & (first < 1024)).all()


def test_profile(tiny_model, wave):
    session = tiny_model.create_streaming_session(nv.StreamingOptions(profile=True))
    session.push_audio(wave[:8 * 1280], 16000)
    summary = session.profile.summary(drop_first=2)
    assert summary["frames"] == 6 and summary["dropped_cold_frames"] == 2
    stages = summary["stages"]
    assert set(stages) == {"perception", "rnnt", "language", "tts", "codec", "total"}
    for stage in stages.values():
        assert 0 < stage["p50_ms"] <= stage["p95_ms"] <= stage["max_ms"]
    parts = sum(stages[s]["mean_ms"] for s in ("perception", "rnnt", "language", "tts", "codec"))
    assert parts <= stages["total"]["mean_ms"] * 1.001
    assert summary["realtime_factor"] == pytest.approx(stages["total"]["mean_ms"] / 80.0)
    assert summary["processing_frames_per_second"] == pytest.approx(1000.0 / stages["total"]["mean_ms"])
    assert "real-time factor" in session.profile.table(2)
    assert len(tiny_model.create_streaming_session(nv.StreamingOptions()).profile.frames) == 0


def test_profile_percentiles_interpolate_like_the_reference():
    from nvchat_torch.events import FrameTiming, VoiceChatProfile

    prof = VoiceChatProfile(80.0, [FrameTiming(i, 1, 1, 1, 1, 1, float(v)) for i, v in enumerate([10, 40, 20, 30])])
    s = prof.summary()["stages"]["total"]
    assert (s["mean_ms"], s["p50_ms"], s["max_ms"]) == (25.0, 25.0, 40.0)
    assert s["p95_ms"] == pytest.approx(38.5)  # position 0.95 * 3 = 2.85 of [10, 20, 30, 40]


def test_loaded_state_dict_is_the_checkpoints(ckpt_q4):
    from nvchat_torch.loading.checkpoint import Checkpoint

    model = nv.load_model(ckpt_q4, device="cpu", dtype=torch.float32, prepare=False, weights="packed")
    with Checkpoint(ckpt_q4) as ckpt:
        stored = {k: ckpt.shape(k) for k in ckpt.keys()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == stored


@pytest.mark.parametrize("kind", ["bf16", "4bit", "8bit"])
def test_full_size_model_on_meta_has_the_checkpoint_layout(kind):
    config = nv.VoiceChatConfig.full_size()
    manifest = full_size_manifest(kind)
    if kind != "bf16":
        bits = {"4bit": 4, "8bit": 8}[kind]
        config.quantization = {"group_size": 64, "bits": bits}
        packed = {k[: -len(".scales")]: config.quant_spec(k[: -len(".scales")], stored=True)
                  for k in manifest if k.endswith(".scales")}
    else:
        packed = {}
    model = build_model(config, "meta", packed)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == {k: shape for k, (shape, _) in manifest.items()}


def test_prepare_changes_layouts_not_outputs(ckpt_q4, wave):
    """The post-load transforms (fused projections, tables, int4pack) leave every output as it was."""
    outputs = []
    for prepare in (False, True):
        model = nv.load_model(ckpt_q4, device="cpu", dtype=torch.float32, prepare=prepare)
        outputs.append(run_stream(model, wave[:16000], PROMPT))
    plain, prepared = outputs
    np.testing.assert_array_equal(plain["codes"], prepared["codes"])
    assert plain["text"] == prepared["text"] and plain["transcript"] == prepared["transcript"]
    np.testing.assert_allclose(plain["audio"], prepared["audio"], atol=1e-4)


def test_xscaling_streams_like_the_references_offline_encoder(tmp_path, ckpt_f32, reference, wave):
    """With ``xscaling`` on (NeMo's FastConformer default), our cached stream applies it as offline does;
    the reference's uncached stream (its offline encoder) agrees frame for frame. (Its cached path
    omits the scaling, so it is not the oracle here.)"""
    import json
    import shutil

    path = tmp_path / "xscaling"
    shutil.copytree(ckpt_f32, path)
    config = json.loads((path / "config.json").read_text())
    config["audio_config"]["encoder"]["xscaling"] = True
    (path / "config.json").write_text(json.dumps(config))
    ref = run_reference_stream(reference(path), wave, PROMPT, use_perception_cache=False)
    ours = run_stream(nv.load_model(path, device="cpu", dtype=torch.float32), wave, PROMPT)
    np.testing.assert_array_equal(ours["codes"], ref["codes"])
    assert ours["text"] == ref["text"] and ours["transcript"] == ref["transcript"]
    plain = run_stream(nv.load_model(ckpt_f32, device="cpu", dtype=torch.float32), wave, PROMPT)
    assert not np.array_equal(plain["codes"], ours["codes"])  # the scaling matters


@pytest.mark.parametrize("spec", [
    dict(seed=12, bits=4, rnnt_blank_boost=-1.0, pattern="M*M-*-M"),  # a dense transcript, another layer pattern
    dict(seed=13, bits=8, conformer_bias=True, hidden=128, control_codes=(0, 1, 2)),
], ids=["dense-transcript", "biases-wide"])
def test_streaming_matches_reference_on_other_seeds_and_shapes(make_checkpoint, reference, spec):
    path = make_checkpoint(**spec)
    wave = synth_audio(2.0, seed=spec["seed"])
    ref = run_reference_stream(reference(path), wave, PROMPT)
    ours = run_stream(nv.load_model(path, device="cpu", dtype=torch.float32), wave, PROMPT)
    np.testing.assert_array_equal(ours["codes"], ref["codes"])
    assert ours["text"] == ref["text"] and ours["function"] == ref["function"]
    assert ours["transcript"] == ref["transcript"]
    np.testing.assert_allclose(ours["audio"], ref["audio"], atol=1e-3, rtol=0)
