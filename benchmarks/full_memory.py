"""Peak memory of the full-size 4-bit model as a user meets it: ``load_model`` from a checkpoint
folder in the real card's layout, then streaming frames.

    python -m benchmarks.full_memory                 # writes the checkpoint once (9.2 GB), then measures
    python -m benchmarks.full_memory --frames 3 --folder /big/disk/full-4bit
    python -m benchmarks.full_memory --compile       # the same with the frame step compiled (inductor)

Phase 1 (once, cached in ``--folder``): the 11B configuration with random weights in the layout of
``mlx-community/NemotronLabs-VoiceChat-11B-4bit`` (LLM and vocabulary matrices MLX affine 4-bit with
float32 scales and biases, every other weight bf16, A_log float32), built one module at a time
(``nvchat_torch.tiny.random_model("full", bits=4)``) and written as safetensors shards of at most
``--shard-gb``. Phase 2, in a fresh process: ``load_model(folder, device="cpu")`` (the faithful
default, with ``prepare()``), then ``--frames`` streaming frames. A thread samples
``/proc/self/status`` every 20 ms; the kernel's own high-water mark (VmHWM) gives the peak RSS.

RSS counts the anonymous memory the process owns (RssAnon: the model, the caches, temporaries) and
the file pages it has mapped and touched (RssFile: the shards while safetensors maps them, and the
shared libraries). The report gives the peak of each and where the process stood at each phase.

Its child processes are sampled too, every 0.5 s: with ``--compile`` on Linux the graph is compiled
in a forked child (which shares the weights copy-on-write) and inductor's compile workers. Their
private memory (``smaps_rollup``: the pages that are theirs alone) is what the compile adds to the
machine beside this process; the report gives its peak, and the peak of this process's RSS plus it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status_mib() -> dict[str, float]:
    """The process's memory lines of /proc/self/status, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) / 1024
    return out


def descendants(root: int) -> list[int]:
    """The processes below ``root`` (children, and theirs), from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # it ended meanwhile
            children.setdefault(parent, []).append(int(name))
    found, frontier = [], [root]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found += frontier
    return found


def private_mib(pid: int) -> float:
    """A process's private memory in MiB (its own pages: not those it shares copy-on-write)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty"))) / 1024
    except OSError:
        return 0.0  # it ended meanwhile


class PeakSampler(threading.Thread):
    """Samples RssAnon and RssFile every ``period`` s, and the child processes' private memory every
    ``children_period`` s; ``mark(name)`` records the current values."""

    def __init__(self, period: float = 0.02, children_period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.peak_anon, self.peak_file, self.marks = period, 0.0, 0.0, []
        self.children_every = max(1, round(children_period / period))
        self.peak_children, self.peak_with_children = 0.0, 0.0
        self.running = True

    def run(self) -> None:
        tick = 0
        while self.running:
            now = status_mib()
            self.peak_anon = max(self.peak_anon, now["RssAnon"])
            self.peak_file = max(self.peak_file, now["RssFile"])
            if tick % self.children_every == 0:
                children = sum(private_mib(pid) for pid in descendants(os.getpid()))
                self.peak_children = max(self.peak_children, children)
                self.peak_with_children = max(self.peak_with_children, now["VmRSS"] + children)
            tick += 1
            time.sleep(self.period)

    def mark(self, name: str) -> None:
        self.marks.append((name, status_mib()))


def write_checkpoint(folder: Path, shard_gb: float, seed: int) -> None:
    """The random full-size 4-bit model in the card's layout, as shards + index + config + tokenizers."""
    import torch
    from safetensors.torch import save_file

    from nvchat_torch.tiny import random_model, write_card_files

    model = random_model("full", seed, bits=4)
    state = model.state_dict()
    limit, shards, current, size = int(shard_gb * 1e9), [], {}, 0
    for key in sorted(state):
        t = state[key]
        if current and size + t.numel() * t.element_size() > limit:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += t.numel() * t.element_size()
    shards.append(current)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(folder / name), metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    write_card_files(model, folder, bits=4, group_size=64)
    (folder / "DONE").write_text(f"{total} bytes, torch {torch.__version__}\n")


def measure(folder: Path, frames: int, threads: int | None, compile: bool = False) -> dict:
    """Phase 2 (run in a fresh process): load, prepare and stream ``frames`` frames under the sampler."""
    import numpy as np
    import torch

    import nvchat_torch as nv
    from nvchat_torch.diagnostics import model_bytes

    if threads:
        torch.set_num_threads(threads)
    sampler = PeakSampler()
    sampler.start()
    sampler.mark("start (torch imported)")
    t0 = time.perf_counter()
    model = nv.load_model(folder, device="cpu", prepare=False)
    sampler.mark("loaded (as stored)")
    model.prepare()
    if compile:  # the first frame compiles the step: its peak includes the compiler's
        model.compile_step("inductor")
    load_s = time.perf_counter() - t0
    sampler.mark("prepared")
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="you are a helpful assistant"))
    sampler.mark("prompt prefilled")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(frames):
        session.push_audio((0.1 * rng.standard_normal(1280)).astype(np.float32), 16000)
    frame_s = (time.perf_counter() - t0) / max(1, frames)
    sampler.mark(f"{frames} frames")
    sampler.running = False
    sampler.join()
    return {"model": model.describe(), "weights_mib": model_bytes(model) / 2**20, "load_s": load_s,
            "frame_s": frame_s, "peak_rss_mib": status_mib()["VmHWM"], "peak_anon_mib": sampler.peak_anon,
            "peak_file_mib": sampler.peak_file, "peak_children_private_mib": sampler.peak_children,
            "peak_with_children_mib": sampler.peak_with_children, "marks": sampler.marks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.full_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "nvchat_torch_bench" / "full-4bit-card"))
    p.add_argument("--frames", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size when writing (the cards use 5 GB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)  # phase 2, in the child
    p.add_argument("--compile", action="store_true", help="the frame step compiled (inductor)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if args.measure_only:
        print(json.dumps(measure(folder, args.frames, args.threads, args.compile)))
        return 0
    if not (folder / "DONE").exists():
        t0 = time.perf_counter()
        write_checkpoint(folder, args.shard_gb, args.seed)
        print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s")
    cmd = [sys.executable, "-m", "benchmarks.full_memory", "--measure-only", "--folder", str(folder),
           "--frames", str(args.frames)] + (["--threads", str(args.threads)] if args.threads else []) + \
        (["--compile"] if args.compile else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:  # the measuring process's own error, not only its exit status
        print(out.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"the measuring process failed (exit {out.returncode})")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"model:   {result['model']}")
    print(f"weights as held: {result['weights_mib']:.0f} MiB; load + prepare {result['load_s']:.0f} s; "
          f"{result['frame_s']:.1f} s/frame")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB ({result['peak_rss_mib'] * 2**20 / 1e9:.2f} GB); "
          f"peak RssAnon {result['peak_anon_mib']:.0f} MiB; peak RssFile {result['peak_file_mib']:.0f} MiB")
    print(f"child processes' private memory: peak {result['peak_children_private_mib']:.0f} MiB; this process's RSS "
          f"plus it: peak {result['peak_with_children_mib']:.0f} MiB ({result['peak_with_children_mib'] * 2**20 / 1e9:.2f} GB)")
    print(f"{'phase':<28}{'RSS':>9}{'anon':>9}{'file':>9}{'peak':>9}  (MiB)")
    for name, m in result["marks"]:
        print(f"{name:<28}{m['VmRSS']:>9.0f}{m['RssAnon']:>9.0f}{m['RssFile']:>9.0f}{m['VmHWM']:>9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(os.EX_OK if main() == 0 else 1)
