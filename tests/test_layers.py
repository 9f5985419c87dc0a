"""nvchat_torch.models.layers against MLX's own kernels: the bf16 arithmetic the faithful mode relies on.

Every finite bf16 value in a useful range goes through each elementwise op; the matmuls and convs
use random bf16 operands. MLX is the reference: these are the ops it runs where it computes in bf16.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as mnn
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlx_oracle import to_np

from nvchat_torch.models import layers

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def values():
    """Every finite bf16 with |x| < 60 (beyond, the activations saturate), as torch and MLX arrays."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(BF16)
    x = every[torch.isfinite(every) & (every.float().abs() < 60)]
    return x, mx.array(x.float().numpy()).astype(mx.bfloat16)


def mismatches(want: mx.array, got: torch.Tensor) -> int:
    assert got.dtype == BF16
    return int((to_np(want) != got.float().numpy()).sum())


@pytest.mark.parametrize("name, ours, theirs, allowed", [
    ("gelu_tanh", layers.gelu_tanh, mnn.gelu_approx, 0),
    ("gelu_erf", layers.gelu_erf, mnn.gelu, 0),
    ("softplus", layers.softplus, mnn.softplus, 0),
    # exp itself differs on 2 inputs between the two libraries
    ("sigmoid", layers.sigmoid, mx.sigmoid, 2),
])
def test_bf16_elementwise_ops_round_as_mlx(values, name, ours, theirs, allowed):
    x, xm = values
    assert mismatches(theirs(xm), ours(x)) <= allowed
    # and the plain torch op would not (what the helper is for)
    assert mismatches(theirs(xm), {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu_erf": F.gelu,
                                   "softplus": F.softplus, "sigmoid": torch.sigmoid}[name](x)) > 100


def test_bf16_rsqrt_mean_and_variance_as_mlx(values):
    x, xm = values
    positive = x[x > 0]
    positive_m = mx.array(positive.float().numpy()).astype(mx.bfloat16)
    assert mismatches(mx.rsqrt(positive_m), layers.rsqrt(positive)) == 0
    rows = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)).to(BF16)
    rows_m = mx.array(rows.float().numpy()).astype(mx.bfloat16)
    mean = layers.mean_last(rows)
    assert mismatches(mx.mean(rows_m, axis=-1, keepdims=True), mean) == 0
    assert mismatches(mx.var(rows_m, axis=-1, keepdims=True), layers.var_last(rows, mean)) == 0


@pytest.mark.parametrize("k", [16, 64, 257, 1024])
def test_bf16_linear_and_matmul_accumulate_in_float32_as_mlx(k):
    rng = np.random.default_rng(k)
    a, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((7, k), (33, k), (33,)))
    at, wt, bt = (torch.from_numpy(v).to(BF16) for v in (a, w, b))
    am, wm, bm = (mx.array(v).astype(mx.bfloat16) for v in (a, w, b))
    assert mismatches(mx.addmm(bm, am, wm.T), layers.linear(at, wt, bt)) == 0  # MLX's Linear: one rounding
    assert mismatches(am @ wm.T, layers.matmul(at, wt.T)) == 0
    # float32 activations with bf16 weights promote: exactly the float32 product of the upcast weight
    a32 = torch.from_numpy(a)
    got = layers.linear(a32, wt, bt)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), F.linear(a32, wt.float(), bt.float()).numpy())


def test_bf16_conv1d_rounds_then_adds_the_bias_as_mlx():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 20, 12)).astype(np.float32)  # channels last for MLX
    conv = layers.Conv1d(12, 12, 7, groups=12).to(BF16)
    xm = mx.array(x).astype(mx.bfloat16)
    ref = mnn.Conv1d(12, 12, 7, groups=12)
    ref.weight = mx.array(conv.weight.detach().float().permute(0, 2, 1).numpy()).astype(mx.bfloat16)
    ref.bias = mx.array(conv.bias.detach().float().numpy()).astype(mx.bfloat16)
    with torch.no_grad():
        got = conv(torch.from_numpy(x).to(BF16).transpose(1, 2)).transpose(1, 2)
    assert mismatches(ref(xm), got.contiguous()) == 0


def test_scalars_are_rounded_to_the_arrays_dtype():
    assert layers.scalar(math.sqrt(2.0), BF16) == 1.4140625
    assert layers.scalar(math.sqrt(2.0), torch.float32) == math.sqrt(2.0)
