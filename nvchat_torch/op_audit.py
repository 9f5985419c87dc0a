"""Every ATen op the port dispatches, with its tensor dtypes, checked against what MPS can run.

``python -m nvchat_torch.op_audit [--write docs/mps.md]`` records the scenarios of :func:`audit`
for each layout and mode, prints the tables and writes them between the markers of docs/mps.md.
tests/test_mps.py fails when an op has no MPS kernel, bf16 appears outside its networks
(:data:`BF16_NETWORKS`, :data:`NETWORKS`), or docs/mps.md is stale.
Design and rules: docs/mps.md, "Op audit".
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NativeFunctions", "OpRecorder", "Audit", "audit", "audit_checkpoint", "LAYOUTS", "MODES", "NETWORKS",
           "BF16_NETWORKS", "network_of", "clear_caches", "markdown_table", "document", "write_between_markers",
           "read_between_markers", "tone"]

MPS_KEYS = ("MPS", "CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
UNSUPPORTED_DTYPES = (torch.float64, torch.complex32, torch.complex64, torch.complex128)
LAYOUTS = ("float32", "4bit", "8bit", "bf16")
MODES = {"faithful": None, "fast": torch.bfloat16}
BEGIN, END = "<!-- op-audit:begin -->", "<!-- op-audit:end -->"

# docs/parity.md's "dtype flow" table, its networks by module path (the longest prefix wins). The Gemma
# norms are a kind of layer, not a path: an OffsetRMSNorm that adds ``1 + w`` in the weight's dtype.
NETWORKS = (
    ("stt_model.perception.log_mel", "log-mel"), ("stt_model.perception", "Conformer, projection"),
    ("stt_model.rnnt_decoder", "RNNT prediction"), ("stt_model.rnnt_joint", "RNNT joint"),
    ("stt_model.embed_tokens", "LLM input"), ("stt_model.llm", "Nemotron-H, both heads"),
    ("stt_model.lm_head", "Nemotron-H, both heads"), ("stt_model.function_head", "Nemotron-H, both heads"),
    ("fused_heads", "Nemotron-H, both heads"),
    ("tts_model.tts_model.embed_subword", "character encoder"),
    ("tts_model.tts_model.gated_fusion_audio_text", "gated fusion"),
    ("tts_model.tts_model", "EAR-TTS depth sum, code embedding, backbone, MoG head, distances"),
    ("tts_model.audio_codec", "codec decoder"),  # the codec's own methods: the decoder's spectral head, the iSTFT
    ("tts_model.audio_codec.prvq", "RVQ nearest neighbour"), ("tts_model.audio_codec.encoder", "codec encoder"),
    ("tts_model.audio_codec.decoder", "codec decoder"),
)
GEMMA_NORMS = "Gemma norms"
# Functions docs/parity.md names as a network's formula, called from wherever it is needed (prepare's
# precomputed codebook norms, the frame loop's LLM input): they name the network before any module does.
FUNCTION_NETWORKS = (("nvchat_torch.models.layers", "squared_norms", "RVQ nearest neighbour"),
                     ("nvchat_torch.models.language_heads", "fused_input", "LLM input"))
OUTSIDE = "outside every network"  # the frame loop's own ops, or a recorder told no model
# Per layout, the networks docs/parity.md has the reference compute (partly) in bf16 in the faithful
# mode. On the cards (float32 LLM scales, every other weight bf16) these are the ops whose operands are
# all bf16; the bf16 card adds the LLM and its input, bf16 throughout its prompt prefill. The fast mode
# is bf16 anywhere, so no rule applies to it.
_BF16_ISLANDS = ("RNNT prediction", "character encoder", "gated fusion", GEMMA_NORMS, "RVQ nearest neighbour",
                 "codec encoder", "codec decoder")
BF16_NETWORKS: dict[str, tuple[str, ...]] = {
    "float32": (), "4bit": _BF16_ISLANDS, "8bit": _BF16_ISLANDS,
    "bf16": _BF16_ISLANDS + ("LLM input", "Nemotron-H, both heads")}


# Ops whose bf16 output holds values of their bf16 inputs exactly (moves, selections, sign changes) or
# creates none (zeros, empty): with no floating input of another dtype they round nothing.
EXACT_IN_BF16 = frozenset({
    "cat", "stack", "index_select", "index", "gather", "clone", "copy_", "_to_copy", "zeros", "zeros_like",
    "empty", "empty_like", "empty_strided", "new_zeros", "new_empty", "new_empty_strided", "index_put_",
    "index_put", "narrow_copy", "repeat", "expand_copy", "where", "embedding", "detach_", "abs", "neg",
    "select_scatter", "slice_scatter", "flip", "roll", "zero_"})


def rounds_to_bf16(func: torch._ops.OpOverload, inputs: set[torch.dtype], outputs: set[torch.dtype]) -> bool:
    """Whether ``func`` rounds a value to bf16: it has a bf16 output that is not a view, and it is neither
    an :data:`EXACT_IN_BF16` op whose floating inputs are all bf16 nor a product of bf16 values with a
    bool mask (``x * mask``: x or 0)."""
    if torch.bfloat16 not in outputs or func.is_view:
        return False
    floating = {d for d in inputs if d.is_floating_point}
    name = func.overloadpacket.__name__
    if name in EXACT_IN_BF16 and floating <= {torch.bfloat16}:
        return False
    return not (name == "mul" and torch.bool in inputs and floating <= {torch.bfloat16})


def network_of(path: str, module: torch.nn.Module) -> str:
    """The docs/parity.md network of the module at ``path`` in the model (see :data:`NETWORKS`)."""
    from .models.layers import OffsetRMSNorm

    if isinstance(module, OffsetRMSNorm) and not module.fp32:
        return GEMMA_NORMS
    found = max((p for p, _ in NETWORKS if path == p or path.startswith(p + ".")), key=len, default=None)
    return dict(NETWORKS)[found] if found else OUTSIDE


def shipped_yaml() -> Path:
    import torchgen

    return Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"


@dataclass
class NativeFunctions:
    """The shipped ``native_functions.yaml``, read for what each op dispatches to."""

    dispatch: dict[str, tuple[str, ...]]  # per op (``name.overload``), its dispatch keys
    delegate: dict[str, str]  # per op, its structured delegate, where it has one

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
    outputs), under a scenario name (``recorder.scenario = ...``). For an op that rounds to bf16 (a
    bf16 output, views aside) it also records the network it ran in: the innermost module of the
    model :meth:`attribute` named (``model``: at once) that is on the call stack (:func:`network_of`)."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.scenario = ""
        self.ops: Counter = Counter()  # (op, dtypes, scenario, bf16 network or None) -> count
        self.modules: dict[int, tuple[str, torch.nn.Module]] = {}  # id -> (path, module): kept, so ids stay unique
        self._inside_stand_in = 0
        self._functions: dict[Any, str] = {}
        if model is not None:
            self.attribute(model)

    def attribute(self, model: torch.nn.Module) -> None:
        """Name the networks of ``model`` (again after a ``prepare`` that swapped modules)."""
        import importlib

        self.modules = {id(m): (path, m) for path, m in model.named_modules()}
        self._functions = {getattr(importlib.import_module(module), function).__code__: network
                           for module, function, network in FUNCTION_NETWORKS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._inside_stand_in:
            self._record(func, (*args, *(kwargs or {}).values()), out)
        return out

    def _record(self, func, inputs: tuple, out) -> None:
        dtypes: set[torch.dtype] = set()
        outputs: set[torch.dtype] = set()
        for value, seen in ((inputs, dtypes), ((out,), outputs)):
            for v in value:  # tensors, or lists of them (cat, split)
                if isinstance(v, torch.Tensor):
                    seen.add(v.dtype)
                elif isinstance(v, (list, tuple)):
                    seen.update(t.dtype for t in v if isinstance(t, torch.Tensor))
        network = self._network() if rounds_to_bf16(func, dtypes, outputs) else None
        self.ops[(func, frozenset(dtypes | outputs), self.scenario, network)] += 1

    def _network(self) -> str:
        frame: FrameType | None = sys._getframe(1)  # the recorder's own frames hold no module: passed
        while frame is not None and self.modules:
            code = frame.f_code
            if code in self._functions:
                return self._functions[code]
            if code.co_argcount and code.co_varnames[0] == "self":
                found = self.modules.get(id(frame.f_locals.get("self")))
                if found is not None:
                    return network_of(*found)
            frame = frame.f_back
        return OUTSIDE

    def recorded_as(self, op: torch._ops.OpOverload, stand_in: Callable[..., Any]) -> Callable[..., Any]:
        """``stand_in`` (a pure-torch model of a device's ``op``, run on the CPU) recorded as the one op the
        device runs: the ops inside it run on no device, so they are not recorded."""
        def call(*args: Any) -> Any:
            self._inside_stand_in += 1
            try:
                out = stand_in(*args)
            finally:
                self._inside_stand_in -= 1
            self._record(op, args, out)
            return out
        return call

    def named(self) -> Counter:
        """The record keyed by ``(op name, dtype names, scenario, bf16 network or None)``."""
        named: Counter = Counter()
        for (func, dtypes, scenario, network), count in self.ops.items():
            names = tuple(sorted(str(d).removeprefix("torch.") for d in dtypes))
            named[(func.name(), names, scenario, network)] += count
        return named


# The CPU's own build of an op whose MPS branch (chosen by device, see nvchat_torch.models.int4pack) runs another.
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
    op: str  # the ATen op, ``aten::name.overload``
    count: int = 0  # calls over every run
    dtypes: set[str] = field(default_factory=set)  # dtype names of its tensors, inputs and outputs
    where: set[str] = field(default_factory=set)  # ``"run scenario"`` for each place it ran
    kernel: str | None = None  # what runs it on MPS (:func:`mps_kernel`); None: nothing does


@dataclass
class Audit:
    """The recorded ops of every run, and what is wrong with them on MPS."""

    rows: dict[str, OpRow]  # per op name
    problems: list[str]  # what fails on MPS or breaks a bf16 rule, sorted, each once
    runs: list[str] = field(default_factory=list)  # the run names, ``"layout/mode"``, in order
    bf16: dict[str, Counter] = field(default_factory=dict)  # per run, the calls that rounded to bf16 by network

    @classmethod
    def of(cls, runs: dict[str, Counter], native: NativeFunctions | None = None) -> "Audit":
        """``runs``: per ``"layout/mode"`` (or any name, then no layout's bf16 rule applies), an
        :class:`OpRecorder`'s ``named()``."""
        native = native or NativeFunctions.read()
        rows: dict[str, OpRow] = {}
        problems = []
        bf16: dict[str, Counter] = {}
        for run, ops in runs.items():
            layout, _, mode = run.partition("/")
            allowed = BF16_NETWORKS.get(layout) if mode == "faithful" else None  # None: no rule
            for (op, dtypes, scenario, network), count in ops.items():
                row = rows.setdefault(op, OpRow(op, kernel=mps_kernel(native, op)))
                row.count += count
                row.dtypes.update(dtypes)
                row.where.add(f"{run} {scenario}")
                bad = [d for d in dtypes if getattr(torch, d) in UNSUPPORTED_DTYPES]
                if bad:
                    problems.append(f"{op} takes {', '.join(bad)} in {run} {scenario}: MPS has no such dtype")
                if "bfloat16" in dtypes and allowed == ():
                    problems.append(f"{op} computes in bfloat16 in {run} {scenario}, which the reference "
                                    "computes in float32 (docs/parity.md)")
                if network is not None:
                    bf16.setdefault(run, Counter())[network] += count
                    if allowed and network not in allowed:
                        problems.append(f"{op} rounds to bfloat16 in {run} {scenario} (network: {network}), which "
                                        f"docs/parity.md computes in float32 for the {layout} layout")
        problems += [f"{row.op} has no MPS kernel in the shipped native_functions.yaml (seen in "
                     f"{', '.join(sorted(row.where)[:3])})" for row in rows.values() if row.kernel is None]
        return cls(rows, sorted(set(problems)), list(runs), bf16)


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


def _scenarios(path: Path, dtype: torch.dtype | None, recorder: OpRecorder,
               int4: bool) -> Iterable[tuple[str, Callable[[], Any]]]:
    """The runs of one layout and mode; ``int4``: the layout has 4-bit linears int4pack packs."""
    from . import load_model
    from .events import StreamingOptions

    wave = tone(0.5)
    model: Any = None

    def load(kernel: Any = None) -> None:
        nonlocal model
        # weights="packed" is what weights="auto" picks on MPS
        model = load_model(path, device="cpu", dtype=dtype, weights="packed", prepare=False)
        recorder.attribute(model)
        model.prepare(kernel=kernel, fused_cpu=False)  # MPS runs the composite code, not the CPU kernels
        recorder.attribute(model)  # prepare swapped modules for fused ones

    def session() -> None:
        s = model.create_streaming_session(StreamingOptions(system_prompt="you are helpful", seed=0))
        s.push_audio(wave, 16000)
        s.flush()

    def engine() -> None:
        e = model.create_engine(max_sessions=2)
        rows = [e.open(system_prompt="hi", seed=1), e.open(system_prompt="", deterministic=True)]
        for row in rows:
            row.push_audio(wave[:2560], 16000)
        e.step()
        e.step()

    def generate() -> None:
        model.generate(wave, system_prompt="hi", seed=0)

    def load_for_mps() -> None:
        # The MPS branch of packing and of the packed matmul, with the MPS kernel's stand-in recorded as
        # the two ops MPS runs (the stand-in's own ops run on no Apple GPU).
        from .models.int4pack import int4_kernel

        stand_in = int4_kernel("mps", stand_in=True)
        assert stand_in is not None
        load(dataclasses.replace(
            stand_in, convert=recorder.recorded_as(torch.ops.aten._convert_weight_to_int4pack.default, stand_in.convert),
            mm=recorder.recorded_as(torch.ops.aten._weight_int4pack_mm.default, stand_in.mm)))

    scenarios = [("load+prepare", load), ("prefill+frames", session), ("engine step", engine), ("generate", generate)]
    if int4:
        scenarios += [("MPS int4pack load+prepare", load_for_mps), ("MPS int4pack prefill+frames", session)]
    return scenarios


def clear_caches() -> None:
    """Empty the ``functools`` caches of nvchat_torch's modules (``layers.promote``, ``layers.scalar``):
    each run then dispatches what it does in a fresh process, whatever ran before it in this one, so
    the test's own audit and the table the script wrote into docs/mps.md can be compared."""
    for name, module in list(sys.modules.items()):
        if name == "nvchat_torch" or name.startswith("nvchat_torch."):
            for value in list(vars(module).values()):
                if getattr(value, "__module__", None) == name and callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


def audit(layouts: Iterable[str] = LAYOUTS, modes: Iterable[str] = tuple(MODES), folder: Path | None = None,
          preset: str = "tiny") -> dict[str, Counter]:
    """Run every scenario for each layout and mode under an :class:`OpRecorder`: per ``"layout/mode"``,
    the recorded ops (feed them to :meth:`Audit.of`). Each run starts from cleared caches
    (:func:`clear_caches`): its record does not depend on what ran before it."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="nvchat_torch_audit") as tmp:
            return audit(layouts, modes, Path(tmp), preset)
    runs: dict[str, Counter] = {}
    for layout in layouts:
        path = audit_checkpoint(layout, Path(folder) / f"{preset}-{layout}", preset)
        for mode in modes:
            clear_caches()
            recorder = OpRecorder()
            for scenario, run in _scenarios(path, MODES[mode], recorder, int4=layout == "4bit"):
                recorder.scenario = scenario
                with recorder:
                    run()
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


def bf16_table(result: Audit) -> str:
    """Per network, the calls that rounded to bf16 in each faithful run, against :data:`BF16_NETWORKS`."""
    runs = [run for run in result.runs if run.endswith("/faithful")]
    networks = list(dict.fromkeys([name for _, name in NETWORKS] + [GEMMA_NORMS, OUTSIDE]))
    lines = [f"| network | {' | '.join(runs)} |", "|---|" + "---:|" * len(runs)]
    for network in networks:
        cells = []
        for run in runs:
            count = result.bf16.get(run, Counter())[network]
            allowed = network in BF16_NETWORKS.get(run.split("/")[0], ())
            cells.append((f"{count:,}" if count else "-") if allowed else
                         (f"**{count:,} (docs/parity.md: float32)**" if count else "float32"))
        lines.append(f"| {network} | {' | '.join(cells)} |")
    return "\n".join(lines)


def document(runs: dict[str, Counter], result: Audit) -> str:
    """What ``--write`` puts between the markers of docs/mps.md: a summary, the bf16 table, the op table."""
    calls = sum(r.count for r in result.rows.values())
    summary = (f"{len(result.rows)} distinct ATen ops, {calls:,} calls over {len(runs)} runs "
               f"({', '.join(runs)}; scenarios: load + prepare, prompt prefill and frames, an engine step with "
               f"a sampling and a deterministic row, offline generate, and for the 4-bit layout load + prepare and "
               f"frames through the MPS int4pack branch), torch {torch.__version__}. Problems: "
               + ("; ".join(result.problems) if result.problems else "none") + ".")
    bf16 = ("Calls that round to bf16 by network, in the faithful mode: ops with a bf16 output, except views, "
            "exact moves of bf16 values and products with a mask. A network docs/parity.md computes in float32 "
            "for a layout reads `float32` there, and any call in it is a problem.")
    return f"{summary}\n\n{bf16}\n\n{bf16_table(result)}\n\n{markdown_table(result)}"


def write_between_markers(path: Path, text: str) -> None:
    """Replace what lies between the op-audit markers of ``path`` with ``text``."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path}: no {BEGIN} ... {END} markers to write the op table between")
    head, rest = doc.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def read_between_markers(path: Path) -> str:
    """What :func:`write_between_markers` wrote into ``path``."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path}: no {BEGIN} ... {END} markers around an op table")
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n").removesuffix("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.op_audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", type=Path, help="the Markdown file to write the table into (between its markers)")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = audit(args.layouts)
    result = Audit.of(runs)
    text = document(runs, result)
    print(text)
    if args.write:
        write_between_markers(args.write, text)
    return 1 if result.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
