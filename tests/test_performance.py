"""What decides MPS speed, counted on the CPU: host reads and kernels per frame; memory; no timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import nvchat_torch as nv
from mlx_oracle import synth_audio
from test_session import as_reference_shows
from nvchat_torch.diagnostics import OpCounter, count_host_reads
from nvchat_torch.model import full_size_bytes
from nvchat_torch.tiny import random_model, save_checkpoint

REPO = Path(__file__).resolve().parents[1]
PROMPT = "you are a helpful assistant"


@pytest.fixture(scope="module")
def deep_q4(make_checkpoint):
    """Tiny widths, the real depth of every network, 4-bit LLM and vocabulary (written by MLX)."""
    return make_checkpoint(seed=0, bits=4, preset="deep")


def steady_state_frame(path, deterministic: bool) -> tuple[int, int]:
    """(host reads, non-view ATen ops) of the 11th frame of a session on ``path`` in the default mode."""
    model = nv.load_model(path, device="cpu")
    assert model.stt_model.llm.layers.__len__() == 56 and len(model.stt_model.perception.encoder.layers) == 24
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT,
                                                                 deterministic=deterministic))
    wave = synth_audio(1.2)
    session.push_audio(wave[:10 * 1280], 16000)
    with count_host_reads() as reads, OpCounter() as ops:
        events = session.push_audio(wave[10 * 1280:11 * 1280], 16000)
    assert [e.kind for e in events][-1] == "audio"  # the frame really ran
    return sum(reads.values()), ops.non_view


# Non-view ATen ops (kernels) of a steady-state deep-preset frame with the fused CPU kernels (the
# default on a CPU; measured 1,102 deterministic and 1,172 sampling, docs/performance.md): issue 21's
# target. Without them (tests/test_cpu_kernels.py) the composite code stays within its old budget, 2,500.
FRAME_OPS = 1200


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampling", "deterministic"])
def test_steady_state_frame_reads_the_host_once_and_stays_within_the_op_budget(deep_q4, deterministic):
    reads, ops = steady_state_frame(deep_q4, deterministic)
    assert reads <= 1
    assert ops <= FRAME_OPS
    model = nv.load_model(deep_q4, device="cpu")
    wave = synth_audio(1.2)
    # the counters count: the offline path reads the host and runs many more ops
    with count_host_reads() as reads:
        model.generate(wave[:2560], deterministic=True)
    assert sum(reads.values()) > 2


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composite"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampling", "deterministic"])
def test_a_frame_decides_no_dtype_promotion(deep_q4, deterministic, fused):
    """Dtypes are settled at load and ``prepare``: a frame dispatches no ``promote_types`` and no
    ``result_type``. With the fused CPU kernels (the default) there is none at all; the composite code
    (what MPS and CUDA run) has them only inside torch's CPU ``rms_norm``, a composite there (pow,
    mean, rsqrt, mul) and one fused kernel on MPS and CUDA."""
    from torch.profiler import profile

    model = nv.load_model(deep_q4, device="cpu", prepare=False).prepare(fused_cpu=fused)
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=deterministic))
    wave = synth_audio(1.2)
    session.push_audio(wave[:10 * 1280], 16000)
    with profile() as prof:
        session.push_audio(wave[10 * 1280:11 * 1280], 16000)

    def inside_rms_norm(event) -> bool:
        while event is not None:
            if event.name == "aten::rms_norm":
                return True
            event = event.cpu_parent
        return False

    promotions = [e for e in prof.events() if e.name in ("aten::result_type", "aten::promote_types")]
    norms = sum(e.name == "aten::rms_norm" for e in prof.events())
    if fused:
        fused_norms = sum(e.name in ("nvchat_cpu::rms_norm", "nvchat_cpu::norm_linear") for e in prof.events())
        assert fused_norms > 100 and norms == 0 and promotions == []  # the profiler saw the frame's norms
        return
    assert norms > 200 and len(promotions) <= norms  # the profiler saw the frame's norms
    assert [e.name for e in promotions if not inside_rms_norm(e)] == []


def test_deep_model_streams_like_the_reference(deep_q4, reference):
    """The deep preset exercises what the tiny one cannot (56-layer pattern, global TTS layers every 6th)."""
    wave = synth_audio(1.0)
    ref = reference(deep_q4).session.create_streaming_session(system_prompt=PROMPT, seed=0)
    ref_events = [e for i in range(0, len(wave), 1280) for e in ref.push_audio(wave[i:i + 1280])] + ref.flush()
    session = nv.load_model(deep_q4, device="cpu", dtype=torch.float32).create_streaming_session(
        nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    events = [e for i in range(0, len(wave), 1280) for e in session.push_audio(wave[i:i + 1280], 16000)]
    events += session.flush()
    ref_codes = np.stack([np.array(e.audio_codes) for e in ref_events if e.kind == "audio"])
    codes = np.stack([e.audio_codes for e in events if e.kind == "audio"])
    np.testing.assert_array_equal(codes, ref_codes)
    # Text channels by frame and token id plus their final text: the reference streams U+FFFD for a
    # character split over byte tokens, where ours holds it back until it completes.
    assert as_reference_shows(events) == as_reference_shows(ref_events)


_OTHER_CAPABILITY = {"AVX512": "avx2", "AVX512_BF16": "avx2", "AMX": "avx2"}.get(
    torch.backends.cpu.get_cpu_capability(), "default")


def test_the_op_budget_holds_under_another_cpu_capability(deep_q4):
    """CI gets an AVX-512 Intel or an AVX2-only AMD: the budget must hold for both, so the check also
    runs under the dispatch the machine does not have (AVX2 on AVX-512; the plain one on AVX2)."""
    code = ("import sys, json; sys.path.insert(0, 'tests'); import torch; torch.set_num_threads(1);"
            "from test_performance import steady_state_frame;"
            f"print(json.dumps([torch.backends.cpu.get_cpu_capability(), *steady_state_frame({str(deep_q4)!r}, True)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "ATEN_CPU_CAPABILITY": _OTHER_CAPABILITY})
    assert proc.returncode == 0, proc.stderr
    capability, reads, ops = json.loads(proc.stdout.strip().splitlines()[-1])
    assert capability.lower() == _OTHER_CAPABILITY
    assert reads <= 1 and ops <= FRAME_OPS, (capability, reads, ops)


def test_full_size_memory_as_loaded():
    """Bytes of the 11B model as load_model returns it (every post-load transform applied), built on
    ``meta`` (nothing allocated)."""
    assert 22.0e9 < full_size_bytes() < 22.8e9  # 11.1 B parameters, 2 bytes each, and the derived tables
    four = full_size_bytes(4)
    assert 8.6e9 < four <= 9.0e9
    assert 13.2e9 < full_size_bytes(8) < 13.8e9


def test_checkpoints_we_write_are_read_by_the_reference(tmp_path, reference):
    """``save_checkpoint`` (our affine quantizer, the mlx-community layout): MLX loads it and streams
    exactly what we stream."""
    path = save_checkpoint(random_model("tiny", seed=5), tmp_path / "ours", bits=4)
    wave = synth_audio(0.8, seed=7)
    ref = reference(path).session.create_streaming_session(system_prompt=PROMPT, seed=0)
    ref_audio = [e for e in ref.push_audio(wave) + ref.flush() if e.kind == "audio"]
    session = nv.load_model(path, device="cpu", dtype=torch.float32).create_streaming_session(
        nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    ours = [e for e in session.push_audio(wave, 16000) + session.flush() if e.kind == "audio"]
    np.testing.assert_array_equal(np.stack([e.audio_codes for e in ours]),
                                  np.stack([np.array(e.audio_codes) for e in ref_audio]))
    np.testing.assert_allclose(np.concatenate([e.samples for e in ours]),
                               np.concatenate([np.array(e.samples) for e in ref_audio]), atol=1e-3)


def test_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.frame_loop", "--preset", "tiny", "--seconds", "1.6",
                           "--warmup", "2", "--threads", "1", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "NVCHAT_BENCH_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    for needle in ("real-time factor", "host reads per frame: 1", "non-view ATen ops per frame", "MLX reference",
                   "min of 2 alternating rounds"):
        assert needle in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    assert report["ours"]["summary"]["frames"] == 20 - 3
    assert report["reference"]["summary"]["frames"] == 20 - 3
    # the ratio is of each side's fastest of the alternating rounds
    assert len(report["ours"]["rounds_ms"]) == len(report["reference"]["rounds_ms"]) == 2
    assert report["ours"]["ratio_to_reference"] == min(report["ours"]["rounds_ms"]) / min(report["reference"]["rounds_ms"])


def test_server_load_benchmark_runs_and_reports(tmp_path):
    """benchmarks/server_load.py against its in-process server on loopback: two tiny clients, a table
    row each, every delta received, no error (its timings are for docs/server.md, not asserted)."""
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.server_load", "--preset", "tiny", "--clients", "2",
                           "--seconds", "1.6", "--stagger", "0.2", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "NVCHAT_BENCH_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| all |" in proc.stdout and "server RSS" in proc.stdout, proc.stdout
    clients = json.loads(out.read_text())["clients"]
    assert [c["deltas"] for c in clients] == [20, 20]  # 1.6 s of 80 ms frames, each heard
    assert not any(c["errors"] for c in clients)
