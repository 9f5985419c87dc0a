"""Counting what decides batch-1 speed on a GPU: host reads and kernels.

On MPS (and CUDA) every host read of a tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``int()``, ``float()``, ``bool()``, use as a Python index) waits for the device, and every ATen op
is a kernel launch (about 5-20 us on MPS). Both can be counted on the CPU, where a real sync cannot
be told from a no-op, so every call counts.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections import Counter
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["return_freed_memory", "HOST_READS", "count_host_reads", "OpCounter", "kernel_launches", "model_bytes", "device_memory", "synchronize",
           "MPS_CPU_FALLBACK", "CpuFallbackWarning", "CpuFallbackRecorder"]

HOST_READS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def count_host_reads() -> Iterator[Counter]:
    """Count calls of the host-reading ``torch.Tensor`` methods inside the block (by method name)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)
        return counted

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


# Ops that launch no kernel: views and reshapes, and allocations.
_NO_KERNEL = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::slice", "aten::select",
             "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::transpose", "aten::permute", "aten::t",
             "aten::detach", "aten::alias", "aten::unflatten", "aten::flatten", "aten::narrow", "aten::split",
             "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::view_as", "aten::lift_fresh",
             "aten::_reshape_alias", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_",
             "aten::contiguous", "aten::expand_as", "aten::diagonal", "aten::numpy_T", "aten::_unsafe_split",
             "aten::movedim", "aten::result_type", "aten::is_nonzero", "aten::to"}


def _is_kernel(name: str) -> bool:
    return (name.startswith(("aten::", "nvchat_cpu::", "cpp_fused", "triton_", "cpp_")) and name not in _NO_KERNEL)


def kernel_launches(run: Callable[[], object]) -> int:
    """Kernels ``run()`` launches, from torch's profiler, which also sees inside a compiled region (a
    dispatch mode such as :class:`OpCounter` does not): each outermost event that is an ATen op other
    than a view or an allocation, a fused ``nvchat_cpu`` op, or a kernel inductor generated (with
    ``torch._inductor.config.cpp.enable_kernel_profile`` set when it compiled, on a CPU); one nested
    inside another, such as the ops a composite op calls, is part of its parent's launch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    count = 0
    for event in prof.events():
        if not _is_kernel(event.name):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested = _is_kernel(parent.name)
            parent = parent.cpu_parent
        count += not nested
    return count



class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside the block; ``non_view`` excludes ops whose schema
    returns an alias of an input (views, reshapes, a ``to`` that converts nothing), which launch no
    kernel. Under ``torch.inference_mode`` (the sessions run in it) composite ops such as ``linear``,
    ``layer_norm`` or ``rms_norm`` count once, as the single kernels MPS and CUDA run for them."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.views: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not isinstance(out, (torch.Tensor, tuple, list)):  # e.g. promote_types: no kernel
            return out
        view = func.is_view
        if view and func.overloadpacket is torch.ops.aten.to:  # a real conversion copies: count it
            view = isinstance(out, torch.Tensor) and out.data_ptr() == args[0].data_ptr()
        (self.views if view else self.ops)[str(func.overloadpacket)] += 1
        return out

    @property
    def non_view(self) -> int:
        return sum(self.ops.values())


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (works on ``meta``; shared storage counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def device_memory(device: torch.device) -> int:
    """Bytes of memory ``device`` offers a model: CUDA's total, MPS's recommended working set
    (Metal's ``recommendedMaxWorkingSetSize``, a share of the Mac's unified memory), the host's
    physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return torch.mps.recommended_max_memory()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (what the profiler's per-stage marks cost); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def return_freed_memory() -> None:
    """Hand the heap memory freed so far back to the OS (glibc's ``malloc_trim``; nothing elsewhere).
    The loader and ``prepare()`` free hundreds of transient tensors of a few MB (converted and fused
    weights), and glibc keeps such freed chunks mapped for reuse: after the full-size 4-bit load that
    was ~1.4 GB of resident memory nothing would use again (docs/performance.md)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return
    trim(0)


# What torch's MPS backend warns (aten/src/ATen/mps/MPSFallback.mm, ``mps_fallback``) when
# PYTORCH_ENABLE_MPS_FALLBACK=1 runs an op without an MPS kernel on the CPU: "The operator
# 'aten::name.overload' is not currently supported on the MPS backend and will fall back to run on the
# CPU. This may have performance implications."
MPS_CPU_FALLBACK = re.compile(r"The operator '([^']+)' is not currently supported on the MPS backend "
                              r"and will fall back to run on the CPU")


class CpuFallbackWarning(RuntimeWarning):
    """An op the MPS backend ran on the CPU (one per op, from :class:`CpuFallbackRecorder`)."""


class CpuFallbackRecorder:
    """Inside the block, records each op that torch's MPS backend ran on the CPU, from its warning.

    torch issues that warning with ``TORCH_WARN_ONCE`` (once per process, for whichever op came first),
    so the block sets ``torch.set_warn_always(True)``: every fallback then warns, and the recorder
    keeps one entry per op and issues one :class:`CpuFallbackWarning` per op new to it, naming the op,
    the device and the cost. ``model``: the entries go to ``model.cpu_fallbacks`` (op -> what it
    costs), which ``model.describe()`` lists, and an op already there is not warned again. Every other
    warning of the block is issued again after it, once per message."""

    def __init__(self, model: Any = None):
        self.ops: dict[str, str] = {}
        self._catch: Any = None
        self._caught: list = []
        self._warn_always = False
        if model is not None:
            self.attach(model)

    def attach(self, model: Any) -> None:
        """Keep the entries in ``model.cpu_fallbacks`` (those recorded so far join it)."""
        held = model.__dict__.setdefault("cpu_fallbacks", {})
        for op, cost in self.ops.items():
            held.setdefault(op, cost)
        self.ops = held

    def __enter__(self) -> "CpuFallbackRecorder":
        self._warn_always = torch.is_warn_always_enabled()
        torch.set_warn_always(True)
        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._catch.__exit__(*exc)
        torch.set_warn_always(self._warn_always)
        others: dict[tuple, warnings.WarningMessage] = {}
        for w in self._caught:
            found = MPS_CPU_FALLBACK.search(str(w.message))
            if found:
                self.record(found.group(1))
            else:
                others.setdefault((w.category, str(w.message)), w)
        for w in others.values():
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

    def record(self, op: str) -> None:
        """``op`` ran on the CPU: kept, and warned about if it is new."""
        if op in self.ops:
            return
        self.ops[op] = ("no mps kernel: PYTORCH_ENABLE_MPS_FALLBACK=1 runs it on the CPU, copying its tensors to "
                        "the host and back and waiting for the mps queue on every call")
        warnings.warn(f"{op} ran on the CPU instead of mps ({self.ops[op]}; see model.describe())",
                      CpuFallbackWarning)
