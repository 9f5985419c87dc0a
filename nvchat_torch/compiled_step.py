"""``torch.compile`` for the frame step's device part (:meth:`FrameStep.run`'s middle), as gpt-fast compiles
its decode step: one graph per frame, caches updated in place, positions as tensors.

What makes the step compilable whole (``fullgraph=True``): it reads no host-side position (the cache
positions ride in the rows' table, and attention runs over the whole key/value buffers with masks
made from them), it takes its random numbers drawn already (:class:`~nvchat_torch.mog.Draws`), it
writes every cache in place, and the buffers grow outside it, a block at a time. Their capacity is
marked dynamic, so a growing cache compiles nothing; CUDA graphs (``mode="reduce-overhead"``, the
default on CUDA) are recorded per shape, so one is recorded when a block is added, never per frame.

Each kind of layer (Mamba, attention and MLP blocks, Conformer layers, the TTS's sliding and global
layers) is a nested compile region (:func:`~nvchat_torch.layers.layer_step`): traced and compiled once,
stamped out for the other layers of its kind, which bounds the compile time of the one graph.

What it leaves eager: the prompt prefill and the speaker warmup (once per session, long sequences),
and the cache-free diagnostics. The fused CPU kernels (:mod:`~nvchat_torch.cpu_kernels`) are not used
under it: the compiler fuses the composite code, which is what MPS and CUDA run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StepCompiler", "BACKENDS", "batch_bucket"]

BACKENDS = ("inductor", "aot_eager", "eager")


def batch_bucket(rows: int) -> int:
    """The batch a compiled step runs ``rows`` rows at: the next power of two, so that rows joining and
    leaving an engine use a bounded set of graphs (1, 2, 4, 8, ... for up to that many rows)."""
    return 1 if rows <= 1 else 1 << (rows - 1).bit_length()


@dataclass
class StepCompiler:
    """How a model's frame steps are compiled (``load_model(..., compile=True)``; one per model, shared by
    its sessions and engines). ``backend``: torch.compile's (inductor makes kernels; "aot_eager" and
    "eager" only trace, which is what the graph counts are tested with; a callable is torch.compile's
    custom backend). ``mode``: None, or
    ``"reduce-overhead"`` (CUDA graphs), the default on CUDA."""

    device: torch.device
    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.backend, str) and self.backend not in BACKENDS:
            raise ValueError(f"compile: the backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.mode is None and self.device.type == "cuda" and self.backend == "inductor":
            self.mode = "reduce-overhead"

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """The compiler settings a step runs under (set per call, so the process's own are left alone):
        only the marked dimensions are dynamic (a batch size is a new graph, from a bounded set, never a
        dynamic one), two dimensions that happen to be equal stay two symbols (the LLM's and TTS's
        capacities are equal at times), room for every graph of the bounded set, and inductor keeps the
        roundings of bf16 chains (``emulate_precision_casts``), which the faithful bf16 networks need."""
        import torch._dynamo.config as dynamo
        import torch._inductor.config as inductor
        import torch.fx.experimental._config as fx

        with dynamo.patch(automatic_dynamic_shapes=False, cache_size_limit=64, accumulated_cache_size_limit=256), \
                fx.patch(use_duck_shape=False), inductor.patch(emulate_precision_casts=True):  # type: ignore[attr-defined]
            yield

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` compiled whole: no graph break is allowed inside it."""
        return torch.compile(step, fullgraph=True, backend=self.backend, mode=self.mode)

    @staticmethod
    def mark_capacity(tensors: list[torch.Tensor], dim: int = 2) -> None:
        """Mark the key/value buffers' capacity dimension dynamic (after each growth: a grown buffer is a
        new tensor), so a cache growing compiles nothing."""
        for t in tensors:
            torch._dynamo.mark_dynamic(t, dim)

    def describe(self) -> str:
        mode = f", mode {self.mode}" if self.mode else ""
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "a custom backend")
        return (f"frame step: compiled whole (torch.compile, {backend}{mode}, fullgraph, the key/value capacity "
                f"dynamic, batches in powers of two, each layer kind compiled once as a nested region); eager: "
                f"the prompt prefill, the speaker warmup and the "
                f"cache-free diagnostics (once per session, or diagnostics); fused CPU kernels: not used "
                f"(the compiler fuses the composite code, the path MPS and CUDA run)")

