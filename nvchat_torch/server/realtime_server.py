"""What the realtime server's connections share: the model's frame scheduler, the session slots and the
limits that refuse a new session, the API key, ``/health``; and the listening socket."""

from __future__ import annotations

import math
import socket
import threading
from typing import Any

from fastapi import WebSocket

from .scheduler import WARM_PROMPT_TOKENS, FrameScheduler
from .security import keys_equal
from .session_config import turn_taking_config

__all__ = ["RealtimeServer", "listen_socket", "MAX_MESSAGE_BYTES", "WS_MAX_BYTES", "MAX_BUFFERED_SECONDS",
           "MAX_UNSENT_SECONDS", "MAX_STEP_FRACTION", "PROMPT_CACHE_BYTES"]

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a larger client message is answered with `message_too_large`
WS_MAX_BYTES = 64 * 1024 * 1024  # the transport's own limit, above ours so that oversize messages get an answer
MAX_BUFFERED_SECONDS = 30.0  # input audio received and not yet run, per session; more is refused
MAX_UNSENT_SECONDS = 3.0  # a client whose oldest unsent event is older than this is not reading: closed
MAX_STEP_FRACTION = 0.9  # a median step this near the frame (72 of 80 ms) refuses new sessions; 0: never
PROMPT_CACHE_BYTES = 1 << 30  # prefilled prompts kept for the next session with the same one; 0: none
SEND_BUFFER_BYTES = 64 * 1024  # per connection, in the kernel: bounds what a client that stops reading holds


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket the server should run on (``uvicorn.Server.run(sockets=[...])``). Its
    connections inherit a fixed send buffer: Linux otherwise grows it to megabytes for a client that
    does not read, and the server would see that client's backlog (``max_unsent_seconds``) only
    once minutes of events sat in the kernel."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class RealtimeServer:
    """One per server, held by every connection. Its limits default to the module's constants."""

    def __init__(self, model, *, model_name: str, max_sessions: int = 4, api_key: str | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, clock: float | None = None,
                 max_buffered_seconds: float = MAX_BUFFERED_SECONDS, max_unsent_seconds: float = MAX_UNSENT_SECONDS,
                 turn_taking: Any = True, max_step_fraction: float = MAX_STEP_FRACTION,
                 prompt_cache_bytes: int = PROMPT_CACHE_BYTES, catch_up: bool = True,
                 warm_prompt_tokens: int = WARM_PROMPT_TOKENS):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        for name, value in (("max_buffered_seconds", max_buffered_seconds), ("max_unsent_seconds", max_unsent_seconds)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.model = model
        self.model_name = model_name
        self.max_sessions = max_sessions
        self.api_key = api_key
        self.max_message_bytes = max_message_bytes
        self.max_buffered_samples = round(max_buffered_seconds * model.config.input_sample_rate)
        self.max_unsent_seconds = max_unsent_seconds
        # Full also when the step nears the frame: another session would put every caller behind real time.
        self.max_step_s = max_step_fraction * model.config.frame_duration
        # NVIDIA's turn-taking policy for GA sessions (True: its stock values; False/None: the raw model)
        self.turn_taking = turn_taking if not isinstance(turn_taking, bool) else turn_taking_config(turn_taking)
        # Outputs (one per frame, mostly) a connection may hold unsent, whatever their age: memory stays bounded.
        self.max_unsent_outputs = 4 * math.ceil(max_unsent_seconds / model.config.frame_duration) + 16
        self.scheduler = FrameScheduler(model, max_sessions=max_sessions, clock=clock, catch_up=catch_up,
                                        prompt_cache_bytes=prompt_cache_bytes, warm_prompt_tokens=warm_prompt_tokens)
        self._lock = threading.Lock()
        self.active = 0

    def try_reserve(self) -> str | None:
        """Take a session slot; or why the server is full (and no slot is taken)."""
        with self._lock:
            full = self._refusal()
            if full is None:
                self.active += 1
            return full

    def refusal(self) -> str | None:
        """Why a new session would be refused now, or None (nothing is reserved)."""
        with self._lock:
            return self._refusal()

    def _refusal(self) -> str | None:
        if self.active >= self.max_sessions:
            return f"all {self.max_sessions} sessions are in use; try again later"
        step = self.scheduler.median_step_s()
        if self.active and self.max_step_s and step >= self.max_step_s:
            return (f"the server is at its real-time limit: its median step of {step * 1000:.0f} ms with "
                    f"{self.active} sessions is near the {self.model.config.frame_duration * 1000:.0f} ms "
                    "frame; try again later")
        return None

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
        return given is not None and keys_equal(given, self.api_key)

    def health(self) -> dict:
        """``GET /health``: the model, the sessions, the step time against its limit, and the sessions' lags."""
        return {"status": "ok", "model": self.model_name, "device": str(self.model.device),
                "dtype": str(self.model.dtype).replace("torch.", ""), "active_sessions": self.active,
                "max_sessions": self.max_sessions, "median_step_ms": round(self.scheduler.median_step_s() * 1000, 1),
                "max_step_ms": round(self.max_step_s * 1000, 1), "catch_up": self.scheduler.catch_up,
                "catch_up_steps": self.scheduler.catch_up_steps, **self.scheduler.lag_report()}
