"""The realtime server: OpenAI Realtime GA and mlx-vlm's dialect on one ``/v1/realtime`` WebSocket.

One model, up to ``max_sessions`` connections, each with its own session in one batched engine
stepped by the ``FrameScheduler`` worker on an 80 ms clock. The protocol mapping (which model channel becomes which event, and
when an utterance starts and ends) is documented in docs/server.md.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import json
import logging
import secrets
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from ..audio_io import StreamResampler, pcm16_decode
from ..events import StreamingOptions
from .responses import ResponseEvents, _id
from .scheduler import FrameScheduler, Output

__all__ = ["create_app", "RealtimeServer", "MAX_MESSAGE_BYTES", "WS_MAX_BYTES"]

log = logging.getLogger("nvchat_torch.server")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a larger client message is answered with `message_too_large`
WS_MAX_BYTES = 64 * 1024 * 1024  # the transport's own limit, above ours so that oversize messages get an answer
INPUT_RATES = (24000, 16000)  # 24 kHz is resampled to the model's 16 kHz; 16 kHz goes in as it is
OUTPUT_RATES = (24000, 22050)  # the model's 22.05 kHz is resampled to 24 kHz, or sent as it is
WEB_DIR = Path(__file__).resolve().parents[1] / "web"
NVCHAT_KEYS = {"deterministic": bool, "seed": int, "max_streaming_seconds": (int, float, type(None)), "stats": bool}
GA_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
             "response.cancel", "response.create", "conversation.item.create")


class ClientError(Exception):
    """A problem with what the client sent: answered with an ``error`` event, the connection stays."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _tools_supported() -> bool:
    return any(f.name == "tools" for f in dataclasses.fields(StreamingOptions))


@dataclasses.dataclass
class SessionConfig:
    instructions: str | None = None
    input_rate: int = 24000
    output_rate: int = 24000
    deterministic: bool = False
    seed: int = 0
    max_streaming_seconds: float | None = None
    stats: bool = False
    tools: list = dataclasses.field(default_factory=list)
    tool_choice: Any = "auto"


class RealtimeServer:
    """What all connections share: the model, its scheduler, the session slots and the API key."""

    def __init__(self, model, *, model_name: str, max_sessions: int = 4, api_key: str | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, clock: float | None = None):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.model = model
        self.model_name = model_name
        self.max_sessions = max_sessions
        self.api_key = api_key
        self.max_message_bytes = max_message_bytes
        self.scheduler = FrameScheduler(model, max_sessions=max_sessions, clock=clock)
        self._lock = threading.Lock()
        self.active = 0

    def try_reserve(self) -> bool:
        with self._lock:
            if self.active >= self.max_sessions:
                return False
            self.active += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.active -= 1

    def authorized(self, ws: WebSocket, offered: list[str]) -> bool:
        if self.api_key is None:
            return True
        header = ws.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else None
        # Browsers cannot set headers on a WebSocket: they pass the key as a subprotocol, as OpenAI's do.
        for protocol in offered:
            if protocol.startswith("openai-insecure-api-key."):
                given = protocol.split(".", 1)[1]
        return given is not None and secrets.compare_digest(given.encode(), self.api_key.encode())

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, "device": str(self.model.device),
                "dtype": str(self.model.dtype).replace("torch.", ""), "active_sessions": self.active,
                "max_sessions": self.max_sessions}


def create_app(model, *, model_name: str = "nvchat", max_sessions: int = 4, api_key: str | None = None,
               max_message_bytes: int = MAX_MESSAGE_BYTES, clock: float | None = None) -> FastAPI:
    """The FastAPI app: ``/`` (the web page), ``/health`` and the ``/v1/realtime`` WebSocket. The
    sessions share one batched engine stepped every ``clock`` seconds (default: the 80 ms frame)."""
    server = RealtimeServer(model, model_name=model_name, max_sessions=max_sessions, api_key=api_key,
                            max_message_bytes=max_message_bytes, clock=clock)
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.scheduler.stop()

    app = FastAPI(title="nvchat_torch realtime server", lifespan=lifespan)
    app.state.realtime = server

    @app.get("/health")
    async def health() -> dict:
        return server.health()

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        if not server.authorized(ws, offered):
            body = {"type": "error", "event_id": _id("event"), "error": {
                "type": "invalid_request_error", "code": "invalid_api_key", "param": None, "event_id": None,
                "message": "missing or wrong API key: send 'Authorization: Bearer <key>'"}}
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(JSONResponse(body, status_code=401))
            else:
                await ws.close(code=1008)
            return
        await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        if not server.try_reserve():
            await ws.send_text(json.dumps({"type": "error", "event_id": _id("event"), "error": {
                "type": "server_error", "code": "server_busy", "param": None, "event_id": None,
                "message": f"all {server.max_sessions} sessions are in use; try again later"}}))
            await ws.close(code=1013)
            return
        try:
            await Connection(server, ws).run()
        finally:
            server.release()

    return app


class Connection(ResponseEvents):
    """One WebSocket: reads client events, queues model work, turns the worker's outputs into events
    (:class:`~nvchat_torch.server.responses.ResponseEvents`)."""

    def __init__(self, server: RealtimeServer, ws: WebSocket):
        self.server, self.ws = server, ws
        self.scheduler = server.scheduler
        cfg = server.model.config
        self.frame_samples = cfg.input_frame_samples
        self.model_rate, self.output_model_rate = cfg.input_sample_rate, cfg.output_sample_rate
        self.eos_id = cfg.eos_token_id
        self.default_instructions = cfg.default_system_prompt
        self.loop = asyncio.get_running_loop()
        self.outputs: asyncio.Queue[Output] = asyncio.Queue()
        self.send_lock = asyncio.Lock()
        self.session_id = _id("sess")
        self.dialect: str | None = None  # "ga" or "mlx", fixed by the first session.update or append
        self.config = SessionConfig()
        self.handle: int | None = None
        self.in_resampler: StreamResampler | None = None
        self.out_resampler: StreamResampler | None = None
        self.response: dict | None = None  # the open response (GA)
        self.user_item: str | None = None  # the user transcript item being filled (GA)
        self.user_text = ""
        self.frames = 0
        self.compute_s: deque[float] = deque(maxlen=25)
        self.client_event_id: str | None = None
        self.announce_open = False  # mlx-vlm's session.update is answered once the session is open

    # ---- plumbing
    async def send(self, payload: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps({"event_id": _id("event"), **payload}))

    async def send_error(self, code: str, message: str, *, param: str | None = None,
                         kind: str = "invalid_request_error") -> None:
        await self.send({"type": "error", "error": {"type": kind, "code": code, "message": message,
                                                    "param": param, "event_id": self.client_event_id}})

    def _deliver(self, out: Output) -> None:  # on the worker thread
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, out)
        except RuntimeError:  # the loop is gone: the connection ended
            pass

    async def run(self) -> None:
        await self.send({"type": "session.created", "session": self._ga_session()})
        reader = asyncio.create_task(self._read())
        pump = asyncio.create_task(self._pump())
        try:
            await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, pump):
                task.cancel()
            await asyncio.gather(reader, pump, return_exceptions=True)
            if self.handle is not None:  # a disconnect frees the session at once
                self.scheduler.close(self.handle)

    async def _read(self) -> None:
        limit = self.server.max_message_bytes
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            self.client_event_id = None
            text = message.get("text")
            try:
                if text is None:
                    raise ClientError("invalid_message", "binary messages are not supported: send JSON text")
                if len(text) > limit or (len(text) * 4 > limit and len(text.encode()) > limit):
                    raise ClientError("message_too_large", f"message of {len(text.encode())} bytes is over the "
                                      f"limit of {limit} bytes; send audio in smaller appends")
                try:
                    event = json.loads(text)
                except ValueError as e:
                    raise ClientError("invalid_json", f"message is not valid JSON: {e}") from None
                if not isinstance(event, dict):
                    raise ClientError("invalid_json", "message must be a JSON object with a 'type'")
                if isinstance(event.get("event_id"), str):
                    self.client_event_id = event["event_id"]
                if await self._handle(event):
                    return
            except ClientError as e:
                await self.send_error(e.code, e.message, param=e.param)

    async def _handle(self, event: dict) -> bool:
        """Handle one client event; True ends the reader."""
        etype = event.get("type")
        if etype == "session.update":
            session = event.get("session")
            if not isinstance(session, dict):
                raise ClientError("invalid_value", "session.update needs a 'session' object", "session")
            mlx_style = "type" not in session and any(k in session for k in ("system_prompt", "seed",
                                                                              "max_streaming_seconds"))
            if self.dialect is None:
                self.dialect = "mlx" if mlx_style else "ga"
            if self.dialect == "mlx":
                await self._mlx_update(session)
            else:
                await self._ga_update(session)
        elif etype == "input_audio_buffer.append":
            self._append(event)
        elif etype == "input_audio_buffer.commit":
            await self._commit(event)
        elif etype == "input_audio_buffer.clear":
            if self.handle is not None:
                self.scheduler.drop_audio(self.handle)
                self.in_resampler = StreamResampler(self.config.input_rate, self.model_rate)
                self.scheduler.mark(self.handle, "clear")
            else:
                await self.send({"type": "input_audio_buffer.cleared"})
        elif etype in ("response.cancel", "session.cancel"):
            if self.dialect == "mlx":
                if self.handle is None:
                    raise ClientError("invalid_state", "no session to cancel: send session.update first")
                self.scheduler.cancel(self.handle)
            elif self.response is not None:
                await self._close_response("cancelled")
        elif etype == "response.create":
            pass  # the model decides itself when to speak: a response opens with its next utterance
        elif etype == "conversation.item.create":
            self._item_create(event)
        elif etype == "session.ping":
            await self.send({"type": "session.pong"})
        else:
            raise ClientError("unknown_event_type", f"unsupported event type {etype!r}; this server takes "
                              f"{', '.join(GA_EVENTS)}", "type")
        return False

    # ---- configuration
    def _ga_session(self) -> dict:
        cfg = self.config
        return {"type": "realtime", "object": "realtime.session", "id": self.session_id,
                "model": self.server.model_name,
                "instructions": self.default_instructions if cfg.instructions is None else cfg.instructions,
                "output_modalities": ["audio"],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": cfg.input_rate},
                                    "turn_detection": None, "transcription": None},
                          "output": {"format": {"type": "audio/pcm", "rate": cfg.output_rate}}},
                "tools": cfg.tools, "tool_choice": cfg.tool_choice,
                "nvchat": {"deterministic": cfg.deterministic, "seed": cfg.seed,
                           "max_streaming_seconds": cfg.max_streaming_seconds, "stats": cfg.stats,
                           "frame_samples": self.frame_samples, "max_message_bytes": self.server.max_message_bytes,
                           "started": self.handle is not None}}

    @staticmethod
    def _rate(fmt: Any, allowed: tuple[int, ...], param: str) -> int:
        if not isinstance(fmt, dict) or fmt.get("type", "audio/pcm") != "audio/pcm":
            raise ClientError("unsupported_audio_format", f"{param} must be {{'type': 'audio/pcm', 'rate': R}} with "
                              f"R in {list(allowed)}, got {fmt!r}", param)
        rate = fmt.get("rate", 24000)
        if isinstance(rate, bool) or rate not in allowed:
            raise ClientError("unsupported_audio_format", f"{param}.rate {rate!r} is not supported; use one of "
                              f"{list(allowed)}", f"{param}.rate")
        return int(rate)

    async def _ga_update(self, session: dict) -> None:
        cfg = dataclasses.replace(self.config, tools=list(self.config.tools))
        if session.get("type", "realtime") != "realtime":
            raise ClientError("invalid_value", f"session.type must be 'realtime', got {session.get('type')!r}",
                              "session.type")
        if "instructions" in session:
            if not isinstance(session["instructions"], (str, type(None))):
                raise ClientError("invalid_value", "session.instructions must be a string", "session.instructions")
            cfg.instructions = session["instructions"]
        audio = session.get("audio") or {}
        if not isinstance(audio, dict):
            raise ClientError("invalid_value", "session.audio must be an object", "session.audio")
        for side, allowed in (("input", INPUT_RATES), ("output", OUTPUT_RATES)):
            part = audio.get(side) or {}
            if not isinstance(part, dict):
                raise ClientError("invalid_value", f"session.audio.{side} must be an object", f"session.audio.{side}")
            if part.get("format") is not None:
                rate = self._rate(part["format"], allowed, f"session.audio.{side}.format")
                setattr(cfg, f"{side}_rate", rate)
        modalities = session.get("output_modalities")
        if modalities is not None and list(modalities) != ["audio"]:
            raise ClientError("invalid_value", "output_modalities must be ['audio']: the model always speaks "
                              "(its text comes as the audio transcript)", "session.output_modalities")
        extension = session.get("nvchat")
        if extension is not None:
            if not isinstance(extension, dict):
                raise ClientError("invalid_value", "session.nvchat must be an object", "session.nvchat")
            for key, value in extension.items():
                kinds = NVCHAT_KEYS.get(key)
                if kinds is None:
                    raise ClientError("invalid_value", f"unknown session.nvchat key {key!r}; known: "
                                      f"{sorted(NVCHAT_KEYS)}", f"session.nvchat.{key}")
                if not isinstance(value, kinds) or (kinds is int and isinstance(value, bool)):
                    raise ClientError("invalid_value", f"session.nvchat.{key} has the wrong type: {value!r}",
                                      f"session.nvchat.{key}")
                if key == "max_streaming_seconds" and value is not None and not value > 0:
                    raise ClientError("invalid_value", "session.nvchat.max_streaming_seconds must be positive",
                                      "session.nvchat.max_streaming_seconds")
                setattr(cfg, key, value)
        if "tools" in session:
            tools = session["tools"] or []
            if not isinstance(tools, list):
                raise ClientError("invalid_value", "session.tools must be a list", "session.tools")
            if tools and not _tools_supported():
                raise ClientError("tools_unsupported", "this build of nvchat_torch has no tool calls yet",
                                  "session.tools")
            if tools:
                from ..tools import validate_tools

                try:
                    validate_tools(tools)
                except ValueError as e:
                    raise ClientError("invalid_value", f"session.tools: {e}", "session.tools") from None
            cfg.tools = tools
        if "tool_choice" in session:
            if session["tool_choice"] not in ("auto", None):
                raise ClientError("invalid_value", "tool_choice must be 'auto': the model decides when to call",
                                  "session.tool_choice")
            cfg.tool_choice = "auto"
        if self.handle is not None:
            fixed = ("instructions", "input_rate", "deterministic", "seed", "max_streaming_seconds", "tools")
            changed = [k for k in fixed if getattr(cfg, k) != getattr(self.config, k)]
            if changed:
                raise ClientError("session_already_started", f"cannot change {', '.join(changed)} after audio "
                                  "has started: open a new connection for a new conversation", "session")
            if cfg.output_rate != self.config.output_rate:
                self.out_resampler = StreamResampler(self.output_model_rate, cfg.output_rate)
        self.config = cfg
        await self.send({"type": "session.updated", "session": self._ga_session()})

    async def _mlx_update(self, session: dict) -> None:
        if self.handle is not None:
            raise ClientError("invalid_state", "the active session cannot be reconfigured")
        prompt = session.get("system_prompt")
        seed = session.get("seed", 0)
        limit = session.get("max_streaming_seconds")
        if not isinstance(prompt, (str, type(None))):
            raise ClientError("invalid_value", "system_prompt must be a string", "session.system_prompt")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ClientError("invalid_value", f"seed must be an int, got {seed!r}", "session.seed")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
            raise ClientError("invalid_value", "max_streaming_seconds must be a positive number",
                              "session.max_streaming_seconds")
        self.config = dataclasses.replace(self.config, instructions=prompt, seed=seed, max_streaming_seconds=limit,
                                          input_rate=self.model_rate, output_rate=self.output_model_rate)
        self._start(announce=True)

    def _start(self, announce: bool = False) -> None:
        cfg = self.config
        kwargs = {"tools": cfg.tools} if cfg.tools else {}
        try:
            options = StreamingOptions(system_prompt=cfg.instructions, seed=cfg.seed, deterministic=cfg.deterministic,
                                       max_streaming_seconds=cfg.max_streaming_seconds, **kwargs)
        except ValueError as e:
            raise ClientError("invalid_value", f"cannot start the session: {e}", "session") from None
        self.in_resampler = StreamResampler(cfg.input_rate, self.model_rate)
        self.out_resampler = StreamResampler(self.output_model_rate, cfg.output_rate)
        self.announce_open = announce
        self.handle = self.scheduler.open(options, self._deliver)

    # ---- audio in
    def _append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientError("invalid_value", "input_audio_buffer.append needs 'audio': base64 pcm16", "audio")
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ClientError("invalid_base64", "'audio' is not valid base64", "audio") from None
        if len(raw) % 2:
            raise ClientError("invalid_audio_length", f"pcm16 audio needs an even number of bytes, got {len(raw)}",
                              "audio")
        if "sample_rate" in event:  # mlx-vlm's field
            if self.dialect is None:
                self.dialect = "mlx"
                self.config = dataclasses.replace(self.config, input_rate=self.model_rate,
                                                  output_rate=self.output_model_rate)
            rate = event["sample_rate"]
            if rate != self.config.input_rate:
                raise ClientError("unsupported_audio_format", f"sample_rate {rate!r} does not match the session's "
                                  f"input rate {self.config.input_rate}", "sample_rate")
        self.dialect = self.dialect or "ga"
        if self.handle is None:
            self._start()
        samples = self.in_resampler(pcm16_decode(raw))
        self.scheduler.push(self.handle, samples)

    async def _commit(self, event: dict) -> None:
        if self.handle is None:
            raise ClientError("input_audio_buffer_commit_empty", "no audio has been appended")
        if self.dialect == "mlx":
            pad = event.get("pad_partial", True)
            await self.send({"type": "input_audio_buffer.committed"})
            self.scheduler.flush(self.handle, bool(pad))
            return
        self.scheduler.push(self.handle, self.in_resampler(np.zeros(0, np.float32), last=True))
        self.scheduler.pad(self.handle)
        self.scheduler.mark(self.handle, "commit")

    def _item_create(self, event: dict) -> None:
        item = event.get("item")
        if not isinstance(item, dict):
            raise ClientError("invalid_value", "conversation.item.create needs an 'item' object", "item")
        if item.get("type") != "function_call_output":
            raise ClientError("unsupported_item", "only function_call_output items can be created: the model "
                              "takes the user's turn as audio", "item.type")
        if self.handle is None:
            raise ClientError("invalid_state", "no session is running", "item")
        if not _tools_supported():
            raise ClientError("tools_unsupported", "this build of nvchat_torch has no tool calls yet", "item")
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise ClientError("invalid_value", "function_call_output needs string 'call_id' and 'output'", "item")
        try:
            value = json.loads(output)
        except ValueError:
            value = output
        self.scheduler.call(self.handle, "send_tool_result", call_id, value)

    # ---- model outputs
    async def _pump(self) -> None:
        while True:
            out = await self.outputs.get()
            if self.dialect == "mlx":
                done = await self._mlx_output(out)
            else:
                done = await self._ga_output(out)
            if done:
                return

    async def _stats(self, out: Output) -> None:
        self.frames += 1
        self.compute_s.append(out.compute_s)
        if self.config.stats and self.frames % 5 == 0:
            backlog = self.scheduler.backlog_samples(self.handle) / self.model_rate
            rtf = sum(self.compute_s) / len(self.compute_s) / (self.frame_samples / self.model_rate)
            await self.send({"type": "nvchat.stats", "frames": self.frames, "realtime_factor": round(rtf, 4),
                             "backlog_ms": round(backlog * 1000)})

    async def _end(self, code: int) -> bool:
        try:
            await self.ws.close(code=code)
        except Exception:  # the client is already gone
            pass
        return True
