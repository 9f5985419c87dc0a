"""The 80 ms frame loop, measured: per-stage latency, real-time factor, host reads, kernels, memory.

    python -m benchmarks.frame_loop                      # generated deep model, 4-bit, cpu
    python -m benchmarks.frame_loop --device mps         # the same on an Apple GPU
    python -m benchmarks.frame_loop --model weights/NemotronLabs-VoiceChat-11B-4bit --device mps
    python -m benchmarks.frame_loop --memory             # memory of the full-size model as loaded
    python -m benchmarks.frame_loop --sessions 1,2,4,8   # the batched engine: sessions per step
    python -m benchmarks.frame_loop --compile            # compiled vs fused eager vs composite eager

Without ``--model`` it generates (once, cached) a model with tiny widths but the real depth of every
network: 56 Nemotron-H layers with the real pattern, 24 Conformer layers, 28 TTS layers, 3 codec
blocks per stage. A frame of it launches as many kernels as the 11B model, so it measures the
per-kernel and per-sync overhead that dominates batch-1 decoding on a GPU. When the MLX reference is
installed (the ``parity`` extra) it runs on the same checkpoint in the same process and the ratio is
printed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

import nvchat_torch as nv
from benchmarks.common import FRAME, PROMPT, generated_checkpoint, machine, test_signal
from nvchat_torch.diagnostics import OpCounter, count_host_reads, model_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20  # KiB on Linux, bytes on macOS


def full_random_model(args) -> nv.VoiceChatModel:
    """The 11B configuration with random weights. With --bits: the layout of the mlx-community card,
    built one module at a time (peaks near the packed size: 4-bit fits a 24 GB machine); with
    --bits none: every weight float32 at once (44 GB), then --dtype (default bfloat16)."""
    from nvchat_torch.tiny import random_model

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.bits == "none":
        model = random_model("full", device=device, dtype=dtype or torch.bfloat16)
        model.set_activation_dtype(dtype or torch.bfloat16)
        model.init_constants(device)
    else:
        model = random_model("full", device=device, dtype=dtype, bits=int(args.bits))
    model.source = f"the full-size configuration with random weights ({args.bits}-bit)"
    return model.prepare()


def load_ours(path: Path | None, args) -> tuple[nv.VoiceChatModel, float, float]:
    """The model (generated full-size with ``path`` None), its load seconds and peak memory after loading."""
    device = torch.device(args.device) if args.device else None
    dtype = getattr(torch, args.dtype) if args.dtype else None
    t0 = time.perf_counter()
    if path is None:
        model = full_random_model(args)
    else:
        model = nv.load_model(path, device=device, dtype=dtype, weights=args.weights)
    return model, time.perf_counter() - t0, peak_memory_mb(model.device)


def run_ours(model: nv.VoiceChatModel, args, wave: np.ndarray, count: bool = True) -> dict:
    """One round: a fresh session (prompt prefilled, not timed), ``--warmup`` cold frames, one frame
    under the op and host-read counters (``count``; not timed), then the rest timed."""
    device = model.device
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, seed=0, profile=True))
    frames = [wave[i:i + FRAME] for i in range(0, len(wave) - FRAME + 1, FRAME)]
    for frame in frames[:args.warmup]:
        session.push_audio(frame, 16000)
    counted: dict = {}
    if count:  # one steady-state frame under the counters (counting slows it: it is not timed)
        with count_host_reads() as reads, OpCounter() as ops:
            session.push_audio(frames[args.warmup], 16000)
        counted = {"host_reads_per_frame": sum(reads.values()), "host_reads": dict(reads),
                   "ops_per_frame": ops.non_view, "top_ops": ops.ops.most_common(12)}
    else:
        session.push_audio(frames[args.warmup], 16000)
    session.profile.frames.clear()
    _sync(device)
    t0 = time.perf_counter()
    for frame in frames[args.warmup + 1:]:
        session.push_audio(frame, 16000)
    _sync(device)
    wall = (time.perf_counter() - t0) / max(1, len(frames) - args.warmup - 1)
    return {"summary": session.profile.summary(), "wall_ms_per_frame": wall * 1000, **counted}


def run_engine(path: Path | None, args, wave: np.ndarray, counts: list[int]) -> list[dict]:
    """The batched engine with ``n`` sessions for each ``n`` in ``counts`` (one model, one engine each,
    all open at once): frames per second over all sessions, the real-time factor of each (a step's
    wall time / 80 ms), ops and host reads per step. The counts take turns step by step (one step of
    each, then the next), so a shared machine's load and the sessions' growing histories fall on them
    alike, and each count's step time is the median of its steps (``rounds_ms``: the median of each
    ``--rounds`` part, to show the spread)."""
    device = torch.device(args.device) if args.device else None
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = full_random_model(args) if path is None else nv.load_model(path, device=device, dtype=dtype,
                                                                        weights=args.weights)
    device = model.device
    frames = [wave[i:i + FRAME] for i in range(0, len(wave) - FRAME + 1, FRAME)]
    engines, counted = {}, {}
    for n in counts:
        engine = model.create_engine(max_sessions=n)
        sessions = [engine.open(nv.StreamingOptions(system_prompt=PROMPT, seed=i, deterministic=args.deterministic))
                    for i in range(n)]
        engines[n] = (engine, sessions, [0])
    def step(n: int) -> None:
        engine, sessions, position = engines[n]
        frame = frames[position[0] % len(frames)]
        position[0] += 1
        for s in sessions:
            s.push_audio(frame, 16000)
        engine.step()

    for n in counts:
        for _ in range(args.warmup):
            step(n)
        with count_host_reads() as reads, OpCounter() as ops:
            step(n)
        counted[n] = (ops.non_view, sum(reads.values()))
    timed = max(1, len(frames) - args.warmup - 1)
    steps: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.rounds * timed):
        for n in counts:
            _sync(device)
            t0 = time.perf_counter()
            step(n)
            _sync(device)
            steps[n].append(time.perf_counter() - t0)
    rows = []
    for n in counts:
        wall = float(np.median(steps[n]))
        parts = [float(np.median(steps[n][k * timed:(k + 1) * timed])) * 1000 for k in range(args.rounds)]
        rows.append({"sessions": n, "step_ms": wall * 1000, "frames_per_second": n / wall,
                     "realtime_factor": wall / 0.08, "ops_per_step": counted[n][0],
                     "host_reads_per_step": counted[n][1], "rounds_ms": parts})
    for row in rows:
        row["speedup"] = row["frames_per_second"] / rows[0]["frames_per_second"]
    return rows


def engine_table(rows: list[dict]) -> str:
    lines = [f"{'sessions':>8}{'step ms':>10}{'frames/s':>10}{'x first':>9}{'RTF each':>10}{'ops':>7}{'reads':>7}"]
    for r in rows:
        lines.append(f"{r['sessions']:>8}{r['step_ms']:>10.2f}{r['frames_per_second']:>10.1f}{r['speedup']:>9.2f}"
                     f"{r['realtime_factor']:>10.3f}{r['ops_per_step']:>7}{r['host_reads_per_step']:>7}")
    return "\n".join(lines)


def load_reference(path: Path):
    """The MLX reference's model and processor for ``path``, or None without the ``parity`` extra."""
    try:
        from mlx_vlm.utils import load
    except ImportError:
        return None
    return load(str(path))


def run_reference(reference, args, wave: np.ndarray) -> dict:
    """One round of the reference, as :func:`run_ours` (its stages are evaluated one by one anyway)."""
    model, processor = reference
    session = model.create_session(processor).create_streaming_session(system_prompt=PROMPT, seed=0, profile=True)
    frames = [wave[i:i + FRAME] for i in range(0, len(wave) - FRAME + 1, FRAME)]
    for frame in frames[:args.warmup + 1]:
        session.push_audio(frame)
    session.profile.frames.clear()
    t0 = time.perf_counter()
    for frame in frames[args.warmup + 1:]:
        session.push_audio(frame)
    wall = (time.perf_counter() - t0) / max(1, len(frames) - args.warmup - 1)
    return {"summary": session.profile.summary(), "wall_ms_per_frame": wall * 1000}


def stage_table(ours: dict, ref: dict | None) -> str:
    stages = ours["summary"]["stages"]
    head = f"{'stage':<11}{'mean':>8}{'p50':>8}{'p95':>8}"
    head += f"{'MLX mean':>10}{'ratio':>7}" if ref else ""
    lines = [head + "   (ms)"]
    for name, s in stages.items():
        row = f"{name:<11}{s['mean_ms']:>8.2f}{s['p50_ms']:>8.2f}{s['p95_ms']:>8.2f}"
        if ref:
            r = ref["summary"]["stages"][name]["mean_ms"]
            row += f"{r:>10.2f}{s['mean_ms'] / r if r else float('nan'):>7.2f}"
        lines.append(row)
    return "\n".join(lines)


def memory_report() -> str:
    """Bytes of the full-size model as loaded, from the model built on ``meta``."""
    from nvchat_torch.model import full_size_bytes

    rows = [("bf16 (everything dequantized)", None, torch.bfloat16),
            ("8-bit packed (LLM + vocab), rest bf16", 8, torch.bfloat16),
            ("4-bit packed (LLM + vocab), rest bf16", 4, torch.bfloat16),
            ("float32 (everything dequantized)", None, torch.float32)]
    lines = [f"{'layout':<40}{'GB':>8}{'GiB':>8}"]
    for label, bits, dtype in rows:
        n = full_size_bytes(bits, dtype)
        lines.append(f"{label:<40}{n / 1e9:>8.2f}{n / 2**30:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frame_loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: generated deep model)")
    p.add_argument("--preset", default="deep", choices=("deep", "tiny", "full"),
                   help="generated model: deep (tiny widths, real depths), tiny, or full (11B, random weights "
                        "built in memory one module at a time, no checkpoint and no MLX run; 4-bit "
                        "fits a 24 GB machine)")
    p.add_argument("--bits", default="4", choices=("4", "8", "none"), help="of the generated model")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="float32 (every weight upcast) or bfloat16 (the fast mode); default: the faithful mode")
    p.add_argument("--weights", default="auto", choices=("auto", "packed", "dequantized"))
    p.add_argument("--seconds", type=float, default=6.0, help="audio streamed (frames = seconds / 0.08)")
    p.add_argument("--warmup", type=int, default=10, help="cold frames not timed")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-reference", action="store_true", help="skip the MLX reference")
    p.add_argument("--memory", action="store_true", help="print the full-size model's memory and exit")
    p.add_argument("--sessions", default=None,
                   help="comma-separated session counts (e.g. 1,2,4,8): the batched engine's scaling instead")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, alternating ours and the reference (the minimum of each is compared); "
                        "with --sessions: times each count is timed (median)")
    p.add_argument("--deterministic", action="store_true",
                   help="with --sessions: deterministic sessions (default: sampling, each its own seed)")
    p.add_argument("--compile", action="store_true",
                   help="the compiled frame step against the fused and composite eager ones, in one run: frame "
                        "time, kernels, memory (benchmarks.compiled_step)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.memory:
        print(memory_report())
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        path = Path(args.model)
    elif args.preset == "full":
        path = None
    else:
        path = generated_checkpoint(args.preset, None if args.bits == "none" else int(args.bits))
    wave = test_signal(args.seconds)
    if args.compile:
        from benchmarks.compiled_step import compare, table

        rows = compare(path, args, wave)
        print(f"machine: {machine()}")
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "variants": rows}, indent=1) + "\n")
        return 0
    if args.sessions:
        counts = [int(c) for c in args.sessions.split(",")]
        rows = run_engine(path, args, wave, counts)
        print(f"machine: {machine()}")
        mode = "deterministic" if args.deterministic else "sampling"
        print(f"engine:  {args.rounds} x {len(wave) // FRAME - args.warmup - 1} steps of each count, taking turns step by step, "
              f"after {args.warmup + 1} cold, every session ({mode}) with a frame each step; median step time")
        print(engine_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "engine": rows}, indent=1) + "\n")
        return 0
    model, load_s, load_peak_mb = load_ours(path, args)
    reference = None if args.no_reference or path is None else load_reference(path)
    # Rounds alternate ours and the reference, so a shared machine's load falls on both alike; each
    # side's best (least disturbed) round is reported, and the ratio is of the two minima.
    rounds_ours, rounds_ref = [], []
    for k in range(args.rounds):
        rounds_ours.append(run_ours(model, args, wave, count=k == 0))
        if reference is not None:
            rounds_ref.append(run_reference(reference, args, wave))
    best = min(rounds_ours, key=lambda r: r["wall_ms_per_frame"])
    ours = {**best, **{k: v for k, v in rounds_ours[0].items() if k not in best}, "model": model.describe(),
            "load_s": load_s, "load_peak_memory_mb": load_peak_mb, "peak_memory_mb": peak_memory_mb(model.device),
            "model_mb": model_bytes(model) / 2**20, "rounds_ms": [r["wall_ms_per_frame"] for r in rounds_ours]}
    ref = None
    if rounds_ref:
        ref = {**min(rounds_ref, key=lambda r: r["wall_ms_per_frame"]),
               "rounds_ms": [r["wall_ms_per_frame"] for r in rounds_ref]}
    s = ours["summary"]
    print(f"machine: {machine()}")
    print(f"model:   {ours['model']} (loaded in {ours['load_s']:.1f} s)")
    print(f"frames:  {s['frames']} timed after {args.warmup + 1} cold, {args.rounds} round(s); the stage table is "
          "each side's fastest round")
    print(stage_table(ours, ref))
    print(f"real-time factor {s['realtime_factor']:.3f} ({s['processing_frames_per_second']:.1f} frames/s); "
          f"wall ms/frame per round: " + ", ".join(f"{w:.2f}" for w in ours["rounds_ms"]))
    print(f"host reads per frame: {ours['host_reads_per_frame']} {ours['host_reads']}")
    print(f"non-view ATen ops per frame: {ours['ops_per_frame']}; most frequent: "
          + ", ".join(f"{k} {v}" for k, v in ours["top_ops"]))
    print(f"memory: weights {ours['model_mb']:.1f} MiB, peak {ours['peak_memory_mb']:.1f} MiB "
          f"({ours['load_peak_memory_mb']:.1f} MiB when loaded)")
    if ref:
        ratio = min(ours["rounds_ms"]) / min(ref["rounds_ms"])
        ours["ratio_to_reference"] = ratio
        print(f"MLX reference wall ms/frame per round: " + ", ".join(f"{w:.2f}" for w in ref["rounds_ms"])
              + f" (real-time factor {ref['summary']['realtime_factor']:.3f})")
        print(f"ours / MLX = {ratio:.3f} (min of {args.rounds} alternating rounds, wall time per frame)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "ours": ours, "reference": ref}, indent=1,
                                              default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
