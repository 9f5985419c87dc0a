"""Every ATen op the port dispatches, with its tensor dtypes, checked against what MPS can run.

A CPU-only build registers no MPS kernels, so the check reads the ``native_functions.yaml`` the torch
wheel ships (``torchgen/packaged/ATen/native/``): an op runs on MPS when its ``dispatch`` names
``MPS`` or a composite key (``CompositeImplicitAutograd``, ``CompositeExplicitAutograd``,
``CompositeExplicitAutogradNonFunctional``: built from other ops), when it has no ``dispatch`` (then it is
CompositeImplicitAutograd), or when its ``structured_delegate`` (the ``.out`` variant that holds the
kernels, as ``add.Tensor`` -> ``add.out``) does. MPS has no float64 and no complex tensors; bf16 needs
macOS 14 and appears only where docs/parity.md has the reference compute in bf16 (never for a
float32 checkpoint in the faithful mode).

``python -m nvchat_torch.op_audit [--write docs/mps.md]`` records the scenarios of :func:`audit`
(load + prepare, prompt prefill and streaming frames, an engine step with a sampling and a
deterministic row, offline ``generate``) for the float32, 4-bit and 8-bit card and bf16 layouts in
both modes, prints the table and writes it between the markers of docs/mps.md; tests/test_mps.py
fails when an op without an MPS kernel appears.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NativeFunctions", "OpRecorder", "Audit", "audit", "audit_checkpoint", "LAYOUTS", "MODES",
           "markdown_table", "write_between_markers", "tone"]

MPS_KEYS = ("MPS", "CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
UNSUPPORTED_DTYPES = (torch.float64, torch.complex32, torch.complex64, torch.complex128)
LAYOUTS = ("float32", "4bit", "8bit", "bf16")
MODES = {"faithful": None, "fast": torch.bfloat16}
BEGIN, END = "<!-- op-audit:begin -->", "<!-- op-audit:end -->"


def shipped_yaml() -> Path:
    import torchgen

    return Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"


@dataclass
class NativeFunctions:
    """``native_functions.yaml``: per op (``name.overload``), its dispatch keys and structured delegate."""

    dispatch: dict[str, tuple[str, ...]]
    delegate: dict[str, str]

    @classmethod
    def read(cls, path: Path | None = None) -> "NativeFunctions":
        dispatch: dict[str, tuple[str, ...]] = {}
        delegate: dict[str, str] = {}
        name, in_dispatch = "", False
        for line in (path or shipped_yaml()).read_text().splitlines():
            func = re.match(r"- func: ([\w.]+)\(", line)
            if func:
                name, in_dispatch = func.group(1), False
                dispatch[name] = ()
            elif line.startswith("  dispatch:"):
                in_dispatch = True
            elif in_dispatch and line.startswith("    ") and ":" in line:
                keys = line.split(":", 1)[0]
                dispatch[name] += tuple(k.strip() for k in keys.split(","))
            elif line.startswith("  structured_delegate:"):
                delegate[name] = line.split(":", 1)[1].strip()
                in_dispatch = False
            elif line.startswith("  ") and not line.startswith("    "):
                in_dispatch = False
        return cls(dispatch, delegate)

    def mps_kernel(self, op: str) -> str | None:
        """How ``op`` (``aten::name.overload`` or ``name.overload``) runs on MPS, or None if it cannot."""
        op = op.removeprefix("aten::").removesuffix(".default")
        if op not in self.dispatch:
            return None
        keys = self.dispatch[op]
        found = next((k for k in MPS_KEYS if k in keys), None)
        if found:
            return found
        if op in self.delegate:
            via = self.mps_kernel(self.delegate[op])
            return None if via is None else f"{via} (via {self.delegate[op]})"
        return None if keys else "CompositeImplicitAutograd"


class OpRecorder(TorchDispatchMode):
    """Records every ATen op dispatched inside the block with the dtypes of its tensors (inputs and
    outputs), under a scenario name (``recorder.scenario = ...``)."""

    def __init__(self):
        super().__init__()
        self.scenario = ""
        self.ops: Counter = Counter()  # (op, dtypes, scenario) -> count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes: set[torch.dtype] = set()
        for value in (*args, *(kwargs or {}).values(), out):  # tensors, or lists of them (cat, split)
            if isinstance(value, torch.Tensor):
                dtypes.add(value.dtype)
            elif isinstance(value, (list, tuple)):
                dtypes.update(v.dtype for v in value if isinstance(v, torch.Tensor))
        self.ops[(func, frozenset(dtypes), self.scenario)] += 1
        return out

    def named(self) -> Counter:
        """The record keyed by ``(op name, dtype names, scenario)``."""
        named: Counter = Counter()
        for (func, dtypes, scenario), count in self.ops.items():
            named[(func.name(), tuple(sorted(str(d).removeprefix("torch.") for d in dtypes)), scenario)] += count
        return named


# The CPU's own build of an op whose MPS branch (chosen by device, see nvchat_torch.int4pack) runs another.
DEVICE_TWINS = {"aten::_weight_int4pack_mm_for_cpu": "aten::_weight_int4pack_mm",
                "aten::_convert_weight_to_int4pack_for_cpu": "aten::_convert_weight_to_int4pack"}


def mps_kernel(native: NativeFunctions, op: str) -> str | None:
    """What runs ``op`` on MPS: its kernel, or for a CPU-only op of a device branch, its MPS twin's."""
    twin = DEVICE_TWINS.get(op)
    if twin is None:
        return native.mps_kernel(op)
    kernel = native.mps_kernel(twin)
    return None if kernel is None else f"{kernel} (the MPS branch runs `{twin.removeprefix('aten::')}`)"


@dataclass
class OpRow:
    op: str
    count: int = 0
    dtypes: set[str] = field(default_factory=set)
    where: set[str] = field(default_factory=set)
    kernel: str | None = None


@dataclass
class Audit:
    """The recorded ops of every run, and what is wrong with them on MPS."""

    rows: dict[str, OpRow]
    problems: list[str]

    @classmethod
    def of(cls, runs: dict[str, Counter], native: NativeFunctions | None = None) -> "Audit":
        """``runs``: per ``"layout/mode"``, an :class:`OpRecorder`'s ``ops``."""
        native = native or NativeFunctions.read()
        rows: dict[str, OpRow] = {}
        problems = []
        for run, ops in runs.items():
            for (op, dtypes, scenario), count in ops.items():
                row = rows.setdefault(op, OpRow(op, kernel=mps_kernel(native, op)))
                row.count += count
                row.dtypes.update(dtypes)
                row.where.add(f"{run} {scenario}")
                bad = [d for d in dtypes if getattr(torch, d) in UNSUPPORTED_DTYPES]
                if bad:
                    problems.append(f"{op} takes {', '.join(bad)} in {run} {scenario}: MPS has no such dtype")
                if "bfloat16" in dtypes and run == "float32/faithful":
                    problems.append(f"{op} computes in bfloat16 in {run} {scenario}, which the reference "
                                    "computes in float32 (docs/parity.md)")
        problems += [f"{row.op} has no MPS kernel in the shipped native_functions.yaml (seen in "
                     f"{', '.join(sorted(row.where)[:3])})" for row in rows.values() if row.kernel is None]
        return cls(rows, sorted(set(problems)))


# --------------------------------------------------------------------------------------
# The scenarios


def audit_checkpoint(layout: str, folder: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A random ``preset`` model written in ``layout``'s format: "float32", "bf16", or the 4-bit and
    8-bit cards ("4bit", "8bit": the LLM packed with float32 scales, every other weight bf16)."""
    from safetensors.torch import load_file, save_file

    from .tiny import random_model, save_checkpoint

    if (folder / "config.json").exists():
        return folder
    bits = {"4bit": 4, "8bit": 8}.get(layout)
    dtype = torch.float32 if layout == "float32" else torch.bfloat16
    save_checkpoint(random_model(preset, seed), folder, bits=bits, dtype=dtype)
    if bits:  # the cards keep float32 scales and biases (exact: they were bf16)
        file = folder / "model.safetensors"
        tensors = load_file(str(file))
        save_file({k: v.float() if k.endswith((".scales", ".biases")) else v for k, v in tensors.items()},
                  str(file), metadata={"format": "mlx"})
    return folder


def tone(seconds: float) -> Any:
    """A 220 Hz tone at 16 kHz, swelling 3 times a second (float32 numpy): input for a run, no file needed."""
    import numpy as np

    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32)


def _scenarios(path: Path, dtype: torch.dtype | None) -> Iterable[tuple[str, Callable[[Any], Any]]]:
    from . import load_model
    from .events import StreamingOptions

    wave = tone(0.5)
    model: Any = None

    def load(_):
        nonlocal model
        model = load_model(path, device="cpu", dtype=dtype, weights="packed")  # what weights="auto" picks on MPS

    def session(_):
        s = model.create_streaming_session(StreamingOptions(system_prompt="you are helpful", seed=0))
        s.push_audio(wave, 16000)
        s.flush()

    def engine(_):
        e = model.create_engine(max_sessions=2)
        rows = [e.open(system_prompt="hi", seed=1), e.open(system_prompt="", deterministic=True)]
        for row in rows:
            row.push_audio(wave[:2560], 16000)
        e.step()
        e.step()

    def generate(_):
        model.generate(wave, system_prompt="hi", seed=0)

    return [("load+prepare", load), ("prefill+frames", session), ("engine step", engine), ("generate", generate)]


def audit(layouts: Iterable[str] = LAYOUTS, modes: Iterable[str] = tuple(MODES), folder: Path | None = None,
          preset: str = "tiny") -> dict[str, Counter]:
    """Run every scenario for each layout and mode under an :class:`OpRecorder`: per ``"layout/mode"``,
    the recorded ops (feed them to :meth:`Audit.of`)."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="nvchat_torch_audit") as tmp:
            return audit(layouts, modes, Path(tmp), preset)
    runs: dict[str, Counter] = {}
    for layout in layouts:
        path = audit_checkpoint(layout, Path(folder) / f"{preset}-{layout}", preset)
        for mode in modes:
            recorder = OpRecorder()
            for scenario, run in _scenarios(path, MODES[mode]):
                recorder.scenario = scenario
                with recorder:
                    run(None)
            runs[f"{layout}/{mode}"] = recorder.named()
    return runs


# --------------------------------------------------------------------------------------
# The table


def markdown_table(result: Audit) -> str:
    lines = ["| op | calls | dtypes | where | MPS kernel |", "|---|---:|---|---|---|"]
    for row in sorted(result.rows.values(), key=lambda r: (-r.count, r.op)):
        where = ", ".join(sorted({w.split(" ", 1)[1] for w in row.where}))
        lines.append(f"| `{row.op.removeprefix('aten::')}` | {row.count:,} | {', '.join(sorted(row.dtypes))} | "
                     f"{where} | {row.kernel or '**none**'} |")
    return "\n".join(lines)


def write_between_markers(path: Path, text: str) -> None:
    """Replace what lies between the op-audit markers of ``path`` with ``text``."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path}: no {BEGIN} ... {END} markers to write the op table between")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.op_audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", type=Path, help="the Markdown file to write the table into (between its markers)")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = audit(args.layouts)
    result = Audit.of(runs)
    calls = sum(r.count for r in result.rows.values())
    summary = (f"{len(result.rows)} distinct ATen ops, {calls:,} calls over {len(runs)} runs "
               f"({', '.join(runs)}; scenarios: load + prepare, prompt prefill and frames, an engine step with "
               f"a sampling and a deterministic row, offline generate), torch {torch.__version__}. Problems: "
               + ("; ".join(result.problems) if result.problems else "none") + ".")
    table = f"{summary}\n\n{markdown_table(result)}"
    print(table)
    if args.write:
        write_between_markers(args.write, table)
    return 1 if result.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
