"""The compiled frame step against the eager ones, in one run (``python -m benchmarks.frame_loop --compile``):

* composite eager: the plain torch code, what MPS and CUDA run eager;
* fused eager: the same with the fused CPU kernels (:mod:`nvchat_torch.models.cpu_kernels`), CPU only;
* compiled: the device step under ``torch.compile`` (inductor), one graph per frame.

For each: ms per frame (the fastest of ``--rounds`` rounds), kernel launches per steady-state frame
counted with torch's profiler (the dispatch-mode counter cannot see inside a compiled region: here a
launch is an outermost ATen op that is not a view or an allocation, a fused ``nvchat_cpu`` op, or a
kernel inductor generated), and the process's resident memory after each. And the compile time a
user waits: the first compiled frame in a fresh process with empty compiler caches (cold), then again
in a second process that finds what the first left: the compiled step it kept
(:mod:`nvchat_torch.runtime.compiled_step`), or with ``--no-store`` torch's on-disk caches alone.

    python -m benchmarks.compiled_step                 # deep preset, 4-bit, cpu, 1 thread
    python -m benchmarks.compiled_step --compile-time  # cold and warm compile, two fresh processes
    python -m benchmarks.compiled_step --compile-time --no-store  # the same without keeping the step
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import nvchat_torch as nv
from nvchat_torch.diagnostics import kernel_launches

PROMPT = "you are a helpful assistant"
FRAME = 1280
def resident_mib() -> tuple[float, float]:
    """The process's resident memory now and at its peak (Linux's VmRSS and VmHWM; 0 elsewhere)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return float(fields["VmRSS"].split()[0]) / 1024, float(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError):
        return 0.0, 0.0


def stream(model, wave: np.ndarray, warmup: int, rounds: int) -> dict:
    """``rounds`` sessions over ``wave``: the first frame's seconds (a compiled step compiles then), ms
    per frame after ``warmup`` frames (the fastest round), and one steady-state frame's launches."""
    frames = [wave[i:i + FRAME] for i in range(0, len(wave) - FRAME + 1, FRAME)]
    walls, first = [], None
    launches = 0
    for k in range(rounds):
        session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, seed=0, deterministic=True))
        t0 = time.perf_counter()
        session.push_audio(frames[0], 16000)
        first = time.perf_counter() - t0 if first is None else first
        for frame in frames[1:warmup]:
            session.push_audio(frame, 16000)
        if k == 0:
            launches = kernel_launches(lambda: session.push_audio(frames[warmup], 16000))
        t0 = time.perf_counter()
        for frame in frames[warmup + 1:]:
            session.push_audio(frame, 16000)
        walls.append((time.perf_counter() - t0) * 1000 / max(1, len(frames) - warmup - 1))
    rss, peak = resident_mib()
    return {"first_frame_s": first, "ms_per_frame": min(walls), "rounds_ms": walls, "kernels_per_frame": launches,
            "rss_mib": rss, "peak_rss_mib": peak}


def compare(path: Path, args, wave: np.ndarray) -> list[dict]:
    """The three variants on one model, in this order (compiling switches the fused kernels off)."""
    from nvchat_torch.doctor import CompositePath

    torch._inductor.config.cpp.enable_kernel_profile = True  # inductor's C++ kernels show in the profiler
    model = nv.load_model(path, device=args.device)
    rows = []
    with CompositePath(model):
        rows.append({"variant": "composite eager", **stream(model, wave, args.warmup, args.rounds)})
    if model.fused_cpu_off is None:
        rows.append({"variant": "fused eager (CPU kernels)", **stream(model, wave, args.warmup, args.rounds)})
    model.compile_step()
    rows.append({"variant": "compiled (inductor)", **stream(model, wave, args.warmup, args.rounds)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':<28}{'ms/frame':>10}{'kernels':>9}{'first frame s':>15}{'RSS MiB':>9}{'peak MiB':>9}"]
    for r in rows:
        lines.append(f"{r['variant']:<28}{r['ms_per_frame']:>10.2f}{r['kernels_per_frame']:>9}"
                     f"{r['first_frame_s']:>15.2f}{r['rss_mib']:>9.0f}{r['peak_rss_mib']:>9.0f}")
    return "\n".join(lines)


def compile_time(path: Path, args) -> dict:
    """The first compiled frame of a fresh process, twice, with one empty compiler cache folder and one
    empty store of compiled steps: cold, then warm. With the store (the default), the warm process
    loads the step the cold one compiled ahead and kept; with ``--no-store``
    (``NVCHAT_TORCH_COMPILE_STORE=off``), it finds torch's on-disk caches alone (inductor's FX graph
    and AOTAutograd caches) and traces the step again. (Each setting needs its own empty caches: a
    graph compiled ahead is cached under other keys than one compiled on its first call.)"""
    from nvchat_torch.runtime.graph_store import STORE_ENV

    cache = tempfile.mkdtemp(prefix="nvchat_inductor_")
    store = "off" if args.no_store else tempfile.mkdtemp(prefix="nvchat_store_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           STORE_ENV: store}
    times = {}
    for name in ("cold", "warm"):
        cmd = [sys.executable, "-m", "benchmarks.compiled_step", "--first-frame", str(path), "--device", args.device,
               "--threads", str(args.threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        times[name] = json.loads(out.strip().splitlines()[-1])
    return times


def first_frame(path: str, device: str) -> dict:
    """In this process: load, compile, and time the first frame (what :func:`compile_time` runs twice)."""
    model = nv.load_model(path, device=device, compile=True)
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    t0 = time.perf_counter()
    session.push_audio(np.zeros(FRAME, dtype=np.float32), 16000)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    session.push_audio(np.zeros(FRAME, dtype=np.float32), 16000)
    second = time.perf_counter() - t0
    compiler = model.step_compiler
    return {"first_frame_s": first, "second_frame_s": second, "loaded": compiler.loaded, "compiled": compiler.precompiled}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import generated_checkpoint, machine, test_signal

    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the generated deep preset, 4-bit)")
    p.add_argument("--preset", default="deep", choices=("deep", "tiny"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-time", action="store_true", help="cold and warm compile time, two fresh processes")
    p.add_argument("--no-store", action="store_true", help="with --compile-time: keep no compiled step (torch's caches only)")
    p.add_argument("--first-frame", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.first_frame:
        print(json.dumps(first_frame(args.first_frame, args.device)))
        return 0
    path = Path(args.model) if args.model else generated_checkpoint(args.preset, 4)
    print(f"machine: {machine()}")
    result: dict = {"machine": machine()}
    if args.compile_time:
        result["compile_time"] = times = compile_time(path, args)
        print("first compiled frame: " + ", ".join(f"{k} {v['first_frame_s']:.1f} s (then {v['second_frame_s']:.3f} s)"
                                                   for k, v in times.items()))
    else:
        result["variants"] = rows = compare(path, args, test_signal(args.seconds))
        print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
