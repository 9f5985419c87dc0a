"""The realtime server as a Ray Serve application: each replica loads the model once and serves
:func:`~nvchat_torch.server.app.create_app`'s app; Serve's proxy gives each WebSocket to a replica, an
open call counting as one ongoing request there for its whole life. ``python -m nvchat_torch.server
--replicas N`` deploys it; ``serve run nvchat_torch.server.ray_serve:app_builder model=... replicas=2``
and Serve config files use :func:`app_builder`. The design, the knobs and what Ray adds to a frame are
in docs/server.md, "Many GPUs"."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .settings import ServerSettings, default_threads

__all__ = ["Deployment", "VoiceChatReplica", "SessionBoard", "RoomRouter", "application", "app_builder",
           "deploy", "end_board", "check_cluster", "REPORT_SECONDS"]

log = logging.getLogger("nvchat_torch.server")

REPORT_SECONDS = 0.5  # how often a replica tells the board its sessions
STALE_SECONDS = 3.0  # a replica silent this long is gone (died, or being replaced)


@dataclass(frozen=True)
class Deployment:
    """How the replicas are placed and scaled."""

    replicas: int = 1  # fixed count (ignored with autoscale)
    gpus_per_replica: float = 0.0  # each replica's GPUs (Ray places it where they are free)
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, by ongoing calls; None: fixed
    target_fraction: float = 0.75  # autoscaling aims at this fraction of max_sessions ongoing per replica
    # How long a replica being stopped (downscaling, an update) keeps its open calls: then they close.
    graceful_shutdown_s: float = 600.0
    app_name: str = "nvchat"
    extra_actor_options: Mapping[str, Any] = field(default_factory=dict)  # e.g. num_cpus, resources


@ray.remote(num_cpus=0)
class SessionBoard:
    """Each replica's sessions and room as it last reported them, so that ``/health`` through the proxy
    reports the deployment without taking a call's slot on every replica."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, state: dict) -> None:
        self.reports[replica] = (time.monotonic(), state)

    def leave(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def snapshot(self) -> dict:
        now = time.monotonic()
        self.reports = {k: v for k, v in self.reports.items() if now - v[0] < STALE_SECONDS}
        live = {k: state for k, (_, state) in sorted(self.reports.items())}
        return {"replicas": len(live), "sessions": sum(s["active_sessions"] for s in live.values()),
                "max_sessions": sum(s["max_sessions"] for s in live.values()),
                "room": sum(s["room"] for s in live.values()), "per_replica": live}


class RoomRouter(FIFOMixin, RequestRouter):
    """Serve's request router for this deployment: a call goes to the replica with the fewest open calls
    of all the replicas. Serve's default compares two picked at random, so with three or more it can
    pick two full ones while a third has room, and the call is refused. A call is long and a handshake
    is rare, so asking every replica is cheap; Serve's router keeps each replica's count between asks."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # One rank of every replica: Serve takes the one with the shortest queue that has a free slot.
        return [list(candidate_replicas)] if candidate_replicas else []


def _board(app_name: str) -> Any:
    # Detached: a board owned by a replica would die with it, and the others would go on reporting to a dead
    # actor (a call to one fails only when its result is read). Ended by `python -m nvchat_torch.server`'s
    # Ctrl-C, or with the cluster.
    return SessionBoard.options(name=f"nvchat-sessions-{app_name}", namespace="nvchat", get_if_exists=True,
                                lifetime="detached").remote()


@serve.ingress()
class VoiceChatReplica:
    """One replica: the model loaded once, and the single-process server's app on it."""

    def __init__(self, settings: ServerSettings) -> None:
        import torch

        from ..stream import load_from_args
        self.settings = settings
        torch.set_num_threads(settings.threads or default_threads())
        self.model = load_from_args(settings)
        context = serve.get_replica_context()
        self.app_name, self.replica = context.app_name, context.replica_id.unique_id
        self._stop = threading.Event()

    def __serve_build_asgi_app__(self) -> Any:
        from .app import create_app

        self.served = create_app(self.model, health=self._deployment_health, **self.settings.app_options())
        threading.Thread(target=self._report, name="nvchat-session-board", daemon=True).start()
        return self.served

    def _state(self) -> dict:
        server = self.served.state.realtime
        room = 0 if server.refusal() else server.max_sessions - server.active
        return {"active_sessions": server.active, "max_sessions": server.max_sessions, "room": room,
                "median_step_ms": round(server.scheduler.median_step_s() * 1000, 1), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    def _report(self) -> None:
        while not self._stop.wait(REPORT_SECONDS):
            try:  # looked up each time: a board someone ended is made again
                _board(self.app_name).report.remote(self.replica, self._state())
            except Exception as e:  # noqa: BLE001 - the report is lost; the next one goes
                log.warning("nvchat_torch: could not report this replica's sessions: %s", e)

    async def _deployment_health(self, mine: dict) -> dict:
        try:
            deployment = await asyncio.wait_for(_board(self.app_name).snapshot.remote(), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - this replica still answers; the deployment's view is missing
            deployment = {"error": f"{type(e).__name__}: {e}"}
        return {**mine, "replica": self.replica, "deployment": deployment}

    def __del__(self) -> None:
        self._stop.set()


def application(settings: ServerSettings, deployment: Deployment) -> serve.Application:
    """The Serve application. Each replica admits ``max_sessions`` calls plus one: the app's own guard
    answers that one with HTTP 503 and its JSON reason, so a full deployment refuses at the handshake
    instead of queueing the connection. :class:`RoomRouter` sends a call to a replica with room while
    there is one."""
    actor_options: dict[str, Any] = {"num_gpus": deployment.gpus_per_replica, **deployment.extra_actor_options}
    options: dict[str, Any] = dict(name="VoiceChatReplica", ray_actor_options=actor_options,
                                   max_ongoing_requests=settings.max_sessions + 1, max_queued_requests=4,
                                   graceful_shutdown_timeout_s=deployment.graceful_shutdown_s,
                                   health_check_period_s=2.0, health_check_timeout_s=30.0,
                                   request_router_config=RequestRouterConfig(request_router_class=RoomRouter))
    if deployment.autoscale is None:
        options["num_replicas"] = deployment.replicas
    else:
        low, high = deployment.autoscale
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high, "initial_replicas": low,
            "target_ongoing_requests": max(1.0, deployment.target_fraction * settings.max_sessions),
            "upscale_delay_s": 10.0, "downscale_delay_s": 300.0}
    return serve.deployment(VoiceChatReplica).options(**options).bind(settings)


def app_builder(args: dict[str, str]) -> serve.Application:
    """``serve run nvchat_torch.server.ray_serve:app_builder model=... replicas=2 max_sessions=4
    gpus_per_replica=1 [autoscale=1:4]``, or ``args:`` in a Serve config file (docs/server.md)."""
    known = {f.name for f in dataclasses.fields(ServerSettings)} | {"replicas", "gpus_per_replica", "autoscale"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"nvchat_torch app_builder: unknown argument(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    ints = {"max_sessions", "threads", "warm_prompt_tokens"}
    floats = {"max_buffered_seconds"}
    bools = {"turn_taking", "catch_up"}
    values: dict[str, Any] = {}
    for name, value in args.items():
        if name in ("replicas", "gpus_per_replica", "autoscale"):
            continue
        if name in ints:
            values[name] = int(value)
        elif name in floats:
            values[name] = float(value)
        elif name in bools:
            values[name] = str(value).lower() in ("1", "true", "on", "yes")
        elif name == "allow_origins":
            values[name] = tuple(o for o in str(value).split(",") if o)
        else:
            values[name] = value
    autoscale = parse_autoscale(args["autoscale"]) if "autoscale" in args else None
    return application(ServerSettings(**values), Deployment(replicas=int(args.get("replicas", 1)),
                                                              gpus_per_replica=float(args.get("gpus_per_replica", 0)),
                                                              autoscale=autoscale))


def parse_autoscale(text: str) -> tuple[int, int]:
    """``MIN:MAX`` replicas, 1 <= MIN <= MAX."""
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--autoscale takes MIN:MAX replicas, e.g. 1:4, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"--autoscale: MIN must be at least 1 and at most MAX, got {text!r}")
    return low, high


def _reachable(address: str, timeout: float = 5.0) -> str | None:
    """None if a Ray head answers at ``address`` (``host:port``, ``ray://host:port``), else why not."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return f"--ray-address takes HOST:PORT (or ray://HOST:PORT, or auto), got {address!r}"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return f"no Ray cluster answers at {address} within {timeout:.0f} s ({e})"


def check_cluster(deployment: Deployment) -> str | None:
    """Why the connected cluster cannot place the deployment, or None."""
    replicas = deployment.autoscale[0] if deployment.autoscale else deployment.replicas
    if replicas < 1:
        return f"--replicas must be at least 1, got {replicas}"
    if deployment.gpus_per_replica < 0:
        return f"--gpus-per-replica must be at least 0, got {deployment.gpus_per_replica}"
    gpus = ray.cluster_resources().get("GPU", 0.0)
    if deployment.gpus_per_replica > gpus:
        return (f"each replica asks for {deployment.gpus_per_replica:g} GPU(s) but the Ray cluster has {gpus:g}: "
                "lower --gpus-per-replica, or add GPUs to the cluster")
    return None


def connect(address: str | None, *, num_gpus: float | None = None) -> str | None:
    """Join the cluster at ``address`` (None: start a local one, which declares ``num_gpus``), unless this
    process is connected already. None, or why it could not."""
    if ray.is_initialized():
        return None
    if address not in (None, "auto", "local"):
        reason = _reachable(address)
        if reason:
            return reason
    try:
        ray.init(address=None if address == "local" else address, num_gpus=num_gpus if address is None else None,
                 namespace="nvchat", log_to_driver=False, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        return f"could not join the Ray cluster at {address}: {e}"
    return None


def end_board(app_name: str = "nvchat") -> None:
    """End the application's session board (it is detached: it outlives the replicas)."""
    try:
        ray.kill(ray.get_actor(f"nvchat-sessions-{app_name}", namespace="nvchat"))
    except ValueError:  # none was made
        pass


def deploy(settings: ServerSettings, deployment: Deployment, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Deploy on the connected cluster, its proxy on ``host:port``; returns the URL. Raises ValueError where
    the cluster cannot place it."""
    reason = check_cluster(deployment)
    if reason:
        raise ValueError(reason)
    # No request_timeout_s: Serve's HTTP timeout also cuts WebSockets (docs/server.md, "Many GPUs").
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(settings, deployment), name=deployment.app_name, route_prefix="/")
    return f"http://{host}:{port}/"
