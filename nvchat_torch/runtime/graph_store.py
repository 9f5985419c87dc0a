"""Compiled frame steps kept for later processes: the store's key, loading and saving, and the forked
child that compiles a graph on a Linux CPU. Every private torch API the compiled step needs is here,
each with the torch version it was checked on and what would let it go. The design is in
docs/performance.md, "The compiled frame step"."""

from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import hashlib
import os
import platform
import signal
import warnings
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch

from ..diagnostics import return_freed_memory

__all__ = ["GraphStore", "CannotKeep", "ChildExit", "STORE_ENV", "VARIANTS", "default_store", "package_digest"]

STORE_ENV = "NVCHAT_TORCH_COMPILE_STORE"
VARIANTS = 8  # graphs kept per store key (one per set of guards), as dynamo's cache_size_limit bounds its own

# What mark_dynamic leaves on a tensor. A kept graph's guards expect the buffers unmarked (pytorch#176341
# guards the marks), and torch 2.13 has no public way to unmark one (said in pytorch#194091's review);
# torch's export deletes them the same way. Drop this when a public unmark exists.
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides", "_specialize_on",
          "_has_dynamo_dim_marking")


def default_store() -> Path | None:
    """Where compiled frame steps are kept for later processes: ``$NVCHAT_TORCH_COMPILE_STORE`` (a folder;
    "off" keeps none), else ``nvchat_torch/compiled`` in ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    value = os.environ.get(STORE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "none") else Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nvchat_torch" / "compiled"


class CannotKeep(Exception):
    """Compiling ahead does not work here (``aot_compile`` is experimental in torch 2.13): the model's
    steps take ``torch.compile``'s own path, which traces in every process."""


class ChildExit(enum.IntEnum):
    """How the child process that compiles a graph ends (a negative status: stopped by that signal)."""

    KEPT = 0  # the graph is in the store: this process loads it
    FAILED = 1  # it could not compile or save the graph: this process compiles it
    CANNOT_KEEP = 2  # compiling ahead does not work here: raised in this process as CannotKeep


class Compiler(Protocol):
    """What the store reads and counts of its model's StepCompiler."""

    device: torch.device
    backend: Any
    mode: str | None
    store: Path | None
    loaded: int
    precompiled: int
    store_problem: str | None
    ahead_failed: bool
    in_child: bool
    graphs: dict[Hashable, Any]
    key_base: list[str] | None

    @property
    def compiles_in_child(self) -> bool: ...

    def settings(self) -> AbstractContextManager[None]: ...

    def wrap(self, step: Callable[..., Any], **options: Any) -> Callable[..., Any]: ...

    def mark_capacity(self, tensors: list[torch.Tensor], dim: int = 2) -> None: ...


class GraphStore:
    """One frame step's graphs in its compiler's store: each (one per flags and batch) compiled ahead
    (``aot_compile``) the first time it is needed, saved, and loaded by later processes. A kept graph
    holds only the guards it can (tensor layouts, constants, shapes; not object identities, which a
    new process cannot match): the store's key stands for the rest."""

    def __init__(self, compiler: Compiler, function: Callable[..., torch.Tensor], owner: Any,
                 dynamic: Callable[[], list[torch.Tensor]]) -> None:
        self.compiler, self.function, self.owner, self.dynamic = compiler, function, owner, dynamic

    @staticmethod
    def can_fork() -> bool:
        return hasattr(os, "fork")

    def graph(self, step: Any, picks: Hashable) -> Any:
        """The graph for ``step``: one already here whose guards hold, else loaded, else compiled ahead
        and kept. None where compiling ahead does not work (said once, with why)."""
        compiler = self.compiler
        args = (self.owner, step, None)
        graphs = compiler.graphs.setdefault(picks, [])
        # The first graph whose guards hold, as dynamo keeps one cache entry per set of guards (two
        # sessions whose constants differ, say turn-taking settings, each get theirs). A graph found runs
        # without the compiler's settings, which only tracing and code generation read.
        graph = next((g for g in graphs if g.guard_check(*args)), None)
        if graph is not None:
            return graph
        try:
            with compiler.settings():
                key = self.key(step)
                graph = self.load(key, args) or self.compile_ahead(key, args)
        except CannotKeep as e:
            compiler.ahead_failed = True
            compiler.store_problem = f"not kept after all: compiled in each process instead ({e})"
            warnings.warn(f"nvchat_torch: the frame step is not kept compiled: {e}", stacklevel=3)
            return None
        graphs.append(graph)
        return_freed_memory()  # the compiler's (or the file's) transients, which glibc would keep
        return graph

    def variants(self, key: str) -> list[Path]:
        """The store's files for ``key``: one per set of guards, at most :data:`VARIANTS` (a further one
        replaces the last)."""
        assert self.compiler.store is not None
        return [self.compiler.store / f"frame-step-{key}{f'-{n}' if n else ''}.bin" for n in range(VARIANTS)]

    def load(self, key: str, args: tuple, count: bool = True) -> Any:
        """The kept graph for ``key`` whose guards hold for ``args``, or None. A file that does not load
        is deleted, to be compiled again."""
        # torch 2.13 rebuilds some guard sources (imported modules) by installing a guard, which needs a
        # tracing context: an empty one serves (pytorch#187736). Drop it when unpickling an ImportSource
        # works with no trace active.
        from torch._guards import TracingContext, tracing

        for path in self.variants(key):
            if not path.is_file():
                return None
            try:
                with tracing(TracingContext(None)), path.open("rb") as f:
                    graph: Any = torch.compiler.load_compiled_function(f)
            except Exception as e:  # noqa: BLE001 - a stale or broken file is compiled again and replaced
                self.compiler.store_problem = (f"{path.name} could not be loaded ({type(e).__name__}: {e}); "
                                               "compiled again")
                path.unlink(missing_ok=True)
                return None
            if graph.guard_check(*args):
                self.compiler.loaded += count
                return graph
        return None

    def compile_ahead(self, key: str, args: tuple) -> Any:
        """The graph for ``key`` compiled ahead and kept: in a child process where it can be (then loaded
        from the store), else in this one."""
        compiler = self.compiler
        if compiler.compiles_in_child:
            reason = self.compile_in_child(key, args)
            graph = None if reason else self.load(key, args, count=False)
            if graph is not None:
                compiler.precompiled += 1
                return graph
            compiler.in_child = False
            reason = reason or "the graph its child process kept did not load"
            compiler.store_problem = f"compiled in this process: {reason}"
            warnings.warn(f"nvchat_torch: {compiler.store_problem}", stacklevel=3)
        graph = self.compile(args)
        compiler.precompiled += 1
        reason = self.save(graph, key)
        if reason:
            compiler.store_problem = reason
        return graph

    def compile_in_child(self, key: str, args: tuple) -> str | None:
        """Compile and keep the graph for ``key`` in a forked child process: None once it is kept, else
        why not. A child that cannot compile ahead raises :class:`CannotKeep` here, as this process
        would."""
        # Held across the fork, so that no other thread of this process is inside the compiler, holding
        # its lock where the child could never have it back. Dynamo is not thread- or fork-safe
        # (pytorch#118260) and has no public lock; drop this when it handles fork itself.
        from torch._dynamo.convert_frame import compile_lock

        read, write = os.pipe()
        # Python 3.12+ warns that a threaded process may deadlock in a forked child: this child runs only
        # the compiler, on this thread's objects, and leaves by os._exit (no atexit handler, no buffered
        # output flushed twice).
        with compile_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            # Frozen, this process's objects are left alone by the child's garbage collector, whose scans
            # would write to (and so copy) every page holding one: Python's advice for fork.
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
            self._run_child(read, write, key, args)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status == ChildExit.CANNOT_KEEP:
            raise CannotKeep(message)
        if status < 0:
            return f"the child process compiling the graph was stopped by signal {-status}"
        return None if status == ChildExit.KEPT else f"the child process could not compile or store the graph ({message})"

    def _run_child(self, read: int, write: int, key: str, args: tuple) -> NoReturn:
        """The child's whole life: compile, keep, report on the pipe, and leave by ``os._exit``."""
        code, message = ChildExit.FAILED, "the child process failed"
        try:
            os.close(read)
            for sig in (signal.SIGINT, signal.SIGTERM):  # stopping the parent's session stops it too
                signal.signal(sig, signal.SIG_DFL)
            # The parent's compile thread pool has no threads here: inductor's own after-fork handler
            # (torch 2.13) resets its process pool but not this one. Drop when it does.
            from torch._inductor.async_compile import AsyncCompile

            AsyncCompile.pool.cache_clear()
            message = self.save(self.compile(args), key) or ""
            code = ChildExit.FAILED if message else ChildExit.KEPT
        except CannotKeep as e:
            code, message = ChildExit.CANNOT_KEEP, str(e)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which compiles instead
            message = f"{type(e).__name__}: {e}"
        finally:
            try:
                os.write(write, message.encode()[:4096])
            finally:
                os._exit(code)

    def compile(self, args: tuple) -> Any:
        """The graph for ``args``, compiled ahead (``aot_compile``, experimental in torch 2.13)."""
        buffers = self.dynamic()
        self.compiler.mark_capacity(buffers)  # traced with their capacity dynamic ...
        try:
            compiled: Any = self.compiler.wrap(self.function, guard_filter_fn=_storable_guards)
            return compiled.aot_compile((args, {}))
        except Exception as e:  # noqa: BLE001 - torch.compile's own path is the fallback
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CannotKeep(f"aot_compile failed: {type(e).__name__}: {first}") from e
        finally:
            for t in buffers:  # ... and then unmarked, as a kept graph's guards expect them
                for name in _MARKS:
                    if hasattr(t, name):
                        delattr(t, name)

    def save(self, graph: Any, key: str) -> str | None:
        """``graph`` kept in the store under ``key``: None, else why it was not."""
        variants = self.variants(key)
        path = next((p for p in variants if not p.is_file()), variants[-1])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))  # written to a temporary file, then renamed
        except Exception as e:  # noqa: BLE001 - it still runs here; a later process compiles again
            return f"{path.name} could not be saved ({type(e).__name__}: {e})"
        return None

    def key(self, step: Any) -> str:
        """Everything the step's graph is made from, hashed: torch and this package's source, the device
        and machine, the compiler's settings and the CPU threads its kernels are built for, the model
        (its configuration, the layout of every parameter and buffer, its modules' plain settings), and
        the step's flags and layout."""
        compiler = self.compiler
        if compiler.key_base is None:  # once per model, on its first miss
            compiler.key_base = [torch.__version__, package_digest(), str(compiler.device), _machine(compiler.device),
                                 repr(compiler.backend), repr(compiler.mode), _model_digest(self.owner.model)]
        parts = compiler.key_base + [_inductor_settings(), _threads(compiler.device), _layout(step)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _storable_guards(entries: list[Any]) -> list[bool]:
    """The guards a kept graph holds: not those on globals, object identities or versions (a new
    process's objects are new), which torch cannot save; the store's key stands for them. A filter of
    our own replaces aot_compile's default one instead of adding to it (torch 2.13), so it repeats it
    with torch's own list; drop it when a custom filter is composed with the default (pytorch#194284)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsaved or unsaved.intersection(e.derived_guard_types)) for e in entries]


@functools.cache
def package_digest() -> str:
    """This package's Python source, hashed: a kept graph is this code traced."""
    root = Path(__file__).resolve().parents[1]  # the whole package, not only this folder
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _machine(device: torch.device) -> str:
    """What a CPU graph's kernels were built for: inductor compiles them for this machine's vector ISA,
    which a kept graph does not record in torch 2.13 (pytorch#196828 would)."""
    if device.type != "cpu":
        return platform.machine()
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"{platform.machine()} {pick_vec_isa()} {torch.backends.cpu.get_cpu_capability()}"


def _threads(device: torch.device) -> str:
    """The CPU threads a graph's kernels run on: inductor writes the count into each parallel loop, so a
    graph built for 2 threads would run on 2 in a process set to 1 or 16 (pytorch#167463; torch 2.13
    keys its own FX cache by it, not a kept graph)."""
    from torch._inductor.utils import parallel_num_threads

    return f"threads {parallel_num_threads()}" if device.type == "cpu" else ""


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype))


def _inductor_settings() -> str:
    """Inductor's settings that are plain values (the ones code generation reads). torch 2.13 has no
    public fingerprint of its settings and checks none when a kept graph loads."""
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
