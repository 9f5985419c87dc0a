"""The frame step compiled whole (``load_model(..., compile=...)``, docs/performance.md): one graph and no
graph break, no recompile as a long session's caches grow, a bounded set of graphs for an engine's
rows, one host read a frame, and the reference's outputs through the compiled step.

The graph counts are the compiler front end's (dynamo: its guards decide what compiles again), so they
are taken with a backend that only counts the graphs it is handed; the outputs are checked through
inductor, the backend that generates kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlx_oracle import synth_audio
from test_engine import Plan, assert_same_events, run_alone, run_engine
from test_layouts import LAYOUTS
from test_off_clock import assert_schedule_matches, assert_tts_alone_matches
from test_off_clock import run_reference as run_off_clock_reference
from test_session import PROMPT, run_reference_stream, run_stream

import nvchat_torch as nv
from nvchat_torch.diagnostics import count_host_reads, kernel_launches
from nvchat_torch.doctor import CompositePath
from nvchat_torch.runtime.compiled_step import batch_bucket

FRAME = 1280


class CountingBackend:
    """A torch.compile backend that runs each graph as traced and records the batch of every graph it
    is handed (the samples' first dimension: the step's one ``[batch, 1280]`` float input)."""

    __name__ = "counting"

    def __init__(self):
        self.batches: list[int] = []
        self.regions: list[list[str]] = []  # per graph: the nested region each invoke_subgraph call runs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        frames = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == FRAME
                  and t.is_floating_point()]
        self.batches.append(int(frames[0].shape[0]) if frames else -1)
        calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
        self.regions.append([str(node.args[0].target) for node in calls])
        return gm.forward


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_step_is_one_graph_with_no_break_and_compiles_once_over_a_long_session():
    from torch._dynamo.utils import counters

    backend = CountingBackend()
    model = nv.load_tiny_model(compile=backend)
    assert "compiled whole (torch.compile, counting" in model.describe()
    session = model.create_streaming_session(system_prompt="hi", deterministic=True, profile=True)
    step = session.frame_step
    wave = (np.random.default_rng(0).standard_normal(2000 * FRAME) * 0.1).astype(np.float32)
    session.push_audio(wave[:FRAME], 16000)  # the warm-up frame compiles the step
    assert backend.batches == [1] and not counters["graph_break"]
    # Each layer kind with more than one layer is one nested region, traced once and called per layer
    # (dynamo inlines a region called once): the tiny LLM's 4 Mamba and 3 MLP blocks, its 2 Conformer
    # layers; and so are the loops over repeated work: the RNNT's symbols after the first (of 10) and
    # the codebook search of each of the 31 quantizers.
    config = model.config
    llm = config.text_config.hybrid_override_pattern
    assert (llm.count("M"), llm.count("-"), config.audio_config.encoder.n_layers) == (4, 3, 2)
    assert (config.audio_config.max_symbols, config.tts_config.num_quantizers) == (10, 31)
    calls = backend.regions[0]
    assert len(calls) == 49 and sorted(calls.count(name) for name in set(calls)) == [2, 3, 4, 9, 31], calls
    capacities = {(step._language.capacity, step._tts.capacities()[0])}
    reads = []
    for k in range(1, 2000):
        if k % 400 == 0:
            with count_host_reads() as read:
                session.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
            reads.append(sum(read.values()))
        else:
            session.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
        capacities.add((step._language.capacity, step._tts.capacities()[0]))
    # Both caches grew at least twice (new buffers, new capacities), and nothing compiled again.
    assert len({c[0] for c in capacities}) >= 3 and len({c[1] for c in capacities}) >= 3, capacities
    assert backend.batches == [1] and not counters["graph_break"]
    assert reads == [1] * 4 and session.frame_index == 2000
    # One graph has no stage marks: a compiled frame's profile is its total.
    timing = session.profile.frames[-1]
    assert timing.total_ms > 0 and timing.perception_ms == timing.tts_ms == 0
    # A new session with another prompt (other positions, another prefill's state layout): the same graph.
    other = model.create_streaming_session(system_prompt="a longer prompt than the first one", deterministic=True)
    other.push_audio(wave[:2 * FRAME], 16000)
    assert backend.batches == [1]


def test_engine_rows_joining_and_leaving_stay_within_the_power_of_two_graphs(ckpt_f32):
    """Rows 1..8 join one at a time, then leave from the middle and the end: the batches the step runs
    at are the powers of two {1, 2, 4, 8}, each compiled once; every row equals its session alone."""
    backend = CountingBackend()
    model = nv.load_model(ckpt_f32, device="cpu", compile=backend)
    eager = nv.load_model(ckpt_f32, device="cpu")
    waves = [synth_audio(0.5 + 0.04 * k, seed=k) for k in range(8)]
    plans = [Plan(PROMPT if k % 2 else "hi", k, waves[k], (FRAME,), start=k) for k in range(8)]
    engine_events = run_engine(model, plans)
    assert sorted(set(backend.batches)) == [1, 2, 4, 8] and len(backend.batches) == 4
    for plan, events in zip(plans, engine_events):
        assert_same_events(events, run_alone(eager, plan))
    assert [batch_bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


def test_sampling_sessions_draw_the_same_through_the_compiled_step(ckpt_f32):
    """A sampling session's random numbers are drawn before the step, in the order it consumes them, so
    compiled it draws and decides exactly as eager; a deterministic engine row beside it mixes modes."""
    backend = CountingBackend()
    compiled = nv.load_model(ckpt_f32, device="cpu", compile=backend)
    eager = nv.load_model(ckpt_f32, device="cpu")
    waves = [synth_audio(0.8, seed=k) for k in range(2)]
    plans = [Plan(PROMPT, 5, waves[0], (FRAME,), deterministic=False),
             Plan("hi", 6, waves[1], (FRAME,), start=2, deterministic=True)]
    assert_same_events(run_alone(compiled, plans[0]), run_alone(eager, plans[0]))
    for plan, events in zip(plans, run_engine(compiled, plans)):
        assert_same_events(events, run_alone(eager, plan))
    assert sorted(set(backend.batches)) == [1, 2]


@pytest.mark.parametrize("layout", ["q4-f32-scales"])
def test_the_compiled_step_gives_the_references_outputs(make_checkpoint, reference, layout):
    """Through inductor: the text, function and transcript ids and all 31 codes per frame equal the MLX
    reference's on the real cards' layout (4-bit, float32 scales, bf16 elsewhere), and the audio is
    within the streaming test's tolerance; engine rows through the compiled step equal their sessions. (The float32 layout passes too; one layout keeps CI's
    compile time to one inductor compile: docs/performance.md.)"""
    path = make_checkpoint(seed=0, **LAYOUTS.get(layout, {}))
    wave = synth_audio(1.2)
    torch._inductor.config.cpp.enable_kernel_profile = True  # its C++ kernels show in the profiler
    from torch._dynamo.utils import counters

    traced = counters["stats"]["unique_graphs"]
    model = nv.load_model(path, device="cpu", compile=True)
    assert "compiled whole (torch.compile, inductor" in model.describe()
    ours = run_stream(model, wave, PROMPT)
    # The compiled frame's kernel launches, counted with the profiler (docs/performance.md), against the
    # same frame eager on the composite path (what MPS and CUDA run eager); and still one host read.
    session = model.create_streaming_session(system_prompt=PROMPT, deterministic=True)
    eager = nv.load_model(path, device="cpu", prepare=True)
    eager_session = eager.create_streaming_session(system_prompt=PROMPT, deterministic=True)
    with CompositePath(eager):
        for s in (session, eager_session):
            s.push_audio(wave[:2 * FRAME], 16000)
        with count_host_reads() as reads:
            session.push_audio(wave[2 * FRAME:3 * FRAME], 16000)
        eager_session.push_audio(wave[2 * FRAME:3 * FRAME], 16000)
        compiled_launches = kernel_launches(lambda: session.push_audio(wave[3 * FRAME:4 * FRAME], 16000))
        eager_launches = kernel_launches(lambda: eager_session.push_audio(wave[3 * FRAME:4 * FRAME], 16000))
    assert sum(reads.values()) == 1 and 0 < compiled_launches < eager_launches / 2, (compiled_launches, eager_launches)
    ref = run_reference_stream(reference(path), wave, PROMPT)
    np.testing.assert_array_equal(ours["codes"], ref["codes"])
    assert ours["text"] == ref["text"] and ours["function"] == ref["function"]
    assert ours["transcript"] == ref["transcript"]
    np.testing.assert_allclose(ours["audio"], ref["audio"], atol=1e-3, rtol=0)
    # Engine rows through inductor (the batch-2 graph, rows that sit out put back): each row gives what
    # its session gives alone, eager.
    plans = [Plan(PROMPT, 0, wave, (FRAME,)), Plan("hi", 1, synth_audio(0.8, seed=1), (FRAME, 777), start=2)]
    for plan, events in zip(plans, run_engine(model, plans)):
        assert_same_events(events, run_alone(eager, plan), atol=1e-3)
    # Steps off the clock through the same graph (its flags are fixed): the reference's outputs, driven
    # the same way (tests/test_off_clock.py).
    assert_schedule_matches(model, wave, run_off_clock_reference(reference(path), wave, PROMPT))
    assert_tts_alone_matches(model, reference(path))  # and steps of the TTS alone, while a tool runs
    # The graphs were stored (compiled ahead): a later load finds them, and runs without compiling (the
    # compiler's front end traces nothing), the reference's outputs again, and past both caches' growth.
    # (Three frame steps ran: two sessions and the engine; the sessions share the batch-1 graph.)
    assert model.step_compiler.precompiled == 2 and model.step_compiler.loaded == 0, model.describe()
    # On Linux each was compiled in a child process (the compiler's memory left with it): this process
    # traced nothing, and loaded the graphs the children stored.
    if sys.platform == "linux":
        assert "2 compiled here, in a child process" in model.describe() and counters["stats"]["unique_graphs"] == traced
    traced = counters["stats"]["unique_graphs"]
    later = nv.load_model(path, device="cpu", compile=True)
    again = run_stream(later, wave, PROMPT)
    np.testing.assert_array_equal(again["codes"], ours["codes"])
    assert (again["text"], again["function"], again["transcript"]) == (ours["text"], ours["function"], ours["transcript"])
    long = Plan(PROMPT, 0, synth_audio(24.0, seed=2), (FRAME,))  # 300 frames: the LLM and TTS caches grow
    assert_same_events(run_alone(later, long), run_alone(eager, long), atol=1e-3)
    assert later.step_compiler.loaded == 1 and later.step_compiler.precompiled == 0, later.describe()
    assert counters["stats"]["unique_graphs"] == traced


def test_the_doctor_compiles_checks_against_eager_and_falls_back(ckpt_f32):
    from nvchat_torch import doctor

    out = doctor.report("cpu", str(ckpt_f32), frames=6, compile="aot_eager")
    section = out.split("### Compiled frame step (--compile)")[1]
    assert "compiled vs eager over 20 frames: the same ids and codes on every frame" in section
    assert "first frame (compiles)" in section and "ms per frame after it: eager" in section
    assert "compiled whole (torch.compile, aot_eager" in out.split("### Model")[1]
    # MPS never runs the fused CPU ops: what the report says MPS would run names none of them.
    fell_back = out.split("### What fell back")[1].split("###")[0]
    assert "nvchat_cpu::" not in fell_back and "(seen in frame )" not in out

    def broken(gm, example_inputs):
        raise RuntimeError("no Metal shader compiler")

    out = doctor.report("cpu", str(ckpt_f32), frames=6, compile=broken)
    section = out.split("### Compiled frame step (--compile)")[1]
    assert "compiling failed: " in section and "RuntimeError: no Metal shader compiler" in section
    assert "the model runs eager" in section and "frame step: eager" in out.split("### Model")[1]


def test_the_store_is_where_the_environment_says_and_a_broken_file_is_compiled_again(tmp_path, monkeypatch):
    """Where compiled graphs are kept (``NVCHAT_TORCH_COMPILE_STORE``, else the user's cache), that only
    inductor without CUDA graphs keeps them, and that a stored file that cannot be loaded is reported
    and compiled again (not raised, not run)."""
    from nvchat_torch.runtime.compiled_step import CompiledStep, StepCompiler
    from nvchat_torch.runtime.graph_store import STORE_ENV, default_store

    monkeypatch.setenv(STORE_ENV, "off")
    assert default_store() is None and "not kept (no store)" in StepCompiler(torch.device("cpu")).describe()
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    assert default_store() == tmp_path
    monkeypatch.delenv(STORE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store() == tmp_path / "xdg" / "nvchat_torch" / "compiled"
    assert StepCompiler(torch.device("cpu"), store=tmp_path).keeps
    assert not StepCompiler(torch.device("cpu"), "aot_eager", store=tmp_path).keeps
    assert not StepCompiler(torch.device("cpu"), mode="reduce-overhead", store=tmp_path).keeps

    class Owner:
        def step(self, step, stamps):
            return step

    compiler = StepCompiler(torch.device("cpu"), store=tmp_path)
    compiled = CompiledStep(compiler, Owner().step, list)
    broken = compiled.store.variants("k")[0]
    broken.write_bytes(b"not a compiled graph")
    assert compiled.store.load("k", ()) is None and compiler.loaded == 0 and not broken.exists()
    assert "frame-step-k.bin could not be loaded" in compiler.describe() and "compiled again" in compiler.describe()
    # Inductor writes the CPU thread count into its parallel loops: a graph is kept per count.
    Owner.model = torch.nn.Linear(2, 2)
    threads = torch.get_num_threads()
    try:
        keys = set()
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.add(compiled.store.key(()))
    finally:
        torch.set_num_threads(threads)
    assert len(keys) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="graphs are compiled in a child process on Linux only")
def test_a_child_that_cannot_compile_leaves_the_graph_to_this_process(tmp_path, monkeypatch):
    """On a Linux CPU a graph to store is compiled in a forked child process. A child that fails leaves the
    graph to this process, which says why and compiles the model's next graphs itself; a child whose
    aot_compile fails is the failure it is here (torch.compile's own path follows). A child that
    succeeds runs in the inductor parity test above."""
    from nvchat_torch.runtime.compiled_step import CompiledStep, StepCompiler
    from nvchat_torch.runtime.graph_store import CannotKeep, GraphStore

    parent = os.getpid()

    class Owner:
        def step(self, step, stamps):
            return step

    class Graph:  # what aot_compile gives, as far as the store goes
        def save_compiled_function(self, path):
            Path(path).write_bytes(b"graph")

    def compile_here_only(self, args):
        if os.getpid() != parent:
            raise MemoryError("no room for the compiler")
        return Graph()

    monkeypatch.setattr(GraphStore, "compile", compile_here_only)
    compiler = StepCompiler(torch.device("cpu"), store=tmp_path)
    assert compiler.compiles_in_child and "compiled here, in a child process" in compiler.describe()
    compiled = CompiledStep(compiler, Owner().step, list)
    with pytest.warns(UserWarning, match=r"compiled in this process: the child process could not compile or "
                                         r"store the graph \(MemoryError: no room for the compiler\)"):
        graph = compiled.store.compile_ahead("k", ())
    assert isinstance(graph, Graph) and compiler.precompiled == 1 and compiler.loaded == 0
    assert compiled.store.variants("k")[0].read_bytes() == b"graph"
    assert not compiler.compiles_in_child and "compiled here, in this process" in compiler.describe()

    def no_fork():
        raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as m:
        m.setattr(os, "fork", no_fork)
        unforked = StepCompiler(torch.device("cpu"), store=tmp_path / "unforked")
        with pytest.warns(UserWarning, match=r"compiled in this process: no child process could be made"):
            assert isinstance(CompiledStep(unforked, Owner().step, list).store.compile_ahead("k", ()), Graph)
        assert unforked.precompiled == 1 and (tmp_path / "unforked" / "frame-step-k.bin").is_file()

    def cannot(self, args):
        raise CannotKeep("aot_compile failed: RuntimeError: unsupported")

    monkeypatch.setattr(GraphStore, "compile", cannot)
    other = StepCompiler(torch.device("cpu"), store=tmp_path / "other")
    with pytest.raises(CannotKeep, match="aot_compile failed: RuntimeError: unsupported"):
        CompiledStep(other, Owner().step, list).store.compile_ahead("k", ())
    assert other.precompiled == 0 and not (tmp_path / "other").exists()


def test_a_weight_read_twice_is_not_held_upcast_between_its_reads():
    """A bf16 weight that a step reads twice (the MoG head's layers, once per draw) is upcast for each
    read and the float32 copy freed, as eager does: inductor would otherwise make both upcasts in one
    kernel and hold the second copy until its use (~150 MB more at the full size's peak). The compiled
    result equals eager's bit for bit."""
    from torch._inductor.utils import run_and_get_code

    from nvchat_torch.models import layers

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 256, generator=gen).to(torch.bfloat16)
    down = torch.randn(256, 512, generator=gen).to(torch.bfloat16)

    def two_draws(x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):  # the same weights each draw
            x = x + layers.linear(torch.relu(layers.linear(x, weight)), down)
        return x

    x = torch.randn(2, 256, generator=gen)
    got, (code, *_) = run_and_get_code(torch.compile(two_draws, fullgraph=True, backend="inductor"), x)
    assert torch.equal(got, two_draws(x))
    assert code.count("= torch.ops.nvchat.linear_float32.default(") == 4  # one upcast per read
    # no buffer of a weight's size: the graph holds only activations ([2, 512] at most)
    assert "empty_strided_cpu((512, 256)" not in code and "empty_strided_cpu((256, 512)" not in code


_CACHED_UNDER_A_DISPATCH = """
import json, sys, torch
from nvchat_torch.runtime.compiled_step import StepCompiler
gen = torch.Generator().manual_seed(0)
up, down = torch.randn(512, 256, generator=gen), torch.randn(256, 512, generator=gen)

def step(x):
    for _ in range(2):
        x = x + torch.relu(x @ up.T) @ down.T
    return x

x = torch.randn(2, 256, generator=gen)
with StepCompiler(torch.device("cpu"), store=None).settings():
    got = torch.compile(step, fullgraph=True)(x)
print(json.dumps([torch.backends.cpu.get_cpu_capability(), bool(torch.equal(got, step(x)))]))
"""


def test_a_step_compiled_under_one_cpu_dispatch_is_not_reused_under_another(tmp_path):
    """Inductor's graph cache does not key on the CPU dispatch (``ATEN_CPU_CAPABILITY``) that its
    kernels' vector width comes from (torch 2.13): a graph cached under AVX-512 gave wrong values under
    AVX2, and one cached under AVX2 crashed under AVX-512. The frame step's compile settings name the
    width, so each dispatch gets its own entries: a step compiled under the machine's dispatch, then the
    other one, then the machine's again, all with one cache folder, equals eager each time."""
    other = {"AVX512": "avx2", "AVX512_BF16": "avx2", "AMX": "avx2"}.get(torch.backends.cpu.get_cpu_capability(),
                                                                        "default")
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    seen = []
    for capability in (None, other, None):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([sys.executable, "-c", _CACHED_UNDER_A_DISPATCH], capture_output=True, text=True,
                              env=run_env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [equal for _, equal in seen] == [True, True, True], seen
    assert seen[1][0].lower() == other and seen[0][0] == seen[2][0] != seen[1][0]
