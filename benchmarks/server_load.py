"""The realtime server under load: N clients streaming at real-time pace, and what each of them hears.

    python -m benchmarks.server_load                          # 8 clients, generated deep model, in-process server
    python -m benchmarks.server_load --clients 1 --seconds 10
    python -m benchmarks.server_load --prompt-chars 2000 --stagger 2 --json load.json
    python -m benchmarks.server_load --url ws://127.0.0.1:8000/v1/realtime --pid 12345   # a running server

Without ``--url`` it starts the server in this process (uvicorn in a thread, on a free 127.0.0.1 port,
as ``tests/test_server.py`` does) with the generated model of ``benchmarks.frame_loop`` and
``--max-sessions`` = ``--clients``. Each client connects (``--stagger`` seconds after the previous
one), asks for 16 kHz in and 22.05 kHz out (the model's own rates), sends ``--seconds`` of
``frame_loop.test_signal`` as 80 ms ``input_audio_buffer.append`` events on an absolute real-time
schedule, commits, and reads until the commit's ``response.done``. Per client it reports the gaps
between consecutive ``response.output_audio.delta`` events (p50, p95, max; 80 ms is real time), the
time from its first append to its first audio delta, the 80 ms frames of audio received per wall
second from the first append to the last delta (12.5 is real time), how long after its commit the
commit's ``response.done`` came (how far the output lagged behind the input at the end), and the
batched step's wall time as the server measured it (``nvchat.stats``: mean compute per frame). The
"all" row pools the gaps, takes the largest first-audio, drain and step times and sums the frames/s.
Below the table: the server's RSS (now and peak, from /proc: this process, clients included, or
``--pid`` with ``--url``) and the cores that process and all others kept busy meanwhile, since a
shared machine's other jobs slow the server as much as its own load does.

``--stall SECONDS --stall-at SECONDS [--stall-clients N]`` injects a network stall: the first N
clients (default 1) send nothing for SECONDS from SECONDS into their stream, then send the held
frames at once and go on at real-time pace. Each client's lag is then reported: for every frame, how
long after its real-time send time (first append + 80 ms x index) its audio delta arrived; "usual"
is the median over the frames due before the stall (after the first second), "peak" the largest
after it, and "back in" how long after the stall ended the lag was back within 2 frames of the
usual lag for the rest of the stream (the frames due before the end). Below the table: each
stalled client's largest lag per half second from the stall on, and the server's worst lag as its
``/health`` reported it (polled every 0.25 s; a server without those fields reports none).
``--no-catch-up`` runs the in-process server without catch-up steps (``create_app(catch_up=False)``):
at most one frame per session per 80 ms tick, the server's behaviour before catch-up steps.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import websockets

import nvchat_torch as nv
from benchmarks.common import FRAME, generated_checkpoint, test_signal
from nvchat_torch.server.app import create_app
from nvchat_torch.server.background import serve_in_thread

PACE = 0.08  # seconds per 1280-sample frame at 16 kHz
OUT_FRAME = 1764  # samples per frame at 22.05 kHz
FILLER = "You are a helpful assistant who answers briefly and kindly. "


def rss_mb(pid: int | None) -> dict | None:
    """VmRSS (now) and VmHWM (peak) of a Linux process (None: this one, 0: none), MiB; None elsewhere."""
    if pid == 0:
        return None
    try:
        text = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return None
    kb = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()
          if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_mb": kb.get("VmRSS", 0) / 1024, "peak_mb": kb.get("VmHWM", 0) / 1024}


def cpu_seconds(pid: int | None) -> tuple[float, float] | None:
    """CPU seconds the whole machine has been busy, and those of the process; None off Linux."""
    if pid == 0:
        return None
    try:
        busy = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
        own = Path(f"/proc/{pid or 'self'}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(busy) - busy[3] - busy[4]) / tick, (int(own[0]) + int(own[1])) / tick


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


async def client(index: int, url: str, pcm: np.ndarray, args, deadline: float) -> dict:
    """One GA client: session.update, real-time appends, commit, read to the commit's response.done."""
    await asyncio.sleep(index * args.stagger)
    session = {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                             "output": {"format": {"type": "audio/pcm", "rate": 22050}}},
               # the whole timeline, every 80 ms heard: listening audio is otherwise held back (docs/server.md)
               "nvchat": {"seed": 0 if args.shared_seed else index, "stats": True, "turn_taking": False,
                          "listening_audio": True}}
    if args.prompt_chars:
        session["instructions"] = (FILLER * (args.prompt_chars // len(FILLER) + 1))[:args.prompt_chars]
    r = {"client": index, "arrivals": [], "samples": 0, "deltas_at": [], "errors": [], "rtf": [], "start": None,
         "commit": None, "done": None}
    remaining = lambda: max(0.1, deadline - time.monotonic())
    try:
        async with websockets.connect(url, max_size=None, open_timeout=remaining()) as ws:
            created = json.loads(await asyncio.wait_for(ws.recv(), remaining()))
            if created["type"] != "session.created":  # server_busy: more clients than --max-sessions
                raise RuntimeError(created.get("error", {}).get("code") or created["type"])
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            updated = json.loads(await asyncio.wait_for(ws.recv(), remaining()))
            if updated["type"] != "session.updated":
                raise RuntimeError(updated.get("error", {}).get("code") or updated["type"])

            async def send():
                r["start"] = start = time.monotonic()
                for i, at in enumerate(range(0, len(pcm) - FRAME + 1, FRAME)):
                    await asyncio.sleep(max(0.0, start + send_at(i, index, args) - time.monotonic()))
                    await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm[at:at + FRAME].tobytes()).decode()}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                r["commit"] = time.monotonic()

            async def receive():
                committed = False
                while True:
                    event = json.loads(await ws.recv())
                    kind = event["type"]
                    if kind == "response.output_audio.delta":
                        r["arrivals"].append(time.monotonic())
                        r["samples"] += len(base64.b64decode(event["delta"])) // 2
                        r["deltas_at"].append((r["arrivals"][-1], r["samples"]))
                    elif kind == "nvchat.stats":
                        r["rtf"].append(event["realtime_factor"])
                    elif kind == "error":
                        r["errors"].append(event["error"].get("code"))
                    elif kind == "input_audio_buffer.committed":
                        committed = True
                    elif kind == "response.done" and committed:
                        r["done"] = time.monotonic()
                        return

            await asyncio.wait_for(asyncio.gather(send(), receive()), remaining())
    except (asyncio.TimeoutError, OSError, websockets.WebSocketException, RuntimeError) as e:
        r["errors"].append(f"{type(e).__name__}: {e}"[:200])
    return r


def send_at(i: int, index: int, args) -> float:
    """When frame ``i`` of client ``index`` is sent, seconds after its first: on the real-time schedule,
    but a stalling client's frames due during the stall all go at its end."""
    due = i * PACE
    if index < args.stall_clients and args.stall_at <= due < args.stall_at + args.stall:
        return args.stall_at + args.stall
    return due


def lags(r: dict) -> np.ndarray:
    """``[frames, 2]``: each heard frame's due time (seconds after the first append) and its lag, how
    long after that its audio delta arrived."""
    rows, heard = [], 0
    for arrival, samples in r["deltas_at"]:
        now_heard = samples // OUT_FRAME
        rows += [(k * PACE, arrival - r["start"] - k * PACE) for k in range(heard, now_heard)]
        heard = now_heard
    return np.array(rows).reshape(-1, 2)


def lag_summary(r: dict, args) -> dict:
    """Usual lag, peak after the stall and the time until the lag stayed within 2 frames of usual."""
    table = lags(r)
    if not len(table) or r["start"] is None:
        return {"usual_lag_ms": float("nan"), "peak_lag_ms": float("nan"), "back_in_s": float("nan"), "series": []}
    due, lag = table[:, 0], table[:, 1]
    stall_end = args.stall_at + args.stall if args.stall else 0.0
    before = lag[(due >= min(1.0, args.stall_at / 2)) & (due < args.stall_at)] if args.stall else lag[due >= 1.0]
    usual = float(np.median(before)) if len(before) else float("nan")
    after = due >= (args.stall_at if args.stall else 0.0)
    peak = float(lag[after].max()) if after.any() else float("nan")
    back_in = float("nan")
    if args.stall and after.any():
        over = np.nonzero(after & (lag > usual + 2 * PACE))[0]
        # the first frame after the last one too late: the lag stays back from its arrival on
        first_ok = over[-1] + 1 if len(over) else np.nonzero(after)[0][0]
        if first_ok < len(lag):
            back_in = max(0.0, float(due[first_ok] + lag[first_ok] - stall_end))
    arrivals = due + lag
    series = []
    if args.stall:  # the largest lag of the deltas that arrived in each half second from the stall on
        for at in np.arange(args.stall_at, stall_end + 4.0, 0.5):
            inside = (arrivals >= at) & (arrivals < at + 0.5)
            series.append(round(float(lag[inside].max()) * 1000) if inside.any() else None)
    return {"usual_lag_ms": usual * 1000, "peak_lag_ms": peak * 1000, "back_in_s": back_in, "series": series}


def summarize(r: dict, args) -> dict:
    t = np.array(r["arrivals"])
    gaps = np.diff(t) * 1000
    span = (t[-1] - r["start"]) if len(t) and r["start"] else 0.0
    fps = r["samples"] / OUT_FRAME / span if span > 0 else 0.0
    pct = lambda q: float(np.percentile(gaps, q)) if len(gaps) else float("nan")
    return {"client": r["client"], "deltas": len(t), "gaps_ms": gaps.tolist(), "gap_p50_ms": pct(50),
            "gap_p95_ms": pct(95), "gap_max_ms": float(gaps.max()) if len(gaps) else float("nan"),
            "first_audio_s": float(t[0] - r["start"]) if len(t) else float("nan"), "frames_per_s": fps,
            "drain_s": (r["done"] - r["commit"]) if r["done"] and r["commit"] else float("nan"),
            "step_ms": float(np.mean(r["rtf"]) * PACE * 1000) if r["rtf"] else float("nan"),
            "errors": r["errors"], "stalled": r["client"] < args.stall_clients and args.stall > 0,
            **lag_summary(r, args)}


def _max(values) -> float:
    values = [v for v in values if not np.isnan(v)]
    return max(values) if values else float("nan")


def back_in(r: dict) -> str:
    if not np.isnan(r["back_in_s"]):
        return f"{r['back_in_s']:.2f}"
    return "never" if r["stalled"] else "-"


def table(rows: list[dict]) -> str:
    gaps = np.concatenate([np.array(r["gaps_ms"]) for r in rows] + [np.zeros(0)])
    pct = lambda q: float(np.percentile(gaps, q)) if len(gaps) else float("nan")
    total = {"client": "all", "deltas": sum(r["deltas"] for r in rows), "gap_p50_ms": pct(50),
             "gap_p95_ms": pct(95), "gap_max_ms": float(gaps.max()) if len(gaps) else float("nan"),
             "first_audio_s": _max(r["first_audio_s"] for r in rows),
             "frames_per_s": sum(r["frames_per_s"] for r in rows), "drain_s": _max(r["drain_s"] for r in rows),
             "step_ms": _max(r["step_ms"] for r in rows), "errors": [e for r in rows for e in r["errors"]]}
    total.update(usual_lag_ms=_max(r["usual_lag_ms"] for r in rows), peak_lag_ms=_max(r["peak_lag_ms"] for r in rows),
                 back_in_s=_max(r["back_in_s"] for r in rows), stalled=False)
    head = "client | deltas | gap p50 ms | gap p95 ms | gap max ms | first audio s | frames/s | drain s | step ms"
    head += " | usual lag ms | peak lag ms | back in s | errors"
    lines = [f"| {head} |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows + [total]:
        errors = f"{len(r['errors'])}: {', '.join(sorted(set(map(str, r['errors']))))[:60]}" if r["errors"] else ""
        name = f"{r['client']} (stalled)" if r["stalled"] else r["client"]
        lines.append(f"| {name} | {r['deltas']} | {r['gap_p50_ms']:.0f} | {r['gap_p95_ms']:.0f} | "
                     f"{r['gap_max_ms']:.0f} | {r['first_audio_s']:.2f} | {r['frames_per_s']:.1f} | "
                     f"{r['drain_s']:.1f} | {r['step_ms']:.0f} | {r['usual_lag_ms']:.0f} | {r['peak_lag_ms']:.0f} | "
                     f"{back_in(r)} | {errors} |")
    return "\n".join(lines)


def health_lags(url: str) -> float | None:
    """The worst lag ``/health`` reports now, ms (None: a server without it, or no answer)."""
    base = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).split("/v1", 1)[0]
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as answer:
            return json.loads(answer.read()).get("worst_lag_ms")
    except (OSError, ValueError):
        return None


async def run_clients(url: str, args, pid: int | None) -> tuple[list[dict], dict | None]:
    pcm = np.round(np.clip(test_signal(args.seconds), -1, 1) * 32767).astype("<i2")
    deadline = time.monotonic() + args.timeout
    peak = {"rss_mb": 0.0, "peak_mb": 0.0}

    async def watch():  # RSS now, every half second (VmHWM is the kernel's own peak)
        while True:
            now = rss_mb(pid)
            if now is None:
                return
            peak["rss_mb"] = max(peak["rss_mb"], now["rss_mb"])
            peak["peak_mb"] = now["peak_mb"]
            await asyncio.sleep(0.5)

    health: list[tuple[float, float]] = []  # (seconds from the start, the worst lag /health reported, ms)

    async def poll():
        while True:
            worst = await asyncio.to_thread(health_lags, url)
            if worst is None and not health:
                return  # a server that does not report lags
            if worst is not None:
                health.append((time.monotonic() - t0, worst))
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    poller = asyncio.create_task(poll()) if args.stall else None
    results = await asyncio.gather(*(client(i, url, pcm, args, deadline) for i in range(args.clients)))
    cpu1, wall = cpu_seconds(pid), time.monotonic() - t0
    watcher.cancel()
    if poller is not None:
        poller.cancel()
    end = rss_mb(pid)
    process = None if end is None else {"rss_end_mb": end["rss_mb"], "rss_max_sampled_mb": peak["rss_mb"],
                                        "rss_peak_mb": end["peak_mb"]}
    if process and cpu0 and cpu1:  # cores busy on average: the server's process, and everything else
        process["cpu_cores_process"] = (cpu1[1] - cpu0[1]) / wall
        process["cpu_cores_others"] = (cpu1[0] - cpu0[0] - (cpu1[1] - cpu0[1])) / wall
    if health:
        process = (process or {}) | {"health_worst_lag_ms": health}
    return [summarize(r, args) for r in results], process


@contextlib.contextmanager
def through_ray(args):
    """The same server as Ray Serve replicas on a local Ray instance; yields the proxy's realtime URL."""
    import socket

    import ray
    from ray import serve

    from nvchat_torch.server.ray_serve import Deployment, deploy
    from nvchat_torch.server.settings import ServerSettings

    path = Path(args.model) if args.model else generated_checkpoint(args.preset, 4)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        deploy(ServerSettings(model=str(path), device="cpu", threads=args.threads,
                               max_sessions=args.max_sessions or args.clients),
               Deployment(replicas=args.ray_replicas), "127.0.0.1", port)
        yield f"ws://127.0.0.1:{port}/v1/realtime"
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.server_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0, help="audio each client streams")
    p.add_argument("--stagger", type=float, default=0.5, help="seconds between client joins")
    p.add_argument("--prompt-chars", type=int, default=0,
                   help="a system prompt of this many characters (0: the model's default)")
    p.add_argument("--url", default=None,
                   help="a running server, ws://127.0.0.1:PORT/v1/realtime (default: start one in this process)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process, for its RSS")
    p.add_argument("--model", default=None, help="checkpoint folder (default: generated --preset, 4-bit)")
    p.add_argument("--preset", default="deep", choices=("tiny", "deep"))
    p.add_argument("--max-sessions", type=int, default=None, help="of the in-process server (default: --clients)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of the in-process server (default: the server's, half of torch's)")
    p.add_argument("--shared-seed", action="store_true",
                   help="every client seed 0: with --prompt-chars, the first client's prompt is prefilled (cold) "
                        "and the others' come from the server's prompt cache; 'first audio s' is then the time to "
                        "the first heard frame, cold and cached")
    p.add_argument("--max-step-fraction", type=float, default=0.9,
                   help="the in-process server refuses sessions (HTTP 503) while its median step is this "
                        "fraction of the frame or more (0: never, to measure an overloaded server)")
    p.add_argument("--stall", type=float, default=0.0, metavar="SECONDS",
                   help="a network stall: the stalling clients send nothing for this long, then the held frames "
                        "at once (0: none)")
    p.add_argument("--stall-at", type=float, default=4.0, metavar="SECONDS",
                   help="when the stall starts, seconds into each stalling client's stream")
    p.add_argument("--stall-clients", type=int, default=1, metavar="N", help="how many clients stall (the first N)")
    p.add_argument("--no-catch-up", action="store_true",
                   help="the in-process server runs no catch-up steps: a late frame waits for its own tick")
    p.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                   help="serve through Ray Serve instead: N replicas of the same model on a local Ray instance, "
                        "behind Serve's proxy (the ray extra; docs/server.md, \"Many GPUs\")")
    p.add_argument("--timeout", type=float, default=600.0, help="overall limit, seconds; clients past it stop")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.stall < 0 or (args.stall and not 0 < args.stall_at < args.seconds):
        p.error("--stall must be positive and --stall-at inside --seconds")
    if args.no_catch_up and args.url:
        p.error("--no-catch-up is an option of the in-process server; a running one takes it on its command line")
    from nvchat_torch.server.settings import default_threads

    torch.set_num_threads(args.threads or default_threads())
    in_process, cache, scheduler = not args.url, None, None
    with contextlib.ExitStack() as stack:
        if args.url:
            url, pid, model_name = args.url, args.pid or 0, args.url  # 0: no process to measure
        elif args.ray_replicas:
            url, model_name = stack.enter_context(through_ray(args)), f"Ray Serve, {args.ray_replicas} replica(s)"
            pid, in_process = 0, False
        else:
            path = Path(args.model) if args.model else generated_checkpoint(args.preset, 4)
            model = nv.load_model(path, device="cpu")
            extra = {"catch_up": False} if args.no_catch_up else {}
            app = create_app(model, max_sessions=args.max_sessions or args.clients,
                             max_step_fraction=args.max_step_fraction, **extra)
            scheduler = app.state.realtime.scheduler
            cache = scheduler.engine.prompt_cache
            url = f"ws://{stack.enter_context(serve_in_thread(app))}/v1/realtime"
            pid, model_name = None, model.describe()
        rows, process = asyncio.run(run_clients(url, args, pid))
    machine = (f"{platform.machine()} {cpu_model()}, {os.cpu_count()} cpus, torch {torch.__version__} "
               f"({torch.get_num_threads()} threads), Python {platform.python_version()}")
    print(f"machine: {machine}")
    print(f"server:  {model_name}")
    print(f"load:    {args.clients} clients x {args.seconds:g} s at real-time pace, {args.stagger:g} s apart, "
          f"prompt {args.prompt_chars or 'default'} chars; 80 ms gaps and 12.5 frames/s are real time")
    if args.stall:
        print(f"stall:   client{'s' if args.stall_clients > 1 else ''} 0-{args.stall_clients - 1} sent nothing from "
              f"{args.stall_at:g} s to {args.stall_at + args.stall:g} s into their stream, then the held frames at "
              f"once; catch-up steps {'off' if args.no_catch_up else 'on' if in_process else 'as the server runs'}")
    print(table(rows))
    usual = [r["usual_lag_ms"] for r in rows if r["usual_lag_ms"] == r["usual_lag_ms"]]
    if usual:
        # With clients spread over the tick (--stagger 0.01: 8 clients, 10 ms apart), the mean leaves out
        # where each client's sends fall against the server's 80 ms tick.
        print(f"clients' usual lag: median {float(np.median(usual)):.1f} ms, mean {float(np.mean(usual)):.1f} ms")
    for r in rows:
        if r["stalled"]:
            series = " ".join("-" if v is None else str(v) for v in r["series"])
            print(f"client {r['client']}: largest lag (ms) per half second from {args.stall_at:g} s: {series}")
    if process and "health_worst_lag_ms" in process:
        worst = max(v for _, v in process["health_worst_lag_ms"])
        print(f"/health: worst lag {worst:.0f} ms at most ({len(process['health_worst_lag_ms'])} polls)")
    if scheduler is not None:
        print(f"steps: {scheduler.engine.steps} batched passes, {scheduler.catch_up_steps} of them catch-up steps")
    if in_process and cache is not None:
        print(f"prompt cache: {cache.hits} hits, {cache.misses} misses, {cache.nbytes / 2**20:.1f} MiB kept")
    if process and "rss_end_mb" in process:
        print(f"server RSS: {process['rss_end_mb']:.0f} MiB at the end, {process['rss_peak_mb']:.0f} MiB peak"
              + (" (this process: server and clients)" if in_process else ""))
        if "cpu_cores_others" in process:
            print(f"cpu: {process['cpu_cores_process']:.2f} cores busy in that process, "
                  f"{process['cpu_cores_others']:.2f} in other processes (of {os.cpu_count()})")
    if args.json:
        steps = None if scheduler is None else {"steps": scheduler.engine.steps, "catch_up": scheduler.catch_up_steps}
        Path(args.json).write_text(json.dumps({"machine": machine, "server": model_name, "args": vars(args),
                                               "clients": rows, "process": process, "steps": steps}, indent=1) + "\n")
    return 1 if any(r["errors"] or not r["deltas"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
