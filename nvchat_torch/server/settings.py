"""The server's settings from its command line, for one process or for each Ray Serve replica, and its
torch thread count. Nothing here needs the server extra, so the command can say which extra is missing."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["ServerSettings", "default_threads"]


@dataclass(frozen=True)
class ServerSettings:
    """What a server loads and how its app runs: the command line's options, for one process or for each
    Ray Serve replica (:mod:`.ray_serve`)."""

    model: str | None = None  # checkpoint folder or Hub id (None: the embedded tiny random model)
    device: str | None = None  # cpu, cuda, mps (None: the machine's best)
    dtype: str | None = None  # float32 or bfloat16 (None: the faithful mode)
    weights: str = "auto"  # packed, dequantized or auto
    compile: str | bool = False  # the frame step under torch.compile (a backend name), or eager
    threads: int | None = None  # torch CPU threads (None: default_threads())
    max_sessions: int = 4  # conversations the server (each replica) holds
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' when set
    allow_origins: tuple[str, ...] = ()  # browser pages of other origins that may connect
    turn_taking: bool = True  # NVIDIA's turn-taking policy for GA sessions
    catch_up: bool = True  # late frames made up between the ticks
    max_buffered_seconds: float | None = None  # input a session may queue (None: the server's default)
    warm_prompt_tokens: int | None = None  # the idle prefill track's length (None: the scheduler's default)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        """From ``python -m nvchat_torch.server``'s options."""
        return cls(model=args.model, device=args.device, dtype=args.dtype, weights=args.weights,
                   compile=args.compile, threads=args.threads, max_sessions=args.max_sessions,
                   api_key=args.api_key, allow_origins=tuple(args.allow_origin),
                   turn_taking=args.turn_taking == "on", catch_up=not args.no_catch_up,
                   max_buffered_seconds=args.max_buffer_seconds, warm_prompt_tokens=args.warm_prompt_tokens)

    def model_name(self) -> str:
        return self.model or "nvchat-tiny-random"

    def app_options(self) -> dict[str, Any]:
        """``create_app``'s keyword arguments (the settings left unset keep its defaults)."""
        options: dict[str, Any] = dict(model_name=self.model_name(), max_sessions=self.max_sessions,
                                       api_key=self.api_key, allow_origins=self.allow_origins,
                                       turn_taking=self.turn_taking, catch_up=self.catch_up)
        if self.max_buffered_seconds is not None:
            options["max_buffered_seconds"] = self.max_buffered_seconds
        if self.warm_prompt_tokens is not None:
            options["warm_prompt_tokens"] = self.warm_prompt_tokens
        return options


def default_threads() -> int:
    """The server's torch threads unless ``--threads`` says otherwise: half of torch's default (its
    cores), at least one. The worker's per-frame steps are thousands of small ops whose fork/join
    contends with the event loop and the connections for the same cores (docs/server.md, "Under load")."""
    import torch

    return max(1, torch.get_num_threads() // 2)
