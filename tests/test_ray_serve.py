"""The realtime server on Ray Serve (nvchat_torch.server.ray_serve), on loopback with a local Ray instance
that declares 3 logical GPUs: 3 replicas of 1 session each on the tiny model carry 3 calls at once (each
call finds the replica with room, though Serve's default router would often pick two full ones), a 4th
is refused with HTTP 503 and the server's JSON reason at the handshake, /health through the proxy reports
the deployment, and a killed replica's call closes while the others go on, until Ray has replaced it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import ray
import websockets
from ray import serve

from nvchat_torch.server.ray_serve import Deployment, deploy
from nvchat_torch.server.settings import ServerSettings

FRAME = 1280
SESSIONS = 1  # per replica
REPLICAS = 3  # with 3, Serve's default router (two replicas at random) would refuse a call a third could take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def proxy():
    ray.init(num_cpus=4, num_gpus=REPLICAS, include_dashboard=False, namespace="nvchat", log_to_driver=False)
    port = free_port()
    try:
        deploy(ServerSettings(max_sessions=SESSIONS, threads=1, warm_prompt_tokens=0, turn_taking=False),
               Deployment(replicas=REPLICAS, gpus_per_replica=1, extra_actor_options={"num_cpus": 1}), "127.0.0.1", port)
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {seconds:.0f} s (last: {got})")


async def open_call(port: int):
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None, open_timeout=20)
    created = json.loads(await asyncio.wait_for(ws.recv(), 20))
    assert created["type"] == "session.created", created
    await ws.send(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "nvchat": {"listening_audio": True, "turn_taking": False}}}))
    return ws


async def stream(ws, seconds: float) -> dict:
    """Send ``seconds`` of audio in real time and count the audio deltas and their longest gap."""
    pcm = (np.sin(np.arange(int(seconds * 16000)) / 9.0) * 3000).astype(np.int16)
    got = {"deltas": 0, "gap": 0.0, "closed": False, "code": None}
    last = None

    async def send():
        start = time.monotonic()
        for i, at in enumerate(range(0, len(pcm) - FRAME + 1, FRAME)):
            await asyncio.sleep(max(0.0, start + i * 0.08 - time.monotonic()))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm[at:at + FRAME].tobytes()).decode()}))

    async def receive():
        nonlocal last
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "response.output_audio.delta":
                now = time.monotonic()
                if last is not None:
                    got["gap"] = max(got["gap"], now - last)
                last = now
                got["deltas"] += 1

    receiver = asyncio.create_task(receive())
    try:
        await send()
        await asyncio.sleep(0.5)
    except websockets.ConnectionClosed:
        got["closed"] = True
    receiver.cancel()
    try:
        await receiver
    except (asyncio.CancelledError, websockets.ConnectionClosed):
        got["closed"] = got["closed"] or ws.close_code is not None
    got["code"] = ws.close_code
    return got


async def refused(port: int) -> tuple[int, dict]:
    with pytest.raises(websockets.InvalidStatus) as denied:
        await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", open_timeout=20)
    response = denied.value.response
    return response.status_code, json.loads(response.body)


def test_replicas_carry_a_call_each_refuse_one_more_and_survive_a_killed_replica(proxy):
    port, calls_at_most = proxy, REPLICAS * SESSIONS
    report = wait_for(lambda: (h := health(port))["deployment"].get("replicas") == REPLICAS and h, 90,
                      "the replicas reporting")
    assert report["deployment"]["max_sessions"] == calls_at_most and report["deployment"]["room"] == calls_at_most

    async def scenario():
        # Each call goes where there is room (open_call fails on a refusal): the last one, and then the
        # same call hung up and made again 6 times, finds the one replica left with room. Serve's default
        # router would pick two full replicas a third of the time, so it passes all 7 by chance 6% of runs.
        calls = [await open_call(port) for _ in range(calls_at_most)]
        for _ in range(6):
            await calls.pop().close()
            wait_for(lambda: health(port)["deployment"]["room"] == SESSIONS, 10, "the hung-up call's room reported")
            calls.append(await open_call(port))
        full = wait_for(lambda: health(port)["deployment"]["sessions"] == calls_at_most and health(port), 10,
                        "every session reported")
        assert full["deployment"]["room"] == 0
        assert all(r["active_sessions"] == SESSIONS for r in full["deployment"]["per_replica"].values())
        status, body = await refused(port)  # every replica full: refused before the upgrade, with the reason
        assert status == 503 and body["error"]["code"] == "server_busy", body
        results = await asyncio.gather(*(stream(ws, 2.0) for ws in calls))
        assert all(r["deltas"] >= 10 and not r["closed"] for r in results), results  # 25 frames sent
        # Kill one replica's process: its call closes, the others go on without a long gap.
        os.kill(next(iter(full["deployment"]["per_replica"].values()))["pid"], signal.SIGKILL)
        results = await asyncio.gather(*(stream(ws, 3.0) for ws in calls))
        closed = [r for r in results if r["closed"]]
        going = [r for r in results if not r["closed"]]
        assert len(closed) == SESSIONS and len(going) == calls_at_most - SESSIONS, results
        assert all(r["code"] == 1006 for r in closed), closed  # no close frame: the replica's process is gone
        assert all(r["deltas"] >= 15 and r["gap"] < 1.0 for r in going), going  # 37 frames sent
        for ws in calls:
            await ws.close()
        # Ray replaces the replica: every replica takes a call again (reconnecting clients are served).
        wait_for(lambda: (h := health(port)["deployment"]).get("replicas") == REPLICAS and h["room"] == calls_at_most,
                 90, "the replica replaced")
        again = [await open_call(port) for _ in range(calls_at_most)]
        results = await asyncio.gather(*(stream(ws, 1.5) for ws in again))
        assert all(r["deltas"] >= 8 and not r["closed"] for r in results), results  # 18 frames sent
        for ws in again:
            await ws.close()

    asyncio.run(scenario())


def run_server(*args: str, modules_missing: str = "") -> subprocess.CompletedProcess:
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules_missing.split(",") if m)
            + "from nvchat_torch.server.__main__ import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_the_command_line_says_what_is_wrong_within_seconds():
    start = time.monotonic()
    done = run_server("--replicas", "2", modules_missing="ray,ray.serve")
    assert done.returncode == 2 and "pip install 'nvchat_torch[ray]'" in done.stderr, done.stderr
    done = run_server("--replicas", "0")
    assert done.returncode == 2 and "--replicas must be at least 1, got 0" in done.stderr, done.stderr
    done = run_server("--replicas", "1", "--autoscale", "3:2")
    assert done.returncode == 2 and "--autoscale" in done.stderr, done.stderr
    done = run_server("--replicas", "1", "--ray-address", f"127.0.0.1:{free_port()}")
    assert done.returncode == 2 and "no Ray cluster answers at 127.0.0.1:" in done.stderr, done.stderr
    assert time.monotonic() - start < 60
    start = time.monotonic()
    done = run_server("--replicas", "1", "--gpus-per-replica", "4", "--port", str(free_port()))  # a local Ray: no GPU
    assert done.returncode == 2 and "asks for 4 GPU(s) but the Ray cluster has 0" in done.stderr, done.stderr
    assert time.monotonic() - start < 60


def test_the_application_builder_takes_serve_run_arguments():
    from nvchat_torch.server.ray_serve import app_builder

    app = app_builder({"max_sessions": "2", "replicas": "3", "gpus_per_replica": "1", "turn_taking": "off"})
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3 and deployment.max_ongoing_requests == 3
    assert deployment.ray_actor_options["num_gpus"] == 1
    settings = deployment.init_args[0]
    assert settings.max_sessions == 2 and settings.turn_taking is False
    scaled = app_builder({"autoscale": "1:4", "max_sessions": "4"})._bound_deployment
    assert scaled._deployment_config.autoscaling_config.max_replicas == 4
    with pytest.raises(ValueError, match="unknown argument.*bogus"):
        app_builder({"bogus": "1"})
