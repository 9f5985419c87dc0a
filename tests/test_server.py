"""The realtime server on loopback, driven by the official ``openai`` SDK and by raw WebSockets
speaking mlx-vlm's dialect; what clients receive is checked against ``StreamingSession``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import uvicorn
import websockets
from openai import AsyncOpenAI

import nvchat_torch as nv
from nvchat_torch.audio_io import StreamResampler, pcm16_decode, pcm16_encode, resample
from nvchat_torch.server.app import MAX_MESSAGE_BYTES, create_app
from nvchat_torch.server.background import serve_in_thread

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "question.wav"
TIMEOUT = 120  # seconds any one exchange may take; every wait below is bounded by it


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def question() -> np.ndarray:
    pcm, sr = sf.read(EXAMPLE, dtype="int16")
    assert sr == 16000
    return pcm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model, **kwargs):
    """The app on uvicorn in a thread, on a free loopback port; yields ``(address, app)``."""
    app = create_app(model, **kwargs)
    with serve_in_thread(app) as address:  # listening as python -m nvchat_torch.server does
        yield address, app


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")


def reference(model, pcm: np.ndarray, **options):
    """What StreamingSession emits for the pcm16 audio (all of it, the partial frame zero-padded)."""
    session = model.create_streaming_session(nv.StreamingOptions(**options))
    events = session.push_audio(pcm.astype(np.float32) / 32768.0, 16000) + session.flush(pad_partial=True)
    audio = np.concatenate([e.samples for e in events if e.kind == "audio"])
    return session, events, audio


def deltas(events, kind: str = "assistant_text_delta", released: bool = True) -> str:
    """The deltas joined: the channel's decode. ``released=False`` leaves out what the session's end
    released (text held back at the last frame: a character still incomplete), which a GA session,
    going on after its commit, has not sent."""
    return "".join(e.delta for e in events if e.kind == kind and (released or e.token_id is not None
                                                                  or kind == "user_transcript_delta"))


GA_16K_22K = {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                            "output": {"format": {"type": "audio/pcm", "rate": 22050}}}}
# The raw model (as StreamingSession runs by default) and every frame's audio, the listening included:
# what the exact comparisons with StreamingSession need (docs/server.md, "Turns").
RAW = {"turn_taking": False, "listening_audio": True}


async def sdk_conversation(address: str, pcm: np.ndarray, session: dict, chunk: int = 3200) -> dict:
    """Stream ``pcm`` with the openai SDK, commit, and collect everything up to the commit's response.done."""
    client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://{address}/v1")
    got = {"text": "", "audio": b"", "transcript": "", "completed": [], "types": [], "responses": []}
    async with client.realtime.connect(model="nvchat") as conn:
        await conn.session.update(session=session)
        for i in range(0, len(pcm), chunk):
            await conn.input_audio_buffer.append(audio=b64(pcm[i:i + chunk]))
        await conn.input_audio_buffer.commit()
        committed = False
        while True:
            event = await asyncio.wait_for(conn.recv(), TIMEOUT)
            got["types"].append(event.type)
            if event.type == "error":
                raise AssertionError(f"server error: {event.error}")
            if event.type == "session.updated":
                got["session"] = event.session
            elif event.type == "response.output_audio_transcript.delta":
                got["text"] += event.delta
            elif event.type == "response.output_audio.delta":
                got["audio"] += base64.b64decode(event.delta)
            elif event.type == "conversation.item.input_audio_transcription.delta":
                got["transcript"] += event.delta
            elif event.type == "conversation.item.input_audio_transcription.completed":
                got["completed"].append(event.transcript)
            elif event.type == "input_audio_buffer.committed":
                committed = True
            elif event.type == "response.done":
                got["responses"].append(event.response)
                if committed:
                    return got


def assert_same_pcm(got: bytes, samples: np.ndarray) -> None:
    """``got`` is pcm16 = round(clip(x, -1, 1) * 32767) of ``samples``, up to one step: the server's
    batched engine gives a session's samples within float rounding (1e-5) of the session alone."""
    want = np.frombuffer(pcm16_encode(samples), np.int16).astype(np.int32)
    have = np.frombuffer(got, np.int16).astype(np.int32)
    assert have.shape == want.shape and np.abs(have - want).max() <= 1


def test_openai_sdk_gets_what_the_session_emits(model, question):
    """Deterministic, 16 kHz in and 22.05 kHz out: text, transcript and audio equal StreamingSession's."""
    prompt = "you are a helpful assistant"
    session = {**GA_16K_22K, "instructions": prompt, "nvchat": {"deterministic": True, "seed": 0, **RAW}}
    with serve(model) as (address, _):
        got = asyncio.run(sdk_conversation(address, question, session))
    ref, events, audio = reference(model, question, system_prompt=prompt, deterministic=True, seed=0)
    assert got["session"].audio.input.format.rate == 16000 and got["session"].audio.output.format.rate == 22050
    assert got["text"] == deltas(events, released=False) and ref.text
    assert got["transcript"] == deltas(events, "user_transcript_delta") and ref.user_transcript
    assert "".join(got["completed"]) == got["transcript"]
    assert len(got["audio"]) == 2 * len(audio) == 2 * ref.frame_index * 1764
    assert_same_pcm(got["audio"], audio)
    # each response's transcript is the text between its utterance's start and its end
    assert "".join(r.output[0].content[0].transcript for r in got["responses"]) == got["text"]
    assert all(r.status == "completed" for r in got["responses"])
    order = got["types"]
    for name in ("response.created", "response.output_item.added", "response.content_part.added"):
        assert order.index(name) < order.index("response.output_audio.delta")
    for name in ("response.output_audio.done", "response.output_audio_transcript.done",
                 "response.content_part.done", "response.output_item.done"):
        assert order.index(name) < order.index("response.done")


def test_default_format_is_24k_both_ways_through_soxr(model, question):
    """GA defaults: 24 kHz pcm16 in (resampled to 16 kHz) and out (22.05 kHz resampled to 24 kHz)."""
    wave16 = question.astype(np.float32) / 32768.0
    pcm24 = np.frombuffer(pcm16_encode(resample(wave16, 16000, 24000)), dtype="<i2")
    session = {"type": "realtime", "nvchat": {"deterministic": True, **RAW}}
    with serve(model) as (address, _):
        got = asyncio.run(sdk_conversation(address, pcm24, session, chunk=1920))
    assert got["session"].audio.input.format.rate == 24000 and got["session"].audio.output.format.rate == 24000
    # the server's input is the 24 kHz audio resampled back to 16 kHz, as one soxr stream
    wave = StreamResampler(24000, 16000)(pcm16_decode(pcm24.tobytes()), last=True)
    ref, _, audio = reference(model, np.round(wave * 32768).clip(-32768, 32767).astype(np.int16), deterministic=True)
    received = pcm16_decode(got["audio"])
    expected = StreamResampler(22050, 24000)(audio, last=True)
    assert abs(len(received) - len(audio) * 24000 / 22050) <= 1 and len(received) == len(expected)
    assert got["transcript"] and got["text"]


async def mlx_conversation(address: str, pcm: np.ndarray, config: dict) -> tuple[list[dict], int]:
    """mlx-vlm's microphone client's sequence: session.update, appends with sample_rate, commit."""
    async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        assert created["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "session": config}))
        updated = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))  # the very next message
        assert updated["type"] == "session.updated", updated
        session = updated["session"]
        assert session["input_audio_format"]["sample_rate"] == 16000
        assert session["output_audio_format"]["sample_rate"] == 22050 and session["frame_samples"] == 1280
        for i in range(0, len(pcm), 1280):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm[i:i + 1280]),
                                      "sample_rate": 16000}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "pad_partial": True}))
        events = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:  # the server ends the session after response.done, as mlx-vlm's does
                events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
        return events, closed.value.rcvd.code


def test_mlx_vlm_dialect(model, question):
    config = {"model": "mlx-community/NemotronLabs-VoiceChat-11B-4bit", "system_prompt": "be brief", "seed": 3}
    with serve(model) as (address, _):
        events, code = asyncio.run(mlx_conversation(address, question, config))
    ref, ref_events, audio = reference(model, question, system_prompt="be brief", seed=3)
    assert code == 1000
    kinds = [e["type"] for e in events]
    assert kinds[0] == "input_audio_buffer.committed" or "input_audio_buffer.committed" in kinds
    assert kinds[-1] == "response.done" and kinds.count("response.done") == 1
    text = [e for e in events if e["type"] == "response.text.delta"]
    assert "".join(e["delta"] for e in text) == deltas(ref_events) and text[-1]["text"] == ref.text
    assert [e["token_id"] for e in text] == [e.token_id for e in ref_events if e.kind == "assistant_text_delta"]
    function = [e for e in events if e["type"] == "response.function.delta"]
    assert "".join(e["delta"] for e in function) == deltas(ref_events, "function_delta")
    user = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert user and user[-1]["transcript"] == ref.user_transcript
    chunks = [e for e in events if e["type"] == "response.audio.delta"]
    assert [c["frame_index"] for c in chunks] == list(range(ref.frame_index))
    assert all(c["sample_rate"] == 22050 and c["format"] == "pcm16" and c["channels"] == 1 for c in chunks)
    assert_same_pcm(b"".join(base64.b64decode(c["delta"]) for c in chunks), audio)
    codes = np.array([c["audio_codes"] for c in chunks])
    assert np.array_equal(codes, np.stack([e.audio_codes for e in ref_events if e.kind == "audio"]))


async def expect_error(ws, code: str) -> dict:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        if event["type"] == "error":
            assert event["error"]["code"] == code, event
            assert event["error"]["message"] and "event_id" in event and "type" in event["error"]
            return event


def test_bad_input_gets_an_error_and_the_connection_survives(model, question):
    async def run(address):
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()  # session.created
            cases = [
                ("{not json", "invalid_json"),
                (json.dumps([1, 2]), "invalid_json"),
                (json.dumps({"type": "conversation.item.frobnicate", "event_id": "client_7"}), "unknown_event_type"),
                (json.dumps({"type": "conversation.item.delete", "item_id": "item_nope"}),
                 "item_delete_invalid_item_id"),
                (json.dumps({"type": "input_audio_buffer.append", "audio": "***"}), "invalid_base64"),
                (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}),
                 "invalid_audio_length"),
                (json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 44100}}}}}), "unsupported_audio_format"),
                (json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {
                    "output": {"format": {"type": "audio/pcmu", "rate": 8000}}}}}), "unsupported_audio_format"),
                (json.dumps({"type": "input_audio_buffer.append",
                             "audio": "A" * (MAX_MESSAGE_BYTES + 4)}), "message_too_large"),
                (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty"),
                (json.dumps({"type": "session.update", "session": {"type": "realtime", "nvchat": {"seed": "x"}}}),
                 "invalid_value"),
            ]
            for message, code in cases:
                await ws.send(message)
                event = await expect_error(ws, code)
                if code == "unknown_event_type":
                    assert event["error"]["event_id"] == "client_7"
            # still usable: a real exchange after all of that
            await ws.send(json.dumps({"type": "session.update", "session": {**GA_16K_22K, "nvchat": RAW}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(question[:6400])}))
            # changed instructions after the start are taken, not applied: the conversation keeps its prompt
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                           "instructions": "changed"}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            events = []
            while "response.done" not in [e["type"] for e in events]:
                events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
            kinds = [e["type"] for e in events]
            assert kinds.count("response.output_audio.delta") == 5 and "error" not in kinds
            updated = [e["session"] for e in events if e["type"] == "session.updated"][-1]
            assert updated["instructions"] == model.config.default_system_prompt
            assert "instructions" in updated["nvchat"]["not_applied"]

    with serve(model) as (address, _):
        asyncio.run(run(address))


class _HookedModel:
    """The model, but every session its engine opens is first handed to ``self.opened(handle)``."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def create_engine(self, max_sessions, profile=False):
        engine = self._model.create_engine(max_sessions, profile)
        open_session = engine.open

        def open(options, **kwargs):
            handle = open_session(options, **kwargs)
            self.opened(handle)
            return handle

        engine.open = open
        return engine


def logit_bias(head, column, strength: float, armed=lambda: True):
    """A forward hook on a vocabulary head adding ``strength`` to its logits' ``column`` (an int, or a
    function of the logits' width) while ``armed()``. Returns the hook's handle."""

    def bias(module, inputs, logits):
        if not armed():
            return logits
        at = column(logits.shape[-1]) if callable(column) else column
        return logits.index_add(-1, torch.tensor([at], device=logits.device),
                                torch.full((*logits.shape[:-1], 1), strength, dtype=logits.dtype, device=logits.device))

    return head.register_forward_hook(bias)


def quiet_function_channel(model, strength: float = 1e4):
    """Make the model's function channel PAD unless forced (a hook on its head's logits): what a trained
    model's is outside its calls. The random one's otherwise opens a call now and then (its start-of-call
    token), which holds the text at PAD and the policy until a random end-of-call token. Returns the
    hook's handle."""
    text_head, function_head = model.vocabulary_heads()
    pad = model.config.pad_token_id
    if function_head is not None:
        return logit_bias(function_head, pad, strength)
    return logit_bias(text_head, lambda width: width // 2 + pad, strength)  # the fused heads: [text | function]


def text_logit_bias(model, column: int, strength: float, armed=lambda: True):
    """:func:`logit_bias` on the text channel: the model's own choice of ``column`` made likelier or
    unlikelier (not forced, so the policy sees it as the model's)."""
    return logit_bias(model.vocabulary_heads()[0], column, strength, armed)  # fused: the text half comes first


class _FailingModel(_HookedModel):
    """Sessions with seed 13 fail on their first frame (their host side raises, as a failing
    detokenizer would)."""

    def opened(self, handle):
        if handle.options.seed == 13:
            def boom(*args, **kwargs):
                raise RuntimeError("injected failure")
            handle._host._frame_events = boom


def test_sessions_run_concurrently_fail_alone_and_the_limit_holds(model, question):
    other = question[::-1].copy()

    async def run(address):
        failing = {**GA_16K_22K, "nvchat": {"seed": 13, **RAW}}

        async def doomed():
            async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "session.update", "session": failing}))
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(question[:2560])}))
                await expect_error(ws, "session_failed")
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    while True:
                        await asyncio.wait_for(ws.recv(), TIMEOUT)
                return closed.value.rcvd.code

        sessions = [{**GA_16K_22K, "nvchat": {"deterministic": True, "seed": s, **RAW}} for s in (0, 1)]
        a, b = await asyncio.gather(sdk_conversation(address, question, sessions[0]),
                                    sdk_conversation(address, other, sessions[1]))
        await wait_idle(address)
        # while two run, a third is turned away before the upgrade (HTTP 503, GA's error as the body)
        async with websockets.connect(f"ws://{address}/v1/realtime") as one, \
                websockets.connect(f"ws://{address}/v1/realtime") as two:
            await one.recv(), await two.recv()
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(f"ws://{address}/v1/realtime"):
                    pass
            assert refused.value.response.status_code == 503
            assert json.loads(refused.value.response.body)["error"]["code"] == "server_busy"
        await wait_idle(address)
        # a failing session next to a healthy one: only it ends
        code, c = await asyncio.gather(doomed(), sdk_conversation(address, question, sessions[0]))
        return a, b, c, code

    with serve(_FailingModel(model), max_sessions=2) as (address, _):
        a, b, c, code = asyncio.run(run(address))
    assert code == 1011
    for got, pcm in ((a, question), (b, other), (c, question)):
        _, events, audio = reference(model, pcm, deterministic=True, seed=0 if got is not b else 1)
        assert got["text"] == deltas(events, released=False)
        assert_same_pcm(got["audio"], audio)


def get_json(url: str, headers: dict | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
        return json.loads(r.read())


async def wait_idle(address: str, headers: dict | None = None) -> None:
    """Until the server has released every session (a client's close reaches it a moment later)."""
    deadline = time.monotonic() + 30
    while get_json(f"http://{address}/health", headers)["active_sessions"]:
        assert time.monotonic() < deadline, "the sessions were not freed"
        await asyncio.sleep(0.05)


def test_api_key_health_and_disconnect_frees_the_session(model, question):
    async def run(address):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(f"ws://{address}/v1/realtime"):
                pass
        assert refused.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(f"ws://{address}/v1/realtime",
                                          additional_headers={"Authorization": "Bearer wrong"}):
                pass
        bad = AsyncOpenAI(api_key="wrong", websocket_base_url=f"ws://{address}/v1")
        with pytest.raises(Exception):
            async with bad.realtime.connect(model="nvchat"):
                pass
        client = AsyncOpenAI(api_key="s3cret", websocket_base_url=f"ws://{address}/v1")
        async with client.realtime.connect(model="nvchat") as conn:
            assert (await asyncio.wait_for(conn.recv(), TIMEOUT)).type == "session.created"
            assert get_json(f"http://{address}/health")["active_sessions"] == 1
            await conn.input_audio_buffer.append(audio=b64(question))  # then hang up mid-stream
        await wait_idle(address)

    with serve(model, api_key="s3cret", max_sessions=3, model_name="tiny") as (address, app):
        health = get_json(f"http://{address}/health")
        assert health == {"status": "ok", "model": "tiny", "device": "cpu", "dtype": "float32",
                          "active_sessions": 0, "max_sessions": 3, "median_step_ms": 0.0, "max_step_ms": 72.0,
                          "catch_up": True, "catch_up_steps": 0, "sessions": [], "worst_lag_frames": 0,
                          "worst_lag_ms": 0.0}
        asyncio.run(run(address))
        assert app.state.realtime.scheduler.active == 0


def test_a_client_gone_while_an_event_is_sent_is_a_disconnect_not_a_failure(model, question, monkeypatch):
    """The pump may find the client gone before the reader does (a send raises WebSocketDisconnect): the
    session is freed as on any disconnect, with no internal_error and nothing logged as a failure (seen
    as a race under load in the pipecat test before it was handled)."""
    import logging

    from fastapi import WebSocketDisconnect

    from nvchat_torch.server import app as server_app

    sent = []
    original = server_app.Connection.send

    async def send(self, payload: dict) -> None:
        sent.append(payload["type"])
        if payload["type"] == "input_audio_buffer.speech_started" or sent.count("response.output_audio.delta") == 2:
            raise WebSocketDisconnect(1006)  # as Starlette raises when the peer has gone
        await original(self, payload)

    monkeypatch.setattr(server_app.Connection, "send", send)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("nvchat_torch.server")
    logger.addHandler(handler)

    async def run(address):
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(question)}))
            with contextlib.suppress(websockets.ConnectionClosed):
                for _ in range(10_000):  # until the server ends the connection
                    await asyncio.wait_for(ws.recv(), TIMEOUT)
        await wait_idle(address)

    try:
        with serve(model, model_name="tiny") as (address, app):
            asyncio.run(run(address))
            assert app.state.realtime.scheduler.active == 0
    finally:
        logger.removeHandler(handler)
    assert "error" not in sent and records == [], (sent, [r.getMessage() for r in records])
    assert "response.output_audio.delta" in sent or "input_audio_buffer.speech_started" in sent


def test_command_line_server_and_client(tmp_path):
    """``python -m nvchat_torch.server`` (the embedded model) and ``python -m nvchat_torch.client``."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "nvchat_torch.server", "--port", str(port), "--device", "cpu",
                               "--log-level", "warning", "--turn-taking", "off"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                health = get_json(f"http://127.0.0.1:{port}/health")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        assert health["model"] == "nvchat-tiny-random" and health["max_sessions"] == 4
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
        assert "getUserMedia" in urllib.request.urlopen(f"http://127.0.0.1:{port}/web/app.js", timeout=10).read().decode()
        assert "/web/app.js" in page
        out = tmp_path / "answer.wav"
        client = subprocess.run([sys.executable, "-m", "nvchat_torch.client", "--url",
                                 f"ws://127.0.0.1:{port}/v1/realtime", "--audio", str(EXAMPLE), "--output", str(out),
                                 "--tail-seconds", "1", "--timeout", "120"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert client.returncode == 0, client.stderr
        assert "[user]" in client.stdout and "[response completed]" in client.stdout
        data, sr = sf.read(out)
        frames = -(-(len(sf.read(EXAMPLE)[0]) + 16000) // 1280)
        # the answer is the audio of the model's responses: at most the whole timeline (the frames where
        # it only listened are not sent, docs/server.md)
        assert sr == 24000 and 0 < len(data) <= frames * 1764 * 24000 / 22050 + 1
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert "random weights" in err


def test_non_loopback_host_needs_an_api_key_or_insecure(monkeypatch, capsys):
    import nvchat_torch.server.__main__ as cli

    import nvchat_torch.server.app as app_module

    calls = []
    monkeypatch.setattr(app_module, "listen_socket", lambda host, port: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: calls.append({"host": self.config.host}))
    assert cli.main(["--host", "0.0.0.0", "--port", "9", "--device", "cpu"]) == 2 and not calls
    err = capsys.readouterr().err
    assert "error: --host 0.0.0.0" in err and "--api-key" in err and "--insecure" in err
    assert cli.main(["--host", "0.0.0.0", "--port", "9", "--device", "cpu", "--insecure"]) == 0
    assert calls and calls[0]["host"] == "0.0.0.0"
    assert "warning: binding 0.0.0.0" in capsys.readouterr().err
    assert cli.main(["--host", "0.0.0.0", "--port", "9", "--device", "cpu", "--api-key", "k"]) == 0
    assert cli.main(["--port", "9", "--device", "cpu", "--max-sessions", "0"]) == 2
    assert cli.main(["--port", "9", "--device", "cpu", "--allow-origin", "not an origin"]) == 2
    assert "--allow-origin" in capsys.readouterr().err
    assert cli.main(["--port", "9", "--device", "cpu", "--threads", "0"]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err
    threads = torch.get_num_threads()
    try:
        assert cli.main(["--port", "9", "--device", "cpu", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert cli.is_loopback("127.0.0.1") and cli.is_loopback("::1") and not cli.is_loopback("192.168.1.4")


CALL = '<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL><SPECIAL_21>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class _CallingModel(_HookedModel):
    """Each session first 'decides' to call a tool: ``spans`` are forced on its function channel, from its
    frame ``after`` on (PAD before it)."""

    def __init__(self, model, spans: list[str], after: int = 0):
        super().__init__(model)
        self.spans, self.after, self.sessions = spans, after, []

    def opened(self, handle):
        handle.force_tokens("function", [self._model.config.pad_token_id] * self.after)
        for span in self.spans:
            handle.force_tokens("function", self._model.tokenizer.encode(span, add_special_tokens=False))
        self.sessions.append(handle)


def test_tool_calls_over_the_realtime_protocol(make_checkpoint, question):
    """session.update tools -> function_call items (output items and conversation items);
    function_call_output -> send_tool_result; bad spans -> a notice (not the client's error), an
    unknown call_id -> error."""
    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    call = CALL
    bad = '<SPECIAL_20><TOOLCALL>[{"name": "get_time", "arguments": {}}]</TOOLCALL><SPECIAL_21>'
    calling = _CallingModel(model, [call, bad])
    # the calls stream a token a frame (NVIDIA's tool pipeline off: tests/test_server_tools.py has it), so
    # the second span follows the first while its result is not in yet
    session = {**GA_16K_22K, "tools": [WEATHER], "tool_choice": "auto",
               "nvchat": {"deterministic": True, "tool_hold": None}}

    async def run(address):
        client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://{address}/v1")
        async with client.realtime.connect(model="nvchat") as conn:
            await conn.session.update(session=session)
            forced = sum(len(model.tokenizer.encode(x, add_special_tokens=False)) for x in (call, bad))
            for i in range(0, (forced + 2) * 1280, 1280):
                await conn.input_audio_buffer.append(audio=b64(question[i % 40000:i % 40000 + 1280]))
            seen, done, errors, notices = [], None, [], []
            while len(notices) < 1 or done is None:
                event = await asyncio.wait_for(conn.recv(), TIMEOUT)
                seen.append(event)
                assert event.type != "error", event
                if event.type == "response.function_call_arguments.done":
                    done = event
                elif event.type == "nvchat.notice":
                    notices.append(event)
            await conn.send({"type": "conversation.item.create", "item": {
                "type": "function_call_output", "call_id": "call_nope", "output": "{}"}})
            errors.append(await wait_for_error(conn))
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": done.call_id,
                                                      "output": json.dumps({"temperature_c": 21})})
            for i in range(0, 60 * 1280, 1280):
                await conn.input_audio_buffer.append(audio=b64(question[i % 40000:i % 40000 + 1280]))
            await conn.input_audio_buffer.commit()
            while True:
                event = await asyncio.wait_for(conn.recv(), TIMEOUT)
                seen.append(event)
                assert event.type != "error", event
                if event.type == "input_audio_buffer.committed":
                    break
            return seen, done, errors, notices

    with serve(calling) as (address, _):
        seen, done, errors, notices = asyncio.run(run(address))
    assert done.name == "get_weather" and json.loads(done.arguments) == {"city": "Paris"}
    added = [e for e in seen if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].item.call_id == done.call_id
    delta = [e for e in seen if e.type == "response.function_call_arguments.delta"]
    assert "".join(e.delta for e in delta) == done.arguments
    assert [e.code for e in errors] == ["invalid_tool_result"]
    assert notices[0].code == "tool_call_parse_error" and "get_time" in notices[0].message
    # the call is a conversation item too (pipecat tracks calls by them), added before its arguments
    types = [e.type for e in seen]
    item = [e for e in seen if e.type == "conversation.item.added" and e.item.type == "function_call"]
    assert len(item) == 1 and item[0].item.call_id == done.call_id
    assert seen.index(item[0]) < seen.index(done)
    finished = [e for e in seen if e.type == "conversation.item.done" and e.item.type == "function_call"]
    assert finished[0].item.arguments == done.arguments and finished[0].item.status == "completed"
    output = [e for e in seen if e.type == "conversation.item.added" and e.item.type == "function_call_output"]
    assert output and output[0].item.call_id == done.call_id and "conversation.item.done" in types
    session = calling.sessions[0]
    assert session.pending_tool_calls == []  # answered through send_tool_result
    assert '<TOOL_RESPONSE>[{"temperature_c": 21}]</TOOL_RESPONSE>' in session.function_text


async def wait_for_error(conn):
    while True:
        event = await asyncio.wait_for(conn.recv(), TIMEOUT)
        if event.type == "error":
            return event.error


def test_scheduler_steps_the_sessions_together_on_its_clock(model):
    """Two sessions with many queued frames run one frame each per step, as one batch, on the worker
    thread at the clock's pace; a session with no full frame sits out; a mark waits for its frames."""
    from nvchat_torch.server.scheduler import FrameScheduler

    clock = 0.03
    # without catch-up steps, which would run the queued frames between the ticks (tests/test_server_lag.py)
    scheduler = FrameScheduler(model, max_sessions=2, clock=clock, catch_up=False)
    outputs: dict[str, list] = {"a": [], "b": []}
    opened = {"a": threading.Event(), "b": threading.Event()}
    done = {"a": threading.Event(), "b": threading.Event()}

    def deliver(out, name):
        assert threading.current_thread().name == "nvchat-frames"
        outputs[name].append((out, time.perf_counter()))
        if out.kind == "opened":
            opened[name].set()
        if out.kind == "mark":
            done[name].set()

    try:
        handles = {name: scheduler.open(nv.StreamingOptions(system_prompt=name, deterministic=True),
                                        lambda out, name=name: deliver(out, name)) for name in ("a", "b")}
        # Prompts are prefilled in pieces between steps, one session after the other: both join first.
        assert opened["a"].wait(60) and opened["b"].wait(60)
        with scheduler._cond:  # queue all the audio before the worker looks again (the lock is reentrant)
            scheduler.push(handles["a"], np.zeros(20 * 1280, np.float32))
            scheduler.push(handles["b"], np.zeros(10 * 1280 + 700, np.float32))  # and a partial frame
            for name in ("a", "b"):
                scheduler.mark(handles[name], "end")
        assert done["a"].wait(60) and done["b"].wait(60)
        frames = {name: [(out, t) for out, t in got if out.kind == "events"] for name, got in outputs.items()}
        assert [len(frames[n]) for n in "ab"] == [20, 10]
        for name in "ab":
            assert [e.frame_index for out, _ in frames[name] for e in out.events if e.kind == "audio"] == \
                list(range(len(frames[name])))
            assert outputs[name][-1][0].kind == "mark"  # after every frame queued before it
        # the first 10 steps ran both sessions: the same step, the same compute time
        assert [out.compute_s for out, _ in frames["a"][:10]] == [out.compute_s for out, _ in frames["b"]]
        assert scheduler.engine.steps == 20
        times = [t for _, t in frames["a"]]
        assert times[-1] - times[0] >= 19 * clock * 0.9
        scheduler.close(handles["a"])
        assert scheduler.active == 1
    finally:
        scheduler.stop()