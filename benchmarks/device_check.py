"""What a GPU should tell us first, in one prepared run of at most 8 minutes.

    python -m benchmarks.device_check                            # cuda if there is one, else the cpu
    python -m benchmarks.device_check --device cpu --quick       # the same code, small: CI, under a minute
    python -m benchmarks.device_check --parts full,prompt --budget-seconds 300

The parts, in priority order (run in this order, so the deadline cuts the last ones first):
environment (device, memory, torch, CUDA, cuDNN, Triton, TF32 flags); doctor (``nvchat_torch.doctor``
on the device); parity (the tiny and deep presets in the real 4-bit card's layout, deterministic, on
the device eager and compiled, CUDA graphs on CUDA: each frame's text id, function id, transcript and
31 codes against the same checkpoint on the CPU, as the MLX reference does not run beside a GPU; the
largest audio difference); deep (the deep preset's frame time and kernels per frame, eager, compiled,
CUDA-graphed); full (a full-size random 4-bit model: build time, memory, the batched engine's step
time and real-time factor with 1 and 8 sessions, then its unseen-prompt times); prompt (the wall time
to open a session with a new ~600-character system prompt until it is ready, then a second new one,
in frames of the device's frame time, deep preset). Each part runs in a process of its own (``--part
NAME``) under a time box, writing its figures as it takes them: an error, a crash or a timeout is
recorded with its text, what was measured is kept, and the next part runs. ``--quick`` runs each
part smaller (the tiny preset for parity, few frames, short prompts, a tiny stand-in, labelled so,
for the full-size model). Writes a JSON (``--json``, default ``$OUT/device_check.json``, else
``device_check.json``) and a Markdown report beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save_file
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import nvchat_torch as nv
from benchmarks.common import generated_checkpoint, test_signal
from benchmarks.device_report import last_line, markdown
from benchmarks.frame_loop import full_random_model
from benchmarks.prefill import language_seconds
from nvchat_torch import doctor
from nvchat_torch.diagnostics import OpCounter, count_host_reads, kernel_launches, model_bytes, synchronize
from nvchat_torch.tiny import random_model, write_card_files

REPO = Path(__file__).resolve().parents[1]
FRAME = 1280
PROMPT = "you are a helpful assistant"
PARTS = ("environment", "doctor", "parity", "deep", "full", "prompt")
# Each part's time box and the least time worth starting it, as fractions of the budget (of 8 minutes: the
# full-size part may take 4, and is not started with under 96 s left; building it took 205 s on 2 CPU cores).
BOXES = {"environment": (0.1, 0.01), "doctor": (0.15, 0.03), "parity": (0.35, 0.06), "deep": (0.35, 0.06),
         "full": (0.5, 0.2), "prompt": (0.15, 0.03)}
LEAST_SECONDS = 3.0  # no part starts with less left: its process could not even import torch
NEW_PROMPTS = (
    "You are the voice of a small bookshop's phone line. Greet callers warmly and ask how you can help. You "
    "can answer questions about opening hours, which are nine to six on weekdays and ten to four on Saturdays, "
    "and about ordering books that are not on the shelves, which takes three to five working days. Keep each "
    "answer to one or two short sentences, speak plainly, and never read out long lists. If a caller asks for "
    "something you cannot do, such as changing an order that has already shipped, say so kindly and offer to "
    "take a message for the owner, who calls back the same day before the shop closes.",
    "You are a patient cooking assistant who talks a home cook through a recipe while their hands are busy. "
    "Wait until the cook says they are ready before giving the next step, and give one step at a time with "
    "the quantity and how long it takes. Use metric units unless the cook asks for cups or ounces. If the "
    "cook sounds unsure, repeat the step more slowly in simpler words. Warn about hot oil, sharp knives and "
    "raw chicken without lecturing. When the dish is done, suggest one simple side dish and how to keep the "
    "leftovers safely in the fridge, then wish them a good meal and stay quiet.",
)


@dataclass(frozen=True)
class Sizes:
    """How much each part runs: the GPU run's, or --quick's (a CPU in CI, under a minute)."""

    doctor_frames: int
    parity_presets: tuple[str, ...]
    parity_frames: int
    warmup: int  # cold frames before the timed ones
    timed: int
    full_preset: str  # "full", or the stand-in --quick builds instead
    engine_warmup: int
    engine_timed: int
    layout: str  # of the generated checkpoints (LAYOUTS; float32 on a CPU, which upcasts bf16 in every op)
    prompt_characters: int  # of each new prompt (--quick cuts them: a CPU prefills a position in ~10 ms)


LAYOUTS = {"card": "the real 4-bit card's (what users run): LLM and vocabulary 4-bit, float32 scales, bf16 elsewhere",
           "float32": "4-bit LLM and vocabulary with float32 scales, float32 elsewhere (benchmarks.frame_loop's)"}
SIZES = {False: Sizes(50, ("tiny", "deep"), 25, 10, 40, "full", 5, 20, "card", 1000),
         True: Sizes(6, ("tiny",), 8, 3, 8, "tiny", 2, 4, "float32", 40)}


@dataclass
class FrameTrace:
    """One session's outputs frame by frame: (text, function) ids, the transcript so far, codes, audio."""

    text_ids: list[int]
    function_ids: list[int]
    transcript: list[str]
    codes: list[np.ndarray]
    audio: list[np.ndarray]


def stream_trace(model: Any, wave: np.ndarray, prompt: str = PROMPT) -> FrameTrace:
    """A deterministic session over ``wave``, one 80 ms frame per push."""
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=prompt, deterministic=True))
    trace = FrameTrace([], [], [], [], [])
    for start in range(0, len(wave) - FRAME + 1, FRAME):
        audio = [e for e in session.push_audio(wave[start:start + FRAME], 16000) if e.kind == "audio"]
        text_id, function_id = session.last_ids
        trace.text_ids.append(int(text_id))
        trace.function_ids.append(int(function_id))
        trace.transcript.append(session.user_transcript)
        trace.codes.append(np.stack([np.asarray(e.audio_codes) for e in audio]) if audio else np.zeros((0,)))
        trace.audio.append(np.concatenate([e.samples for e in audio]) if audio else np.zeros(0, np.float32))
    return trace


def compare_traces(reference: FrameTrace, candidate: FrameTrace) -> dict:
    """Frame by frame: how many frames agree on each output, the first that differs (and in what), the
    largest audio difference. ``ok``: both ran the same frames, at least one, and every output agrees."""
    n = min(len(reference.codes), len(candidate.codes))
    same = {"text ids": [reference.text_ids[i] == candidate.text_ids[i] for i in range(n)],
            "function ids": [reference.function_ids[i] == candidate.function_ids[i] for i in range(n)],
            "transcript": [reference.transcript[i] == candidate.transcript[i] for i in range(n)],
            "codes": [bool(np.array_equal(reference.codes[i], candidate.codes[i])) for i in range(n)]}
    first = min((row.index(False) for row in same.values() if False in row), default=None)
    result: dict[str, Any] = {"frames": {"reference": len(reference.codes), "candidate": len(candidate.codes)},
                              "compared": n, "agree": {name: sum(row) for name, row in same.items()},
                              "first_divergent_frame": first}
    if first is not None:
        result["differs_in"] = [name for name, row in same.items() if not row[first]]
        a, b = reference.codes[first], candidate.codes[first]
        if a.shape == b.shape:
            result["codes_differ_at"] = np.flatnonzero(a != b).tolist()
    a, b = (np.concatenate(trace.audio[:n]) if n else np.zeros(0) for trace in (reference, candidate))
    m = min(len(a), len(b))
    result["audio_samples"] = m
    result["max_audio_diff"] = float(np.abs(a[:m] - b[:m]).max()) if m else None
    result["ok"] = n > 0 and len(reference.codes) == len(candidate.codes) and first is None
    return result


class PartRecord:
    """A part's figures, rewritten to its file after each one (a part cut off keeps what it measured)."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def update(self, values: dict[str, Any]) -> None:
        self.data.update(values)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(self.data, default=str))
        os.replace(temporary, self.path)


@dataclass
class Context:
    device: torch.device
    quick: bool
    deadline: float  # when this part's time box ends (time.time())
    seed: int
    backend: str  # the compiled parity variant's torch.compile backend
    full_dtype: str

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.quick]

    def left(self) -> float:
        return self.deadline - time.time()

    def checkpoint(self, preset: str) -> Path:
        """The generated 4-bit ``preset`` checkpoint in this run's layout (written once, then cached)."""
        if self.sizes.layout == "card":
            return card_checkpoint(preset, self.seed)
        return generated_checkpoint(preset, 4, self.seed)


def say(message: str) -> None:
    print(message, flush=True)


def error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:]).strip()


def card_checkpoint(preset: str, seed: int = 0) -> Path:
    """A random ``preset`` model in the real 4-bit card's layout (4-bit LLM and vocabulary with float32
    scales, bf16 elsewhere), written once to the benchmarks' cache (``$NVCHAT_BENCH_CACHE``)."""
    root = Path(os.environ.get("NVCHAT_BENCH_CACHE", Path(tempfile.gettempdir()) / "nvchat_torch_bench"))
    folder = root / f"{preset}-card4bit-seed{seed}-v{nv.__version__}"
    if not (folder / "config.json").exists():
        model = random_model(preset, seed, bits=4)  # unprepared: its state_dict is the checkpoint's
        root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=folder.name, dir=root))
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(building / "model.safetensors"), metadata={"format": "mlx"})
        write_card_files(model, building, bits=4)
        os.replace(building, folder)  # whole or not at all
    return folder


def frames_of(wave: np.ndarray) -> list[np.ndarray]:
    return [wave[i:i + FRAME] for i in range(0, len(wave) - FRAME + 1, FRAME)]


def peak_mib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process's peak resident set elsewhere."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024), 1)


def release(device: torch.device) -> None:
    """Let go of what a finished variant held (its model, sessions, compiled graphs); reset the peak."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


KERNEL_COUNTING = (
    "cuda kernels: device kernels the profiler (CUPTI) saw in one steady-state frame, copies and fills apart; "
    "launch calls, graph launches: the host's CUDA calls in it; profiler ops: outermost ATen ops and generated "
    "kernels the profiler saw on the host (diagnostics.kernel_launches; blind to a CUDA graph's replay); "
    "dispatched ops: non-view ATen ops a dispatch mode counted (eager only: it cannot see into a compiled region)")


def kernels_of(run: Callable[[], object], device: torch.device) -> dict:
    """What one call of ``run`` launches, counted as KERNEL_COUNTING says (the CUDA counts on CUDA only)."""
    counts: dict[str, Any] = {"profiler_ops": kernel_launches(run)}
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
        names = [(e.name, e.device_type == DeviceType.CUDA) for e in prof.events()]
        on_device = [name for name, device_side in names if device_side]
        copies = sum(name.startswith(("Memcpy", "Memset")) for name in on_device)
        counts.update(cuda_kernels=len(on_device) - copies, cuda_copies=copies,
                      launch_calls=sum(not d and name.startswith(("cudaLaunch", "cuLaunch")) for name, d in names),
                      graph_launches=sum(not d and "GraphLaunch" in name for name, d in names))
    return counts


def timed_frames(session: Any, chunks: list[np.ndarray], warmup: int, device: torch.device) -> tuple[list, float]:
    """Push ``chunks`` one at a time, each timed to a device sync: the ms of those after ``warmup``, and
    the first frame's seconds (a compiled step compiles there)."""
    times = []
    for chunk in chunks:
        start = time.perf_counter()
        session.push_audio(chunk, 16000)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return [t * 1000 for t in times[warmup:]], times[0]


def spread(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"median": float(np.median(a)), "mean": float(a.mean()), "p95": float(np.percentile(a, 95)),
            "min": float(a.min()), "frames": len(ms)}


def part_environment(ctx: Context, record: PartRecord) -> None:
    device = ctx.device
    record.update({"device": str(device), "device_name": doctor.chip() if device.type == "cpu" else str(device),
                   "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
                   "cpu": f"{doctor.chip()}, {os.cpu_count()} cpus, torch uses {torch.get_num_threads()} threads",
                   "nvchat_torch": nv.__version__, "git_commit": command_output(["git", "rev-parse", "HEAD"]),
                   "mlx": "installed" if importlib.util.find_spec("mlx") else
                   "not installed: the parity part compares the device against the CPU"})
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update({"device_name": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 2),
                       "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                       "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                       "driver": command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                       "triton": version("triton") if importlib.util.find_spec("triton") else None,
                       # as a user gets them (the parity part reruns a divergence with cuDNN's TF32 off)
                       "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                                "cudnn": torch.backends.cudnn.allow_tf32}})


def command_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def part_doctor(ctx: Context, record: PartRecord) -> None:
    """The doctor in this process, as ``python -m nvchat_torch.doctor --device D --frames N`` runs it."""
    record["frames"] = ctx.sizes.doctor_frames
    text = doctor.report(str(ctx.device), None, ctx.sizes.doctor_frames)
    record.update({"report": text, **doctor_figures(text)})


def doctor_figures(text: str) -> dict:
    """The figures of a doctor's report (None where its wording has changed)."""
    def number(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1).replace(",", "")) if m else None

    fell_back = re.search(r"### What fell back\n\n((?:- .*\n?)+)", text)
    return {"kernels_per_frame": number(r"kernels \(non-view ATen ops\) per steady-state frame: ([\d,]+)"),
            "host_reads_per_frame": number(r"host reads per frame: (\d+)"),
            "wall_ms_per_frame": number(r"wall time per frame: ([\d.]+) ms"),
            "realtime_factor": number(r"wall time per frame: [\d.]+ ms, real-time factor ([\d.]+)"),
            "fell_back": [line[2:] for line in fell_back.group(1).splitlines() if line != "- nothing"]
            if fell_back else None,
            "self_tests_failing": [line for line in text.splitlines() if "| FAILS" in line]}


def part_parity(ctx: Context, record: PartRecord) -> None:
    device, sizes = ctx.device, ctx.sizes
    wave = test_signal(sizes.parity_frames * 0.08)
    on_cpu = device.type == "cpu"
    # The reference, the CPU eager: beside a GPU on the composite code (what CUDA runs; and no C++ build of
    # the fused CPU kernels there), on a CPU on its default, the fused kernels, so that the variants there
    # (the composite code) compare two code paths.
    record.update({"reference": "cpu, eager, " + ("fused CPU kernels where they build" if on_cpu else
                                                  "composite code (the fused CPU kernels off)"),
                   "mode": "faithful (load_model's default), deterministic", "layout": LAYOUTS[sizes.layout],
                   "frames": sizes.parity_frames})
    compiled = ("compiled (inductor, CUDA graphs)" if device.type == "cuda" and ctx.backend == "inductor" else
                "compiled (inductor)" if ctx.backend == "inductor" else f"compiled (traced only: backend {ctx.backend})")
    eager: tuple[str, Callable[[Path], Any], Any] = \
        ("composite eager (the code MPS and CUDA run)", lambda p: nv.load_model(p, device=device),
         doctor.CompositePath) \
        if on_cpu else ("eager", lambda p: nv.load_model(p, device=device), None)
    variants = [eager, (compiled, lambda p: nv.load_model(p, device=device, compile=ctx.backend), None)]
    models: list[dict] = []
    references = {}
    for preset in sizes.parity_presets:
        path = ctx.checkpoint(preset)
        models.append({"preset": preset, "checkpoint": str(path), "variants": []})
        start = time.perf_counter()
        cpu = nv.load_model(path, device="cpu") if on_cpu else \
            nv.load_model(path, device="cpu", prepare=False).prepare(fused_cpu=False)
        references[preset] = stream_trace(cpu, wave)
        del cpu
        models[-1]["reference_seconds"] = seconds = round(time.perf_counter() - start, 2)
        say(f"parity {preset}: reference on the cpu, {len(references[preset].codes)} frames, {seconds} s")
    for name, load, within in variants:  # every preset eager before the compiles (the slow part)
        for entry in models:
            reference, path = references[entry["preset"]], Path(entry["checkpoint"])
            row: dict[str, Any] = {"variant": name, "device": str(device)}
            entry["variants"].append(row)
            if ctx.left() < 15:
                row["skipped"] = "the part's time box ran out"
                continue
            start = time.perf_counter()
            try:
                model = load(path)
                with within(model) if within is not None else contextlib.nullcontext():
                    row["comparison"] = compare_traces(reference, stream_trace(model, wave))
                if name == "eager" and device.type == "cuda" and not row["comparison"]["ok"] \
                        and torch.backends.cudnn.allow_tf32:  # is it cuDNN's TF32 convolutions?
                    torch.backends.cudnn.allow_tf32 = False
                    try:
                        entry["variants"].append({"variant": "eager, cuDNN TF32 off", "device": str(device),
                                                  "comparison": compare_traces(reference, stream_trace(model, wave))})
                    finally:
                        torch.backends.cudnn.allow_tf32 = True
                del model
            except Exception as e:  # noqa: BLE001 - recorded; the next variant runs
                row["error"] = error_text(e)
            row["seconds"] = round(time.perf_counter() - start, 2)
            release(device)
            c = row.get("comparison")
            say(f"parity {entry['preset']} {name}: " + (f"{'OK' if c['ok'] else 'MISMATCH'}, {c['compared']} frames, "
                                                         f"max audio diff {c['max_audio_diff']}" if c else
                                                         last_line(row.get("error"))) + f" ({row['seconds']} s)")
            record["models"] = models
    ran = [v for m in models for v in m["variants"] if "skipped" not in v]
    record["ok"] = bool(ran) and all(v.get("comparison", {}).get("ok", False) for v in ran)


def part_deep(ctx: Context, record: PartRecord) -> None:
    device, sizes = ctx.device, ctx.sizes
    path = ctx.checkpoint("deep")
    record.update({"checkpoint": str(path), "mode": "faithful, deterministic, one session",
                   "layout": LAYOUTS[sizes.layout], "kernel_counting": KERNEL_COUNTING})
    chunks = frames_of(test_signal((sizes.warmup + sizes.timed + 2) * 0.08))
    variants: list[tuple[str, Any]] = [("eager", None)]
    skipped = []
    if device.type == "cuda":  # before the plain compile: CUDA's default (and the compiler's caches warm it)
        variants.append(("CUDA graphs (inductor, reduce-overhead)", ("inductor", "reduce-overhead")))
    else:
        skipped.append({"variant": "CUDA graphs", "skipped": f"needs a CUDA device, not {device.type}"})
    if ctx.quick and device.type == "cpu":
        skipped.append({"variant": "compiled", "skipped": "--quick on a CPU: a cold inductor compile of the deep "
                        "preset takes minutes there"})
    else:
        variants.append(("compiled (inductor, no CUDA graphs)", ("inductor", "default")))
    rows: list[dict] = []
    for name, how in variants:
        row: dict[str, Any] = {"variant": name}
        rows.append(row)
        if how is not None and ctx.left() < 30:
            row["skipped"] = "the part's time box ran out"
            continue
        try:
            release(device)
            model = nv.load_model(path, device=device)
            if how is not None:
                model.compile_step(*how)
            session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
            ms, first = timed_frames(session, chunks[:sizes.warmup + sizes.timed], sizes.warmup, device)
            row.update(first_frame_s=round(first, 3), ms_per_frame=spread(ms), realtime_factor=float(np.median(ms)) / 80)
            row["kernels"] = kernels_of(lambda: session.push_audio(chunks[-2], 16000), device)
            if how is None:
                with count_host_reads() as reads, OpCounter() as ops:
                    session.push_audio(chunks[-1], 16000)
                row["kernels"]["dispatched_ops"] = ops.non_view
                row["host_reads"] = sum(reads.values())
            row.update(peak_memory_mib=peak_mib(device), describe=model.describe())
            del session, model
        except Exception as e:  # noqa: BLE001 - recorded; the next variant runs
            row["error"] = error_text(e)
        say(f"deep {name}: " + (f"{row['ms_per_frame']['median']:.2f} ms per frame (median), kernels {row['kernels']}"
                                if "kernels" in row else last_line(row.get("error"))))
        record["variants"] = rows + skipped
    release(device)


def build_full(ctx: Context) -> Any:
    """The full-size 4-bit model (``benchmarks.frame_loop.full_random_model``: made on the CPU one module at
    a time, each moved to the device as it is made), or --quick's stand-in, made the same way."""
    dtype = None if ctx.full_dtype == "faithful" else ctx.full_dtype
    if ctx.sizes.full_preset == "full":
        return full_random_model(SimpleNamespace(device=str(ctx.device), dtype=dtype, bits="4"))
    return random_model(ctx.sizes.full_preset, ctx.seed, device=ctx.device,
                        dtype=None if dtype is None else getattr(torch, dtype), bits=4).prepare()


def part_full(ctx: Context, record: PartRecord) -> None:
    device, sizes = ctx.device, ctx.sizes
    stand_in = sizes.full_preset != "full"
    record.update({"model": f"STAND-IN: the {sizes.full_preset} preset in the 4-bit layout (--quick), not the "
                   "full-size model" if stand_in else "the full-size configuration (11B), random weights, 4-bit",
                   "stand_in": stand_in, "mode": {"faithful": "faithful (float32 activations)", "float32": "float32",
                   "bfloat16": "fast (bf16 activations, the int4pack kernel where it passes)"}[ctx.full_dtype]})
    release(device)
    start = time.perf_counter()
    model = build_full(ctx)
    synchronize(device)
    built, weights = round(time.perf_counter() - start, 1), round(model_bytes(model) / 1e9, 3)
    record.update({"build_s": built, "weights_gb": weights, "memory_after_build_mib": peak_mib(device),
                   "host_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   "describe": model.describe()})
    say(f"full: built in {built} s, {weights} GB of weights")
    chunks = frames_of(test_signal((sizes.engine_warmup + sizes.engine_timed + 1) * 0.08))
    rows: list[dict] = []
    for n in (1, 8):
        engine = model.create_engine(max_sessions=n)
        handles = [engine.open(nv.StreamingOptions(system_prompt=PROMPT, seed=i)) for i in range(n)]
        times = []
        for k in range(sizes.engine_warmup + sizes.engine_timed):
            for handle in handles:
                handle.push_audio(chunks[k], 16000)
            synchronize(device)
            start = time.perf_counter()
            engine.step()
            synchronize(device)
            times.append((time.perf_counter() - start) * 1000)
        ms = spread(times[sizes.engine_warmup:])
        row = {"sessions": n, "step_ms": ms, "realtime_factor": ms["median"] / 80,
               "frames_per_second": n * 1000 / ms["median"]}
        if n == 1:  # the kernels of one step
            row["kernels"] = kernels_of(lambda: (handles[0].push_audio(chunks[-1], 16000), engine.step()), device)
        rows.append(row)
        record["engine"] = rows
        say(f"full: {n} session(s): step {ms['median']:.1f} ms (median), real-time factor {row['realtime_factor']:.3f}")
        for handle in handles:
            handle.cancel()
        del engine, handles
    record["peak_memory_mib"] = peak_mib(device)
    try:  # the prompt part's figures for this model (the parent moves them there)
        label = f"stand-in ({sizes.full_preset})" if stand_in else "full"
        record["prompt"] = {"model": label, **prompt_timings(model, ctx)}
    except Exception as e:  # noqa: BLE001 - the step times above stand
        record["prompt"] = {"error": error_text(e)}


def prompt_timings(model: Any, ctx: Context) -> dict:
    """The device's frame time (a session with a short prompt, after warm-up frames), then the wall time
    of opening a session with each new prompt until it is ready, in seconds and in those frames, in the
    server's default mode (sampling, seed 0; the second prompt finds the prefill track made); then the
    LLM's pass over the first prompt by piece size, to choose the pieces where nothing else streams."""
    device, sizes = ctx.device, ctx.sizes
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=PROMPT, deterministic=True))
    ms, _ = timed_frames(session, frames_of(test_signal((sizes.warmup + sizes.timed) * 0.08)), sizes.warmup, device)
    frame_ms = float(np.median(ms))
    result: dict[str, Any] = {"frame_ms": frame_ms, "prompts": []}
    for name, prompt in zip(("first new prompt", "second new prompt"), NEW_PROMPTS):
        prompt = prompt[:sizes.prompt_characters]
        synchronize(device)
        start = time.perf_counter()
        session = model.create_streaming_session(nv.StreamingOptions(system_prompt=prompt, seed=0))
        synchronize(device)
        seconds = time.perf_counter() - start
        result["prompts"].append({"prompt": name, "characters": len(prompt), "positions": session.timeline_index,
                                  "seconds": round(seconds, 4), "frames": round(seconds * 1000 / frame_ms, 1)})
        say(f"prompt: {name}, {len(prompt)} characters ({session.timeline_index} positions): {seconds:.3f} s = "
            f"{seconds * 1000 / frame_ms:.1f} frames of {frame_ms:.2f} ms")
    ids = model.tokenizer.encode(NEW_PROMPTS[0][:sizes.prompt_characters], add_special_tokens=False)
    result["llm_ms_per_position"] = {str(piece or "whole"): round(language_seconds(model, ids, piece, 2) * 1000 / len(ids), 3)
                                     for piece in (64, 128, 256, 0)}
    say(f"prompt: the LLM's pass, ms per position by piece: {result['llm_ms_per_position']}")
    return result


def part_prompt(ctx: Context, record: PartRecord) -> None:
    record["note"] = ("positions: the prompt's tokens (these random models' byte-level tokenizer gives about four "
                      "times the real tokenizer's count for English)"
                      + ("; --quick cuts each prompt to its first 40 characters" if ctx.quick else ""))
    record["deep"] = {"model": "deep", **prompt_timings(nv.load_model(ctx.checkpoint("deep"), device=ctx.device), ctx)}


PART_FUNCTIONS: dict[str, Callable[[Context, PartRecord], None]] = {
    "environment": part_environment, "doctor": part_doctor, "parity": part_parity, "deep": part_deep,
    "full": part_full, "prompt": part_prompt}


def run_part(args: argparse.Namespace) -> int:
    """In a part's own process: run it, recording its figures and, on failure, the error's text."""
    record = PartRecord(Path(args.result))
    if args.part == "doctor" or args.quick and args.device == "cpu":  # tiny widths: more threads only contend
        torch.set_num_threads(1)  # (the doctor's own default for its generated model, and the tests')
    ctx = Context(torch.device(args.device), args.quick, args.part_deadline, args.seed, args.compile_backend,
                  args.full_dtype)
    try:
        PART_FUNCTIONS[args.part](ctx, record)
    except BaseException as e:  # noqa: BLE001 - the parent reports it and runs the next part
        record["error"] = error_text(e)
        say(f"{args.part} failed: {record.data['error']}")
        return 1
    return 0


def launch(part: str, args: argparse.Namespace, timeout: float, result: Path) -> dict:
    """Run ``part`` in a process of its own for at most ``timeout`` seconds, echoing its output as it comes."""
    cmd = [sys.executable, "-m", "benchmarks.device_check", "--part", part, "--result", str(result),
           "--part-deadline", str(time.time() + timeout), "--device", args.device, "--seed", str(args.seed),
           "--compile-backend", args.compile_backend, "--full-dtype", args.full_dtype] + ["--quick"] * args.quick
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    # A process group of its own: a timeout ends it together with the compiler workers it started.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    tail: deque[str] = deque(maxlen=30)

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"  [{part}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    entry: dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1)}
    entry["result"] = json.loads(result.read_text()) if result.exists() else {}  # written whole (PartRecord)
    error = entry["result"].pop("error", None)
    if timed_out:
        entry.update(status="timed out", error=f"stopped at its time box of {timeout:.0f} s; what it measured is kept")
    elif error is not None or proc.returncode != 0:
        entry.update(status="failed", error=error or f"exit status {proc.returncode}: " + "\n".join(list(tail)[-8:]))
    else:
        entry["status"] = "ok"
    if entry["status"] != "ok":
        entry["output_tail"] = list(tail)
    return entry


def run_all(args: argparse.Namespace) -> dict:
    started = time.time()
    deadline = started + args.budget_seconds
    report: dict[str, Any] = {"command": " ".join(["python -m benchmarks.device_check"] + (args.argv or [])),
                              "device": args.device, "quick": args.quick, "budget_seconds": args.budget_seconds,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)), "parts": {}}
    parts = report["parts"]
    scratch = Path(tempfile.mkdtemp(prefix="device_check_"))
    for part in PARTS:
        if part not in args.parts:
            parts[part] = {"status": "skipped", "reason": "not in --parts"}
            continue
        box, least = (fraction * args.budget_seconds for fraction in BOXES[part])
        least, left = max(least, LEAST_SECONDS), deadline - time.time()
        if left < least:
            parts[part] = {"status": "skipped",
                           "reason": f"{left:.0f} s of the budget left, under the {least:.0f} s this part needs at least"}
            say(f"== {part}: skipped ({parts[part]['reason']})")
            continue
        say(f"== {part} (at most {min(box, left):.0f} s; {left:.0f} s of the budget left)")
        entry = parts[part] = launch(part, args, min(box, left), scratch / f"{part}.json")
        say(f"== {part}: {entry['status']} in {entry['seconds']} s" + (f": {entry['error']}" if "error" in entry else ""))
        write_outputs(report, args)  # a run stopped from outside keeps every part before
    if "result" in parts["prompt"]:  # the full-size model's, measured in the full-size part's process
        full = parts["full"].get("result", {})
        parts["prompt"]["result"]["full"] = full.pop("prompt", {"skipped": "the full-size part did not get to it"})
    report["wall_s"] = round(time.time() - started, 1)
    report["ok"] = all(p["status"] in ("ok", "skipped") for p in parts.values()) and \
        parts["parity"].get("result", {}).get("ok", True)
    write_outputs(report, args)
    return report


def write_outputs(report: dict, args: argparse.Namespace) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    Path(args.markdown).write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda, cpu or mps (default: cuda if there is one, else cpu)")
    p.add_argument("--quick", action="store_true",
                   help="small: the tiny preset for parity, few frames, short prompts, a tiny stand-in for the 11B")
    p.add_argument("--budget-seconds", type=float, default=480.0,
                   help="the global deadline (default 8 minutes): a part that no longer fits is skipped")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    p.add_argument("--json", default=None, help="default: $OUT/device_check.json if OUT is set, else device_check.json")
    p.add_argument("--markdown", default=None, help="default: the JSON's path with .md")
    p.add_argument("--compile-backend", default=None, choices=("inductor", "aot_eager", "eager"),
                   help="of the compiled parity variant (default inductor; eager, traced only, with --quick on a cpu)")
    p.add_argument("--full-dtype", default=None, choices=("bfloat16", "faithful", "float32"),
                   help="the full-size model's mode (default bfloat16, the fast mode: the int4pack kernel; "
                        "float32 with --quick on a cpu, whose bf16 ops are slow)")
    p.add_argument("--seed", type=int, default=0, help="of the generated models")
    p.add_argument("--part", default=None, choices=PARTS, help=argparse.SUPPRESS)  # in a part's process
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    small_cpu = args.quick and args.device == "cpu"
    args.compile_backend = args.compile_backend or ("eager" if small_cpu else "inductor")
    args.full_dtype = args.full_dtype or ("float32" if small_cpu else "bfloat16")
    if args.part:
        return run_part(args)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    out = os.environ.get("OUT")
    args.json = args.json or str(Path(out) / "device_check.json" if out else Path("device_check.json"))
    args.markdown = args.markdown or str(Path(args.json).with_suffix(".md"))
    report = run_all(args)
    say(f"wrote {args.json} and {args.markdown} ({report['wall_s']} s); "
        + ("every part that ran passed" if report["ok"] else "NOT everything passed: see the parts above"))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
