"""The modes load_model offers, the kernel paths it picks, and what a PyTorch user will try on them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from mlx_oracle import synth_audio

import nvchat_torch as nv
from nvchat_torch.diagnostics import model_bytes
from nvchat_torch.models import quant
from nvchat_torch.models.quant import Int4PackedLinear, QuantizedLinear


def stream_codes(model, seconds: float = 0.5) -> np.ndarray:
    session = model.create_streaming_session(nv.StreamingOptions(deterministic=True))
    events = session.push_audio(synth_audio(seconds), 16000) + session.flush()
    return np.stack([e.audio_codes for e in events if e.kind == "audio"])


@pytest.fixture(scope="module")
def q4_bf16(make_checkpoint):
    """The real 4-bit card's layout: 4-bit LLM with float32 scales, everything else bf16."""
    return make_checkpoint(seed=0, bits=4, dtype="bfloat16", scales_dtype="float32")


@pytest.mark.parametrize("cast", ["to_bf16", "half", "bfloat16", "float", "double"])
def test_a_loaded_model_refuses_casts_that_would_round_its_float32_islands(q4_bf16, cast):
    model = nv.load_model(q4_bf16, device="cpu", dtype=None if cast == "to_bf16" else torch.bfloat16)
    call = {"to_bf16": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half(),
            "bfloat16": lambda m: m.bfloat16(), "float": lambda m: m.float(), "double": lambda m: m.double()}[cast]
    with pytest.raises(RuntimeError, match=r"load_model\(path, dtype="):
        call(model)
    # nothing was cast: the model still streams, its islands intact
    assert model.stt_model.llm.layers[0].mixer.A.dtype == torch.float32
    assert model.tts_model.tts_model.rvq_float.dtype == torch.float32
    assert stream_codes(model).shape[1] == 31


def test_both_directions_go_through_load_model(q4_bf16):
    """What the error says to do, in both directions, with a session after each."""
    faithful = nv.load_model(q4_bf16, device="cpu")
    fast = nv.load_model(q4_bf16, device="cpu", dtype=torch.bfloat16)
    assert faithful.dtype == torch.float32 and fast.dtype == torch.bfloat16
    assert fast.stt_model.perception.encoder.layers[0].feed_forward1.linear1.weight.dtype == torch.bfloat16
    for model in (faithful, fast):
        assert model.to("cpu") is model and model.to(model.dtype) is model  # a no-op move is fine
        assert stream_codes(model).shape[1] == 31
    upcast = nv.load_model(q4_bf16, device="cpu", dtype=torch.float32)
    assert upcast.stt_model.perception.encoder.layers[0].feed_forward1.linear1.weight.dtype == torch.float32
    assert stream_codes(upcast).shape[1] == 31


def test_float16_is_refused_with_a_clear_error(q4_bf16):
    with pytest.raises(ValueError, match="float16 is not supported.*bfloat16"):
        nv.load_model(q4_bf16, device="cpu", dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 is not supported"):
        nv.load_tiny_model(device="cpu", dtype=torch.float16)


def test_auto_weights_pick_the_fastest_faithful_path(make_checkpoint, q4_bf16):
    # float32 activations on a CPU, float32 scales, a small model: dense float32 matmuls
    dense = nv.load_model(q4_bf16, device="cpu")
    assert not any(isinstance(m, (QuantizedLinear, Int4PackedLinear)) for m in dense.modules())
    assert "dense linears: torch.float32 weights" in dense.describe()
    # bf16 scales need the reference's bf16 sums in the prefill: kept packed
    bf16_scales = nv.load_model(make_checkpoint(seed=0, bits=4, dtype="bfloat16"), device="cpu")
    assert any(isinstance(m, QuantizedLinear) for m in bf16_scales.modules())
    # the fast mode keeps them packed, on the int4 kernel where it passes its self-test
    fast = nv.load_model(q4_bf16, device="cpu", dtype=torch.bfloat16)
    packed = [m for m in fast.modules() if isinstance(m, (QuantizedLinear, Int4PackedLinear))]
    assert packed and "4-bit linears: " in fast.describe()
    # all paths agree on the discrete outputs with the faithful default
    np.testing.assert_array_equal(stream_codes(nv.load_model(q4_bf16, device="cpu", weights="packed")),
                                  stream_codes(dense))


def test_a_failing_int4_kernel_is_reported_once_and_falls_back(q4_bf16, monkeypatch):
    monkeypatch.setattr(quant, "_kernel_self_test", lambda packed, source: "the int4pack kernel failed its "
                        "self-test (relative error 0.5 > 0.02)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = nv.load_model(q4_bf16, device="cpu", dtype=torch.bfloat16)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "on cpu" in messages[0] and "self-test" in messages[0], messages
    assert "slower" in messages[0]
    assert not any(isinstance(m, Int4PackedLinear) for m in model.modules())
    assert "dequantized on every call" in model.describe()
    assert stream_codes(model).shape[1] == 31


def test_prepare_keeps_no_second_copy_of_the_heads(q4_bf16):
    raw = nv.load_model(q4_bf16, device="cpu", prepare=False, weights="packed")
    before = model_bytes(raw.stt_model.lm_head) + model_bytes(raw.stt_model.function_head)
    prepared = nv.load_model(q4_bf16, device="cpu", weights="packed")
    assert not hasattr(prepared.stt_model, "lm_head") and not hasattr(prepared.stt_model, "function_head")
    assert model_bytes(prepared.fused_heads) == before
