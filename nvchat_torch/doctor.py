"""``python -m nvchat_torch.doctor``: what this machine runs, and how fast, as one Markdown block to
paste into a bug report.

    python -m nvchat_torch.doctor [--device mps|cuda|cpu] [--model PATH] [--frames 50] [--dtype bfloat16] [--compile]

What it prints: docs/mps.md, "The doctor"; ``--compile``: docs/mps.md, "Compiling the frame step".
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .diagnostics import (
    CpuFallbackRecorder,
    CpuFallbackWarning,
    OpCounter,
    count_host_reads,
    device_memory,
    model_bytes,
    synchronize,
)
from .events import StreamingOptions
from .models import cpu_kernels
from .models.int4pack import INT4_DEVICE_TYPES, int4_kernel
from .models.layers import fused_cpu_paths
from .models.quant import QuantizedLinear, self_test_kernel
from .op_audit import Audit, OpRecorder, tone

__all__ = ["main", "report", "deep_checkpoint"]

FRAME = 1280


def deep_checkpoint(seed: int = 0) -> Path:
    """The deep preset (tiny widths, the real depths) with random weights as a 4-bit mlx-community
    checkpoint, written once to ``$NVCHAT_DOCTOR_CACHE`` (default: the temp folder)."""
    from .tiny import random_model, save_checkpoint

    root = Path(os.environ.get("NVCHAT_DOCTOR_CACHE", Path(tempfile.gettempdir()) / "nvchat_torch_doctor"))
    folder = root / f"deep-4bit-seed{seed}-v{__version__}"
    if not (folder / "config.json").exists():
        save_checkpoint(random_model("deep", seed), folder, bits=4)
    return folder


def chip() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def devices() -> str:
    mps = ("available" if torch.backends.mps.is_available() else
           "built, not available" if torch.backends.mps.is_built() else "not in this build")
    cuda = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else "not available"
    return f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads); mps: {mps}; cuda: {cuda}"


def bf16_support(device: torch.device) -> str:
    try:
        x = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        ok = bool(((x @ x) == 4).all().item())
        return "yes (a bf16 matmul runs)" if ok else "no: a bf16 matmul gives wrong values"
    except (RuntimeError, TypeError) as e:
        return f"no ({str(e).splitlines()[0]}); MPS needs macOS 14 for bf16"


def kernel_rows(device: torch.device) -> list[tuple[str, str, str]]:
    """Each int4 kernel path this device could take, with its self-test (on a CPU, also the MPS and
    CUDA layouts through their pure-torch stand-ins, which is what CI checks)."""
    kernels = [int4_kernel(device.type)]
    if device.type == "cpu":
        kernels += [int4_kernel(t, stand_in=True) for t in INT4_DEVICE_TYPES if t != "cpu"]
    rows = []
    for kernel in kernels:
        if kernel is None:
            rows.append((f"int4pack on {device.type}", "-", "no such kernel: 4-bit weights dequantize per call"))
            continue
        for dtype in kernel.activation_dtypes:
            try:  # a report, not a crash: whatever goes wrong is what the user pastes
                why = self_test_kernel(kernel, dtype, device if not kernel.stand_in else "cpu")
            except Exception as e:  # noqa: BLE001
                why = f"the self-test could not run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            rows.append((kernel.name, str(dtype).removeprefix("torch."), "passes" if why is None else f"FAILS: {why}"))
    rows.append(("dequantize per call (any bit width)", "any", "always available (slower for large models)"))
    if device.type == "cpu":  # the streaming step's fused kernels (built here on first use)
        why = cpu_kernels.status()
        rows.append(("fused CPU step kernels (nvchat_cpu)", "float32",
                     "passes" if why is None else f"not used: {why} (the composite torch code runs)"))
    return rows


def peak_memory(device: torch.device) -> float:
    """Peak bytes: allocated on CUDA, the driver's on MPS, the process's resident set on the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return float(torch.mps.driver_allocated_memory())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss * (1 if sys.platform == "darwin" else 1024))


class CompositePath:
    """Inside the block the model runs the composite torch code, not its fused CPU kernels: what MPS and
    CUDA run, so an audit of it says what MPS would run (the fused ops are CPU-only)."""

    def __init__(self, model: Any):
        self.fused = fused_cpu_paths(model)

    def __enter__(self) -> None:
        for m, flag in self.fused:
            setattr(m, flag, False)

    def __exit__(self, *exc: Any) -> None:
        for m, flag in self.fused:
            setattr(m, flag, True)


def run_frames(model: Any, frames: int, warmup: int = 3) -> dict:
    """Stream ``frames`` 80 ms frames: ``warmup`` cold ones, one steady-state frame under the op and
    host-read counters (counting slows it: not timed), then the rest timed with the profiler. The op
    audit (what MPS would run) records that frame again on the composite path where the fused CPU
    kernels ran it."""
    session = model.create_streaming_session(StreamingOptions(system_prompt="you are a helpful assistant", seed=0,
                                                              profile=True))
    wave = tone(frames * FRAME / 16000)
    chunks = [wave[i:i + FRAME] for i in range(0, frames * FRAME, FRAME)]
    for chunk in chunks[:warmup]:
        session.push_audio(chunk, 16000)
    recorder = OpRecorder()
    recorder.scenario = f"frame {warmup} (as MPS runs it)"
    with count_host_reads() as reads, OpCounter() as ops:
        session.push_audio(chunks[warmup], 16000)
    audit_session = model.create_streaming_session(StreamingOptions(system_prompt="you are a helpful assistant"))
    with CompositePath(model):
        for chunk in chunks[:warmup]:
            audit_session.push_audio(chunk, 16000)
        with recorder:
            audit_session.push_audio(chunks[warmup], 16000)
    session.profile.frames.clear()
    synchronize(model.device)
    start = time.perf_counter()
    for chunk in chunks[warmup + 1:]:
        session.push_audio(chunk, 16000)
    synchronize(model.device)
    timed = max(1, len(chunks) - warmup - 1)
    wall = (time.perf_counter() - start) / timed
    return {"table": session.profile.table(), "kernels": ops.non_view, "host_reads": sum(reads.values()),
            "reads": dict(reads), "wall_ms": wall * 1000, "rtf": wall / 0.08, "timed": timed,
            "audit": Audit.of({"frame": recorder.named()})}


def compile_check(model: Any, frames: int = 20, backend: Any = "inductor") -> dict:
    """Compile ``model``'s frame step and check ``frames`` deterministic frames against the eager step:
    the same text and function ids and codes per frame. Returns the times (compile = the first frame,
    then ms per frame of both) and the verdict; a failure to compile leaves the model eager and says why."""
    wave = tone(frames * FRAME / 16000)
    chunks = [wave[i:i + FRAME] for i in range(0, frames * FRAME, FRAME)]

    def stream() -> tuple[list[tuple], float, float]:
        session = model.create_streaming_session(StreamingOptions(system_prompt="you are a helpful assistant",
                                                                  deterministic=True))
        outputs, times = [], []
        for chunk in chunks:
            start = time.perf_counter()
            events = session.push_audio(chunk, 16000)
            synchronize(model.device)
            times.append(time.perf_counter() - start)
            audio = [e for e in events if e.kind == "audio"]
            outputs += [(session.last_ids, tuple(int(c) for c in e.audio_codes)) for e in audio]
        return outputs, times[0], 1000 * sum(times[1:]) / max(1, len(times) - 1)

    eager, _, eager_ms = stream()
    try:
        model.compile_step(backend)
        compiled, first, compiled_ms = stream()
    except Exception as e:  # noqa: BLE001 - the report names it, and the model runs eager
        model.step_compiler = None
        cause: BaseException = e  # the compiler wraps what failed in its own errors: name the innermost
        while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
            cause = inner
        why = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        return {"ok": False, "why": why if cause is e else f"{type(e).__name__} ({why})", "eager_ms": eager_ms}
    differ = next((i for i, (a, b) in enumerate(zip(eager, compiled)) if a != b), None)
    compiler = model.step_compiler
    how = "loaded the kept step" if compiler is not None and compiler.loaded else "compiles"
    return {"ok": True, "first_s": first, "eager_ms": eager_ms, "compiled_ms": compiled_ms, "frames": len(compiled),
            "differ": differ, "first_how": how}


def compile_lines(check: dict) -> list[str]:
    lines = ["", "### Compiled frame step (--compile)", ""]
    if not check["ok"]:
        return lines + [f"- compiling failed: {check['why']}; the model runs eager "
                        f"({check['eager_ms']:.1f} ms per frame)"]
    same = "the same ids and codes on every frame" if check["differ"] is None else \
        f"DIFFERENT from frame {check['differ']} on (please send us this report)"
    return lines + [f"- first frame ({check.get('first_how', 'compiles')}): {check['first_s']:.1f} s",
                    f"- ms per frame after it: eager {check['eager_ms']:.1f}, compiled {check['compiled_ms']:.1f}",
                    f"- compiled vs eager over {check['frames']} frames: {same}"]


def report(device: str | None = None, model_path: str | None = None, frames: int = 50, seed: int = 0,
           dtype: torch.dtype | None = None, compile: Any = False) -> str:
    """The doctor's Markdown report (what ``python -m nvchat_torch.doctor`` prints); ``compile``: also
    compile the frame step and check it against eager (True: inductor; a backend name or callable)."""
    from . import load_model
    from .model import default_device

    target = torch.device(device) if device else default_device()
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels = kernel_rows(target)
        path = Path(model_path) if model_path else deep_checkpoint(seed)
        with CpuFallbackRecorder() as cpu_fallbacks:  # what MPS ran on the CPU, per op
            model = load_model(path, device=target, dtype=dtype)
            cpu_fallbacks.attach(model)  # model.describe() lists them
            run = run_frames(model, frames)
            check = compile_check(model, backend="inductor" if compile is True else compile) if compile else None
    fell_back = sorted({str(w.message).splitlines()[0] for w in caught
                        if issubclass(w.category, RuntimeWarning) and not issubclass(w.category, CpuFallbackWarning)})
    fell_back += sorted({f"model: {m.fallback}" for m in model.modules()
                         if isinstance(m, QuantizedLinear) and m.fallback})
    fell_back += [f"{op} ran on the CPU instead of mps: {cost}" for op, cost in sorted(cpu_fallbacks.ops.items())]
    on_cpu_for_mps = [p for p in run["audit"].problems if "no MPS kernel" in p]
    lines = ["## nvchat_torch doctor", "", "| | |", "|---|---|",
             f"| nvchat_torch | {__version__} |", f"| torch | {torch.__version__} |",
             f"| Python | {platform.python_version()} |", f"| OS | {platform.platform()} |",
             f"| chip | {chip()} |", f"| devices | {devices()} |", f"| device used | {target} |",
             f"| bf16 on {target.type} | {bf16_support(target)} |",
             f"| PYTORCH_ENABLE_MPS_FALLBACK | {os.environ.get('PYTORCH_ENABLE_MPS_FALLBACK', 'unset')} |",
             f"| memory | device {device_memory(target) / 2**30:.1f} GiB, model {model_bytes(model) / 2**30:.2f} GiB "
             f"as held, peak {peak_memory(target) / 2**30:.2f} GiB |", "",
             "### Kernel paths (one-time self-tests)", "", "| path | activations | self-test |", "|---|---|---|"]
    lines += [f"| {name} | {dtype} | {result} |" for name, dtype, result in kernels]
    lines += ["", "### What fell back", ""]
    lines += [f"- {item}" for item in fell_back] or ["- nothing"]
    if on_cpu_for_mps:
        lines += [f"- on MPS this would fall back to the CPU: {p}" for p in on_cpu_for_mps]
    lines += ["", "### Model", "", "```", model.describe(), "```", "",
              f"### {frames} streaming frames ({run['timed']} timed after 3 cold and 1 counted)", "", "```",
              run["table"], "```", "",
              f"- kernels (non-view ATen ops) per steady-state frame: {run['kernels']:,}",
              f"- host reads per frame: {run['host_reads']} ({', '.join(f'{k} {v}' for k, v in run['reads'].items())})",
              f"- wall time per frame: {run['wall_ms']:.1f} ms, real-time factor {run['rtf']:.3f} "
              "(< 1 keeps up with live audio)",
              f"- the doctor took {time.perf_counter() - started:.1f} s"]
    if check is not None:
        lines += compile_lines(check)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="mps, cuda or cpu (default: mps > cuda > cpu)")
    p.add_argument("--model", default=None, help="a checkpoint folder or Hub id (default: the generated deep preset)")
    p.add_argument("--frames", type=int, default=50, help="streaming frames to run (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated model")
    p.add_argument("--dtype", choices=["faithful", "float32", "bfloat16"], default="faithful",
                   help="the mode load_model runs (default: faithful; bfloat16 is the fast mode)")
    p.add_argument("--compile", nargs="?", const="inductor", default=False, choices=("inductor", "aot_eager", "eager"),
                   help="then compile the frame step (default backend inductor), check 20 frames against eager, "
                        "and time both")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for the generated model, whose tiny widths make every op "
                        "overhead-bound, so more threads only contend; torch's default with --model)")
    args = p.parse_args(argv)
    if args.frames < 6:
        p.error("--frames must be at least 6 (3 cold, 1 counted, 2 timed)")
    threads = args.threads or (None if args.model else 1)
    if threads:
        torch.set_num_threads(threads)
    dtype = None if args.dtype == "faithful" else getattr(torch, args.dtype)
    print(report(args.device, args.model, args.frames, args.seed, dtype, args.compile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
