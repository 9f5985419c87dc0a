"""Serve NemotronLabs VoiceChat over the OpenAI Realtime protocol (and mlx-vlm's), with a web page.

    python -m nvchat_torch.server                      # the embedded tiny model on 127.0.0.1:8000
    python -m nvchat_torch.server --model weights/NemotronLabs-VoiceChat-11B-4bit --api-key SECRET

Open http://127.0.0.1:8000/ to talk to it, or point an OpenAI Realtime client at ws://HOST:PORT/v1.
"""

from __future__ import annotations

import argparse
import sys

from ..stream import DTYPES, add_compile_argument
from .security import is_loopback, normalize_origin
from .settings import ServerSettings, default_threads

__all__ = ["main", "is_loopback", "default_threads"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hub repo id (default: the embedded tiny random model)")
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: mps > cuda > cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="float32 (every weight upcast) or bfloat16 (the fast mode); default: the faithful mode")
    p.add_argument("--weights", default="auto", choices=("auto", "packed", "dequantized"),
                   help="keep quantized weights packed or expand them")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-sessions", type=int, default=4, help="concurrent conversations sharing the model")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/realtime")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="also accept browser pages from ORIGIN (e.g. https://app.example.com; repeatable); by "
                        "default only the server's own pages and clients that send no Origin are accepted")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key (anyone who can reach it can use the model)")
    p.add_argument("--max-buffer-seconds", type=float, default=None,
                   help="input audio a session may queue beyond what has run (default 30 s); more is refused")
    p.add_argument("--no-catch-up", action="store_true",
                   help="run at most one frame per session per 80 ms tick: a session whose audio arrives late stays "
                        "that late (by default it gets extra steps in the spare time of each tick until it is back "
                        "to real time, docs/server.md)")
    p.add_argument("--warm-prompt-tokens", type=int, default=None, metavar="N",
                   help="while idle, make the prefill track of the default mode (sampling, seed 0) long enough for "
                        "a prompt of N tokens, so the first caller's prompt opens at once (default 640; 0: the "
                        "first session that needs it makes it; docs/server.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the model (default: half of torch's default, at least 1: the "
                        "steps' many small ops contend with the server's own threads; on 2 cores one thread "
                        "steps 2-3x faster than two, docs/server.md)")
    p.add_argument("--turn-taking", default="on", choices=("on", "off"),
                   help="NVIDIA's turn-taking policy for GA sessions (on: its stock values, docs/turn_taking.md; "
                        "off: the raw model decides alone); a session may choose otherwise with nvchat.turn_taking")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_compile_argument(p)
    ray = p.add_argument_group("many GPUs, on Ray Serve (the ray extra; docs/server.md, \"Many GPUs\")")
    ray.add_argument("--replicas", type=int, default=None, metavar="N",
                     help="serve N replicas of the model on Ray Serve, each holding --max-sessions calls; its proxy "
                          "listens on --host:--port")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to join (HOST:PORT, ray://HOST:PORT or auto; default: start a local one)")
    ray.add_argument("--gpus-per-replica", type=float, default=None, metavar="G",
                     help="GPUs each replica asks Ray for (default: 1 with --device cuda, else 0)")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                     help="scale between MIN and MAX replicas by open calls (off by default; docs/server.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_sessions < 1:
        print(f"error: --max-sessions must be at least 1, got {args.max_sessions}", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"error: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.warm_prompt_tokens is not None and args.warm_prompt_tokens < 0:
        print(f"error: --warm-prompt-tokens must be at least 0, got {args.warm_prompt_tokens}", file=sys.stderr)
        return 2
    if args.max_buffer_seconds is not None and not args.max_buffer_seconds > 0:
        print(f"error: --max-buffer-seconds must be positive, got {args.max_buffer_seconds}", file=sys.stderr)
        return 2
    for origin in args.allow_origin:
        try:
            normalize_origin(origin)
        except ValueError as e:
            print(f"error: --allow-origin: {e}", file=sys.stderr)
            return 2
    if not is_loopback(args.host) and not args.api_key and not args.insecure:
        print(f"error: --host {args.host} would let anyone who can reach this machine use the model (and the "
              "microphone page): give --api-key KEY, or --insecure to serve it without one", file=sys.stderr)
        return 2
    if args.replicas is not None or args.autoscale is not None:
        return _serve_on_ray(args)
    try:
        import uvicorn

        from .app import WS_MAX_BYTES, create_app, listen_socket
    except ImportError as e:
        print(f"error: the server needs its extra ({e.name} is missing): pip install 'nvchat_torch[server]'",
              file=sys.stderr)
        return 2
    import nvchat_torch as nv

    from ..stream import load_from_args

    if not is_loopback(args.host):
        print(f"warning: binding {args.host} exposes the server beyond this machine"
              + ("" if args.api_key else "; anyone who can reach it can use it (--insecure)"), file=sys.stderr)
    import torch

    torch.set_num_threads(default_threads() if args.threads is None else args.threads)
    try:
        model = load_from_args(args)
    except (nv.CheckpointError, nv.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model: {model.describe()}", file=sys.stderr)
    app = create_app(model, **ServerSettings.from_args(args).app_options())
    print(f"serving on http://{args.host}:{args.port}/ (realtime: ws://{args.host}:{args.port}/v1/realtime, "
          f"{args.max_sessions} sessions)", file=sys.stderr, flush=True)
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, ws_max_size=WS_MAX_BYTES, log_level=args.log_level)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _serve_on_ray(args: argparse.Namespace) -> int:
    """``--replicas``: deploy on Ray Serve and stay in the foreground until interrupted."""
    if args.replicas is not None and args.replicas < 1:
        print(f"error: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
        return 2
    try:
        from . import ray_serve
    except ImportError as e:
        print(f"error: --replicas needs the ray extra ({e.name} is missing): pip install 'nvchat_torch[ray]'",
              file=sys.stderr)
        return 2
    try:
        autoscale = None if args.autoscale is None else ray_serve.parse_autoscale(args.autoscale)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if (args.device or "").startswith("cuda") else 0.0
    settings = ServerSettings.from_args(args)
    deployment = ray_serve.Deployment(replicas=args.replicas or 1, gpus_per_replica=gpus, autoscale=autoscale)
    reason = ray_serve.connect(args.ray_address)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:
        url = ray_serve.deploy(settings, deployment, args.host, args.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    count = f"{autoscale[0]} to {autoscale[1]}" if autoscale else str(deployment.replicas)
    print(f"serving on {url} (realtime: {url.replace('http', 'ws', 1)}v1/realtime) through Ray Serve: {count} "
          f"replica(s) of {args.max_sessions} sessions; Ctrl-C stops it", file=sys.stderr, flush=True)
    try:
        import threading

        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        from ray import serve

        serve.shutdown()
        ray_serve.end_board(deployment.app_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
