"""Long conversations: flat per-frame work, the session limit, memory formulas, clean failures, threads."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from mlx_oracle import synth_audio
from test_session import as_reference_shows

import nvchat_torch as nv
import nvchat_torch.runtime.timeline as timeline_module
from nvchat_torch.diagnostics import OpCounter
from nvchat_torch.events import TokenAccumulator
from nvchat_torch.model import VoiceChatModel
from nvchat_torch.models.config import VoiceChatConfig
from nvchat_torch.models.rnnt import TranscriptText, decode_pieces
from nvchat_torch.tiny import _hf_tokenizer, randomize_, tiny_config_dict

PROMPT = "you are a helpful assistant"
FRAME = 1280
SKIP = {1, 2, 11, 12}


@pytest.fixture(scope="module")
def tiny():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


def small_context_model(max_positions: int) -> VoiceChatModel:
    """The tiny model with a short LLM context, to reach the model's own limit quickly."""
    return tiny_model_with("text_config", max_position_embeddings=max_positions)


def tiny_model_with(section: str, **values) -> VoiceChatModel:
    """The tiny model (random weights, prepared) with ``values`` set in its config's ``section``."""
    config = tiny_config_dict("tiny")
    config[section].update(values)
    with torch.device("cpu"), torch.no_grad():
        model = VoiceChatModel(VoiceChatConfig.from_dict(config))
    tokenizer = _hf_tokenizer()
    randomize_(model, 0, tokenizer.get_vocab())
    model.eval().requires_grad_(False)
    model.set_tokenizer(tokenizer)
    return model.prepare()


def frames_of(wave: np.ndarray) -> list[np.ndarray]:
    return [wave[i:i + FRAME] for i in range(0, len(wave) - FRAME + 1, FRAME)]


def comparable(events) -> list[tuple]:
    return [(e.kind, e.frame_index, e.token_id, e.delta, e.text,
             None if e.audio_codes is None else e.audio_codes.tolist(),
             None if e.samples is None else e.samples.tobytes()) for e in events]


# ---- incremental detokenizers: equal to decoding the whole history every time


def test_text_accumulator_equals_the_full_decode_at_every_token():
    tokenizer = _hf_tokenizer()
    vocab = len(tokenizer.get_vocab())
    for seed in range(6):
        rng = random.Random(seed)
        acc, tokens, joined = TokenAccumulator(tokenizer, SKIP), [], ""
        for _ in range(300):
            # random byte tokens make partial and invalid UTF-8; specials and word merges mix in
            token = rng.randrange(vocab) if rng.random() < 0.7 else rng.choice([12, 40, 200, vocab - 1])
            update = acc.append(token)
            if token in SKIP:
                assert update is None
                continue
            tokens.append(token)
            full = tokenizer.decode(tokens, skip_special_tokens=False)
            joined += update[0]
            assert update[1] == joined and full.startswith(joined) and acc.full_text == full
        end = acc.finish()
        assert joined + (end[0] if end else "") == full == acc.text
        assert "\ufffd" in full  # the partial-character path ran


def test_transcript_equals_the_full_decode_at_every_frame():
    vocabulary = ["<unk>", "<en-US>", "\u2581", "\u2581\u2581", "a", "\u2581b", "c\u2581", "\n", "<s>", "\u2581word"]
    for seed in range(10):
        rng = random.Random(seed)
        transcript, tokens, text = TranscriptText(vocabulary), [], ""
        for _ in range(200):
            ids = [rng.choice([-1, rng.randrange(len(vocabulary) + 2)]) for _ in range(rng.randrange(1, 4))]
            update = transcript.update(ids)
            new = [i for i in ids if i >= 0 and not transcript.is_special(i)]
            if not new:
                assert update is None
                continue
            tokens += new
            full = decode_pieces(tokens, vocabulary).strip()
            assert update == (full[len(text):], full)
            text = full


# ---- flat cost: the same kernels at frame 3000 as at frame 100; cache bytes from the formula


def kv_capacity(positions: int, limit: int) -> int:
    """Slots of a key/value buffer holding ``positions`` (docs/performance.md): 256, then 1.5x, whole
    blocks of 256, at most ``limit``."""
    capacity = 256
    while capacity < positions:
        capacity = min(-(-(capacity * 3 // 2) // 256) * 256, limit)
    return capacity


def expected_cache_bytes(config, llm_positions: int, tts_positions: int, element: int) -> dict[str, int]:
    text, tts = config.text_config, config.tts_config
    pattern = text.hybrid_override_pattern
    kv = 2 * text.num_key_value_heads * text.head_dim * kv_capacity(llm_positions, text.max_position_embeddings)
    mamba = (text.conv_kernel - 1) * text.mamba_conv_dim + text.mamba_num_heads * text.mamba_head_dim * text.ssm_state_size
    language = pattern.count("*") * kv * element + pattern.count("M") * mamba * 4
    n_global = tts.num_hidden_layers // tts.sliding_window_pattern
    n_sliding = tts.num_hidden_layers - n_global
    row = 2 * 2 * tts.num_key_value_heads * tts.head_dim * element  # keys + values, conditional + unconditional
    tts_limit = text.max_position_embeddings + 37
    global_slots = kv_capacity(tts_positions, tts_limit)
    sliding_slots = kv_capacity(min(tts_positions, tts.sliding_window), tts.sliding_window)
    return {"language": language, "tts": row * (n_global * global_slots + n_sliding * sliding_slots)}


def test_frame_work_is_flat_and_cache_bytes_follow_the_formula(tiny):
    session = tiny.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    prompt = session.timeline_index
    frame = synth_audio(0.08, seed=3)[:FRAME]
    counts = {}
    for target in (100, 3000):
        while session.frame_index < target:  # 8 s pieces of varied audio
            session.push_audio(synth_audio(8.0, seed=session.frame_index), 16000)
        with OpCounter() as ops:
            session.push_audio(frame, 16000)
        counts[target] = ops.ops
        llm, tts_positions = session.timeline_index, 37 + session.timeline_index - 1
        assert session.cache_bytes() == expected_cache_bytes(tiny.config, llm, tts_positions, 4), target
    assert counts[3000] == counts[100]  # op by op: nothing per frame grows with the session
    assert session.cache_bytes()["language"] > expected_cache_bytes(tiny.config, 101 + prompt, 137, 4)["language"]


# ---- the session limit


def test_default_limit_comes_from_the_models_context_and_ends_cleanly():
    model = small_context_model(64)
    backbone = model.tts_model.tts_model.backbone
    assert backbone.max_positions == 64 + 37  # rotary tables for every TTS position, built at load
    tables = backbone.rope_global.cos.data_ptr()
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="hello", deterministic=True))
    prompt = session.timeline_index
    assert session.max_frames == 64 - prompt and session.max_seconds == pytest.approx(session.max_frames * 0.08)
    wave = synth_audio(0.08 * (session.max_frames + 3) + 0.05)
    with pytest.raises(nv.ContextLimit, match="max_position_embeddings=64") as first:
        session.push_audio(wave, 16000)
    assert session.frame_index == session.max_frames and session.timeline_index == 64
    assert [e.frame_index for e in first.value.events if e.kind == "audio"] == list(range(session.max_frames))
    with pytest.raises(nv.ContextLimit) as second:
        session.push_audio(wave[:FRAME], 16000)
    assert second.value.events == [] and first.value.events  # each carries its own events
    assert session._pending.size == len(wave) % FRAME  # the partial frame of the first push
    assert [e.kind for e in session.flush()] == ["done"]  # past the limit the partial frame is dropped
    assert session.closed and session.flush() == []
    assert backbone.rope_global.cos.data_ptr() == tables  # no shared state changed by the session
    with pytest.raises(ValueError, match="leaves no room in the model's context of 64 positions"):
        model.create_streaming_session(nv.StreamingOptions(system_prompt="x" * 70))


def test_a_shorter_max_streaming_seconds_wins(tiny):
    session = tiny.create_streaming_session(nv.StreamingOptions(max_streaming_seconds=0.16))
    assert session.max_frames == 2 and session.model_max_frames > 100_000
    with pytest.raises(nv.ContextLimit, match="max_streaming_seconds=0.16"):
        session.push_audio(np.zeros(4 * FRAME, np.float32), 16000)


# ---- chunked prefill: one LLM call, the stepwise result


def test_chunked_prefill_equals_the_stepwise_prefill(tiny, monkeypatch):
    options = nv.StreamingOptions(system_prompt=PROMPT * 12, deterministic=True)
    session = tiny.create_streaming_session(options)
    monkeypatch.setattr(timeline_module, "PREFILL_CHUNK", 1)  # one LLM step per prompt position
    stepwise = tiny.create_streaming_session(options)
    assert session.timeline_index == stepwise.timeline_index > 256  # past a KV block and an SSD chunk
    torch.testing.assert_close(session._timeline.last_hidden, stepwise._timeline.last_hidden, atol=1e-4, rtol=1e-4)
    for a, b in zip(session._frame_step._language.layers, stepwise._frame_step._language.layers):
        if a is not None and hasattr(a, "ssm_state"):
            torch.testing.assert_close(a.ssm_state, b.ssm_state, atol=1e-4, rtol=1e-4)
    assert session._frame_step.rows[0] == stepwise._frame_step.rows[0]  # the same LLM and TTS positions
    wave = synth_audio(1.2, seed=5)
    ours, steps = session.push_audio(wave, 16000), stepwise.push_audio(wave, 16000)
    assert [(e.kind, e.frame_index, e.token_id, e.text) for e in ours] == \
        [(e.kind, e.frame_index, e.token_id, e.text) for e in steps]
    np.testing.assert_array_equal(np.stack([e.audio_codes for e in ours if e.kind == "audio"]),
                                  np.stack([e.audio_codes for e in steps if e.kind == "audio"]))


def test_long_prompt_session_matches_the_reference(ckpt_f32, reference):
    prompt = PROMPT * 12  # > 256 tokens: the chunked prefill crosses an SSD chunk and a KV block
    wave = synth_audio(1.5, seed=9)
    ref = reference(ckpt_f32).session.create_streaming_session(system_prompt=prompt, seed=0)
    ref_events = ref.push_audio(wave) + ref.flush()
    session = nv.load_model(ckpt_f32, device="cpu", dtype=torch.float32).create_streaming_session(
        nv.StreamingOptions(system_prompt=prompt, deterministic=True))
    events = session.push_audio(wave, 16000) + session.flush()
    assert session.timeline_index - session.frame_index == len(ref._text_tokens) - ref.frame_index > 256
    np.testing.assert_array_equal(np.stack([e.audio_codes for e in events if e.kind == "audio"]),
                                  np.stack([np.array(e.audio_codes) for e in ref_events if e.kind == "audio"]))
    assert as_reference_shows(events) == as_reference_shows(ref_events)


# ---- failures


def test_a_failed_frame_closes_the_session_naming_the_failure(tiny):
    wave = synth_audio(0.8)
    session = tiny.create_streaming_session(nv.StreamingOptions(deterministic=True))
    language_step = session._frame_step._language_step
    calls = []

    def failing(*args):  # mid-frame: perception and the RNNT have advanced
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device went away")
        return language_step(*args)

    session._frame_step._language_step = failing
    with pytest.raises(RuntimeError, match="the device went away"):
        session.push_audio(wave, 16000)
    assert session.closed
    for call in (lambda: session.push_audio(wave[:FRAME], 16000), session.flush, session.cancel):
        with pytest.raises(RuntimeError, match="frame 2 failed with RuntimeError: the device went away") as error:
            call()
        assert isinstance(error.value.__cause__, RuntimeError)
    # the model is untouched: a new session gives what a fresh one gives
    a = tiny.create_streaming_session(nv.StreamingOptions(deterministic=True)).push_audio(wave, 16000)
    b = tiny.create_streaming_session(nv.StreamingOptions(deterministic=True)).push_audio(wave, 16000)
    assert comparable(a) == comparable(b)


def test_every_documented_input_kind_is_accepted(tiny):
    pcm = np.round(synth_audio(0.16, seed=2) * 32767).astype(np.int16)
    floats = pcm.astype(np.float32) / 32768
    reference = comparable(tiny.create_streaming_session(nv.StreamingOptions(deterministic=True)).push_audio(pcm, 16000))
    for chunk in (pcm.tolist(), floats.tolist(), tuple(pcm.tolist()), torch.from_numpy(floats)[None],
                  torch.from_numpy(pcm), torch.from_numpy(floats).to(torch.bfloat16), torch.from_numpy(floats).half()):
        session = tiny.create_streaming_session(nv.StreamingOptions(deterministic=True))
        events = session.push_audio(chunk, 16000)
        assert [e.frame_index for e in events if e.kind == "audio"] == [0, 1]
        if not (isinstance(chunk, torch.Tensor) and chunk.dtype in (torch.bfloat16, torch.float16)):
            assert comparable(events) == reference  # exact: the same float32 samples


def test_int16_values_stored_as_floats_are_refused(tiny):
    session = tiny.create_streaming_session(nv.StreamingOptions(deterministic=True))
    pcm = np.round(synth_audio(0.16) * 32767).astype(np.float32)
    with pytest.raises(ValueError, match="int16 values stored as floats"):
        session.push_audio(pcm, 16000)
    with pytest.raises(ValueError, match="outside -32768..32767"):
        session.push_audio([0, 40000], 16000)
    assert session.frame_index == 0 and not session.closed
    overshoot = np.clip(pcm / 32768, -1, 1) * 1.5  # resampling overshoot stays accepted
    assert [e.kind for e in session.push_audio(overshoot, 16000)].count("audio") == 2


# ---- threads


def test_three_threads_give_what_each_session_gives_alone(tiny):
    inputs = [(synth_audio(1.0, seed=s), p) for s, p in ((1, PROMPT), (2, "hello"), (3, ""))]

    def run(wave, prompt):
        session = tiny.create_streaming_session(nv.StreamingOptions(system_prompt=prompt, deterministic=True))
        events = []
        for chunk in frames_of(wave):
            events += session.push_audio(chunk, 16000)
        return comparable(events + session.flush())

    alone = [run(*i) for i in inputs]
    results: list = [None] * 3
    errors: list = []

    def worker(k):
        try:
            results[k] = run(*inputs[k])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results == alone
    assert alone[0] != alone[1]  # the inputs differ, so the comparison means something


# ---- offline in bounded memory: pieces equal to one pass


def test_offline_encoder_in_pieces_equals_one_pass(tiny):
    perception = tiny.stt_model.perception
    encoder = perception.encoder
    wave = np.concatenate([synth_audio(8.0, seed=s) for s in range(7)])  # 56 s: 701 encoder frames
    with torch.inference_mode():
        mel = perception.log_mel(torch.from_numpy(wave))
        whole = encoder(mel, chunk=10**6)
        assert whole.shape[1] == 701 > 512 + encoder.left + 8  # the default really runs in pieces
        for chunk in (1, 37, 512):
            torch.testing.assert_close(encoder(mel, chunk=chunk), whole, atol=2e-5, rtol=1e-5)
        for frames in (1, 9, 17, 100, 803):  # the subsampling's pieces at every length and alignment
            part = encoder._check_mel(mel[:, :frames], "test")
            torch.testing.assert_close(encoder._subsample(part, 2), encoder.pre_encode(part), atol=2e-5, rtol=1e-5)
        assert tiny.transcriber.greedy_decode(encoder(mel)) == tiny.transcriber.greedy_decode(whole)


def test_codec_decode_in_pieces_equals_one_pass(tiny):
    codec = tiny.tts_model.audio_codec
    codes = torch.randint(0, codec.config.codebook_size, (1, codec.config.num_quantizers, 300),
                          generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = codec.decode(codes, chunk=10**6)
        assert whole.shape == (1, 1, 300 * 1764)
        for chunk in (1, 7, 256):
            torch.testing.assert_close(codec.decode(codes, chunk=chunk), whole, atol=1e-5, rtol=0)


def test_offline_log_mel_in_pieces_equals_one_pass(tiny, monkeypatch):
    import nvchat_torch.models.mel as mel

    log_mel = tiny.stt_model.perception.log_mel
    wave = torch.from_numpy(np.concatenate([synth_audio(8.0, seed=s) for s in range(3)]))
    with torch.inference_mode():
        monkeypatch.setattr(mel, "OFFLINE_CHUNK", 10**9)
        whole = log_mel(wave)
        assert whole.shape[1] == 2401
        monkeypatch.setattr(mel, "OFFLINE_CHUNK", 333)
        torch.testing.assert_close(log_mel(wave), whole, atol=1e-5, rtol=0)


def test_the_command_line_keeps_the_frames_that_ran_before_the_limit(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import soundfile as sf

    out = tmp_path / "answer.wav"
    audio = tmp_path / "question.wav"
    sf.write(audio, synth_audio(1.0), 16000)
    proc = subprocess.run([sys.executable, "-m", "nvchat_torch.stream", "--audio", str(audio), "--output-audio",
                           str(out), "--max-streaming-seconds", "0.4", "--quiet"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "stopped: the session reached max_streaming_seconds=0.4" in proc.stderr
    assert len(sf.read(out)[0]) == 5 * 1764  # every frame up to the limit, including those of the last push
