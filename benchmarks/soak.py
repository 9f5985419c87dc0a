"""One long conversation through one session: does a frame cost the same after an hour?

    python -m benchmarks.soak --frames 45000                 # generated tiny 4-bit model, cpu, one hour
    python -m benchmarks.soak --frames 10000 --window 500 --json soak.json
    python -m benchmarks.soak --model weights/NemotronLabs-VoiceChat-11B-4bit --device mps --frames 2000

Streams ``--frames`` 80 ms frames of varied audio (tone bursts, chirps, noise and silence, changing
every few seconds, made chunk by chunk) through one streaming session, one frame per
``push_audio``, and prints per window of ``--window`` frames: the median and p95 frame time (wall
clock), the median CPU time of the process per frame (what the frame itself cost, which other
processes on a shared machine do not inflate as they do the wall clock), the process RSS, and the bytes of the two caches that grow with the session (LLM key/values, TTS
key/values). Without ``--model`` it uses the tiny 4-bit checkpoint of ``benchmarks.frame_loop``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

import nvchat_torch as nv
from benchmarks.common import PROMPT, generated_checkpoint

FRAME = 1280
SR = 16000


def varied_audio(frames: int, seed: int = 0, segment_frames: int = 40):
    """``frames`` frames of audio, one ``[1280]`` float32 array at a time: every ``segment_frames``
    frames a new segment, drawn from tone bursts, a chirp, noise and silence."""
    rng = np.random.default_rng(seed)
    t = np.arange(segment_frames * FRAME) / SR
    for start in range(0, frames, segment_frames):
        kind = rng.integers(4)
        if kind == 0:
            f = rng.uniform(150, 900)
            x = 0.3 * np.sin(2 * np.pi * f * t) * (np.sin(2 * np.pi * rng.uniform(1, 4) * t) > 0)
        elif kind == 1:
            f0, f1 = rng.uniform(100, 500), rng.uniform(1000, 4000)
            x = 0.2 * np.sin(2 * np.pi * (f0 * t + 0.5 * (f1 - f0) / t[-1] * t * t))
        elif kind == 2:
            x = rng.uniform(0.01, 0.2) * rng.standard_normal(t.shape)
        else:
            x = 0.001 * rng.standard_normal(t.shape)
        x = x.astype(np.float32)
        for i in range(min(segment_frames, frames - start)):
            yield x[i * FRAME:(i + 1) * FRAME]


def rss_mb() -> float:
    """The process's resident set now (not the peak), MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    except OSError:  # macOS: the peak is what getrusage has
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q * 100)) if len(values) else 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: a generated tiny model)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "deep"], help="generated model's preset")
    p.add_argument("--bits", type=int, default=4, help="generated model's quantization (0: float)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--frames", type=int, default=45000, help="frames to stream (45000 = one hour)")
    p.add_argument("--window", type=int, default=1000, help="frames per reported window")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--json", help="write the per-window report here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or generated_checkpoint(args.preset, args.bits or None)
    model = nv.load_model(path, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    device = model.device
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT,
                                                                 deterministic=args.deterministic))
    if args.frames > session.max_frames:
        raise SystemExit(f"--frames {args.frames} is past the session's limit of {session.max_frames} frames")
    print(f"{model.describe()}\n{args.frames} frames ({args.frames * 0.08 / 60:.1f} min), windows of {args.window}; "
          f"session limit {session.max_frames} frames ({session.max_seconds / 60:.1f} min)")
    print(f"{'frames':>13} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} {'CPU ms':>7} {'RSS MB':>8} "
          f"{'LLM KV MB':>10} {'TTS KV MB':>10}")
    windows, times, cpu = [], [], []
    for i, chunk in enumerate(varied_audio(args.frames)):
        start, start_cpu = time.perf_counter(), time.process_time()
        session.push_audio(chunk, SR)
        if device.type == "mps":
            torch.mps.synchronize()
        times.append((time.perf_counter() - start) * 1000.0)
        cpu.append((time.process_time() - start_cpu) * 1000.0)
        if len(times) == args.window or i == args.frames - 1:
            ms = np.asarray(times)
            caches = session.cache_bytes()
            row = {"first_frame": i + 1 - len(times), "last_frame": i, "median_ms": percentile(ms, 0.5),
                   "p95_ms": percentile(ms, 0.95), "max_ms": float(ms.max()),
                   "median_cpu_ms": percentile(np.asarray(cpu), 0.5), "rss_mb": rss_mb(),
                   "language_cache_bytes": caches["language"], "tts_cache_bytes": caches["tts"]}
            windows.append(row)
            print(f"{row['first_frame']:>6}-{row['last_frame']:<6} {row['median_ms']:>10.2f} {row['p95_ms']:>8.2f} "
                  f"{row['max_ms']:>8.1f} {row['median_cpu_ms']:>7.2f} {row['rss_mb']:>8.1f} "
                  f"{caches['language'] / 2**20:>10.2f} {caches['tts'] / 2**20:>10.2f}")
            times, cpu = [], []
    session.flush()
    first, last = windows[min(1, len(windows) - 1)], windows[-1]
    print(f"last window / second window median: {last['median_ms'] / first['median_ms']:.2f}x wall, "
          f"{last['median_cpu_ms'] / first['median_cpu_ms']:.2f}x CPU; "
          f"RSS {last['rss_mb'] - windows[0]['rss_mb']:+.1f} MB since the first window")
    report = {"model": model.describe(), "device": str(device), "frames": args.frames, "window": args.window,
              "machine": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "windows": windows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
