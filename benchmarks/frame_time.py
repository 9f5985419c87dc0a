"""A lone session's frame time without the profiler, to compare two checkouts in one run.

    python -m benchmarks.frame_time                              # this checkout
    python -m benchmarks.frame_time --other ../old --rounds 3    # alternating with another checkout

Each measurement is a fresh process (so each imports its own ``nvchat_torch``): the generated deep
4-bit model (``benchmarks.frame_loop``), one deterministic session with a system prompt, ``--frames``
80 ms frames of the benchmark's test signal pushed one at a time, the first ``--warmup`` untimed.
Prints min, median and mean ms per frame for each round; with ``--other``, the two alternate so a
shared machine's load falls on both alike. Set ``ATEN_CPU_CAPABILITY`` to time another dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import sys, time, json
import numpy as np, torch
torch.set_num_threads({threads})
import nvchat_torch as nv
from benchmarks.common import generated_checkpoint, test_signal
model = nv.load_model(generated_checkpoint("deep", 4), device="cpu")
session = model.create_streaming_session(nv.StreamingOptions(system_prompt="you are a helpful assistant",
                                                             deterministic=True))
wave = test_signal({frames} * 0.08)
times = []
for i in range({frames}):
    start = time.perf_counter()
    session.push_audio(wave[i * 1280:(i + 1) * 1280], 16000)
    times.append((time.perf_counter() - start) * 1000.0)
t = np.array(times[{warmup}:])
print(json.dumps({{"min": float(t.min()), "median": float(np.median(t)), "mean": float(t.mean())}}))
"""


def measure(root: Path, args: argparse.Namespace) -> dict:
    code = _CHILD.format(threads=args.threads, frames=args.frames, warmup=args.warmup)
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{root}: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frame_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", type=Path, default=None, help="another checkout to alternate with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.frames <= args.warmup:
        p.error("--frames must exceed --warmup")
    roots = [REPO] + ([args.other.resolve()] if args.other else [])
    print(f"dispatch: {os.environ.get('ATEN_CPU_CAPABILITY', 'default')}, {args.threads} thread(s), "
          f"{args.frames - args.warmup} frames timed per round")
    for round_ in range(1, args.rounds + 1):
        for root in roots:
            r = measure(root, args)
            print(f"round {round_}  {root.name:<20} min {r['min']:7.2f}  median {r['median']:7.2f}  "
                  f"mean {r['mean']:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
