"""MLX packed formats: our dequantization and packed modules against MLX itself."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest
import torch
from torch import nn

from nvchat_torch.models.config import ConfigError, QuantSpec
from nvchat_torch.models.quant import (
    Int4PackedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    concat_linears,
    dequantize,
    int4pack_available,
    pack_int4,
    quantize_modules,
    unpack_codes,
)

MX_TO_TORCH = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16, mx.float16: torch.float16,
               mx.uint8: torch.uint8}


def t(a: mx.array) -> torch.Tensor:
    """An MLX array as a torch tensor of the same dtype (uint32 codes included)."""
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32)).view(torch.uint32)
    if a.dtype in (mx.bfloat16,):
        return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a)).to(MX_TO_TORCH[a.dtype])


def f32(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().float().numpy()
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_dequantize_is_bit_exact(bits, group_size, scale_dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    w = mx.array(rng.standard_normal((5, 384)).astype(np.float32) * 0.3).astype(scale_dtype)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    ref = mx.dequantize(wq, s, b, group_size=group_size, bits=bits)
    got = dequantize(t(wq), t(s), t(b), QuantSpec(bits, group_size))
    assert got.dtype == MX_TO_TORCH[scale_dtype]
    np.testing.assert_array_equal(f32(got), f32(ref))
    # the requested output dtype only casts MLX's result (mx.dequantize(dtype=...) does the same)
    ref32 = mx.dequantize(wq, s, b, group_size=group_size, bits=bits, dtype=mx.float32)
    np.testing.assert_array_equal(f32(dequantize(t(wq), t(s), t(b), QuantSpec(bits, group_size), torch.float32)),
                                  f32(ref32))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_unpack_reads_every_code_of_random_words(bits):
    rng = np.random.default_rng(bits)
    words = rng.integers(0, 2**32, size=(3, 2 * bits), dtype=np.uint64).astype(np.uint32)
    n = words.shape[1] * 32 // bits
    # Bit-stream reader written independently: element j = bits [j*b, (j+1)*b) of the row's LE bytes.
    as_bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    expect = sum(as_bits[:, k::bits][:, :n].astype(np.int64) << k for k in range(bits))
    got = unpack_codes(torch.from_numpy(words.view(np.int32)).view(torch.uint32), bits)
    np.testing.assert_array_equal(got.numpy(), expect)
    if bits not in (1, 7):  # MLX itself agrees (scale 1, bias 0)
        ones = mx.ones((3, n // 32), dtype=mx.float32)
        ref = mx.dequantize(mx.array(words), ones, mx.zeros_like(ones), group_size=32, bits=bits)
        np.testing.assert_array_equal(got.numpy(), np.array(ref).astype(np.int64))


@pytest.mark.parametrize("mode,group_size,bits", [("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)])
@pytest.mark.parametrize("out_dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_fp_modes_dequantize_is_bit_exact(mode, group_size, bits, out_dtype):
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal((8, 256)).astype(np.float32))
    wq, s = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    ref = mx.dequantize(wq, s, group_size=group_size, bits=bits, mode=mode, dtype=out_dtype)
    got = dequantize(t(wq), t(s), None, QuantSpec(bits, group_size, mode), MX_TO_TORCH[out_dtype])
    np.testing.assert_array_equal(f32(got), f32(ref))


def test_fp_scale_specials_match_mlx():
    """Random words and every scale byte, including E8M0 0 (2^-127) and 255 (+inf in MLX) and NaN codes."""
    rng = np.random.default_rng(3)
    words = mx.array(rng.integers(0, 2**32, size=(4, 64), dtype=np.uint64).astype(np.uint32))
    for mode, gs, bits in (("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)):
        n_in = 64 * 32 // bits
        scales = mx.array(rng.integers(0, 256, size=(4, n_in // gs)).astype(np.uint8))
        scales[0, 0] = 0
        scales[1, 0] = 255
        ref = f32(mx.dequantize(words, scales, group_size=gs, bits=bits, mode=mode, dtype=mx.float32))
        got = f32(dequantize(t(words), t(scales), None, QuantSpec(bits, gs, mode), torch.float32))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


def test_quant_spec_rejects_unsupported():
    for spec in (QuantSpec(7, 64), QuantSpec(4, 16), QuantSpec(4, 64, "mxfp4"), QuantSpec(4, 32, "int4")):
        with pytest.raises(ConfigError):
            spec.validate("test")


def _mlx_linear(in_f, out_f, bits, gs, bias, mode="affine", seed=0):
    mx.random.seed(seed)
    lin = mnn.Linear(in_f, out_f, bias=bias)
    return mnn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits, mode=mode)


def _load_quantized_linear(ref, spec, scale_dtype=torch.float32) -> QuantizedLinear:
    q = QuantizedLinear(ref.weight.shape[1] * 32 // spec.bits, ref.weight.shape[0], "bias" in ref, spec, scale_dtype)
    state = {"weight": t(ref.weight), "scales": t(ref.scales)}
    if spec.has_biases:
        state["biases"] = t(ref.biases)
    if "bias" in ref:
        state["bias"] = t(ref.bias)
    q.load_state_dict(state, strict=True)
    return q


@pytest.mark.parametrize("bits,gs,mode,bias", [(4, 64, "affine", False), (8, 64, "affine", True),
                                               (3, 32, "affine", True), (6, 128, "affine", False),
                                               (4, 32, "mxfp4", False), (8, 32, "mxfp8", True),
                                               (4, 16, "nvfp4", False)])
def test_quantized_linear_matches_mlx_quantized_matmul(bits, gs, mode, bias):
    ref = _mlx_linear(256, 96, bits, gs, bias, mode, seed=bits + gs)
    spec = QuantSpec(bits, gs, mode)
    ours = _load_quantized_linear(ref, spec)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    want = np.array(ref(mx.array(x)).astype(mx.float32))
    got = ours(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_quantized_linear_bf16_scales_run_unrounded_in_fp32():
    """With fp32 activations MLX uses the unrounded s*q+b even for bf16 scales; so do we."""
    mx.random.seed(5)
    lin = mnn.Linear(128, 64, bias=False)
    lin.weight = lin.weight.astype(mx.bfloat16)
    ref = mnn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    assert ref.scales.dtype == mx.bfloat16
    ours = _load_quantized_linear(ref, QuantSpec(4, 64), torch.bfloat16)
    assert ours.scales.dtype == torch.bfloat16
    x = np.random.default_rng(2).standard_normal((2, 128)).astype(np.float32)
    want = np.array(mx.quantized_matmul(mx.array(x), ref.weight, ref.scales, ref.biases, transpose=True,
                                        group_size=64, bits=4).astype(mx.float32))
    got = ours(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32)])
def test_quantized_embedding_matches_mlx_and_reads_only_its_rows(bits, gs):
    mx.random.seed(11)
    emb = mnn.Embedding(50, 128)
    ref = mnn.QuantizedEmbedding.from_embedding(emb, group_size=gs, bits=bits)
    ours = QuantizedEmbedding(50, 128, QuantSpec(bits, gs), torch.float32)
    ours.load_state_dict({"weight": t(ref.weight), "scales": t(ref.scales), "biases": t(ref.biases)})
    ids = np.array([[3, 0, 49, 3]])
    np.testing.assert_array_equal(ours(torch.from_numpy(ids)).numpy(), f32(ref(mx.array(ids))))
    # dequantize only the looked-up rows: poisoning every other row's scales changes nothing
    ours.scales[torch.arange(50) != 3] = float("nan")
    assert torch.isfinite(ours(torch.tensor([3, 3]))).all()


@pytest.mark.parametrize("out_features", [128, 200])  # 200: rows padded to the kernel's multiple of 16
def test_int4pack_linear_matches_mlx(out_features):
    """Where the device has the fused int4 kernel the module is swapped; either way the output is MLX's."""
    ref = _mlx_linear(256, out_features, 4, 64, True, seed=21)
    model = nn.Sequential(_load_quantized_linear(ref, QuantSpec(4, 64)))
    has_kernel = int4pack_available("cpu")
    assert pack_int4(model, dtype=torch.float32) == int(has_kernel)
    assert isinstance(model[0], Int4PackedLinear if has_kernel else QuantizedLinear)
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    want = np.array(ref(mx.array(x)))
    got = model(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the bf16 fast path agrees to bf16 precision
    model_bf16 = nn.Sequential(_load_quantized_linear(ref, QuantSpec(4, 64)))
    pack_int4(model_bf16, dtype=torch.bfloat16)
    np.testing.assert_allclose(model_bf16(torch.from_numpy(x)).detach().numpy(), want,
                               atol=2e-2 * np.abs(want).max())


def test_module_swap_on_meta_and_errors():
    with torch.device("meta"):
        model = nn.ModuleDict({"emb": nn.Embedding(1000, 256), "proj": nn.Linear(256, 512, bias=True),
                               "norm": nn.LayerNorm(256)})
    swapped = quantize_modules(model, {"emb": QuantSpec(4, 64), "proj": QuantSpec(8, 32)})
    assert swapped == ["emb", "proj"]
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["emb.weight"] == (1000, 32) and shapes["emb.scales"] == (1000, 4)
    assert shapes["proj.weight"] == (512, 64) and shapes["proj.biases"] == (512, 8) and shapes["proj.bias"] == (512,)
    assert model.proj.weight.device.type == "meta"
    with pytest.raises(ValueError, match="'norm'"):
        quantize_modules(model, {"norm": QuantSpec(4, 64)})
    with pytest.raises(ValueError, match="'odd'"):
        quantize_modules(nn.ModuleDict({"odd": nn.Linear(100, 8)}), {"odd": QuantSpec(4, 64)})


def test_concat_linears_packed_equals_separate():
    refs = [_mlx_linear(128, n, 4, 64, bias, seed=n) for n, bias in ((64, False), (32, True), (32, False))]
    parts = [_load_quantized_linear(r, QuantSpec(4, 64)) for r in refs]
    fused = concat_linears(parts)
    x = torch.randn(3, 128)
    np.testing.assert_array_equal(fused(x).detach().numpy(), torch.cat([p(x) for p in parts], -1).detach().numpy())
