"""Who may use the server from a browser: ``Origin`` and ``Host`` checks, and the API key.

Browsers do not apply CORS to WebSockets, so any page could open a local server. The server accepts
a request only with no ``Origin``, its own origin or an allowed one. A loopback server also requires
a loopback ``Host``, against DNS rebinding. Refusals are HTTP 403 before any WebSocket is accepted.
Design: docs/server.md, "Who may connect".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
from typing import Any, Iterable
from urllib.parse import urlsplit

__all__ = ["OriginPolicy", "normalize_origin", "is_loopback", "keys_equal"]

log = logging.getLogger("nvchat_torch.server")

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (brackets allowed)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case with the default port dropped; ValueError if it is not one."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{origin!r} is not an origin such as 'https://app.example.com' or 'http://localhost:3000'")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    default = 80 if parts.scheme == "http" else 443
    port = parts.port
    return f"{parts.scheme}://{host}" + ("" if port in (None, default) else f":{port}")


def _split_host(value: str) -> tuple[str, int | None]:
    """A ``Host`` header -> (host, port or None)."""
    parts = urlsplit(f"//{value}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    return (parts.hostname or "").lower(), port


def keys_equal(given: str, expected: str) -> bool:
    """Constant-time comparison of API keys (of their digests, so that not even the length leaks)."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


class OriginPolicy:
    """The ``Origin``/``Host`` rule above, as a pure ASGI middleware around the app (HTTP and WebSocket)."""

    def __init__(self, app: Any, allow_origins: Iterable[str] = ()):
        self.app = app
        self.allowed = {normalize_origin(o) for o in allow_origins}
        self.allowed_hosts = {urlsplit(o).hostname for o in self.allowed}

    def refusal(self, scope: dict) -> str | None:
        """Why the request is refused, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host_header = headers.get("host", "")
        host, port = _split_host(host_header)
        bound = scope.get("server") or ("", None)
        if bound[0] and is_loopback(bound[0]) and not (is_loopback(host) or host in self.allowed_hosts):
            return (f"Host {host_header!r} is not this machine: a server bound to {bound[0]} answers only "
                    "requests for localhost/127.0.0.1 (or an --allow-origin host), which stops DNS rebinding")
        origin = headers.get("origin")
        if origin is None:
            return None  # not a browser page: the SDK, curl, the command-line client
        try:
            normalized = normalize_origin(origin)
        except ValueError:
            return f"Origin {origin!r} is not a valid origin"
        if normalized in self.allowed:
            return None
        own_port = bound[1] if port is None else port
        if bound[0] and is_loopback(bound[0]):  # this machine's names for it: localhost, 127.0.0.1, [::1]
            parts = urlsplit(normalized)
            if is_loopback(parts.hostname or "") and (parts.port or (80 if parts.scheme == "http" else 443)) == bound[1]:
                return None
        for scheme in ("http", "https"):
            default = 80 if scheme == "http" else 443
            own = f"{scheme}://{host}" + ("" if own_port in (None, default) else f":{own_port}")
            if normalized == own:
                return None
        return (f"Origin {origin!r} may not use this server: only its own pages (and clients that send no "
                "Origin) are accepted; start it with --allow-origin ORIGIN to admit another site")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        reason = self.refusal(scope)
        if reason is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"type": "error", "error": {"type": "invalid_request_error", "code": "origin_not_allowed",
                                                      "message": reason, "param": None, "event_id": None}}).encode()
        log.warning("refused %s %s: %s", scope["type"], scope.get("path"), reason)
        if scope["type"] == "http":
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 403, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        else:  # closing a WebSocket before accepting it is an HTTP 403 (browsers show no body anyway)
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
