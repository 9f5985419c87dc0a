"""The MPS and CUDA branches, run on the CPU: the int4pack layouts through their pure-torch stand-ins
(each checked against a line-by-line transcription of PyTorch's kernel), the device choices, and the
fallbacks."""

from __future__ import annotations

import types
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest
import torch
from mlx_oracle import synth_audio

import nvchat_torch as nv
from nvchat_torch import diagnostics
from nvchat_torch import model as model_module
from nvchat_torch.loading.checkpoint import Checkpoint
from nvchat_torch.models.config import QuantSpec
from nvchat_torch.models.int4pack import (
    cuda_convert_weight_to_int4pack,
    cuda_weight_int4pack_mm,
    int4_kernel,
    mps_convert_weight_to_int4pack,
    mps_weight_int4pack_mm,
    unpack_int4pack,
)
from nvchat_torch.models.quant import Int4PackedLinear, QuantizedLinear, pack_int4, self_test_kernel, unpack_codes
from nvchat_torch.op_audit import (
    LAYOUTS,
    Audit,
    NativeFunctions,
    OpRecorder,
    audit,
    document,
    markdown_table,
    read_between_markers,
)


@pytest.fixture(scope="module")
def q4_card(make_checkpoint):
    """The real 4-bit card's layout: 4-bit LLM with float32 scales, everything else bf16."""
    return make_checkpoint(seed=0, bits=4, dtype="bfloat16", scales_dtype="float32")


def gpt_fast_bytes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` as the MPS/CUDA converters take them: uint8 ``[N, K/2]``, even k in the high nibble."""
    return (q[:, ::2] << 4) | q[:, 1::2]


def random_codes(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------
# The stand-ins against transcriptions of the kernels' own loops


def metal_weight_to_int4pack(w: torch.Tensor) -> bytes:
    """``weight_to_int4pack`` (aten/src/ATen/native/mps/kernels/Quantized.metal), one thread per int32."""
    words = w.contiguous().view(torch.int32)
    n_rows, k_int32 = words.shape
    out = bytearray(n_rows * k_int32 * 4)
    for n in range(n_rows):
        for k in range(k_int32):
            src = int(words[n, k]) & 0xFFFFFFFF
            v0, v1, v2, v3 = (src & 0xFF000000) >> 24, (src & 0x00FF0000) >> 16, (src & 0x0000FF00) >> 8, src & 0xFF
            for i, v in enumerate((v3, v2, v1, v0)):
                out[n * k_int32 * 4 + k * 4 + i] = ((v & 0xF) << 4) | (v >> 4)
    return bytes(out)


def metal_int4pack_mm(a: np.ndarray, b: bytes, sz: np.ndarray, group_size: int, n_out: int) -> np.ndarray:
    """``int4pack_mm`` (Quantized.metal): per 4 output channels, 32 threads each taking 4 k at a time."""
    m_rows, k_total = a.shape
    out = np.zeros((m_rows, n_out))
    for m in range(m_rows):
        for n in range(0, n_out, 4):
            for tid in range(32):
                result = np.zeros(4)
                for k in range(tid * 4, k_total, 128):
                    g = k // group_size
                    scales = [float(sz[g, n + i, 0]) for i in range(4)]
                    zeros = np.array([float(sz[g, n + i, 1]) - scales[i] * 8 for i in range(4)])
                    a_val = a[m, k:k + 4].astype(np.float64)
                    a_vec = a_val * np.array([1, 1 / 16, 1 / 256, 1 / 4096])
                    for i in range(4):
                        start = ((n + i) * k_total + k) // 2
                        ushort = b[start] | (b[start + 1] << 8)
                        b_row = scales[i] * np.array([ushort & 0x000F, ushort & 0x00F0, ushort & 0x0F00, ushort & 0xF000])
                        result[i] += a_vec @ b_row
                    result += a_val.sum() * zeros
                out[m, n:n + 4] += result
    return out


def cuda_matrix_to_m16n8k16_bint4_layout(w: np.ndarray, inner_k_tiles: int) -> np.ndarray:
    """``matrix_to_m16n8k16_Bint4_layout`` (aten/src/ATen/native/cuda/int4mm.cu), NVIDIA branch."""
    n_in, half_k = w.shape
    n_tiles, k_super = -(-n_in // 8), half_k * 2 // (inner_k_tiles * 16)
    out = np.zeros((n_tiles, k_super, 32, inner_k_tiles // 2), dtype=np.uint32)
    for k_outer in range(k_super):
        for n_tile in range(n_tiles):
            for t in range(32):
                for inner in range(0, inner_k_tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    k_base0 = (k_outer * inner_k_tiles + inner) * 16 // 2
                    ks = [k_base0 + t % 4, k_base0 + t % 4 + 4, k_base0 + 8 + t % 4, k_base0 + 8 + t % 4 + 4]
                    v = [int(w[n0, kk]) if n0 < n_in and kk < half_k else 0 for kk in ks]
                    out[n_tile, k_outer, t, inner // 2] = (
                        ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16)
                        | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4))
    return out.view(np.int32)


def cuda_b_fragments(packed: np.ndarray, k_total: int) -> np.ndarray:
    """The codes ``BLayout_TC_int4::load`` hands the MMA, placed where the m16n8k16 B fragment puts
    them (PTX ISA: register r of a k-tile holds rows ``(lane % 4) * 2 + 8 r + {0, 1}``, column
    ``lane / 4``): ``convert_i4x8_to_bf16x2x4`` makes pair ``h[i]`` of nibbles ``i`` (low half) and
    ``i + 4`` (high half), and pairs 0, 1 feed k-tile ``2 j``, pairs 2, 3 k-tile ``2 j + 1``."""
    n_tiles, k_outer_tiles, _, half = packed.shape
    codes = np.full((n_tiles * 8, k_total), -1)
    for nt in range(n_tiles):
        for ko in range(k_outer_tiles):
            for lane in range(32):
                for j in range(half):
                    word = int(packed[nt, ko, lane, j]) & 0xFFFFFFFF
                    for i in range(4):
                        pair = (word >> (4 * i)) & 0x000F000F
                        k_tile = ko * half * 2 + 2 * j + i // 2
                        row = k_tile * 16 + (lane % 4) * 2 + 8 * (i % 2)
                        codes[nt * 8 + lane // 4, row] = pair & 0xF
                        codes[nt * 8 + lane // 4, row + 1] = pair >> 16
    return codes


def test_mps_converter_is_the_metal_kernel():
    w = gpt_fast_bytes(random_codes(16, 128, seed=1))
    packed = mps_convert_weight_to_int4pack(w, 2)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (2, 4, 32, 1)  # the op's (fake) shape
    assert packed.contiguous().view(torch.uint8).numpy().tobytes() == metal_weight_to_int4pack(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mps_matmul_is_the_metal_kernel(dtype):
    g = torch.Generator().manual_seed(2)
    q = random_codes(8, 256, seed=2)
    packed = mps_convert_weight_to_int4pack(gpt_fast_bytes(q), 2)
    sz = torch.stack((torch.rand(4, 8, generator=g) + 0.1, torch.randn(4, 8, generator=g)), -1).to(dtype)
    x = torch.randn(2, 256, generator=g).to(dtype)
    want = metal_int4pack_mm(x.float().numpy(), packed.view(torch.uint8).numpy().tobytes(),
                             sz.float().numpy() if dtype == torch.float32 else _bf16_shifted(sz), 64, 8)
    got = mps_weight_int4pack_mm(x, packed, 64, sz)
    assert got.dtype == dtype and got.shape == (2, 8)
    np.testing.assert_allclose(got.float().numpy(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-4 * np.abs(want).max())


def _bf16_shifted(sz: torch.Tensor) -> np.ndarray:
    # the kernel forms `zero - scale * T(8)` in T: hand the transcription a zero that gives that after its own - 8 s
    scale, zero = sz[..., 0], sz[..., 1]
    return torch.stack((scale.float(), (zero - scale * 8).float() + scale.float() * 8), -1).numpy()


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_cuda_converter_is_the_tile_kernel(inner_k_tiles):
    w = gpt_fast_bytes(random_codes(20, 256, seed=inner_k_tiles))  # 20 rows: the last n-tile half empty
    packed = cuda_convert_weight_to_int4pack(w, inner_k_tiles)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (3, 256 // (16 * inner_k_tiles), 32, inner_k_tiles // 2)
    np.testing.assert_array_equal(packed.numpy(), cuda_matrix_to_m16n8k16_bint4_layout(w.numpy(), inner_k_tiles))


@pytest.mark.parametrize("inner_k_tiles", [2, 8])
def test_cuda_layout_holds_each_code_where_the_mma_reads_it(inner_k_tiles):
    q = random_codes(16, 256, seed=5)
    packed = cuda_convert_weight_to_int4pack(gpt_fast_bytes(q), inner_k_tiles)
    np.testing.assert_array_equal(cuda_b_fragments(packed.numpy(), 256), q.numpy())
    np.testing.assert_array_equal(unpack_int4pack(packed, "cuda", 16, 256).numpy(), q.numpy())


def test_cuda_matmul_dequantizes_with_one_bf16_rounding_and_takes_bf16_only():
    g = torch.Generator().manual_seed(3)
    q = random_codes(16, 128, seed=3)
    packed = cuda_convert_weight_to_int4pack(gpt_fast_bytes(q), 2)
    sz = torch.stack((torch.rand(2, 16, generator=g) + 0.1, torch.randn(2, 16, generator=g)), -1).to(torch.bfloat16)
    # an identity input reads the weights back: bf16((q - 8) * scale + zero), one rounding (__hfma2)
    got = cuda_weight_int4pack_mm(torch.eye(128, dtype=torch.bfloat16), packed, 64, sz).t()
    scale, zero = (sz[..., i].t().double().repeat_interleave(64, 1) for i in (0, 1))
    np.testing.assert_array_equal(got.float().numpy(), ((q.double() - 8) * scale + zero).to(torch.bfloat16).float().numpy())
    with pytest.raises(RuntimeError, match="bfloat16"):
        cuda_weight_int4pack_mm(torch.eye(128), packed, 64, sz.float())


# --------------------------------------------------------------------------------------
# MLX's codes through the device layouts


def mlx_linear(seed: int, out_features: int = 200, in_features: int = 256) -> tuple[QuantizedLinear, torch.Tensor]:
    """MLX's own 4-bit linear as our packed module, and ``mx.dequantize`` of its weights."""
    mx.random.seed(seed)
    ref = mnn.QuantizedLinear.from_linear(mnn.Linear(in_features, out_features), group_size=64, bits=4)
    ours = QuantizedLinear(in_features, out_features, True, QuantSpec(4, 64), torch.float32)
    ours.load_state_dict({"weight": torch.from_numpy(np.array(ref.weight).view(np.int32)).view(torch.uint32),
                          "scales": torch.from_numpy(np.array(ref.scales)),
                          "biases": torch.from_numpy(np.array(ref.biases)),
                          "bias": torch.from_numpy(np.array(ref.bias))})
    return ours, torch.from_numpy(np.array(mx.dequantize(ref.weight, ref.scales, ref.biases, group_size=64, bits=4)))


def test_mlx_codes_through_the_mps_packing_path_are_the_dequantized_weights():
    source, dequantized = mlx_linear(seed=7)
    packed = Int4PackedLinear(source, torch.float32, int4_kernel("mps", stand_in=True))
    assert packed.packed.dtype == torch.int32 and tuple(packed.packed.shape) == (208 // 8, 256 // 32, 32, 1)
    # the bytes the Metal kernel reads hold MLX's codes, k in order
    codes = unpack_int4pack(packed.packed, "mps", 208, 256)[:200]
    np.testing.assert_array_equal(codes.numpy(), unpack_codes(source.weight, 4).numpy())
    # and an identity input through the kernel's arithmetic gives MLX's dequantized weights, bit for bit
    eye = torch.eye(256)
    weights = mps_weight_int4pack_mm(eye, packed.packed, 64, packed.scales_and_zeros)[:, :200].t()
    np.testing.assert_array_equal(weights.numpy(), dequantized.numpy())
    # the module: MLX's quantized matmul, to float32 summation order
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    want = x @ dequantized.t() + source.bias
    np.testing.assert_allclose(packed(x).detach().numpy(), want.detach().numpy(), rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())


def test_mlx_codes_through_the_cuda_packing_path():
    source, dequantized = mlx_linear(seed=8)
    packed = Int4PackedLinear(source, torch.bfloat16, int4_kernel("cuda", stand_in=True))
    assert tuple(packed.packed.shape) == (208 // 8, 256 // 32, 32, 1)
    np.testing.assert_array_equal(unpack_int4pack(packed.packed, "cuda", 200, 256).numpy(),
                                  unpack_codes(source.weight, 4).numpy())
    weights = cuda_weight_int4pack_mm(torch.eye(256, dtype=torch.bfloat16), packed.packed, 64,
                                      packed.scales_and_zeros)[:, :200].t()
    # CUDA's kernel reads scale and zero as bf16: bf16((q - 8) * bf16(s) + bf16(b + 8 s)), MLX's weights to bf16
    codes = unpack_codes(source.weight, 4).double()
    scale = source.scales.to(torch.bfloat16).double().repeat_interleave(64, 1)
    zero = (source.biases + 8 * source.scales).to(torch.bfloat16).double().repeat_interleave(64, 1)
    np.testing.assert_array_equal(weights.float().numpy(), ((codes - 8) * scale + zero).to(torch.bfloat16).float().numpy())
    np.testing.assert_allclose(weights.float().numpy(), dequantized.numpy(), atol=2**-7 * dequantized.abs().max().item())


def test_each_stand_in_passes_the_self_test_the_device_runs():
    assert self_test_kernel(int4_kernel("mps", stand_in=True), torch.float32) is None
    assert self_test_kernel(int4_kernel("mps", stand_in=True), torch.bfloat16) is None
    assert self_test_kernel(int4_kernel("cuda", stand_in=True), torch.bfloat16) is None
    assert "bfloat16 activations, not torch.float32" in self_test_kernel(int4_kernel("cuda", stand_in=True),
                                                                          torch.float32)


# --------------------------------------------------------------------------------------
# Whole sessions through the device branches


def stream(model) -> dict:
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="you are a helpful assistant",
                                                                 seed=0, deterministic=True))
    events = session.push_audio(synth_audio(1.5), 16000) + session.flush()
    return {"codes": np.stack([e.audio_codes for e in events if e.kind == "audio"]),
            "shown": [(e.kind, e.frame_index, e.token_id, e.delta) for e in events if e.kind != "audio"]}


def packed_for(path, kernel, dtype=None):
    model = nv.load_model(path, device="cpu", dtype=dtype, weights="packed", prepare=False)
    model.prepare(int4=False)
    eligible = sum(isinstance(m, QuantizedLinear) and m.spec.bits == 4 for m in model.modules())
    assert pack_int4(model, dtype=model.dtype, kernel=kernel) == eligible > 0
    layouts = {m.kernel.device_type for m in model.modules() if isinstance(m, Int4PackedLinear)}
    assert layouts == {kernel.device_type}
    return model


def test_a_session_through_the_mps_branch_equals_the_cpu_default(q4_card):
    mps = packed_for(q4_card, int4_kernel("mps", stand_in=True))
    assert "aten::_weight_int4pack_mm (mps layout, pure-torch stand-in)" in repr(mps)
    want, got = stream(nv.load_model(q4_card, device="cpu")), stream(mps)
    np.testing.assert_array_equal(got["codes"], want["codes"])
    assert got["shown"] == want["shown"]  # text, function and transcript tokens, frame by frame


def test_a_session_through_the_cuda_branch_holds_the_checkpoints_codes(q4_card):
    """CUDA's kernel takes bf16 activations only (the fast mode, not bit-faithful, so no session to
    equal): every packed linear holds the checkpoint's codes in the tile layout, and a session runs."""
    cuda = packed_for(q4_card, int4_kernel("cuda", stand_in=True), dtype=torch.bfloat16)
    plain = nv.load_model(q4_card, device="cpu", dtype=torch.bfloat16, weights="packed", prepare=False)
    plain.prepare(int4=False)
    sources = dict(plain.named_modules())
    for name, m in cuda.named_modules():
        if isinstance(m, Int4PackedLinear):
            np.testing.assert_array_equal(unpack_int4pack(m.packed, "cuda", m.out_features, m.in_features).numpy(),
                                          unpack_codes(sources[name].weight, 4).numpy())
    got, want = stream(cuda), stream(nv.load_model(q4_card, device="cpu", dtype=torch.bfloat16))
    assert got["codes"].shape == want["codes"].shape and got["codes"].shape[1] == 31


# --------------------------------------------------------------------------------------
# Device choices and fallbacks


def test_the_faithful_mode_on_cuda_falls_back_loudly_once_and_says_so(q4_card):
    model = nv.load_model(q4_card, device="cpu", weights="packed", prepare=False)
    model.prepare(int4=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pack_int4(model, dtype=model.dtype, kernel=int4_kernel("cuda", stand_in=True)) == 0
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "aten::_weight_int4pack_mm takes torch.bfloat16 activations, not torch.float32" in messages[0]
    assert "4-bit linears on cpu" in messages[0] and "slower" in messages[0]
    assert "fallback: aten::_weight_int4pack_mm takes torch.bfloat16" in model.describe()


def test_a_missing_kernel_falls_back_loudly_once(q4_card, monkeypatch):
    from nvchat_torch.models.int4pack import Int4Kernel

    monkeypatch.setattr(Int4Kernel, "available", lambda self: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = nv.load_model(q4_card, device="cpu", dtype=torch.bfloat16)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "this torch build has no aten::_weight_int4pack_mm_for_cpu for cpu" in messages[0]
    assert "fallback: this torch build has no aten::_weight_int4pack_mm_for_cpu" in model.describe()


def test_weights_auto_on_each_device(q4_card, monkeypatch):
    with Checkpoint(q4_card) as ckpt:
        quantized = ckpt.quantized_modules()
        auto = model_module.auto_dequantizes
        # MPS: packed (its int4 kernel takes float32 activations); the fast mode: packed everywhere
        assert not auto(ckpt, quantized, torch.device("mps"), None)
        assert not auto(ckpt, quantized, torch.device("cuda"), torch.bfloat16)
        # CUDA: dense float32 when it takes at most a quarter of the card's memory
        dense = sum(r * w * 8 * 4 for r, w in (ckpt.shape(f"{p}.weight") for p in quantized))

        class Card:
            total_memory = 4 * dense

        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Card)
        assert auto(ckpt, quantized, torch.device("cuda"), None)
        Card.total_memory = 4 * dense - 4
        assert not auto(ckpt, quantized, torch.device("cuda"), torch.float32)


def test_device_memory_and_synchronize_take_each_device_branch(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 11 << 30)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(f"cuda:{device}"))
    assert diagnostics.device_memory(torch.device("mps")) == 11 << 30
    assert diagnostics.device_memory(torch.device("cpu")) > 0
    for device in ("mps", "cuda", "cpu"):
        diagnostics.synchronize(torch.device(device))
    assert calls == ["mps", "cuda:cuda"]


def test_the_default_device_prefers_mps_then_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert model_module.default_device() == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model_module.default_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_module.default_device() == torch.device("cpu")


def test_the_real_device_kernels_dispatch_torchs_ops_with_torchs_shapes(monkeypatch):
    """``int4_kernel("mps")`` and ``("cuda")``, not their stand-ins: on fake mps/cuda tensors (torch's
    own meta functions) packing and the matmul dispatch torch's device ops, in the stand-ins' shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    words = mlx_linear(seed=9, out_features=32)[0].weight  # MLX's uint32 words [32, 256 / 8]
    for device, dtype in (("mps", torch.float32), ("cuda", torch.bfloat16)):
        kernel, stand_in = int4_kernel(device), int4_kernel(device, stand_in=True)
        assert not kernel.stand_in and kernel.name == f"aten::_weight_int4pack_mm ({device} layout)"
        assert kernel.activation_dtypes[0] == dtype and kernel.available()  # every build registers the op
        with FakeTensorMode(allow_non_fake_inputs=True), OpRecorder() as recorder:
            packed = kernel.pack(torch.empty(32, 256 // 8, dtype=torch.uint32, device=device), 256)
            y = kernel.mm(torch.empty(3, 256, dtype=dtype, device=device), packed, 64,
                          torch.empty(256 // 64, 32, 2, dtype=dtype, device=device))
        ops = {op for op, *_ in recorder.named()}
        assert {"aten::_convert_weight_to_int4pack", "aten::_weight_int4pack_mm"} <= ops and "_for_cpu" not in str(ops)
        want = stand_in.pack(words, 256)  # real codes through the pure-torch model of the kernel
        assert (packed.device.type, packed.dtype, packed.shape) == (device, torch.int32, want.shape)
        assert (y.device.type, y.dtype, tuple(y.shape)) == (device, dtype, (3, 32))

    monkeypatch.setattr(torch.ops, "aten", types.SimpleNamespace())  # a build without the int4pack ops
    assert not int4_kernel("mps").available() and not int4_kernel("cuda").available()
    assert int4_kernel("mps", stand_in=True).available()  # a stand-in always runs


# --------------------------------------------------------------------------------------
# The op audit


def test_native_functions_follow_delegates_and_composites(tmp_path):
    yaml = tmp_path / "native_functions.yaml"
    yaml.write_text("""\
- func: good.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
  dispatch:
    CPU, CUDA, MPS: good_out

- func: good(Tensor self) -> Tensor
  structured_delegate: good.out
  dispatch:
    SparseCPU, SparseMPS: good_sparse

- func: cpu_only.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
  dispatch:
    CPU, CUDA: cpu_only_out

- func: cpu_only(Tensor self) -> Tensor
  structured_delegate: cpu_only.out
  dispatch:
    SparseMPS: only_sparse

- func: implicit(Tensor self) -> Tensor
  variants: function

- func: explicit.Scalar(Tensor self, Scalar other) -> Tensor
  dispatch:
    CompositeExplicitAutograd: explicit
""")
    native = NativeFunctions.read(yaml)
    assert native.mps_kernel("aten::good") == "MPS (via good.out)"
    assert native.mps_kernel("aten::cpu_only") is None  # SparseMPS is not MPS
    assert native.mps_kernel("aten::implicit") == "CompositeImplicitAutograd"
    assert native.mps_kernel("aten::explicit.Scalar") == "CompositeExplicitAutograd"
    assert native.mps_kernel("aten::unknown") is None
    shipped = NativeFunctions.read()
    assert shipped.mps_kernel("aten::add.Tensor") == "MPS (via add.out)"
    assert shipped.mps_kernel("aten::_weight_int4pack_mm") == "MPS"
    assert shipped.mps_kernel("aten::_weight_int4pack_mm_for_cpu") is None


def test_the_audit_flags_an_op_without_an_mps_kernel_and_float64():
    recorder = OpRecorder()
    recorder.scenario = "frame"
    x = torch.arange(12.0).view(3, 4)
    with recorder:
        (x * 2).sum()
    assert Audit.of({"float32/faithful": recorder.named()}).problems == []
    with recorder:
        torch.mode(x, dim=-1)  # aten::mode: CPU and CUDA kernels, none for MPS in torch 2.13
        x.double().sum()
        x.bfloat16() + 1
    problems = Audit.of({"float32/faithful": recorder.named()}).problems
    assert any(p.startswith("aten::mode has no MPS kernel") for p in problems), problems
    assert any("aten::_to_copy takes float64" in p for p in problems), problems
    assert any("computes in bfloat16 in float32/faithful" in p for p in problems), problems
    table = markdown_table(Audit.of({"float32/faithful": recorder.named()}))
    assert "| `mode` | 1 | float32, int64 | frame | **none** |" in table


def test_the_audit_checks_bf16_against_the_networks_of_docs_parity():
    """Modules at the model's real paths: bf16 arithmetic passes per layout only inside the networks
    docs/parity.md computes in bf16; moves of bf16 values and products with a mask round nothing."""
    from nvchat_torch.models.layers import squared_norms

    def computes(forward):  # a module whose call runs ``forward`` (found on the stack as the module's call)
        module = torch.nn.Module()
        module.forward = forward
        return module

    weight = torch.ones(2, dtype=torch.bfloat16)
    model = torch.nn.Module()
    model.stt_model, model.tts_model = torch.nn.Module(), torch.nn.Module()
    model.stt_model.perception = computes(lambda x: x.bfloat16() * 3)  # parity.md: float32 in every layout
    model.stt_model.rnnt_decoder = computes(lambda x: x.bfloat16() + 1)  # parity.md: bf16 bias sum
    model.stt_model.llm = computes(lambda x: x.bfloat16() - 1)  # bf16 only in the bf16 card's prompt prefill
    model.tts_model.tts_model = computes(lambda x: torch.cat([weight, weight]) * (x > 0))  # a move, a mask
    with OpRecorder(model) as recorder:
        for network in (*model.stt_model.children(), model.tts_model.tts_model):
            network(torch.arange(1.0, 5.0))
        squared_norms(weight[None])  # parity.md's RVQ formula, wherever it is called from
    ops = recorder.named()

    flagged = {run: {p.split(" (network: ")[1].split(")")[0] for p in Audit.of({run: ops}).problems}
               for run in ("4bit/faithful", "bf16/faithful", "4bit/fast")}
    assert flagged == {"4bit/faithful": {"Conformer, projection", "Nemotron-H, both heads"},
                       "bf16/faithful": {"Conformer, projection"}, "4bit/fast": set()}
    assert any("computes in bfloat16 in float32/faithful" in p for p in Audit.of({"float32/faithful": ops}).problems)
    assert set(Audit.of({"4bit/faithful": ops}).bf16["4bit/faithful"]) == {
        "Conformer, projection", "RNNT prediction", "Nemotron-H, both heads", "RVQ nearest neighbour"}


def test_every_op_of_every_layout_and_mode_runs_on_mps(tmp_path):
    """load + prepare, prefill and frames, an engine step (a sampling and a deterministic row) and
    generate, for the float32, 4-bit and 8-bit card and bf16 layouts, faithful and fast (the 4-bit one
    also packed and run through the MPS branch): every op has an MPS kernel, no tensor is float64 or
    complex, bf16 only in the networks docs/parity.md computes in bf16; and docs/mps.md holds this table."""
    runs = audit(folder=tmp_path)
    assert set(runs) == {f"{layout}/{mode}" for layout in LAYOUTS for mode in ("faithful", "fast")}
    result = Audit.of(runs)
    assert result.problems == [], "\n".join(result.problems)
    seen = set(result.rows)
    # the branches the CPU run stands for: the int4 kernel (4-bit card, both modes), sampling, the RNNT
    assert {"aten::_weight_int4pack_mm_for_cpu", "aten::uniform_", "aten::normal_"} <= seen, sorted(seen)
    assert "MPS branch runs `_weight_int4pack_mm`" in result.rows["aten::_weight_int4pack_mm_for_cpu"].kernel
    # the MPS packing branch: the stand-in recorded as the two ops MPS runs, the nibble swap before it
    packing = {f"4bit/{mode} MPS int4pack load+prepare" for mode in ("faithful", "fast")}
    assert result.rows["aten::bitwise_or.Tensor"].where == packing == result.rows["aten::_convert_weight_to_int4pack"].where
    mm = result.rows["aten::_weight_int4pack_mm"]
    assert mm.kernel == "MPS" and mm.dtypes == {"float32", "bfloat16", "int32"} and packing < mm.where
    # bf16 is found where parity.md puts it (the check above would pass vacuously if nothing were attributed)
    assert "float32/faithful" not in result.bf16 and result.bf16["bf16/faithful"]["Nemotron-H, both heads"] > 0
    assert {"character encoder", "codec decoder", "RVQ nearest neighbour"} <= set(result.bf16["4bit/faithful"])
    doc = Path(__file__).resolve().parents[1] / "docs" / "mps.md"
    assert read_between_markers(doc) == document(runs, result), (
        "docs/mps.md's op table is stale: regenerate it with `python -m nvchat_torch.op_audit --write docs/mps.md`")


# --------------------------------------------------------------------------------------
# The doctor

# torch's warning for an op PYTORCH_ENABLE_MPS_FALLBACK=1 runs on the CPU (aten/src/ATen/mps/MPSFallback.mm)
TORCH_MPS_FALLBACK = ("The operator 'aten::mode' is not currently supported on the MPS backend and will fall back "
                      "to run on the CPU. This may have performance implications.")


def test_the_doctor_reports_on_the_cpu(tmp_path):
    """What a Mac user pastes into a bug report, run as they run it (here on the CPU)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NVCHAT_DOCTOR_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "nvchat_torch.doctor", "--device", "cpu"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for heading in ("## nvchat_torch doctor", "| torch | " + torch.__version__, "| bf16 on cpu | yes",
                    "| PYTORCH_ENABLE_MPS_FALLBACK |", "### Kernel paths", "### What fell back", "### Model",
                    "### 50 streaming frames (46 timed", "real-time factor"):
        assert heading in out, (heading, out)
    assert "| aten::_weight_int4pack_mm_for_cpu (cpu layout) | float32 | passes |" in out
    assert "| aten::_weight_int4pack_mm (mps layout, pure-torch stand-in) | float32 | passes |" in out
    assert "| aten::_weight_int4pack_mm (cuda layout, pure-torch stand-in) | bfloat16 | passes |" in out
    assert "- nothing" in out and "56-layer Nemotron-H" in out  # the deep preset
    assert "- host reads per frame: 1 (" in out
    kernels = int(out.split("kernels (non-view ATen ops) per steady-state frame: ")[1].split()[0].replace(",", ""))
    assert 1000 < kernels < 5000


def test_the_doctor_shows_each_fallback(q4_card, monkeypatch):
    """A failed self-test, and an op torch reports as run on the CPU on every call of a 4-bit linear."""
    from nvchat_torch import doctor
    from nvchat_torch.models import quant

    monkeypatch.setattr(quant, "_kernel_self_test", lambda packed, source: f"{packed.kernel.op} failed its "
                        "self-test (relative error 0.5 > 0.02)")
    forward = QuantizedLinear.forward
    monkeypatch.setattr(QuantizedLinear, "forward", lambda self, x: warnings.warn(TORCH_MPS_FALLBACK) or forward(self, x))
    out = doctor.report("cpu", str(q4_card), frames=6, dtype=torch.bfloat16)
    fell_back = out.split("### What fell back")[1].split("###")[0]
    assert "- aten::mode ran on the CPU instead of mps: no mps kernel" in fell_back  # named once, not per call
    assert fell_back.count("aten::mode") == 1
    assert "fallback: aten::mode ran on the CPU" in out.split("### Model")[1]  # model.describe()
    assert "4-bit linears on cpu (torch.bfloat16 activations): aten::_weight_int4pack_mm_for_cpu failed" in fell_back
    assert "model: aten::_weight_int4pack_mm_for_cpu failed its self-test" in fell_back
    assert "| aten::_weight_int4pack_mm_for_cpu (cpu layout) | bfloat16 | FAILS: " in out
    assert "fallback: aten::_weight_int4pack_mm_for_cpu failed its self-test" in out  # model.describe()


def test_the_doctors_kernel_rows_and_devices_off_the_cpu(monkeypatch):
    """On mps the doctor self-tests the device's own kernel there (no stand-in rows), or its stand-in on
    the CPU; a device with no kernel says so; the devices line names what torch finds; peak memory."""
    from nvchat_torch import doctor
    from nvchat_torch.models import int4pack

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 << 30)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 5 << 30)
    assert [doctor.peak_memory(torch.device(d)) for d in ("cuda", "mps")] == [3 << 30, 5 << 30]
    assert doctor.peak_memory(torch.device("cpu")) > 0
    tested = []
    monkeypatch.setattr(doctor, "self_test_kernel", lambda k, dtype, device: tested.append((k.name, dtype, str(device))))
    mps, stand_in = int4_kernel("mps"), int4_kernel("mps", stand_in=True)
    rows = doctor.kernel_rows(torch.device("mps"))
    assert tested == [(mps.name, dtype, "mps") for dtype in mps.activation_dtypes]
    assert rows[:3] == [(mps.name, str(d).removeprefix("torch."), "passes") for d in mps.activation_dtypes]
    assert [r[0] for r in rows[3:]] == ["dequantize per call (any bit width)"]  # no stand-in rows
    monkeypatch.undo()
    monkeypatch.setattr(doctor, "int4_kernel", lambda t, stand_in=False: int4pack.int4_kernel(t, stand_in=t != "cpu"))
    rows = doctor.kernel_rows(torch.device("mps"))
    assert rows[:3] == [(stand_in.name, str(d).removeprefix("torch."), "passes") for d in stand_in.activation_dtypes]
    assert len(rows) == 4 and doctor.kernel_rows(torch.device("xpu"))[0] == (
        "int4pack on xpu", "-", "no such kernel: 4-bit weights dequantize per call")

    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"card {i}")
    for found, cards, want in ((True, 2, "mps: available; cuda: card 0, card 1"),
                               (False, 0, "mps: built, not available; cuda: not available")):
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: found)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cards > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cards)
        assert doctor.devices().endswith(want), doctor.devices()


def test_an_op_mps_runs_on_the_cpu_warns_once_and_shows_in_describe(q4_card):
    model = nv.load_model(q4_card, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second run finds the op known already: not warned again
            with diagnostics.CpuFallbackRecorder(model) as recorder:
                assert torch.is_warn_always_enabled()  # torch's TORCH_WARN_ONCE then warns for every op
                for message in [TORCH_MPS_FALLBACK] * 3 + ["something else"] * 2:
                    warnings.warn(message, UserWarning)
            assert not torch.is_warn_always_enabled()
    ours = [str(w.message) for w in caught if issubclass(w.category, diagnostics.CpuFallbackWarning)]
    assert len(ours) == 1 and ours[0].startswith("aten::mode ran on the CPU instead of mps"), ours
    assert [str(w.message) for w in caught if w.category is UserWarning] == ["something else"] * 2  # once a run
    assert list(recorder.ops) == list(model.cpu_fallbacks) == ["aten::mode"]
    assert "fallback: aten::mode ran on the CPU (no mps kernel" in model.describe()
