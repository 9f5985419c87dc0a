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
import time
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

import numpy as np
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from ..audio_io import StreamResampler
from ..events import StreamingOptions
from .conversation_state import Response, SpokenPhrase, TurnState, new_id
from .ga_schema import show
from .items import ItemEvents
from .realtime_server import (
    MAX_BUFFERED_SECONDS,
    MAX_MESSAGE_BYTES,
    MAX_STEP_FRACTION,
    MAX_UNSENT_SECONDS,
    PROMPT_CACHE_BYTES,
    WS_MAX_BYTES,
    RealtimeServer,
    listen_socket,
)
from .requests import RequestEvents
from .responses import ResponseEvents
from .scheduler import WARM_PROMPT_TOKENS, Output
from .security import OriginPolicy
from .session_config import (
    FIXED_AFTER_START,
    ClientError,
    SessionConfig,
    decode_audio,
    format_json,
    ga_update,
    is_mlx_update,
    mlx_update,
    not_applied,
    turn_taking_json,
)

__all__ = ["create_app", "listen_socket", "RealtimeServer", "MAX_MESSAGE_BYTES", "WS_MAX_BYTES", "MAX_BUFFERED_SECONDS",
           "MAX_UNSENT_SECONDS"]

log = logging.getLogger("nvchat_torch.server")

CLOSE_TOO_SLOW = 1008  # policy violation: the client does not read what it asked for
CLOSE_WAIT_SECONDS = 10.0  # how long a too-slow client's close frame waits for it to read
WEB_DIR = Path(__file__).resolve().parents[1] / "web"
GA_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
             "response.cancel", "response.create", "conversation.item.create", "conversation.item.truncate",
             "conversation.item.retrieve", "conversation.item.delete", "output_audio_buffer.clear")


_READ = object()  # send_error's default: the client event being read


def _tools_supported() -> bool:
    return any(f.name == "tools" for f in dataclasses.fields(StreamingOptions))


def _check_tools_expressible(model, tools: list) -> None:
    """Tools the model's tokenizer cannot express (no call markers) are refused at session.update,
    not when the first append starts the session."""
    if not tools:
        return
    from ..tools import ToolChannel

    try:
        ToolChannel(model.tokenizer, tools, pad_id=model.config.pad_token_id, vocab_size=0, device=model.device)
    except ValueError as e:
        raise ClientError("tools_unsupported", f"this model cannot call tools: {e}", "session.tools") from None


def _call_start_id(model, tools: list) -> int:
    """The function channel's start-of-call id for these tools (they were checked at session.update)."""
    from ..tools import ToolChannel

    return ToolChannel(model.tokenizer, tools, pad_id=model.config.pad_token_id, vocab_size=0,
                       device=model.device).start_id


def create_app(model, *, model_name: str = "nvchat", max_sessions: int = 4, api_key: str | None = None,
               max_message_bytes: int = MAX_MESSAGE_BYTES, clock: float | None = None,
               allow_origins: Iterable[str] = (), max_buffered_seconds: float = MAX_BUFFERED_SECONDS,
               max_unsent_seconds: float = MAX_UNSENT_SECONDS, turn_taking: Any = True,
               max_step_fraction: float = MAX_STEP_FRACTION, prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
               catch_up: bool = True, warm_prompt_tokens: int = WARM_PROMPT_TOKENS,
               health: Callable[[dict], Awaitable[dict]] | None = None) -> FastAPI:
    """The FastAPI app: ``/`` (the web page), ``/health`` and the ``/v1/realtime`` WebSocket. The
    sessions share one batched engine stepped every ``clock`` seconds (default: the 80 ms frame).
    Browser pages of other origins than the server's own are refused unless in ``allow_origins``
    (:mod:`~nvchat_torch.server.security`); a session buffers at most ``max_buffered_seconds`` of
    input not yet run, and a client that leaves events unread for ``max_unsent_seconds`` is closed.
    ``turn_taking``: the policy GA sessions get unless they say otherwise (``nvchat.turn_taking``):
    True is NVIDIA's (docs/turn_taking.md), False the raw model, or a ``TurnTakingConfig``. The server
    is full at ``max_sessions``, or while its median step is ``max_step_fraction`` of the frame or more:
    a WebSocket upgrade is then refused with HTTP 503 and a JSON reason. Prefilled prompts are kept for
    the next session with the same one, up to ``prompt_cache_bytes`` (0: none). ``catch_up``: a session
    behind gets extra steps between the ticks (False: one frame per session per tick). While idle the
    server makes its default mode's prefill track ``warm_prompt_tokens`` long (0: not before a session
    asks), so its first caller's prompt opens at once too. ``health``: what ``/health`` answers, given
    this server's own report (a Ray Serve replica adds its deployment's)."""
    server = RealtimeServer(model, model_name=model_name, max_sessions=max_sessions, api_key=api_key, clock=clock,
                            max_message_bytes=max_message_bytes, max_buffered_seconds=max_buffered_seconds,
                            max_unsent_seconds=max_unsent_seconds, turn_taking=turn_taking, catch_up=catch_up,
                            max_step_fraction=max_step_fraction, prompt_cache_bytes=prompt_cache_bytes,
                            warm_prompt_tokens=warm_prompt_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.scheduler.stop()

    app = FastAPI(title="nvchat_torch realtime server", lifespan=lifespan)
    app.state.realtime = server
    app.add_middleware(OriginPolicy, allow_origins=list(allow_origins))

    @app.get("/health")
    async def health_report() -> dict:
        return server.health() if health is None else await health(server.health())

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        if not server.authorized(ws, offered):
            body = {"type": "error", "event_id": new_id("event"), "error": {
                "type": "invalid_request_error", "code": "invalid_api_key", "param": None, "event_id": None,
                "message": "missing or wrong API key: send 'Authorization: Bearer <key>'"}}
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(JSONResponse(body, status_code=401))
            else:
                await ws.close(code=1008)
            return
        full = server.try_reserve()
        if full is not None:  # refused before the upgrade: no session is created, accepted or closed
            body = {"type": "error", "event_id": new_id("event"), "error": {
                "type": "server_error", "code": "server_busy", "param": None, "event_id": None, "message": full}}
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(JSONResponse(body, status_code=503, headers={"Retry-After": "1"}))
            else:  # a server without the denial extension: the GA error, then the close
                await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
                await ws.send_text(json.dumps(body))
                await ws.close(code=1013)
            return
        try:
            await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        except BaseException:
            server.release()
            raise
        connection = Connection(server, ws)
        try:
            await connection.run()
        finally:
            connection.release_slot()

    return app


class Connection(ItemEvents, RequestEvents, ResponseEvents):
    """One WebSocket: reads client events, queues model work, turns the worker's outputs into events
    (:class:`~nvchat_torch.server.responses.ResponseEvents`)."""

    def __init__(self, server: RealtimeServer, ws: WebSocket):
        self.server, self.ws = server, ws
        self.scheduler = server.scheduler
        cfg = server.model.config
        self.frame_samples = cfg.input_frame_samples
        self.model_rate, self.output_model_rate = cfg.input_sample_rate, cfg.output_sample_rate
        self.eos_id, self.bos_id = cfg.eos_token_id, cfg.bos_token_id
        self.default_instructions = cfg.default_system_prompt
        self.loop = asyncio.get_running_loop()
        # The worker's outputs not yet sent, with the time each arrived; bounded (see _enqueue).
        self.outputs: deque[tuple[float, Output]] = deque()
        self.output_ready = asyncio.Event()
        self.too_slow = asyncio.Event()  # the client does not read its events: the connection is closed
        self.sending_since: float | None = None  # arrival time of the output the pump is sending
        self.released = False  # the server's slot given back (release_slot)
        self.refused: str | None = None  # why the engine would not open a session with this config
        self.send_lock = asyncio.Lock()
        self.session_id = new_id("sess")
        self.dialect: str | None = None  # "ga" or "mlx", fixed by the first session.update or append
        self.config = SessionConfig(turn_taking=server.turn_taking, base_turn_taking=server.turn_taking)
        self._init_items()
        self.handle: int | None = None
        self.in_resampler: StreamResampler | None = None
        self.out_resampler: StreamResampler | None = None
        self.response: Response | None = None  # the open response (GA)
        self.user_item: str | None = None  # the user transcript item being filled (GA)
        self.user_text = ""
        self.turn = TurnState()  # whose turn it is (GA)
        self.phrase = SpokenPhrase()  # what the TTS says during a tool call (GA)
        self.call_start_id = -1  # the start-of-call id while the session runs NVIDIA's tool pipeline
        self.frames = 0
        self.compute_s: deque[float] = deque(maxlen=25)
        self.client_event_id: str | None = None
        self.announce_open = False  # mlx-vlm's session.update is answered once the session is open

    def release_slot(self) -> None:
        """Give back the server's slot (once): as soon as the session is gone, not after the close."""
        if not self.released:
            self.released = True
            self.server.release()

    # ---- plumbing
    async def send(self, payload: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps({"event_id": new_id("event"), **payload}))

    async def send_error(self, code: str, message: str, *, param: str | None = None,
                         kind: str = "invalid_request_error", event_id: Any = _READ) -> None:
        """An ``error`` naming ``event_id``: by default the client event being read; outputs of the
        worker pass the event that queued them (or None)."""
        named = self.client_event_id if event_id is _READ else event_id
        await self.send({"type": "error", "error": {"type": kind, "code": code, "message": message,
                                                    "param": param, "event_id": named}})

    async def _refused(self, out: Output) -> None:
        """The engine would not open the session with these options: the client's error; it may
        send a session.update and start again."""
        self.scheduler.close(self.handle)
        self.handle = None
        self.refused = str(out.error)
        await self.send_error("invalid_value", f"the session cannot start: {out.error}", param="session",
                              event_id=out.tag)

    def _deliver(self, out: Output) -> None:  # on the worker thread
        try:
            self.loop.call_soon_threadsafe(self._enqueue, out)
        except RuntimeError:  # the loop is gone: the connection ended
            pass

    def _enqueue(self, out: Output) -> None:
        """Queue an output for the pump. A client that stops reading blocks the pump's sends (the
        transport's buffer is full); once its oldest unsent output is ``max_unsent_seconds`` old, or
        too many are queued, it is closed (``run``) and its queue dropped, so memory stays bounded."""
        if self.too_slow.is_set():
            return
        now = time.monotonic()
        self.outputs.append((now, out))
        self.output_ready.set()
        oldest = self.sending_since if self.sending_since is not None else self.outputs[0][0]
        if now - oldest > self.server.max_unsent_seconds or len(self.outputs) > self.server.max_unsent_outputs:
            self.outputs.clear()
            self.too_slow.set()

    async def run(self) -> None:
        await self.send({"type": "session.created", "session": self._ga_session()})
        tasks = {asyncio.create_task(self._read()), asyncio.create_task(self._pump()),
                 asyncio.create_task(self.too_slow.wait())}
        crash: BaseException | None = None
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            crash = next((t.exception() for t in done if not t.cancelled() and t.exception() is not None), None)
            if isinstance(crash, WebSocketDisconnect):  # the client left while an event was being sent to it:
                crash = None  # a disconnect, as the reader's own, not a failure of ours
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.handle is not None:  # a disconnect frees the session at once
                self.scheduler.close(self.handle)
            self.release_slot()
        if crash is not None:  # a bug of ours, not the client's: said, logged, and the connection ends
            log.error("session %s: the connection failed", self.session_id, exc_info=crash)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.send_error("internal_error", f"the server failed: {crash!r}",
                                                       kind="server_error", event_id=None), timeout=2.0)
                await asyncio.wait_for(self.ws.close(code=1011), timeout=2.0)
        elif self.too_slow.is_set():
            reason = f"client too slow: events unread for over {self.server.max_unsent_seconds:g} s"
            log.warning("session %s closed: %s", self.session_id, reason)
            # Its slot is free already. The close frame queues behind the events the client has not
            # read: it gets it if it reads within CLOSE_WAIT_SECONDS, else the connection is dropped.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code=CLOSE_TOO_SLOW, reason=reason), timeout=CLOSE_WAIT_SECONDS)

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
                except RecursionError:
                    raise ClientError("invalid_json", "message is nested too deeply to parse") from None
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
            if self.dialect is None:
                self.dialect = "mlx" if is_mlx_update(session) else "ga"
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
                await self._cancel_response()
        elif etype == "output_audio_buffer.clear":
            # the client plays the deltas itself (WebSocket): there is no server-side buffer to clear
            await self.send({"type": "output_audio_buffer.cleared",
                             "response_id": None if self.response is None else self.response.id})
        elif etype == "response.create":
            if self.dialect != "mlx":  # mlx-vlm's dialect has no responses to ask for
                await self._response_create(event)
        elif etype == "conversation.item.create":
            await self._item_create(event)
        elif etype == "conversation.item.truncate":
            await self._item_truncate(event)
        elif etype == "conversation.item.retrieve":
            await self._item_retrieve(event)
        elif etype == "conversation.item.delete":
            await self._item_delete(event)
        elif etype == "session.ping":
            await self.send({"type": "session.pong"})
        else:
            raise ClientError("unknown_event_type", f"unsupported event type {show(etype)}; this server takes "
                              f"{', '.join(GA_EVENTS)}", "type")
        return False

    # ---- configuration
    def _ga_session(self) -> dict:
        cfg = self.config
        # What is in effect: the model always speaks, decides itself when to call a tool, and its RNNT
        # head transcribes; turns are NVIDIA's policy (nvchat.turn_taking) or the model's own.
        detection = cfg.accepted.get("audio.input.turn_detection", ...)
        if detection is ... or cfg.turn_taking_given:
            detection = {"type": "server_vad", "create_response": True, "interrupt_response": True}
        return {"type": "realtime", "object": "realtime.session", "id": self.session_id,
                "model": self.server.model_name,
                "instructions": self.default_instructions if cfg.instructions is None else cfg.instructions,
                "output_modalities": ["audio"],
                "audio": {"input": {"format": format_json(cfg.input_format, cfg.input_rate),
                                    "turn_detection": detection or None if cfg.turn_taking is not None else None,
                                    "transcription": {"model": "nvchat-rnnt"}},
                          "output": {"format": format_json(cfg.output_format, cfg.output_rate),
                                     "voice": self.server.model.config.speaker}},
                "tools": cfg.tools, "tool_choice": "auto",
                "nvchat": {"deterministic": cfg.deterministic, "seed": cfg.seed,
                           "turn_taking": turn_taking_json(cfg.turn_taking), "listening_audio": cfg.listening_audio,
                           "tool_hold": None if cfg.tool_hold is None else cfg.tool_hold.to_dict(),
                           "max_streaming_seconds": cfg.max_streaming_seconds, "stats": cfg.stats,
                           "frame_samples": self.frame_samples, "max_message_bytes": self.server.max_message_bytes,
                           "max_buffered_seconds": self.server.max_buffered_samples / self.model_rate,
                           "max_unsent_seconds": self.server.max_unsent_seconds,
                           # GA keys taken but not acted on (the model has one voice, no VAD, ...)
                           "not_applied": not_applied(cfg),
                           "started": self.handle is not None}}

    async def _ga_update(self, session: dict) -> None:
        cfg = ga_update(self.config, session, tools_supported=_tools_supported())
        if cfg.tools != self.config.tools:
            _check_tools_expressible(self.server.model, cfg.tools)
        if self.handle is not None:
            # The running conversation keeps its prompt, tools and options (its context was prefilled
            # with them): other values are taken, not applied, and listed in nvchat.not_applied.
            for key in FIXED_AFTER_START:
                if getattr(cfg, key) != getattr(self.config, key):
                    cfg.accepted[key] = session["nvchat"][key] if key in session.get("nvchat", {}) else \
                        session.get(key)
                    setattr(cfg, key, getattr(self.config, key))
            if cfg.turn_taking != self.config.turn_taking:  # the policy can change live (from the next frame)
                self.scheduler.call(self.handle, "set_turn_taking", cfg.turn_taking, tag=self.client_event_id)
                if cfg.turn_taking is None:  # see _mark("policy_off")
                    self.scheduler.mark(self.handle, "policy_off")
            if cfg.input_rate != self.config.input_rate:  # the stream so far is resampled to its end first
                self.scheduler.push(self.handle, self.in_resampler(np.zeros(0, np.float32), last=True))
                self.in_resampler = StreamResampler(cfg.input_rate, self.model_rate)
            if cfg.output_rate != self.config.output_rate:
                self.out_resampler = StreamResampler(self.output_model_rate, cfg.output_rate)
        self.config, self.refused = cfg, None
        await self.send({"type": "session.updated", "session": self._ga_session()})

    async def _mlx_update(self, session: dict) -> None:
        if self.handle is not None:
            raise ClientError("invalid_state", "the active session cannot be reconfigured")
        # mlx-vlm has no turn-taking: the policy only where nvchat.turn_taking asks for it
        self.config = mlx_update(dataclasses.replace(self.config, turn_taking=None), session,
                                 input_rate=self.model_rate, output_rate=self.output_model_rate)
        self._start(announce=True)

    def _start(self, announce: bool = False) -> None:
        options = self.config.options(self.default_instructions)
        self.in_resampler = StreamResampler(self.config.input_rate, self.model_rate)
        self.out_resampler = StreamResampler(self.output_model_rate, self.config.output_rate)
        self.announce_open = announce
        self.handle = self.scheduler.open(options, self._deliver, tag=self.client_event_id)
        if self.config.tools and self.config.tool_hold is not None:  # its calls run NVIDIA's pipeline
            self.call_start_id = _call_start_id(self.server.model, self.config.tools)
        if self.response is not None and self.response.waiting:  # asked for before the start: the
            self._force_turn()  # agent speaks from the first frame

    # ---- audio in
    def _append(self, event: dict) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientError("invalid_value", "input_audio_buffer.append needs 'audio': base64 pcm16", "audio")
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raw = None
        # strict: only the canonical encoding (padding where it belongs), as every encoder writes it
        if raw is None or base64.b64encode(raw).decode("ascii") != audio:
            raise ClientError("invalid_base64", "'audio' is not valid base64 (standard alphabet, padded)", "audio")
        width = 2 if self.config.input_format == "audio/pcm" else 1  # bytes per sample: pcm16, G.711
        if len(raw) % width:
            raise ClientError("invalid_audio_length", f"pcm16 audio needs an even number of bytes, got {len(raw)}",
                              "audio")
        if "sample_rate" in event:  # mlx-vlm's field
            if self.dialect is None:
                self.dialect = "mlx"
                self.config = dataclasses.replace(self.config, input_rate=self.model_rate,
                                                  output_rate=self.output_model_rate, turn_taking=None)
            rate = event["sample_rate"]
            if rate != self.config.input_rate:
                raise ClientError("unsupported_audio_format", f"sample_rate {show(rate)} does not match the session's "
                                  f"input rate {self.config.input_rate}", "sample_rate")
        self.dialect = self.dialect or "ga"
        if self.handle is not None:
            # A client sending faster than real time queues audio; past the bound the append is refused
            # (whole, so the stream stays as sent up to it) and the session goes on.
            incoming = len(raw) // width * self.model_rate // self.config.input_rate
            backlog = self.scheduler.backlog_samples(self.handle)
            limit = self.server.max_buffered_samples
            if backlog + incoming > limit:
                raise ClientError("input_audio_buffer_full", f"this append would buffer "
                                  f"{(backlog + incoming) / self.model_rate:.1f} s of audio not yet run, over the "
                                  f"limit of {limit / self.model_rate:.1f} s; send audio at real-time pace (the "
                                  "append was dropped)", "audio")
        elif self.refused is not None:
            raise ClientError("invalid_value", f"the session cannot start: {self.refused}; send a session.update "
                              "that fixes it", "session")
        else:
            self._start()
        samples = self.in_resampler(decode_audio(raw, self.config.input_format))
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

    # ---- model outputs
    async def _pump(self) -> None:
        while True:
            while not self.outputs:
                self.output_ready.clear()
                await self.output_ready.wait()
            self.sending_since, out = self.outputs.popleft()
            if self.dialect == "mlx":
                done = await self._mlx_output(out)
            else:
                done = await self._ga_output(out)
            self.sending_since = None
            if done:
                return

    async def _stats(self, out: Output) -> None:
        """A step that heard a frame of audio: counted (``frames``, what ``audio_end_ms`` and the usage
        read), its compute time kept, and every fifth an ``nvchat.stats``."""
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
