"""benchmarks/device_check.py, the prepared GPU check, run small on the CPU (``--device cpu --quick``): every
part runs in its own process and reports, the parity comparison catches what differs, and a part that
fails or overruns is recorded while the rest go on."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # plain `pytest` (not `python -m pytest`) leaves the checkout off the path
    sys.path.insert(0, str(REPO))

from benchmarks import frame_loop  # noqa: E402
from benchmarks.device_check import PARTS, compare_traces, launch, main, stream_trace  # noqa: E402


def run_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    env = {**os.environ, "NVCHAT_BENCH_CACHE": str(out / "cache"), "NVCHAT_DOCTOR_CACHE": str(out / "cache")}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", *args, "--json", str(out / "check.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return proc, json.loads((out / "check.json").read_text()), (out / "check.md").read_text()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_check(tmp_path_factory.mktemp("device_check"), "--device", "cpu", "--quick")


def test_every_part_runs_and_reports(quick):
    proc, report, md = quick
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert list(report["parts"]) == list(PARTS)
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part)
        assert f"== {name}: ok" in proc.stdout
    env = report["parts"]["environment"]["result"]
    assert env["device"] == "cpu" and env["device_name"] and env["torch"]
    doctor = report["parts"]["doctor"]["result"]
    assert "## nvchat_torch doctor" in doctor["report"]
    assert doctor["kernels_per_frame"] > 100 and doctor["host_reads_per_frame"] == 1 and doctor["wall_ms_per_frame"] > 0
    assert doctor["self_tests_failing"] == []
    for heading in ("# Device check", "## Doctor", "## Parity against the CPU", "## Deep preset", "## Full-size",
                    "## Unseen prompt"):
        assert heading in md
    assert env["device_name"] in md


def test_parity_compared_frames_on_two_code_paths_and_the_compiled_step(quick):
    parity = quick[1]["parts"]["parity"]["result"]
    assert parity["ok"] is True
    (model,) = parity["models"]
    assert model["preset"] == "tiny"
    names = [v["variant"] for v in model["variants"]]
    # Against the reference's fused CPU kernels, both run the composite code (the code CUDA runs): two code
    # paths, the same outputs (the audio within float rounding).
    assert names == ["composite eager (the code MPS and CUDA run)", "compiled (traced only: backend eager)"]
    for variant in model["variants"]:
        c = variant["comparison"]
        assert c["frames"] == {"reference": 8, "candidate": 8} and c["compared"] == 8
        assert c["agree"] == {"text ids": 8, "function ids": 8, "transcript": 8, "codes": 8}
        assert c["first_divergent_frame"] is None and c["audio_samples"] == 8 * 1764
        assert 0 <= c["max_audio_diff"] < 1e-3


def test_the_deep_full_and_prompt_parts_measure_and_say_what_they_skipped(quick):
    parts = quick[1]["parts"]
    deep = {v["variant"]: v for v in parts["deep"]["result"]["variants"]}
    eager = deep["eager"]
    assert eager["ms_per_frame"]["frames"] == 8 and eager["ms_per_frame"]["median"] > 0
    assert eager["kernels"]["dispatched_ops"] > 500 and eager["kernels"]["profiler_ops"] > 500
    assert eager["host_reads"] == 1
    assert "cold inductor compile" in deep["compiled"]["skipped"]
    assert "needs a CUDA device" in deep["CUDA graphs"]["skipped"]
    full = parts["full"]["result"]
    assert full["stand_in"] is True and full["model"].startswith("STAND-IN")
    assert [row["sessions"] for row in full["engine"]] == [1, 8]
    assert all(row["realtime_factor"] > 0 and row["step_ms"]["frames"] == 4 for row in full["engine"])
    assert full["peak_memory_mib"] > 0 and full["weights_gb"] > 0 and full["build_s"] >= 0
    assert "prompt" not in full  # moved to the prompt part
    prompt = parts["prompt"]["result"]
    for model, label in (("deep", "deep"), ("full", "stand-in (tiny)")):
        timings = prompt[model]
        assert timings["model"] == label and timings["frame_ms"] > 0
        assert [p["prompt"] for p in timings["prompts"]] == ["first new prompt", "second new prompt"]
        for p in timings["prompts"]:
            assert p["characters"] == 40 and p["positions"] >= 30 and p["seconds"] > 0
            assert p["frames"] == pytest.approx(p["seconds"] * 1000 / timings["frame_ms"], abs=0.06)


def test_the_comparison_reports_each_kind_of_difference():
    import nvchat_torch as nv

    model = nv.load_tiny_model(device="cpu")
    reference = stream_trace(model, frame_loop.test_signal(0.8))
    assert len(reference.codes) == 10
    same = compare_traces(reference, stream_trace(model, frame_loop.test_signal(0.8)))
    assert same["ok"] and same["compared"] == 10 and same["max_audio_diff"] == 0.0

    codes = copy.deepcopy(reference)
    codes.codes[4][0, 7] += 1
    c = compare_traces(reference, codes)
    assert not c["ok"] and c["first_divergent_frame"] == 4 and c["differs_in"] == ["codes"]
    assert c["codes_differ_at"] == [7] and c["agree"]["codes"] == 9 and c["agree"]["text ids"] == 10

    ids = copy.deepcopy(reference)
    ids.text_ids[2] += 1
    ids.transcript[6] += "x"
    c = compare_traces(reference, ids)
    assert not c["ok"] and c["first_divergent_frame"] == 2 and c["differs_in"] == ["text ids"]
    assert c["agree"]["transcript"] == 9

    audio = copy.deepcopy(reference)
    audio.audio[3] = audio.audio[3] + np.float32(0.25)
    c = compare_traces(reference, audio)
    assert c["ok"] and c["max_audio_diff"] == pytest.approx(0.25)  # audio is reported, not a verdict

    short = copy.deepcopy(reference)
    for field in ("text_ids", "function_ids", "transcript", "codes", "audio"):
        del getattr(short, field)[-1]
    c = compare_traces(reference, short)
    assert not c["ok"] and c["compared"] == 9 and c["first_divergent_frame"] is None

    empty = copy.deepcopy(reference)
    for field in ("text_ids", "function_ids", "transcript", "codes", "audio"):
        getattr(empty, field).clear()
    assert not compare_traces(empty, empty)["ok"]


def test_a_failing_part_is_recorded_and_the_next_one_runs(tmp_path):
    proc, report, md = run_check(tmp_path, "--device", "cuda:99", "--parts", "environment,doctor")
    assert proc.returncode == 1
    for name in ("environment", "doctor"):
        part = report["parts"][name]
        assert part["status"] == "failed" and part["error"] and part["seconds"] > 0, part
    assert report["parts"]["parity"] == {"status": "skipped", "reason": "not in --parts"}
    assert "| doctor | failed |" in md


def test_the_deadline_skips_what_no_longer_fits(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--device", "cpu", "--quick", "--budget-seconds", "1", "--json", str(out)]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert [p["status"] for p in parts.values()] == ["skipped"] * len(PARTS)
    assert all("of the budget left" in p["reason"] for p in parts.values())


def test_a_part_past_its_time_box_is_stopped_and_recorded(tmp_path):
    args = argparse.Namespace(device="cpu", seed=0, compile_backend="eager", full_dtype="float32", quick=True)
    entry = launch("doctor", args, 0.1, tmp_path / "doctor.json")  # a part's process cannot even import torch in that
    assert entry["status"] == "timed out" and "time box" in entry["error"]
