"""The codec (``tts_model.audio_codec``) against the MLX reference (mlx-audio ``NemotronVoiceChatCodec``)
on tiny random checkpoints, plus an independent numpy iSTFT."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache
from mlx_oracle import full_size_manifest, to_np
from torch.utils._python_dispatch import TorchDispatchMode

from nvchat_torch.loading.checkpoint import Checkpoint
from nvchat_torch.models.codec import Codec, ResidualVectorQuantizer, StackedCodebooks
from nvchat_torch.models.config import VoiceChatConfig

PREFIX = "tts_model.audio_codec."
SAMPLES = 1764  # per codec frame
TOL = 1e-4


def codec_state(path, dtype: torch.dtype = torch.float32) -> tuple[Codec, dict[str, torch.Tensor]]:
    with Checkpoint(path) as ckpt:
        state = {k[len(PREFIX):]: v for k, v in ckpt.iter_tensors(dtype=dtype) if k.startswith(PREFIX)}
        config = ckpt.config.codec_config
    return Codec(config), state


def load_codec(path, dtype: torch.dtype = torch.float32, fuse: bool = False) -> Codec:
    codec, state = codec_state(path, dtype)
    codec = codec.to(dtype)
    codec.init_constants()  # the cast rounded the float32 constants: recreate them (the documented path)
    codec.load_state_dict(state, strict=True)
    codec.requires_grad_(False)
    if fuse:
        codec.fuse()
    return codec


@pytest.fixture(scope="module")
def codec(ckpt_f32) -> Codec:
    return load_codec(ckpt_f32)


@pytest.fixture(scope="module")
def fused(ckpt_f32) -> Codec:
    return load_codec(ckpt_f32, fuse=True)


@pytest.fixture(scope="module")
def ref_codec(ckpt_f32, reference):
    return reference(ckpt_f32).model.tts_model.audio_codec


def random_codes(batch: int, frames: int, seed: int, quantizers: int = 31) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, (batch, quantizers, frames))


def sine(frames: int) -> np.ndarray:
    t = np.arange(frames * SAMPLES) / 22050.0
    return (0.5 * np.sin(2 * np.pi * 440.0 * t) + 0.2 * np.sin(2 * np.pi * 3100.0 * t))[None, None].astype(np.float32)


def stream(codec: Codec, codes: np.ndarray, cache) -> list[torch.Tensor]:
    return [codec.decode_step(torch.from_numpy(codes[:, :, t:t + 1]), cache) for t in range(codes.shape[2])]


# ---- names and shapes


def test_names_and_shapes_match_the_checkpoint(ckpt_f32):
    codec, state = codec_state(ckpt_f32)
    ours = {k: tuple(v.shape) for k, v in codec.state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in state.items()}
    assert "prvq._variance_list.30.variance" in ours and "decoder.layers.0.weight" in ours


def test_full_size_names_and_shapes_on_meta():
    with torch.device("meta"):
        codec = Codec(VoiceChatConfig.full_size().codec_config)
    ours = {PREFIX + k: tuple(v.shape) for k, v in codec.state_dict().items()}
    manifest = {k: shape for k, (shape, _) in full_size_manifest("bf16").items() if k.startswith(PREFIX)}
    assert ours == manifest
    assert ours[PREFIX + "decoder.layers.0.weight"] == (512, 1536, 9)  # ConvTranspose1d [in, out, k]
    codec.init_constants("cpu")  # what the loader does after materializing
    assert codec.synthesis_basis.device.type == "cpu" and codec.synthesis_basis.dtype == torch.float32


# ---- decoding


@pytest.mark.parametrize("quantizers", [31, 8])
def test_decode_matches_reference(codec, ref_codec, quantizers):
    codes = random_codes(2, 4, seed=quantizers, quantizers=quantizers)
    ours = codec.decode(torch.from_numpy(codes))
    theirs = to_np(ref_codec.decode(mx.array(codes)))
    assert ours.shape == (2, 1, 4 * SAMPLES) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), theirs, atol=TOL, rtol=0)


def numpy_istft(spectrum: np.ndarray, clamp: bool) -> np.ndarray:
    """Independent float64 iSTFT: irfft per frame, [clamp to the window], Hann window, OLA, / max(env, 1e-10)."""
    n_fft, hop = 16, 4
    bins = n_fft // 2 + 1
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    complex_spec = spectrum[:, :bins].astype(np.float64) + 1j * spectrum[:, bins:].astype(np.float64)
    frames = np.fft.irfft(complex_spec, n=n_fft, axis=1)  # [B, n_fft, N]; ignores imag at DC and Nyquist
    if clamp:
        frames = np.clip(frames, -window[:, None], window[:, None])
    batch, _, count = frames.shape
    out = np.zeros((batch, (count - 1) * hop + n_fft))
    env = np.zeros(out.shape[1])
    for i in range(count):
        out[:, i * hop:i * hop + n_fft] += frames[:, :, i] * window
        env[i * hop:i * hop + n_fft] += window ** 2
    return out / np.maximum(env, 1e-10)


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_istft_matches_numpy(codec, scale):
    spectrum = np.random.default_rng(3).standard_normal((2, 18, 25)).astype(np.float32) * scale
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(16) / 16)
    clamped = np.abs(np.fft.irfft(spectrum[:, :9] + 1j * spectrum[:, 9:], n=16, axis=1))[:, 1:] > window[1:, None]
    assert clamped.any() == (scale > 1)  # the small spectrum is clamp-free, the large one is not
    ours = codec.istft(torch.from_numpy(spectrum))[:, 0].numpy()
    np.testing.assert_allclose(ours, numpy_istft(spectrum, clamp=True), atol=1e-5, rtol=0)
    if scale < 1:
        np.testing.assert_allclose(ours, numpy_istft(spectrum, clamp=False), atol=1e-5, rtol=0)


# ---- streaming


def test_decode_step_matches_reference_and_offline(codec, ref_codec):
    codes = random_codes(1, 6, seed=7)
    cache = codec.new_cache()
    shapes = [t.shape for t in cache.blocks + [cache.spectrum]]
    spectrum = cache.spectrum.data_ptr()
    ours = stream(codec, codes, cache)
    assert all(chunk.shape == (1, 1, SAMPLES) for chunk in ours)
    # fixed size (each block's state is replaced by a view of its window, the spectrum updated in place)
    assert [t.shape for t in cache.blocks + [cache.spectrum]] == shapes and cache.spectrum.data_ptr() == spectrum

    ref_cache = CausalConv1dCache()
    theirs = [to_np(ref_codec.decode_step(mx.array(codes[:, :, t:t + 1]), ref_cache)) for t in range(codes.shape[2])]
    streamed = torch.cat(ours, -1).numpy()
    np.testing.assert_allclose(streamed, np.concatenate(theirs, -1), atol=TOL, rtol=0)

    # The stream is the offline decode delayed by 8 samples (offline samples 0-5 see the edge normalisation).
    offline = codec.decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_allclose(streamed[..., 8 + 6:], offline[..., 6:-8], atol=TOL, rtol=0)

    cache.clear()
    again = stream(codec, codes[:, :, :2], cache)
    torch.testing.assert_close(torch.cat(again, -1), torch.cat(ours[:2], -1), atol=0, rtol=0)


class HostSyncs(TorchDispatchMode):
    """Records the ops that read a tensor value back to the host."""

    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal")

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.SYNCS):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fuse", [False, True])
def test_decode_step_has_no_host_sync(codec, fused, fuse):
    model = fused if fuse else codec
    cache = model.new_cache()
    codes = torch.from_numpy(random_codes(1, 1, seed=11))
    with HostSyncs() as offline:
        model.decode(codes)
    assert offline.syncs  # the detector sees the offline range check's reads
    with HostSyncs() as step:
        for _ in range(3):
            model.decode_step(codes, cache)
    assert step.syncs == []


def test_fuse_keeps_outputs_and_memory(ckpt_f32, codec, fused):
    assert isinstance(fused.prvq, StackedCodebooks) and type(codec.prvq) is ResidualVectorQuantizer
    assert sum(p.nbytes for p in fused.parameters()) == sum(p.nbytes for p in codec.parameters())
    state = dict(codec.state_dict())
    assert [k for k in state if "mus_list" not in k] == [k for k in fused.state_dict() if "codebooks" not in k]
    assert torch.equal(fused.prvq.codebooks, torch.stack([state[f"prvq.mus_list.{q}"] for q in range(31)]))

    codes = random_codes(2, 3, seed=5)
    assert torch.equal(fused.decode(torch.from_numpy(codes)), codec.decode(torch.from_numpy(codes)))
    one = codes[:1]
    assert torch.equal(torch.cat(stream(fused, one, fused.new_cache()), -1),
                       torch.cat(stream(codec, one, codec.new_cache()), -1))
    wave = torch.from_numpy(sine(2))
    assert torch.equal(fused.encode(wave), codec.encode(wave))


def test_a_cast_rounds_the_constants_until_init_constants_recreates_them(ckpt_f32):
    model = Codec(Checkpoint(ckpt_f32).config.codec_config).to(torch.bfloat16)
    assert model.synthesis_basis.dtype == torch.bfloat16  # a plain nn.Module cast: nothing hidden
    model.init_constants()
    assert model.synthesis_basis.dtype == torch.float32 and model.window.dtype == torch.float32
    assert model.prvq.codebook(0).dtype == torch.bfloat16


# ---- encoding (the silent warmup prompt)


@pytest.mark.parametrize("signal", ["sine", "silence"])
def test_encode_matches_reference(codec, ref_codec, signal):
    wave = sine(3) if signal == "sine" else np.zeros((1, 1, 38 * SAMPLES), np.float32)
    latents = codec.encode_latents(torch.from_numpy(wave))
    np.testing.assert_allclose(latents.numpy(), to_np(ref_codec.encode_latents(mx.array(wave))), atol=TOL, rtol=0)
    codes = codec.encode(torch.from_numpy(wave))
    assert codes.shape == (1, 31, wave.shape[-1] // SAMPLES)
    np.testing.assert_array_equal(codes.numpy(), to_np(ref_codec.encode(mx.array(wave))))


def test_bfloat16_checkpoint(make_checkpoint, reference):
    path = make_checkpoint(seed=0, dtype="bfloat16")
    model = load_codec(path, torch.bfloat16)
    ref = reference(path).model.tts_model.audio_codec
    assert model.synthesis_basis.dtype == torch.float32 and model.decoder.layers[0].weight.dtype == torch.bfloat16
    # The encoder runs in float32 like the reference (its float32 spectrogram promotes every layer):
    # the warmup codes are exactly the reference's.
    for wave in (sine(2), np.zeros((1, 1, 38 * SAMPLES), np.float32)):
        np.testing.assert_array_equal(model.encode(torch.from_numpy(wave)).numpy(),
                                      to_np(ref.encode(mx.array(wave))))
    # The decoder runs in bf16 (rounding differs op by op), the iSTFT in float32.
    codes = random_codes(1, 3, seed=2)
    ours = model.decode(torch.from_numpy(codes))
    assert ours.dtype == torch.float32
    diff = np.abs(ours.numpy() - to_np(ref.decode(mx.array(codes))))
    assert diff.mean() < 0.02 and diff.max() < 0.25


# ---- bad input


def test_bad_input_is_named(codec):
    with pytest.raises(ValueError, match="shape"):
        codec.decode(torch.zeros(31, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="quantizers"):
        codec.decode(torch.zeros(1, 32, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        codec.decode(torch.zeros(1, 31, 3))
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        codec.decode(torch.full((1, 31, 2), 1024))
    cache = codec.new_cache()
    with pytest.raises(ValueError, match="one frame"):
        codec.decode_step(torch.zeros(1, 31, 2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="batch"):
        codec.decode_step(torch.zeros(2, 31, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="1000 samples"):
        codec.encode(torch.zeros(1, 1, 1000))
    with pytest.raises(ValueError, match="mono"):
        codec.encode(torch.zeros(1, 2, 4 * SAMPLES))
