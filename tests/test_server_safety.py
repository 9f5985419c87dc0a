"""The realtime server under attack and load, each with a second session streaming beside it: other
sites' pages refused (Origin, DNS rebinding), every session.update key checked in both dialects, a
long system prompt joining without stalling the others, a client that stops reading, one that
sends faster than real time. Loopback only; every loop is bounded by a deadline."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import websockets

import nvchat_torch as nv
from test_server import (GA_16K_22K, RAW, TIMEOUT, assert_same_pcm, b64, deltas, expect_error, get_json, mlx_conversation,
                         reference, serve, wait_idle)

FRAME = 1280
LONG_PROMPT = ("You are a helpful voice assistant for a museum. Answer briefly and kindly, in plain words. " * 25)[:2000]


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """Ten seconds of int16 'speech' (the example question, repeated)."""
    import soundfile as sf

    from test_server import EXAMPLE

    pcm, _ = sf.read(EXAMPLE, dtype="int16")
    return np.tile(pcm, 4)[:160000]


def http_status(url: str, headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# ---- Origin and Host


def test_other_sites_are_refused_before_any_session(model):
    async def created(address: str, **kwargs) -> dict:
        async with websockets.connect(f"ws://{address}/v1/realtime", **kwargs) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))

    async def refused(address: str, **kwargs) -> int:
        with pytest.raises(websockets.InvalidStatus) as e:
            async with websockets.connect(f"ws://{address}/v1/realtime", **kwargs):
                pass
        return e.value.response.status_code

    with serve(model, allow_origins=["https://app.example.com"]) as (address, app):
        port = address.split(":")[1]
        assert asyncio.run(refused(address, origin="http://evil.example")) == 403
        assert asyncio.run(refused(address, origin=f"http://evil.example:{port}")) == 403
        assert asyncio.run(refused(address, origin="null")) == 403  # sandboxed iframes, file:// pages
        assert app.state.realtime.active == 0  # no session was ever made for them
        # the server's own pages, an allowed origin, and clients that send no Origin (the SDK)
        for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", "https://app.example.com", None):
            assert asyncio.run(created(address, origin=origin))["type"] == "session.created"
        # the page and the health check: other sites' requests and DNS rebinding (a foreign Host) refused
        base = f"http://{address}"
        assert http_status(f"{base}/", {}) == 200
        assert http_status(f"{base}/", {"Origin": f"http://127.0.0.1:{port}"}) == 200
        assert http_status(f"{base}/health", {"Origin": "http://evil.example"}) == 403
        assert http_status(f"{base}/", {"Origin": "http://localhost:3000"}) == 403  # another local app
        assert http_status(f"{base}/", {"Host": f"evil.example:{port}"}) == 403
        assert http_status(f"{base}/web/app.js", {"Host": f"evil.example:{port}",
                                                  "Origin": f"http://evil.example:{port}"}) == 403
        assert http_status(f"{base}/", {"Host": f"localhost:{port}"}) == 200


def test_api_keys_compare_in_constant_time():
    from nvchat_torch.server.security import keys_equal

    assert keys_equal("s3cret", "s3cret") and not keys_equal("s3cre", "s3cret") and not keys_equal("", "s3cret")


# ---- session.update: every key checked, in both dialects


def test_unknown_session_keys_are_errors_naming_them_and_ga_keys_are_accepted(model):
    async def run(address):
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await ws.recv()
            for session, param in (({"type": "realtime", "temprature": 0.5}, "session.temprature"),
                                   ({"type": "realtime", "audio": {"input": {"formats": {}}}}, "session.audio.input.formats"),
                                   ({"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcm",
                                                                                          "rat": 24000}}}},
                                    "session.audio.output.format.rat"),
                                   ({"type": "realtime", "nvchat": {"determinstic": True}}, "session.nvchat.determinstic")):
                await ws.send(json.dumps({"type": "session.update", "session": session}))
                error = (await expect_error(ws, "unknown_parameter"))["error"]
                assert error["param"] == param and param.rsplit(".", 1)[1] in error["message"]
            # keys of the GA schema the model cannot act on are accepted and shown as such
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "model": "gpt-realtime", "audio": {"output": {"voice": "marin", "speed": 1.0},
                                                                       "input": {"noise_reduction": None}},
                "tracing": None, "max_output_tokens": "inf"}}))
            updated = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
            assert updated["type"] == "session.updated", updated
            assert updated["session"]["nvchat"]["not_applied"] == [
                "audio.input.noise_reduction", "audio.output.speed", "audio.output.voice", "max_output_tokens",
                "model", "tracing"]
            assert updated["session"]["audio"]["output"]["voice"] == model.config.speaker
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:  # mlx-vlm's dialect
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"system_prompt": "x", "sede": 3}}))
            assert (await expect_error(ws, "unknown_parameter"))["error"]["param"] == "session.sede"
            await ws.send(json.dumps({"type": "session.update", "session": {"seed": 1, "nvchat": {"seed": "one"}}}))
            assert (await expect_error(ws, "invalid_value"))["error"]["param"] == "session.nvchat.seed"

    with serve(model) as (address, _):
        asyncio.run(run(address))


def test_mlx_vlm_dialect_honours_nvchat(model, question_pcm):
    config = {"model": "mlx-community/NemotronLabs-VoiceChat-11B-4bit", "system_prompt": "be brief", "seed": 3,
              "nvchat": {"deterministic": True, "seed": 0}}
    with serve(model) as (address, _):
        events, code = asyncio.run(mlx_conversation(address, question_pcm, config))
    ref, ref_events, audio = reference(model, question_pcm, system_prompt="be brief", deterministic=True, seed=0)
    assert code == 1000
    codes = np.array([e["audio_codes"] for e in events if e["type"] == "response.audio.delta"])
    assert np.array_equal(codes, np.stack([e.audio_codes for e in ref_events if e.kind == "audio"]))
    assert_same_pcm(b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"),
                    audio)


@pytest.fixture(scope="module")
def question_pcm() -> np.ndarray:
    import soundfile as sf

    from test_server import EXAMPLE

    return sf.read(EXAMPLE, dtype="int16")[0]


# ---- load: a second session streaming beside each case


class Streamer:
    """A GA client that sends ``pcm`` at real-time pace (one frame per 80 ms) and records when each
    audio delta arrives; deterministic, 16 kHz in and 22.05 kHz out, so its output can be compared
    with StreamingSession's."""

    def __init__(self, address: str, pcm: np.ndarray, session: dict | None = None, pace: float = 0.08):
        self.address, self.pcm, self.pace = address, pcm, pace
        self.session = session or {**GA_16K_22K, "nvchat": {"deterministic": True, "seed": 0, **RAW}}
        self.arrivals: list[float] = []
        self.audio = b""
        self.text = ""
        self.transcript = ""
        self.errors: list[dict] = []

    async def run(self) -> None:
        async with websockets.connect(f"ws://{self.address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": self.session}))

            async def send():
                start = time.monotonic()
                for i, at in enumerate(range(0, len(self.pcm), FRAME)):
                    await asyncio.sleep(max(0.0, start + i * self.pace - time.monotonic()))
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(self.pcm[at:at + FRAME])}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

            sender = asyncio.create_task(send())
            committed = False
            deadline = time.monotonic() + 4 * TIMEOUT
            while time.monotonic() < deadline:
                event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                kind = event["type"]
                if kind == "response.output_audio.delta":
                    self.arrivals.append(time.monotonic())
                    self.audio += base64.b64decode(event["delta"])
                elif kind == "response.output_audio_transcript.delta":
                    self.text += event["delta"]
                elif kind == "conversation.item.input_audio_transcription.delta":
                    self.transcript += event["delta"]
                elif kind == "error":
                    self.errors.append(event["error"])
                elif kind == "input_audio_buffer.committed":
                    committed = True
                elif kind == "response.done" and committed:
                    break
            await sender

    def check_against(self, model) -> None:
        """Its output is what StreamingSession gives alone for the same audio."""
        assert not self.errors, self.errors
        _, events, audio = reference(model, self.pcm, deterministic=True, seed=0)
        assert self.text == deltas(events, released=False) and self.transcript == deltas(events, "user_transcript_delta")
        assert_same_pcm(self.audio, audio)

    def gaps_between(self, start: float, end: float) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:]) if start <= b <= end]


def test_a_long_prompt_joins_without_stalling_a_streaming_session(model, speech):
    """A 2,000-character system prompt is prefilled in pieces between steps: while it runs, the
    streaming session's audio keeps its 80 ms pace (no gap grows by more than one frame)."""
    joined = {}

    async def joiner(address: str):
        await asyncio.sleep(2.0)  # the streamer is well under way
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {
                **GA_16K_22K, "instructions": LONG_PROMPT, "nvchat": {"deterministic": True, **RAW}}}))
            joined["start"] = start = time.monotonic()

            async def listen():
                while True:
                    if json.loads(await ws.recv())["type"] == "response.output_audio.delta":
                        joined["first_audio"] = time.monotonic()
                        return

            listener = asyncio.create_task(listen())
            for i in range(int(4 * TIMEOUT / 0.08)):  # a microphone, until the joiner is heard
                await asyncio.sleep(max(0.0, start + i * 0.08 - time.monotonic()))
                if listener.done():
                    break
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(speech[:FRAME])}))
            await listener

    async def run(address):
        streamer = Streamer(address, speech)
        await asyncio.gather(streamer.run(), joiner(address))
        return streamer

    with serve(model) as (address, app):
        streamer = asyncio.run(run(address))
    assert joined["first_audio"] - joined["start"] > 1.0, "the prefill was too short to overlap the stream"
    during = streamer.gaps_between(joined["start"], joined["first_audio"])
    assert len(during) >= 10 and max(during) <= 0.16 + 0.04, sorted(during)[-5:]
    assert np.median(during) < 0.1
    streamer.check_against(model)


def test_a_client_that_stops_reading_is_closed_and_the_others_go_on(model, speech):
    result = {}

    async def stalled(address: str):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # it reads nothing: fill up quickly
        sock.connect(tuple((address.split(":")[0], int(address.split(":")[1]))))
        async with websockets.connect(f"ws://{address}/v1/realtime", sock=sock, max_queue=1, max_size=None) as ws:
            # every frame's audio (listening included), so that unread events pile up
            await ws.send(json.dumps({"type": "session.update", "session": {**GA_16K_22K, "nvchat": RAW}}))
            start = time.monotonic()
            try:
                for i in range(int(60 / 0.08)):  # a microphone that keeps sending; nobody reads
                    await asyncio.sleep(max(0.0, start + i * 0.08 - time.monotonic()))
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(speech[:FRAME])}))
                    if i % 3 == 0 and i > 12 and get_json(f"http://{address}/health")["active_sessions"] == 1:
                        result.setdefault("freed", time.monotonic() - start)
                        break
            except websockets.ConnectionClosed:
                pass
            # reading again now: what was sent, then the server's close with its reason
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while time.monotonic() < start + 2 * TIMEOUT:
                    await asyncio.wait_for(ws.recv(), TIMEOUT)
            result["close"] = closed.value.rcvd

    async def run(address):
        streamer = Streamer(address, speech)
        await asyncio.gather(streamer.run(), stalled(address))
        return streamer

    with serve(model, max_unsent_seconds=1.0) as (address, app):
        streamer = asyncio.run(run(address))
        asyncio.run(wait_idle(address))
    assert "freed" in result and result["freed"] < 30
    assert result["close"] is not None and result["close"].code == 1008 and "too slow" in result["close"].reason
    streamer.check_against(model)


def test_a_client_sending_faster_than_real_time_is_bounded(model, speech):
    """Audio beyond the backlog bound is refused with an error (the append whole); the session goes on
    and the one beside it is unchanged."""

    async def flooder(address: str) -> tuple[list[dict], list[str]]:
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {**GA_16K_22K, "nvchat": RAW}}))
            half_second = speech[:8000]
            for i in range(20):  # 10 s at once, against a bound of 2 s
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(half_second),
                                          "event_id": f"flood_{i}"}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            errors, kinds = [], []
            deadline = time.monotonic() + 2 * TIMEOUT
            committed = False
            while time.monotonic() < deadline:
                event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                kinds.append(event["type"])
                if event["type"] == "error":
                    errors.append(event["error"])
                elif event["type"] == "input_audio_buffer.committed":
                    committed = True
                elif event["type"] == "response.done" and committed:
                    break
            return errors, kinds

    async def run(address):
        streamer = Streamer(address, speech[:48000])
        (errors, kinds), _ = await asyncio.gather(flooder(address), streamer.run())
        return errors, kinds, streamer

    with serve(model, max_buffered_seconds=2.0) as (address, _):
        errors, kinds, streamer = asyncio.run(run(address))
    assert errors and all(e["code"] == "input_audio_buffer_full" for e in errors)
    refused = {e["event_id"] for e in errors}
    assert len(refused) <= 17 and "flood_0" not in refused  # the first 2 s (and what ran meanwhile) was taken
    heard = kinds.count("response.output_audio.delta")
    assert 2.0 / 0.08 <= heard <= (20 - len(refused)) * 0.5 / 0.08 + 1
    streamer.check_against(model)


# ---- streamed text that adds up, over the wire


def test_ga_deltas_add_up_on_a_speech_heavy_checkpoint(make_checkpoint, question_pcm):
    """A dense RNNT transcript (several user items) and byte-level text with split characters: the
    transcription deltas a GA client joins are the session's transcript, each item's deltas its
    ``completed`` transcript, and the text deltas the session's streamed text, as sent alone."""
    model = nv.load_model(make_checkpoint(seed=12, bits=4, rnnt_blank_boost=-1.0, pattern="M*M-*-M"), device="cpu")
    pcm = np.tile(question_pcm, 2)
    session = {**GA_16K_22K, "nvchat": {"deterministic": True, "seed": 0, **RAW}}

    async def run(address):
        items: dict[str, str] = {}
        completed: dict[str, str] = {}
        got = {"text": "", "transcript": "", "responses": []}
        async with websockets.connect(f"ws://{address}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            for i in range(0, len(pcm), FRAME):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm[i:i + FRAME])}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            committed = False
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                kind = event["type"]
                assert kind != "error", event
                if kind == "conversation.item.input_audio_transcription.delta":
                    assert event["delta"], "an item opened for nothing"
                    items[event["item_id"]] = items.get(event["item_id"], "") + event["delta"]
                    got["transcript"] += event["delta"]
                elif kind == "conversation.item.input_audio_transcription.completed":
                    completed[event["item_id"]] = event["transcript"]
                elif kind == "response.output_audio_transcript.delta":
                    got["text"] += event["delta"]
                elif kind == "response.done":
                    got["responses"].append(event["response"])
                    if committed:
                        return got, items, completed
                elif kind == "input_audio_buffer.committed":
                    committed = True

    with serve(model) as (address, _):
        got, items, completed = asyncio.run(run(address))
    ref, events, _ = reference(model, pcm, deterministic=True, seed=0)
    assert len(items) > 1 and got["transcript"] == ref.user_transcript == deltas(events, "user_transcript_delta")
    assert completed == items
    assert got["text"] == deltas(events, released=False)
    assert "".join(r["output"][0]["content"][0]["transcript"] for r in got["responses"]) == got["text"]
    assert model.tokenizer.decode(ref._text.tokens, skip_special_tokens=False).startswith(got["text"])
