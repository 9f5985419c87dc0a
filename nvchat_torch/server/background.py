"""The realtime server in a thread of this process: for notebooks, tests and benchmarks that drive it
from the same Python process (``python -m nvchat_torch.server`` runs it on its own)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

from .app import WS_MAX_BYTES, listen_socket

__all__ = ["serve_in_thread"]


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    start_timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` (``create_app(...)``) on uvicorn in a daemon thread, listening as the command line
    does (``port`` 0: a free one); yields ``"host:port"`` once it accepts connections, and stops it on
    exit."""
    import uvicorn

    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=bound, ws_max_size=WS_MAX_BYTES,
                                           log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="nvchat-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{bound} within {start_timeout:g} s")
        time.sleep(0.02)
    try:
        yield f"{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
