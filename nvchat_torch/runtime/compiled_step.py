"""``torch.compile`` for the frame step's device part, as gpt-fast compiles its decode step: one graph
per frame, the caches written in place, the key/value capacity dynamic, batches in powers of two.

Keeping compiled graphs for later processes is :mod:`.graph_store`. The design and its measurements
are in docs/performance.md, "The compiled frame step"."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .graph_store import GraphStore, default_store, package_digest

__all__ = ["StepCompiler", "CompiledStep", "BACKENDS", "batch_bucket", "vector_bits"]

BACKENDS = ("inductor", "aot_eager", "eager")


def batch_bucket(rows: int) -> int:
    """The batch a compiled step runs ``rows`` rows at: the next power of two, so that rows joining and
    leaving an engine use a bounded set of graphs (1, 2, 4, 8, ... for up to that many rows)."""
    return 1 if rows <= 1 else 1 << (rows - 1).bit_length()


@functools.cache  # the dispatch is fixed when torch starts; the compiled path enters settings() every frame
def vector_bits() -> int:
    """The vector width inductor's CPU kernels take under the ATen dispatch in effect (0: none). Left
    unset, inductor reads it from ``ATEN_CPU_CAPABILITY`` but its graph cache does not key on it, so a
    graph cached under one dispatch is reused under another: in torch 2.13 one cached under AVX-512 gave
    wrong values under AVX2, and one cached under AVX2 crashed under AVX-512. Set, it is part of the
    settings the cache keys on."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    import torch._inductor.config as inductor

    with inductor.patch({"cpp.simdlen": None}):  # type: ignore[attr-defined]
        return pick_vec_isa().bit_width()


@dataclass
class StepCompiler:
    """How a model's frame steps are compiled (``load_model(..., compile=True)``): one per model, shared
    by its sessions and engines."""

    device: torch.device
    # torch.compile's backend: inductor makes kernels; "aot_eager" and "eager" only trace (the graph
    # counts are tested with them); a callable is a custom backend.
    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None  # None, or "reduce-overhead" (CUDA graphs), the default on CUDA
    # The folder compiled graphs are kept in for later processes (None keeps none): used with inductor
    # without CUDA graphs, which are recorded in the process that runs them.
    store: Path | None = field(default_factory=default_store)
    loaded: int = 0  # graphs loaded from the store
    precompiled: int = 0  # graphs compiled ahead of their first call, and kept
    store_problem: str | None = None  # the last graph not kept, not loaded, or not compiled in a child
    ahead_failed: bool = False  # compiling ahead failed once: this model's steps take torch.compile's path
    # Compile each kept graph in a forked child process (on Linux, for the CPU; docs/performance.md); set
    # False after a child fails, so this model's next graphs compile in this process.
    in_child: bool = sys.platform == "linux"
    # The graphs loaded or compiled ahead, by what picks them (flags, batch): shared by the model's frame
    # steps (a graph takes its frame step as an argument, and its guards check that step's caches).
    graphs: dict[Hashable, Any] = field(default_factory=dict, repr=False)
    key_base: list[str] | None = field(default=None, repr=False)  # the store key's parts fixed for the model

    def __getstate__(self) -> dict[str, Any]:
        # A compiled graph's guards save the frame step's objects, this one among them: without the graphs.
        return {k: v for k, v in vars(self).items() if k != "graphs"}

    def __post_init__(self) -> None:
        if isinstance(self.backend, str) and self.backend not in BACKENDS:
            raise ValueError(f"compile: the backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.mode is None and self.device.type == "cuda" and self.backend == "inductor":
            self.mode = "reduce-overhead"
        if self.keeps:
            package_digest()  # the source as loaded now, not as it may be on disk at the first frame

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """The compiler settings a step runs under, set per call so the process's own are left alone:
        only the marked dimensions dynamic (a batch size is a new graph, from a bounded set); two
        dimensions that happen to be equal kept two symbols (the LLM's and TTS's capacities are equal at
        times); room for every graph of the set; the roundings of bf16 chains kept
        (``emulate_precision_casts``), which the faithful bf16 networks need; and on a CPU the vector width
        of the dispatch in effect, named (see :func:`vector_bits`)."""
        import torch._dynamo.config as dynamo
        import torch._inductor.config as inductor
        import torch.fx.experimental._config as fx  # duck sizing is on by default in torch 2.13 (pytorch#186373)

        vector = {"cpp.simdlen": vector_bits()} if self.device.type == "cpu" else {}
        with dynamo.patch(automatic_dynamic_shapes=False, cache_size_limit=64, accumulated_cache_size_limit=256), \
                fx.patch(use_duck_shape=False), inductor.patch({"emulate_precision_casts": True, **vector}):  # type: ignore[attr-defined]
            yield

    @property
    def keeps(self) -> bool:
        """Whether graphs are compiled ahead and kept in the store (see ``store``)."""
        return self.store is not None and self.backend == "inductor" and self.mode is None and not self.ahead_failed

    @property
    def compiles_in_child(self) -> bool:
        """Whether a graph to keep is compiled in a forked child process (``in_child``, the CPU)."""
        return self.keeps and self.in_child and self.device.type == "cpu" and GraphStore.can_fork()

    def wrap(self, step: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        """``step`` compiled whole: no graph break is allowed inside it."""
        return torch.compile(step, fullgraph=True, backend=self.backend, mode=self.mode, options=options or None)

    @staticmethod
    def mark_capacity(tensors: list[torch.Tensor], dim: int = 2) -> None:
        """Mark the key/value buffers' capacity dimension dynamic (after each growth: a grown buffer is a
        new tensor), so a cache growing compiles nothing."""
        for t in tensors:
            torch._dynamo.mark_dynamic(t, dim)

    def describe(self) -> str:
        if self.store is None:
            kept = "; compiled graphs not kept (no store)"
        elif self.backend != "inductor" or self.mode is not None:
            kept = "; compiled graphs not kept (kept only with inductor, without CUDA graphs)"
        else:
            where = "in a child process" if self.compiles_in_child else "in this process"
            kept = (f"; compiled graphs kept in {self.store} ({self.loaded} loaded, {self.precompiled} compiled "
                    f"here, {where})")
        if self.store_problem:
            kept += f"; {self.store_problem}"
        mode = f", mode {self.mode}" if self.mode else ""
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "a custom backend")
        return (f"frame step: compiled whole (torch.compile, {backend}{mode}, fullgraph, the key/value capacity "
                f"dynamic, batches in powers of two, each layer kind compiled once as a nested region); eager: "
                f"the prompt prefill, the speaker warmup and the "
                f"cache-free diagnostics (once per session, or diagnostics); fused CPU kernels: not used "
                f"(the compiler fuses the composite code, the path MPS and CUDA run){kept}")


class CompiledStep:
    """A frame step's device part (``device_step(step, stamps)``, a bound method) compiled whole, called
    as ``compiled(step, picks)``. ``dynamic()`` gives the key/value buffers whose capacity (dim 2) is
    dynamic; :meth:`buffers_changed` says they were replaced (grown, or a new batch). Where the
    compiler keeps graphs, each comes from the store (:class:`GraphStore`); else, or where compiling
    ahead fails, from ``torch.compile``'s own path, which traces in every process."""

    def __init__(self, compiler: StepCompiler, device_step: Callable[..., torch.Tensor],
                 dynamic: Callable[[], list[torch.Tensor]]) -> None:
        self.compiler = compiler
        self.function, self.owner = device_step.__func__, device_step.__self__  # type: ignore[attr-defined]
        self.dynamic = dynamic
        self.store = GraphStore(compiler, self.function, self.owner, dynamic)
        self.traced: Callable[..., torch.Tensor] | None = None  # torch.compile's path (no store, or it failed)
        self.unmarked = True

    def buffers_changed(self) -> None:
        self.unmarked = True

    def __getstate__(self) -> dict[str, Any]:
        # A compiled graph's guards save the frame step's objects, this one among them: nothing of it is
        # guarded (the step does not read it), and its compiled functions cannot be saved.
        return {}

    def __call__(self, step: Any, picks: Hashable) -> torch.Tensor:
        """The step's packed output. ``picks``: what picks its graph (the flags and the batch)."""
        if self.traced is None and self.compiler.keeps:
            graph = self.store.graph(step, picks)
            if graph is not None:
                return graph.fn(self.owner, step, None)
        with self.compiler.settings():  # torch.compile's path may trace again on any call
            if self.traced is None:
                self.traced = self.compiler.wrap(self.function.__get__(self.owner))
            if self.unmarked:  # new buffers: their capacity is dynamic to the compiler
                self.compiler.mark_capacity(self.dynamic())
                self.unmarked = False
            return self.traced(step, None)
