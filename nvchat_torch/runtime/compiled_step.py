"""``torch.compile`` for the frame step's device part (:meth:`FrameStep.run`'s middle), as gpt-fast compiles
its decode step: one graph per frame, caches updated in place, positions as tensors.

What makes the step compilable whole (``fullgraph=True``): it reads no host-side position (the cache
positions ride in the rows' table, and attention runs over the whole key/value buffers with masks
made from them), it takes its random numbers drawn already (:class:`~nvchat_torch.models.mog.Draws`), it
writes every cache in place, and the buffers grow outside it, a block at a time. Their capacity is
marked dynamic, so a growing cache compiles nothing; CUDA graphs (``mode="reduce-overhead"``, the
default on CUDA) are recorded per shape, so one is recorded when a block is added, never per frame.

Each kind of layer (Mamba, attention and MLP blocks, Conformer layers, the TTS's sliding and global
layers) is a nested compile region (:func:`~nvchat_torch.models.layers.layer_step`): traced and compiled once,
stamped out for the other layers of its kind, which bounds the compile time of the one graph. So are
the loops over repeated work: the RNNT's symbols and the 31 quantizers' codebook searches.

A second process need not compile again: with inductor (and no CUDA graphs), each graph is compiled
ahead of its first call (``aot_compile``) and kept in a store (:func:`default_store`), keyed by all it
was made from (torch, this package's source, the machine, the model's layout, the graph's flags and
batch), so a later process loads the graph's kernels and skips the compiler front end. torch's own
guards, those a stored graph can keep, are still checked on every call.

On a Linux CPU the graph is compiled in a forked child process, which shares the model's weights
copy-on-write, stores the graph and exits; this process then loads it as a later one would. The
compiler's own memory (its modules, traced graphs and fragmented heap: ~300 MiB at full size, which a
process that compiled keeps for its life) leaves with the child, and the compiler does not hold this
process's interpreter lock meanwhile, so a server's other sessions stream on. CUDA and MPS cannot run
in a forked child, and on macOS forking a process that has used the system frameworks is unsafe (as
Python's own default for multiprocessing says): there the graph is compiled in this process.

What it leaves eager: the prompt prefill and the speaker warmup (once per session, long sequences),
and the cache-free diagnostics. The fused CPU kernels (:mod:`~nvchat_torch.models.cpu_kernels`) are not used
under it: the compiler fuses the composite code, which is what MPS and CUDA run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import os
import platform
import signal
import sys
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..diagnostics import return_freed_memory

__all__ = ["StepCompiler", "CompiledStep", "BACKENDS", "STORE_ENV", "batch_bucket", "default_store"]

STORE_ENV = "NVCHAT_TORCH_COMPILE_STORE"
VARIANTS = 8  # graphs kept per store key (one per set of guards), as dynamo's cache_size_limit bounds its own

BACKENDS = ("inductor", "aot_eager", "eager")


def batch_bucket(rows: int) -> int:
    """The batch a compiled step runs ``rows`` rows at: the next power of two, so that rows joining and
    leaving an engine use a bounded set of graphs (1, 2, 4, 8, ... for up to that many rows)."""
    return 1 if rows <= 1 else 1 << (rows - 1).bit_length()


def default_store() -> Path | None:
    """Where compiled frame steps are kept for later processes: ``$NVCHAT_TORCH_COMPILE_STORE`` (a folder;
    "off" keeps none), else ``nvchat_torch/compiled`` in ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    value = os.environ.get(STORE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nvchat_torch" / "compiled"


@dataclass
class StepCompiler:
    """How a model's frame steps are compiled (``load_model(..., compile=True)``; one per model, shared by
    its sessions and engines). ``backend``: torch.compile's (inductor makes kernels; "aot_eager" and
    "eager" only trace, which is what the graph counts are tested with; a callable is torch.compile's
    custom backend). ``mode``: None, or
    ``"reduce-overhead"`` (CUDA graphs), the default on CUDA. ``store``: the folder compiled graphs are
    kept in (:func:`default_store`; None keeps none), used with inductor without CUDA graphs (a stored
    graph holds inductor's kernels; CUDA graphs are recorded in the process that runs them)."""

    device: torch.device
    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    store: Path | None = field(default_factory=default_store)
    loaded: int = 0  # graphs loaded from the store
    precompiled: int = 0  # graphs compiled ahead of their first call (and stored)
    not_stored: str | None = None  # why a graph was not stored or not loaded (the last reason)
    ahead_failed: bool = False  # compiling ahead failed once: this model's steps take torch.compile's path
    # Compile each stored graph in a forked child process (see the module's docstring): on Linux, for the
    # CPU; set False after a child fails, so this model's next graphs compile in this process.
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
        if self.stores:
            _package_digest()  # the source as loaded now, not as it may be on disk at the first frame

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

    @property
    def stores(self) -> bool:
        """Whether graphs are compiled ahead and kept (see ``store``)."""
        return self.store is not None and self.backend == "inductor" and self.mode is None and not self.ahead_failed

    @property
    def compiles_in_child(self) -> bool:
        """Whether a graph to store is compiled in a forked child process (``in_child``, the CPU)."""
        return self.stores and self.in_child and self.device.type == "cpu" and hasattr(os, "fork")

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
        if self.not_stored:
            kept += f"; {self.not_stored}"
        mode = f", mode {self.mode}" if self.mode else ""
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "a custom backend")
        return (f"frame step: compiled whole (torch.compile, {backend}{mode}, fullgraph, the key/value capacity "
                f"dynamic, batches in powers of two, each layer kind compiled once as a nested region); eager: "
                f"the prompt prefill, the speaker warmup and the "
                f"cache-free diagnostics (once per session, or diagnostics); fused CPU kernels: not used "
                f"(the compiler fuses the composite code, the path MPS and CUDA run){kept}")



_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides", "_specialize_on",
          "_has_dynamo_dim_marking")


class CompiledStep:
    """A frame step's device part (``device_step(step, stamps)``, a bound method) compiled whole, and
    called as ``compiled(step)``. ``dynamic()`` gives the key/value buffers whose capacity (dim 2) is
    dynamic; :meth:`buffers_changed` says they were replaced (grown, or a new batch).

    With a store (:attr:`StepCompiler.stores`), each graph (one per flags and batch) is compiled ahead
    (``aot_compile``) the first time it is needed (in a forked child process on a Linux CPU,
    :attr:`StepCompiler.compiles_in_child`), saved, and loaded by later processes. Only the
    guards a saved graph can hold are kept (tensor layouts, constants, shapes; not object identities,
    which a new process cannot match): the store's key stands for the rest. Where compiling ahead
    fails (an experimental torch API), the step falls back to ``torch.compile``'s own path, which
    traces in every process, and :meth:`StepCompiler.describe` says why."""

    def __init__(self, compiler: StepCompiler, device_step: Callable[..., torch.Tensor],
                 dynamic: Callable[[], list[torch.Tensor]]) -> None:
        self.compiler, self.dynamic = compiler, dynamic
        self.function, self.owner = device_step.__func__, device_step.__self__  # type: ignore[attr-defined]
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
        if self.traced is None and self.compiler.stores:
            args = (self.owner, step, None)
            graphs = self.compiler.graphs.setdefault(picks, [])
            # The first graph whose guards hold (as dynamo keeps one cache entry per set of guards: two
            # sessions whose constants differ, say turn-taking settings, each get theirs). A graph found
            # runs without the compiler's settings, which only tracing and code generation read.
            graph = next((g for g in graphs if g.guard_check(*args)), None)
            if graph is None:
                try:
                    with self.compiler.settings():
                        key = self._key(step)
                        graph = self._load(key, args) or self._compile_ahead(key, args)
                    graphs.append(graph)
                    return_freed_memory()  # the compiler's (or the file's) transients, which glibc would keep
                except _CannotStore as e:
                    self.compiler.ahead_failed = True
                    self.compiler.not_stored = f"not kept after all: compiled in each process instead ({e})"
                    warnings.warn(f"nvchat_torch: the frame step is not kept compiled: {e}", stacklevel=2)
            if graph is not None:
                return graph.fn(*args)
        with self.compiler.settings():  # torch.compile's path may trace again on any call
            if self.traced is None:
                self.traced = self.compiler.wrap(self.function.__get__(self.owner))
            if self.unmarked:  # new buffers: their capacity is dynamic to the compiler
                self.compiler.mark_capacity(self.dynamic())
                self.unmarked = False
            return self.traced(step, None)

    # ---- the store
    def _variants(self, key: str) -> list[Path]:
        """The store's files for ``key``: the graphs compiled for it, one per set of guards, at most
        :data:`VARIANTS` (a further one replaces the last)."""
        assert self.compiler.store is not None
        return [self.compiler.store / f"frame-step-{key}{f'-{n}' if n else ''}.bin" for n in range(VARIANTS)]

    def _load(self, key: str, args: tuple, count: bool = True) -> Any:
        from torch._guards import TracingContext, tracing

        for path in self._variants(key):
            if not path.is_file():
                return None
            try:
                # torch 2.13 rebuilds some guard sources (imported modules) by installing a guard, which
                # needs a tracing context: an empty one serves.
                with tracing(TracingContext(None)), path.open("rb") as f:
                    graph: Any = torch.compiler.load_compiled_function(f)
            except Exception as e:  # noqa: BLE001 - a stale or broken file is compiled again and replaced
                self.compiler.not_stored = f"{path.name} could not be loaded ({type(e).__name__}: {e}); compiled again"
                path.unlink(missing_ok=True)
                return None
            if graph.guard_check(*args):
                self.compiler.loaded += count
                return graph
        return None

    def _compile_ahead(self, key: str, args: tuple) -> Any:
        """The graph for ``key`` compiled ahead and stored: in a child process where it can be (then
        loaded from the store), else in this one."""
        compiler = self.compiler
        if compiler.compiles_in_child:
            reason = self._compile_in_child(key, args)
            graph = None if reason else self._load(key, args, count=False)
            if graph is not None:
                compiler.precompiled += 1
                return graph
            compiler.in_child = False
            reason = reason or "the graph its child process stored did not load"
            compiler.not_stored = f"compiled in this process: {reason}"
            warnings.warn(f"nvchat_torch: {compiler.not_stored}", stacklevel=3)
        graph = self._compile(args)
        compiler.precompiled += 1
        reason = self._save(graph, key)
        if reason:
            compiler.not_stored = reason
        return graph

    def _compile_in_child(self, key: str, args: tuple) -> str | None:
        """Compile and store the graph for ``key`` in a forked child process: None once it is stored, else
        why not. A child that cannot compile ahead raises :class:`_CannotStore` here, as this process would."""
        from torch._dynamo.convert_frame import compile_lock

        read, write = os.pipe()
        # Python 3.12+ warns that a threaded process may deadlock in a forked child: this child runs only
        # the compiler, on this thread's objects, and leaves by os._exit (nothing of the parent's runs
        # there: no atexit handler, no buffered output flushed twice). It forks holding dynamo's lock,
        # so no other thread of this process is inside the compiler, holding it where the child could
        # never have it back.
        with compile_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            # Frozen, this process's objects are left alone by the child's garbage collector, whose
            # scans would write to (and so copy) every page holding one: Python's advice for fork.
            gc.freeze()
            pid = -1
            try:
                pid = os.fork()
            except OSError as e:  # no memory or processes left for a child: this process compiles
                os.close(read)
                os.close(write)
                return f"no child process could be made ({e})"
            finally:
                if pid != 0:
                    gc.unfreeze()
        if pid == 0:
            code, message = 1, "the child process failed"
            try:
                os.close(read)
                for sig in (signal.SIGINT, signal.SIGTERM):  # stopping the parent's session stops it too
                    signal.signal(sig, signal.SIG_DFL)
                from torch._inductor.async_compile import AsyncCompile

                AsyncCompile.pool.cache_clear()  # a thread pool of the parent's has no threads here
                message = self._save(self._compile(args), key) or ""
                code = 1 if message else 0
            except _CannotStore as e:
                code, message = 2, str(e)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which compiles instead
                message = f"{type(e).__name__}: {e}"
            finally:
                try:
                    os.write(write, message.encode()[:4096])
                finally:
                    os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code == 2:
            raise _CannotStore(message)
        if code < 0:
            return f"the child process compiling the graph was stopped by signal {-code}"
        return f"the child process could not compile or store the graph ({message})" if code else None

    def _compile(self, args: tuple) -> Any:
        buffers = self.dynamic()
        self.compiler.mark_capacity(buffers)  # traced with their capacity dynamic ...
        try:
            compiled: Any = self.compiler.wrap(self.function, guard_filter_fn=_storable_guards)
            return compiled.aot_compile((args, {}))
        except Exception as e:  # noqa: BLE001 - torch.compile's own path is the fallback
            raise _CannotStore(f"aot_compile failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
        finally:
            # ... and then unmarked: a stored graph's guards (torch 2.13) expect the buffers unmarked.
            for t in buffers:
                for name in _MARKS:
                    if hasattr(t, name):
                        delattr(t, name)

    def _save(self, graph: Any, key: str) -> str | None:
        """``graph`` kept in the store under ``key``: None, else why it was not."""
        variants = self._variants(key)
        path = next((p for p in variants if not p.is_file()), variants[-1])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))  # written to a temporary file, then renamed
        except Exception as e:  # noqa: BLE001 - it still runs here; a later process compiles again
            return f"{path.name} could not be saved ({type(e).__name__}: {e})"
        return None

    def _key(self, step: Any) -> str:
        """Everything the step's graph is made from, hashed: torch and this package's source, the device
        and machine, the compiler's settings (and the CPU threads its kernels are built for), the model
        (its configuration, the layout of every parameter and buffer, and its modules' plain settings),
        and the step's flags and layout."""
        compiler = self.compiler
        if compiler.key_base is None:  # computed once per model, on its first miss
            compiler.key_base = [torch.__version__, _package_digest(), str(compiler.device), _machine(compiler.device),
                                 repr(compiler.backend), repr(compiler.mode), _model_digest(self.owner.model)]
        parts = compiler.key_base + [_inductor_settings(), _threads(compiler.device), _layout(step)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


class _CannotStore(Exception):
    pass


def _storable_guards(entries: list[Any]) -> list[bool]:
    """The guards a stored graph keeps: not those on globals, object identities or versions (a new
    process's objects are new), which torch cannot save; the store's key stands for them."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsaved or unsaved.intersection(e.derived_guard_types)) for e in entries]


@functools.cache
def _package_digest() -> str:
    """This package's Python source, hashed: a stored graph is this code traced."""
    root = Path(__file__).resolve().parents[1]  # the whole package, not only this folder
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _machine(device: torch.device) -> str:
    """What a CPU graph's kernels were built for (inductor compiles them for this machine's vector ISA)."""
    if device.type != "cpu":
        return platform.machine()
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"{platform.machine()} {pick_vec_isa()} {torch.backends.cpu.get_cpu_capability()}"


def _threads(device: torch.device) -> str:
    """The CPU threads a graph's kernels run on: inductor writes the count into each parallel loop
    (``torch.get_num_threads()`` at code generation), so a graph built for 2 threads would run on 2
    in a process set to 1 or 16."""
    from torch._inductor.utils import parallel_num_threads

    return f"threads {parallel_num_threads()}" if device.type == "cpu" else ""


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype))


def _inductor_settings() -> str:
    """Inductor's settings that are plain values (the ones code generation reads)."""
    import torch._inductor.config as inductor

    portable = inductor.save_config_portable()  # type: ignore[attr-defined]
    return repr(sorted((k, v) for k, v in portable.items() if _plain(v)))


def _model_digest(model: torch.nn.Module) -> str:
    """A model as a graph sees it: its configuration, each parameter's and buffer's name, shape and dtype,
    and each module's plain settings (flags, sizes, constants)."""
    h = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    for name, module in model.named_modules():
        settings = sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and _plain(v))
        tensors = [(k, tuple(t.shape), t.dtype) for k, t in list(module._parameters.items()) + list(module._buffers.items())
                   if t is not None]
        h.update(repr((name, type(module).__qualname__, settings, tensors)).encode())
    return h.hexdigest()


def _layout(value: Any) -> str:
    """A step's inputs as the graph sees them: tensors by shape and dtype, dataclasses field by field."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}(" + ",".join(_layout(getattr(value, f.name)) for f in dataclasses.fields(value)) + ")"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_layout(v) for v in value) + "]"
    return repr(value)
