"""The fused CPU kernels (nvchat_torch/models/cpu_kernels.cpp): built, self-tested, equal to the composite
code they replace on every output a session gives, and a model without them still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlx_oracle import synth_audio

import nvchat_torch as nv
from nvchat_torch.diagnostics import OpCounter
from nvchat_torch.models import cpu_kernels

REPO = Path(__file__).resolve().parents[1]
PROMPT = "you are a helpful assistant"


@pytest.fixture(scope="module")
def deep_q4(make_checkpoint):
    return make_checkpoint(seed=0, bits=4, preset="deep")


def test_the_kernels_build_and_pass_their_self_test():
    # CI has a C++ compiler (.ci/run installs one): the default CPU path must be the fused one there
    assert cpu_kernels.status() is None
    assert cpu_kernels._self_test() is None
    assert cpu_kernels.blas()  # torch's BLAS reached: the norm + projection kernels run too


@pytest.mark.parametrize("rows", [1, 8])
def test_a_fused_projection_computes_as_torch_linear(rows):
    """norm_linear's product is torch's own BLAS call: without a norm or activation it equals F.linear bit
    for bit (with and without a bias, at widths MKL blocks); with them, the composite ops within rounding."""
    ops, g = torch.ops.nvchat_cpu, torch.Generator().manual_seed(3)
    x, w, b = torch.randn(rows, 1, 320, generator=g), torch.randn(1030, 320, generator=g), torch.randn(1030, generator=g)
    assert torch.equal(ops.norm_linear(x, "", None, None, 0.0, w, b, ""), F.linear(x, w, b))
    assert torch.equal(ops.norm_linear(x, "", None, None, 0.0, w, None, ""), F.linear(x, w))
    lw, lb = torch.randn(320, generator=g), torch.randn(320, generator=g)
    torch.testing.assert_close(ops.norm_linear(x, "layer", lw, lb, 1e-5, w, b, "silu"),
                               F.silu(F.linear(F.layer_norm(x, (320,), lw, lb, 1e-5), w, b)), rtol=1e-5, atol=1e-5)
    gate, up = F.linear(F.rms_norm(x, (320,), lw, 1e-6), w).chunk(2, -1)
    out = ops.norm_linear(x, "rms", lw, None, 1e-6, w, None, "gelu_tanh_mul")
    assert out.shape == (rows, 1, 515)
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 8])
def test_the_codec_block_and_upsampling_equal_the_composite_code_row_by_row(rows):
    """convnext_block and upsample_conv1d at widths BLAS blocks (48 channels, 192 hidden): the composite
    code within rounding, each row's output the bits it gets alone (the engine's guarantee), the state
    the window's last frames exactly."""
    ops, g = torch.ops.nvchat_cpu, torch.Generator().manual_seed(5)
    C, T, K = 48, 63, 7
    x, state = torch.randn(rows, C, T, generator=g), torch.randn(rows, C, K - 1, generator=g)
    taps, db, lw, lb = (torch.randn(*shape, generator=g) for shape in ((C, K), (C,), (C,), (C,)))
    w1, b1 = torch.randn(4 * C, C, generator=g) / C ** 0.5, torch.randn(4 * C, generator=g)
    w2, b2 = torch.randn(C, 4 * C, generator=g) / (2 * C ** 0.5), torch.randn(C, generator=g)
    out, next_state = ops.convnext_block(x, state, taps, db, lw, lb, 1e-6, w1, b1, w2, b2)
    padded = torch.cat([state, x], -1)
    h = F.layer_norm(F.conv1d(padded, taps[:, None], db, groups=C).transpose(1, 2), (C,), lw, lb, 1e-6)
    torch.testing.assert_close(out, x + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2).transpose(1, 2),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(next_state, padded[..., -(K - 1):])
    up_x, up_w = torch.randn(rows, 40, 9, generator=g), torch.randn(40, 24, 7, generator=g)
    upsampled = ops.upsample_conv1d(up_x, up_w)
    torch.testing.assert_close(upsampled, F.conv_transpose1d(up_x, up_w, stride=7), rtol=1e-5, atol=1e-5)
    for r in range(rows):
        alone, alone_state = ops.convnext_block(x[r:r + 1], state[r:r + 1], taps, db, lw, lb, 1e-6, w1, b1, w2, b2)
        assert torch.equal(alone, out[r:r + 1]) and torch.equal(alone_state, next_state[r:r + 1])
        assert torch.equal(ops.upsample_conv1d(up_x[r:r + 1], up_w), upsampled[r:r + 1])


def test_a_conformer_layer_off_the_fused_op_reads_the_same_distances(ckpt_q4):
    """The fused encoder hands each layer its whole distance table (the fused op reads it at the rows'
    columns); a layer that takes the composite code gathers the same distances itself."""
    model = nv.load_model(ckpt_q4)
    encoder = model.stt_model.perception.encoder
    assert encoder.fused_on_cpu and all(layer.self_attn.fused_on_cpu for layer in encoder.layers)
    g = torch.Generator().manual_seed(2)
    mels = [torch.randn(3, encoder.subsampling, encoder.config.feat_in, generator=g) for _ in range(4)]

    def run() -> torch.Tensor:
        cache = encoder.new_cache(3)
        with torch.inference_mode():
            return torch.cat([encoder.forward_step(mel, cache) for mel in mels], dim=1)

    fused = run()
    for layer in encoder.layers:
        layer.self_attn.fused_on_cpu = False
    try:
        torch.testing.assert_close(run(), fused, rtol=1e-5, atol=1e-5)
    finally:
        for layer in encoder.layers:
            layer.self_attn.fused_on_cpu = True


def test_the_fused_exact_gelu_keeps_float32_precision_on_both_tails():
    """The block's GELU (an erfc fit, no libm call) against float64's erf GELU from -12 to 12: the pre-GELU
    values are the hidden bias itself (w1 = 0), and one-hot w2 rows read them out unchanged."""
    ops = torch.ops.nvchat_cpu
    C = 16
    values = torch.linspace(-12.0, 12.0, 4 * C)
    exact = (values.double() * 0.5 * torch.special.erfc(-values.double() / 2 ** 0.5)).float()
    got = torch.empty(4 * C)
    for offset in range(4):  # channel c reads hidden unit 4c + offset
        w2 = torch.zeros(C, 4 * C)
        w2[torch.arange(C), 4 * torch.arange(C) + offset] = 1.0
        out, _ = ops.convnext_block(torch.zeros(1, C, 1), torch.zeros(1, C, 2), torch.zeros(C, 3), torch.zeros(C),
                                    torch.ones(C), torch.zeros(C), 1e-6, torch.zeros(4 * C, C), values, w2,
                                    torch.zeros(C))
        got[offset::4] = out.flatten()
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-37)
    assert got[0] < 0 < -got[0] < 1e-30  # the negative tail is a tiny negative number, not 0 or NaN


def frames_of(model, wave: np.ndarray, deterministic: bool, seed: int = 0) -> tuple[list, int]:
    """Every event of a session over ``wave`` (80 ms pushes), and the ops of its 11th frame."""
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, seed=seed,
                                                                 deterministic=deterministic))
    events, ops = [], 0
    for i in range(0, len(wave) - 1279, 1280):
        if i == 10 * 1280:
            with OpCounter() as counter:
                events += session.push_audio(wave[i:i + 1280], 16000)
            ops = counter.non_view
        else:
            events += session.push_audio(wave[i:i + 1280], 16000)
    return events + session.flush(), ops


def outputs(events) -> dict:
    audio = [e for e in events if e.kind == "audio"]
    return {"codes": np.stack([e.audio_codes for e in audio]),
            "audio": np.concatenate([e.samples for e in audio]),
            "text": [(e.kind, e.frame_index, getattr(e, "delta", None)) for e in events if e.kind != "audio"]}


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "sampling"])
def test_the_fused_step_gives_what_the_composite_code_gives(deep_q4, deterministic):
    """The deep preset (every layer kind at its real depth) with and without the kernels: the same text,
    function and transcript events frame by frame, the same 31 codes per frame, audio within float
    rounding; the fused frame launches far fewer kernels."""
    fused = nv.load_model(deep_q4, device="cpu")
    composite = nv.load_model(deep_q4, device="cpu", prepare=False).prepare(fused_cpu=False)
    assert fused.fused_cpu_off is None and composite.fused_cpu_off == "not asked for"
    assert "fused CPU kernels: not used (not asked for)" in composite.describe()
    wave = synth_audio(2.4)
    ours, fused_ops = frames_of(fused, wave, deterministic)
    theirs, composite_ops = frames_of(composite, wave, deterministic)
    a, b = outputs(ours), outputs(theirs)
    assert a["text"] == b["text"]
    np.testing.assert_array_equal(a["codes"], b["codes"])
    np.testing.assert_allclose(a["audio"], b["audio"], atol=2e-4)
    assert fused_ops < 0.7 * composite_ops, (fused_ops, composite_ops)


def test_engine_rows_take_the_fused_kernels_and_equal_a_lone_session(deep_q4):
    """Three sessions at different frames in one engine step: each equals itself alone (fused both)."""
    model = nv.load_model(deep_q4, device="cpu")
    waves = [synth_audio(1.6, seed=s) for s in range(3)]
    engine = model.create_engine(max_sessions=3)
    handles, got = [], [[] for _ in waves]
    for step in range(20):
        if step in (0, 3, 6):
            handles.append(engine.open(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True)))
        for i, handle in enumerate(handles):
            start = (step - (0, 3, 6)[i]) * 1280
            if start + 1280 <= len(waves[i]):
                handle.push_audio(waves[i][start:start + 1280], 16000)
        for handle, events in engine.step().items():
            got[handles.index(handle)] += events
    for i, wave in enumerate(waves):
        alone, _ = frames_of(model, wave[:(20 - (0, 3, 6)[i]) * 1280], True)
        alone = [e for e in alone if e.kind not in ("done",)]
        want = outputs(alone)
        have = outputs(got[i])
        n = len(have["codes"])
        np.testing.assert_array_equal(have["codes"], want["codes"][:n])
        assert [t for t in have["text"] if t[1] < n] == [t for t in want["text"] if t[1] < n]


@pytest.mark.parametrize("why", ["disabled", "no compiler"])
def test_without_the_kernels_a_model_runs_within_the_old_budget_and_says_why(deep_q4, tmp_path, why):
    """NVCHAT_CPU_KERNELS=0, or no C++ compiler and no cached build: the composite code, as before,
    <= 2,500 ops a frame, and describe() says why."""
    env, reason = ({cpu_kernels.ENV: "0"}, "disabled (NVCHAT_CPU_KERNELS=0)") if why == "disabled" else \
        ({"CXX": "no-such-c++", "TORCH_EXTENSIONS_DIR": str(tmp_path)}, "no C++ compiler ('no-such-c++' is not on PATH)")
    code = ("import sys, json; sys.path.insert(0, 'tests'); import torch;"
            "import nvchat_torch as nv; from test_cpu_kernels import frames_of; from mlx_oracle import synth_audio;"
            f"m = nv.load_model({str(deep_q4)!r}, device='cpu');"
            "events, ops = frames_of(m, synth_audio(1.2), True);"
            "print(json.dumps([m.describe(), ops, sum(e.kind == 'audio' for e in events)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    describe, ops, frames = json.loads(proc.stdout.strip().splitlines()[-1])
    assert f"fused CPU kernels: not used ({reason})" in describe
    assert frames == 15 and 1600 < ops <= 2500


def test_the_fast_mode_and_other_devices_keep_the_composite_code(ckpt_q4):
    """bf16 activations: torch's own ops (the kernels take float32 CPU tensors only)."""
    model = nv.load_model(ckpt_q4, device="cpu", dtype=torch.bfloat16)
    assert model.fused_cpu_off == "not asked for"
    assert not any(getattr(m, "fused_on_cpu", False) for m in model.modules())
    assert not cpu_kernels.usable(torch.zeros(2, dtype=torch.bfloat16)) and cpu_kernels.usable(torch.zeros(2))
    assert not cpu_kernels.usable(torch.zeros(4, 4).t())  # a transposed view: not contiguous


def test_bad_inputs_get_an_error_naming_what_is_wrong():
    assert cpu_kernels.available()
    ops = torch.ops.nvchat_cpu
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.float64), None, 1e-6)
    with pytest.raises(RuntimeError, match="weight has 3 at dim 0, expected 4"):
        ops.rms_norm(torch.zeros(2, 4), torch.ones(3), 1e-6)
    w = torch.zeros(6, 4)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ops.norm_linear(torch.zeros(4, 4).t(), "", None, None, 0.0, w, None, "")
    with pytest.raises(RuntimeError, match="weight has 4 at dim 1, expected 5"):
        ops.norm_linear(torch.zeros(2, 5), "", None, None, 0.0, w, None, "")
    with pytest.raises(RuntimeError, match="unknown activation 'gelu'"):
        ops.norm_linear(torch.zeros(2, 4), "rms", None, None, 1e-6, w, None, "gelu")
    with pytest.raises(RuntimeError, match="norm_weight has 3 at dim 0, expected 4"):
        ops.norm_linear(torch.zeros(2, 4), "layer", torch.ones(3), None, 1e-5, w, None, "")
    with pytest.raises(RuntimeError, match="depthwise_conv1d: 3 frames for a kernel of 4"):
        ops.depthwise_conv1d(torch.zeros(1, 2, 3), torch.zeros(2, 4), None)
    with pytest.raises(RuntimeError, match="overlap_add: envelope of 5 samples for 12"):
        ops.overlap_add(torch.zeros(1, 4, 5), torch.ones(4), torch.ones(5), 2)
    with pytest.raises(RuntimeError, match="state has 2 at dim 2, expected 3"):
        ops.convnext_block(torch.zeros(1, 4, 5), torch.zeros(1, 4, 2), torch.zeros(4, 4), torch.zeros(4), torch.ones(4),
                           torch.zeros(4), 1e-6, torch.zeros(16, 4), torch.zeros(16), torch.zeros(4, 16), torch.zeros(4))
    with pytest.raises(RuntimeError, match="weight has 3 at dim 0, expected 2"):
        ops.upsample_conv1d(torch.zeros(1, 2, 5), torch.zeros(3, 4, 2))
    with pytest.raises(RuntimeError, match="distance column 9 of 7"):
        ops.conformer_attention_step(torch.zeros(1, 16), torch.zeros(2, 1, 2, 5, 2), torch.tensor([0]),
                                     torch.tensor([0]), torch.zeros(2, 2, 7), torch.tensor([[0, 9]]), None, 2, 1.0)
    with pytest.raises(RuntimeError, match="rvq_assign: quantizers 3..5"):
        ops.rvq_assign(torch.zeros(1, 5), torch.zeros(4, 16, 5), torch.zeros(4, 16), None, 3, 2)
    # and the op still works after an error
    x = torch.randn(3, 8)
    torch.testing.assert_close(ops.rms_norm(x, None, 1e-6), F.rms_norm(x, (8,), None, 1e-6))
