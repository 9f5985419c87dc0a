"""Perception against the MLX reference: log-mel front end, FastConformer (offline, cached, uncached), RNNT.

Float32 tiny random checkpoints written by the reference itself (see mlx_oracle.py).
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_audio.dsp import hanning, mel_filters
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram
from mlx_oracle import full_size_manifest, synth_audio, to_np
from mlx_vlm.models.nemotron_voicechat.streaming import _RNNTState

from nvchat_torch.loading.checkpoint import Checkpoint
from nvchat_torch.models.config import PreprocessorConfig, VoiceChatConfig
from nvchat_torch.models.mel import LogMel
from nvchat_torch.models.perception import Perception
from nvchat_torch.models.rnnt import RnntDecoder, RnntJoint, RnntTranscriber, TranscriptText

FRAME = 1280
PREFIXES = ("stt_model.perception.", "stt_model.rnnt_decoder.", "stt_model.rnnt_joint.")


def load_ours(path) -> SimpleNamespace:
    """Our perception + RNNT from a checkpoint folder, loaded strictly (float32)."""
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    state = dict(ckpt.iter_tensors(dtype=torch.float32))

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

    perception = Perception(cfg.audio_config)
    perception.load_state_dict(part("stt_model.perception."), strict=True)
    decoder = RnntDecoder(cfg.audio_config.decoder)
    decoder.load_state_dict(part("stt_model.rnnt_decoder."), strict=True)
    joint = RnntJoint(cfg.audio_config.joint)
    joint.load_state_dict(part("stt_model.rnnt_joint."), strict=True)
    transcriber = RnntTranscriber(decoder, joint, cfg.rnnt_blank_id, cfg.audio_config.max_symbols)
    return SimpleNamespace(config=cfg, perception=perception.eval(), transcriber=transcriber.eval(),
                           quantized=ckpt.quantized_modules())


@pytest.fixture(scope="module")
def ref(reference, ckpt_f32):
    return reference(ckpt_f32)


@pytest.fixture(scope="module")
def ours(ckpt_f32):
    return load_ours(ckpt_f32)


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    return synth_audio(3.0)  # 48000 samples: 37 whole 80 ms frames and a half


@pytest.fixture(scope="module")
def ref_offline(ref, audio):
    """The reference's offline perception of ``audio``: mel, projected, encoded (numpy)."""
    mel = log_mel_spectrogram(mx.array(audio), ref.model.config.audio_config.preprocessor)
    projected, _, encoded = ref.model.stt_model.perception(mel, mx.array([mel.shape[1]], dtype=mx.int32))
    return SimpleNamespace(mel=to_np(mel), projected=to_np(projected), encoded=to_np(encoded), encoded_mx=encoded)


def assert_log_mel_close(ours: np.ndarray, expected: np.ndarray, power_tol: float, log_tol: float = 1e-3) -> None:
    """Compare log-mel spectrograms the way float32 STFTs can agree.

    A float32 transform (the reference's FFT as much as our DFT matmul) is accurate relative to the
    frame's energy, not per bin: the reference itself is up to 3e-4 away from exact arithmetic in
    the log of bins 1e-7 below the frame's energy (even torch.stft differs from it by 3.5e-4 there).
    So: the mel power error relative to the frame's total mel power, and a loose log bound everywhere.
    """
    assert ours.shape == expected.shape
    ours64, expected64 = ours.astype(np.float64), expected.astype(np.float64)
    power_err = np.abs(np.exp(ours64) - np.exp(expected64)) / np.exp(expected64).sum(axis=-1, keepdims=True)
    assert power_err.max() <= power_tol, f"mel power error {power_err.max():.3g} of the frame energy"
    assert np.abs(ours64 - expected64).max() <= log_tol


# --------------------------------------------------------------------------------------
# Log-mel front end


def test_filterbank_and_window_match_reference():
    mel = LogMel(PreprocessorConfig())
    expected_fb = to_np(mel_filters(16000, 512, 128, norm="slaney", mel_scale="slaney"))
    np.testing.assert_allclose(mel.filterbank.numpy(), expected_fb, rtol=0, atol=2e-7)
    window = np.zeros(512, np.float32)
    window[56:456] = to_np(hanning(400))  # symmetric Hann, centred in n_fft
    np.testing.assert_allclose(mel.window.numpy(), window, rtol=0, atol=2e-7)
    for buffer in ("window", "dft_basis", "filterbank"):
        assert getattr(mel, buffer).dtype == torch.float32
    assert not mel.state_dict()  # derived constants are not checkpoint state


def test_log_mel_offline_matches_reference(ours, ref, audio, ref_offline):
    mel = ours.perception.log_mel
    got = mel(torch.from_numpy(audio))
    assert got.shape == (1, audio.shape[0] // 160 + 1, 128) and got.dtype == torch.float32
    assert_log_mel_close(got.numpy(), ref_offline.mel, power_tol=1e-5)
    args = ref.model.config.audio_config.preprocessor
    for n in (257, 1279, 4001):  # lengths off the hop grid, down to the shortest reflectable one
        expected = to_np(log_mel_spectrogram(mx.array(audio[:n]), args))
        got = mel(torch.from_numpy(audio[:n])[None])
        assert got.shape == expected.shape == (1, n // 160 + 1, 128)
        assert_log_mel_close(got.numpy(), expected, power_tol=1e-5)


def test_dft_stft_matches_torch_stft(ours, audio):
    """Independent check of the DFT-matmul STFT: torch.stft on the same preemphasised signal."""
    mel = ours.perception.log_mel
    x = torch.from_numpy(audio)
    y = torch.cat([x[:1], x[1:] - 0.97 * x[:-1]])
    spec = torch.stft(y, n_fft=512, hop_length=160, win_length=400,
                      window=torch.hann_window(400, periodic=False), center=True, pad_mode="reflect",
                      return_complex=True)
    expected = torch.log(mel.filterbank @ spec.abs().square() + 2.0**-24).T[None]
    assert_log_mel_close(mel(x).numpy(), expected.numpy(), power_tol=2e-6)


def test_log_mel_streaming_joins_offline(ours, audio):
    """80 ms pushes give 1, 8, 8, ... frames (right-aligned in each row), which join to the offline
    pass; two streams side by side, one a frame behind, give each its own."""
    mel = ours.perception.log_mel
    x = torch.from_numpy(audio)
    frames = 12
    offline = mel(x)[:, :1 + 8 * (frames - 1)]
    cache = mel.new_cache(2)
    rows: list[list[torch.Tensor]] = [[], []]
    for i in range(frames + 1):
        # row 0 pushes frame i; row 1 starts a frame later (its first push: zeros, then the stream)
        push = torch.stack([x[i * FRAME:(i + 1) * FRAME], x[(i - 1) * FRAME:i * FRAME] if i else torch.zeros(FRAME)])
        if i == 1:
            cache.frames[1] = 0  # row 1's stream starts here
            cache.samples[1] = 0
        out = mel.forward_step(push, cache)
        assert out.shape == (2, 8, 128)
        for r in (0, 1):
            first = i == r
            rows[r].append(out[r:r + 1, -1:] if first else out[r:r + 1])
    for r in (0, 1):
        streamed = torch.cat(rows[r][r:r + frames], dim=1)
        assert streamed.shape == offline.shape
        assert_log_mel_close(streamed.numpy(), offline.numpy(), power_tol=2e-6)
    assert cache.frames.tolist() == [frames + 1, frames]


def test_log_mel_rejects_bad_input(ours):
    mel = ours.perception.log_mel
    with pytest.raises(ValueError, match=r"shape \(2, 1000\)"):
        mel(torch.zeros(2, 1000))
    with pytest.raises(ValueError, match="100 samples"):
        mel(torch.zeros(100))
    with pytest.raises(ValueError, match=r"expected frames \[B, 1280\].*\(1, 100\)"):
        mel.forward_step(torch.zeros(1, 100), mel.new_cache())


# --------------------------------------------------------------------------------------
# FastConformer and projection


def test_encoder_offline_matches_reference(ours, ref_offline):
    with torch.no_grad():
        projected, encoded = ours.perception(torch.from_numpy(ref_offline.mel))
    length = ref_offline.mel.shape[1]
    for _ in range(3):  # three causal stride-2 stages: L -> L // 2 + 1
        length = length // 2 + 1
    assert encoded.shape == ref_offline.encoded.shape == (1, length, 32)
    np.testing.assert_allclose(encoded.numpy(), ref_offline.encoded, rtol=0, atol=1e-4)
    np.testing.assert_allclose(projected.numpy(), ref_offline.projected, rtol=0, atol=1e-4)


def test_frames_in_frames_out(ours):
    """N whole 80 ms frames of audio -> 8N + 1 mel frames -> N + 1 encoder frames."""
    x = torch.from_numpy(synth_audio(6 * FRAME / 16000))
    with torch.no_grad():
        mel = ours.perception.log_mel(x)
        _, encoded = ours.perception(mel)
    assert mel.shape[1] == 49 and encoded.shape[1] == 7


def stream(perception: Perception, audio: np.ndarray, frames: int):
    """Our cached perception over ``frames`` 80 ms pushes -> (projected, encoded) [1, frames, *]."""
    mel_cache, cache = perception.log_mel.new_cache(), perception.new_cache()
    out = []
    with torch.no_grad():
        for i in range(frames):
            mel = perception.log_mel.forward_step(torch.from_numpy(audio[None, i * FRAME:(i + 1) * FRAME]), mel_cache)
            out.append(perception.forward_step(mel, cache))
    return torch.cat([p for p, _ in out], 1), torch.cat([e for _, e in out], 1)


def test_streaming_encoder_matches_offline_and_reference_session(ours, ref, audio):
    frames = audio.shape[0] // FRAME
    projected, encoded = stream(ours.perception, audio, frames)
    with torch.no_grad():
        offline_projected, offline = ours.perception(ours.perception.log_mel(torch.from_numpy(audio)))
    np.testing.assert_allclose(encoded.numpy(), offline[:, :frames].numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(projected.numpy(), offline_projected[:, :frames].numpy(), rtol=0, atol=1e-4)

    session = ref.session.create_streaming_session()  # cached perception, as the realtime server runs it
    steps = [session._perception_step(mx.array(audio[i * FRAME:(i + 1) * FRAME])) for i in range(frames)]
    np.testing.assert_allclose(encoded.numpy(), np.concatenate([to_np(e) for _, e in steps], 1), rtol=0, atol=1e-4)
    np.testing.assert_allclose(projected.numpy(), np.concatenate([to_np(p) for p, _ in steps], 1), rtol=0, atol=1e-4)


def test_fuse_keeps_outputs(ours, audio):
    fused = copy.deepcopy(ours.perception)
    fused.fuse()
    assert not any(k.endswith(("linear_q.weight", "pos_bias_u")) for k in fused.state_dict())
    with torch.no_grad():
        mel = ours.perception.log_mel(torch.from_numpy(audio[:20 * FRAME]))
        for a, b in zip(ours.perception(mel), fused(mel)):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for a, b in zip(stream(ours.perception, audio, 20), stream(fused, audio, 20)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_conformer_with_biases_matches_reference(make_checkpoint, reference, audio):
    """use_bias=True: biases in the block projections, FFs and convolution module (also fused)."""
    path = make_checkpoint(seed=1, conformer_bias=True)
    ref_b, ours_b = reference(path), load_ours(path)
    assert "stt_model.perception.encoder.layers.0.conv.depthwise_conv.bias" in Checkpoint(path)
    mel = log_mel_spectrogram(mx.array(audio), ref_b.model.config.audio_config.preprocessor)
    ref_projected, _, ref_encoded = ref_b.model.stt_model.perception(mel, mx.array([mel.shape[1]], dtype=mx.int32))
    fused = copy.deepcopy(ours_b.perception)
    fused.fuse()
    frames = audio.shape[0] // FRAME
    for perception in (ours_b.perception, fused):
        with torch.no_grad():
            projected, encoded = perception(torch.from_numpy(to_np(mel)))
        np.testing.assert_allclose(encoded.numpy(), to_np(ref_encoded), rtol=0, atol=1e-4)
        np.testing.assert_allclose(projected.numpy(), to_np(ref_projected), rtol=0, atol=1e-4)
        _, streamed = stream(perception, audio, frames)
        np.testing.assert_allclose(streamed.numpy(), to_np(ref_encoded)[:, :frames], rtol=0, atol=1e-4)


def test_xscaling_streams_like_offline(ours, audio):
    """xscaling multiplies the subsampled input by sqrt(d_model) in both paths (the reference's
    cached path ignores the flag; NeMo and the reference's offline path apply it)."""
    config = copy.deepcopy(ours.config.audio_config)
    config.encoder.xscaling = True
    scaled = Perception(config).eval()
    scaled.load_state_dict(ours.perception.state_dict(), strict=True)
    with torch.no_grad():
        mel = scaled.log_mel(torch.from_numpy(audio[:12 * FRAME]))
        _, offline = scaled(mel)
        _, plain = ours.perception(mel)
    _, streamed = stream(scaled, audio, 12)
    assert (offline - plain).abs().max() > 1e-2  # the flag does change the encoder
    np.testing.assert_allclose(streamed.numpy(), offline[:, :12].numpy(), rtol=0, atol=1e-4)


def test_forward_step_checks_its_input(ours):
    perception = ours.perception
    cache = perception.new_cache()
    with torch.no_grad():
        for shape in ((1, 1, 128), (2, 8, 128), (1, 8, 80)):
            with pytest.raises(ValueError, match=r"expected mel \[1, 8, 128\].*" + re.escape(str(shape))):
                perception.forward_step(torch.zeros(shape), cache)
        perception.forward_step(torch.zeros(1, 8, 128), cache)
    assert cache.frames.tolist() == [1]


def test_uncached_fallback_matches_reference(ours, ref):
    x = synth_audio(6.0, seed=5)  # 75 frames: past the 71-frame window the fallback recomputes
    session = ref.session.create_streaming_session(use_perception_cache=False)
    with torch.no_grad():
        for i in range(x.shape[0] // FRAME):
            ref_projected, ref_encoded = session._perception_step(mx.array(x[i * FRAME:(i + 1) * FRAME]))
            projected, encoded = ours.perception.uncached_frame(torch.from_numpy(x[:(i + 1) * FRAME]))
            assert encoded.shape == (1, 1, 32) and projected.shape == (1, 1, 64)
            np.testing.assert_allclose(encoded.numpy(), to_np(ref_encoded), rtol=0, atol=1e-4)
            np.testing.assert_allclose(projected.numpy(), to_np(ref_projected), rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------
# RNNT transcript


def reference_transcript(ref, encoded_mx) -> tuple[list[int], list, str]:
    """The reference's online (per-frame `_RNNTState`) ids and updates, and its offline text."""
    state = _RNNTState(ref.session)
    updates = [state.step(encoded_mx[:, t:t + 1]) for t in range(encoded_mx.shape[1])]
    text = ref.session._rnnt_decode(encoded_mx, encoded_mx.shape[1])
    assert text == state.text
    return state.tokens, updates, text


def test_rnnt_streaming_state_follows_the_reference(ours, ref, ref_offline):
    """After every frame the prediction network's state is the reference's: the hidden state it
    continues from (the state after the last emitted token) and the prediction the joint reads next."""
    stt = ref.model.stt_model
    ref_state = _RNNTState(ref.session)
    transcriber = ours.transcriber
    state = transcriber.new_state()
    blank = ref.model.config.rnnt_blank_id
    emitted = 0
    for t in range(ref_offline.encoded_mx.shape[1]):
        ref_state.step(ref_offline.encoded_mx[:, t:t + 1])
        with torch.no_grad():
            ids = transcriber.forward_step(torch.from_numpy(ref_offline.encoded[:, t:t + 1]), state)
        emitted += int((ids >= 0).sum())
        # the reference recomputes its next prediction from (last token, hidden): do the same here
        token = None if ref_state.last_token == blank else mx.array([[ref_state.last_token]], dtype=mx.int32)
        pred, proposed = stt.rnnt_decoder(token, ref_state.hidden)
        np.testing.assert_allclose(state.hc[-1].numpy(), to_np(pred)[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(state.hc[:-1].numpy(), np.concatenate([to_np(h) for h in proposed]),
                                   rtol=0, atol=1e-5)
    assert emitted > 0


def test_rnnt_prediction_and_joint_match_reference(ours, ref, ref_offline):
    stt = ref.model.stt_model
    ref_pred, ref_hidden = stt.rnnt_decoder(None, None)
    ref_pred2, ref_hidden2 = [], ref_hidden
    for token in (5, 7):  # the reference's LSTM wrapper steps one token at a time
        pred_u, ref_hidden2 = stt.rnnt_decoder(mx.array([[token]], dtype=mx.int32), ref_hidden2)
        ref_pred2.append(pred_u)
    ref_pred2 = mx.concatenate(ref_pred2, axis=1)
    ref_logits = stt.rnnt_joint(ref_offline.encoded_mx[:, :4], ref_pred2)
    decoder, joint = ours.transcriber.decoder, ours.transcriber.joint
    with torch.no_grad():
        pred, hidden = decoder(None)
        pred2, hidden2 = decoder(torch.tensor([[5, 7]]), hidden)
        logits = joint(torch.from_numpy(ref_offline.encoded[:, :4]), pred2)
    np.testing.assert_allclose(pred.numpy(), to_np(ref_pred), rtol=0, atol=1e-6)
    with torch.no_grad():
        start = ours.transcriber.new_state().hc  # the zero start input's LSTM state and prediction
    # The first emitted token continues from the state after the start input (not from zeros).
    np.testing.assert_allclose(start[:-1].numpy(), np.concatenate([to_np(t) for t in ref_hidden]), rtol=0, atol=1e-6)
    assert np.abs(start[:-1].numpy()).max() > 0
    np.testing.assert_allclose(start[-1].numpy(), to_np(ref_pred)[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(pred2.numpy(), to_np(ref_pred2), rtol=0, atol=1e-6)
    np.testing.assert_allclose(hidden2.numpy(), np.concatenate([to_np(t) for t in ref_hidden2]), rtol=0, atol=1e-6)
    assert logits.shape == (1, 4, 2, 31)
    np.testing.assert_allclose(logits.numpy(), to_np(ref_logits), rtol=0, atol=1e-5)


def test_rnnt_transcript_matches_reference_offline_and_streaming(ours, ref, ref_offline):
    ref_ids, ref_updates, ref_text = reference_transcript(ref, ref_offline.encoded_mx)
    assert ref_text  # the tiny checkpoint does transcribe something
    encoded = torch.from_numpy(ref_offline.encoded)
    transcriber = ours.transcriber
    offline = TranscriptText(ours.config.rnnt_vocabulary)
    offline.update(transcriber.greedy_decode(encoded))
    assert offline.tokens == ref_ids and offline.text == ref_text

    text, state, full_frames = TranscriptText(ours.config.rnnt_vocabulary), transcriber.new_state(), 0
    with torch.no_grad():
        for t in range(encoded.shape[1]):
            ids = transcriber.forward_step(encoded[:, t:t + 1], state)[:, 0]
            assert ids.shape == (10,) and ids.dtype == torch.long
            full_frames += int((ids >= 0).all())
            assert text.update(ids.tolist()) == ref_updates[t], f"frame {t}"
    assert text.tokens == ref_ids
    assert full_frames > 0  # some frame stopped at max_symbols rather than at a blank


def test_transcript_end_to_end_from_audio(ours, ref, audio, ref_offline):
    """Our mel -> our encoder -> our RNNT gives the reference's transcript of the same audio."""
    _, _, ref_text = reference_transcript(ref, ref_offline.encoded_mx)
    with torch.no_grad():
        _, encoded = ours.perception(ours.perception.log_mel(torch.from_numpy(audio)))
    text = TranscriptText(ours.config.rnnt_vocabulary)
    text.update(ours.transcriber.greedy_decode(encoded))
    assert text.text == ref_text


def test_transcript_text_rules():
    vocab = ["<unk>", "<en-US>", "\u2581hel", "lo", "\u2581you", "<s>", "<pad>", "<fra-FR>", "<x-YZ>"]
    text = TranscriptText(vocab)
    assert text.update([-1, -1]) is None
    assert text.update([1, 0, 5, 6, 7]) is None  # specials only: nothing appended
    assert text.update([2, 3, -1]) == ("hello", "hello")
    assert text.update([4]) == (" you", "hello you")
    assert text.update([8]) == ("<x-YZ>", "hello you<x-YZ>")  # not a language tag: a piece
    assert text.update([99]) == ("", "hello you<x-YZ>")  # out of range: appended, not shown
    assert text.tokens == [2, 3, 4, 8, 99]


# --------------------------------------------------------------------------------------
# Streaming invariants


def test_step_paths_never_read_the_host():
    """The whole per-frame path runs on `meta` tensors, which have no data to read: any host read
    (.item(), .tolist(), a tensor as a condition) would raise."""
    audio_config = VoiceChatConfig.full_size().audio_config
    audio_config.encoder.n_layers = 2
    with torch.device("meta"):
        perception = Perception(audio_config)
        transcriber = RnntTranscriber(RnntDecoder(audio_config.decoder), RnntJoint(audio_config.joint), 1024, 10)
    mel_cache, cache, state = perception.log_mel.new_cache(), perception.new_cache(), transcriber.new_state()
    samples = torch.zeros(1, FRAME, device="meta")
    with torch.no_grad():
        for _ in range(3):
            projected, encoded = perception.forward_step(perception.log_mel.forward_step(samples, mel_cache), cache)
            ids = transcriber.forward_step(encoded, state)
    assert projected.shape == (1, 1, 4480) and encoded.shape == (1, 1, 1024) and ids.shape == (10, 1)


def test_cache_sizes_constant_after_200_frames(ours):
    perception, transcriber = ours.perception, ours.transcriber
    x = torch.from_numpy(synth_audio(16.0))
    mel_cache, cache, state = perception.log_mel.new_cache(), perception.new_cache(), transcriber.new_state()

    def footprint():
        return (mel_cache.samples.shape, tuple((t.shape, t.data_ptr()) for t in (cache.kv, cache.mel)),
                tuple(t.shape for t in cache.conv), state.hc.shape)

    with torch.no_grad():
        for i in range(200):
            mel = perception.log_mel.forward_step(x[None, i * FRAME:(i + 1) * FRAME], mel_cache)
            _, encoded = perception.forward_step(mel, cache)
            transcriber.forward_step(encoded, state)
            if i == 9:
                early = footprint()
    assert footprint() == early  # same sizes, same (in-place) ring and mel buffers
    assert cache.kv.shape[4] == 71 and cache.conv[0].shape[-1] == 9 - 1 and cache.mel.shape[1] == 17
    assert cache.frames.tolist() == mel_cache.frames.tolist() == [200]


# --------------------------------------------------------------------------------------
# Checkpoint names


def test_full_size_names_and_shapes():
    audio_config = VoiceChatConfig.full_size().audio_config
    with torch.device("meta"):
        modules = {"stt_model.perception.": Perception(audio_config),
                   "stt_model.rnnt_decoder.": RnntDecoder(audio_config.decoder),
                   "stt_model.rnnt_joint.": RnntJoint(audio_config.joint)}
    ours = {prefix + k: tuple(v.shape) for prefix, m in modules.items() for k, v in m.state_dict().items()}
    expected = {k: shape for k, (shape, _) in full_size_manifest("bf16").items() if k.startswith(PREFIXES)}
    assert ours == expected


def test_quantized_checkpoint_leaves_perception_unquantized(reference, ckpt_q4, ref_offline):
    q4 = load_ours(ckpt_q4)
    assert q4.quantized and not any(path.startswith(PREFIXES) for path in q4.quantized)
    ref_q4 = reference(ckpt_q4)
    mel = mx.array(ref_offline.mel)
    ref_projected, _, ref_encoded = ref_q4.model.stt_model.perception(mel, mx.array([mel.shape[1]], dtype=mx.int32))
    with torch.no_grad():
        projected, encoded = q4.perception(torch.from_numpy(ref_offline.mel))
    np.testing.assert_allclose(encoded.numpy(), to_np(ref_encoded), rtol=0, atol=1e-4)
    np.testing.assert_allclose(projected.numpy(), to_np(ref_projected), rtol=0, atol=1e-4)
