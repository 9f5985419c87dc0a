"""Shared fixtures: tiny checkpoints written by the MLX reference, and the reference itself.

With ``CI=true`` a skipped test fails the run: the parity tests must run, not skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config  # noqa: F401 (the attribute set below)
from mlx_oracle import Reference, TinySpec, build_tiny_checkpoint

from nvchat_torch.runtime.compiled_step import vector_bits

# Tiny models are dominated by per-op overhead, which extra threads only add to (and the CI box has 2 cores).
torch.set_num_threads(1)

# The tests' own torch.compile calls name the CPU vector width too, as the frame step's compile settings
# do: inductor's graph cache does not key on ATEN_CPU_CAPABILITY, so a run under another dispatch (CI's
# AVX2 machine reproduced) would otherwise reuse this one's graphs and give wrong values (vector_bits).
torch._inductor.config.cpp.simdlen = vector_bits()  # type: ignore[attr-defined]

_CHECKPOINTS: dict[str, Path] = {}
_REFERENCES: dict[tuple[str, bool], Reference] = {}
_SKIPPED: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def compile_store(tmp_path_factory):
    """The compiled frame steps the tests store (nvchat_torch.runtime.graph_store.default_store) go to a
    folder of this run's, not the user's cache."""
    from nvchat_torch.runtime.graph_store import STORE_ENV

    before = os.environ.get(STORE_ENV)
    os.environ[STORE_ENV] = str(tmp_path_factory.mktemp("compiled"))
    yield Path(os.environ[STORE_ENV])
    if before is None:
        del os.environ[STORE_ENV]
    else:
        os.environ[STORE_ENV] = before


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """``make_checkpoint(**TinySpec fields) -> Path``, built once per session per spec."""

    def make(**kwargs) -> Path:
        spec = TinySpec(**kwargs)
        key = spec.key()
        if key not in _CHECKPOINTS:
            out = tmp_path_factory.mktemp("ckpt")
            _CHECKPOINTS[key] = build_tiny_checkpoint(out, spec)
        return _CHECKPOINTS[key]

    return make


@pytest.fixture(scope="session")
def reference():
    """``reference(path, deterministic=True) -> Reference`` (the MLX model), cached per path."""

    def get(path, deterministic: bool = True) -> Reference:
        key = (str(path), deterministic)
        if key not in _REFERENCES:
            _REFERENCES[key] = Reference(path, deterministic=deterministic)
        return _REFERENCES[key]

    return get


@pytest.fixture(scope="session")
def ckpt_f32(make_checkpoint) -> Path:
    return make_checkpoint(seed=0)


@pytest.fixture(scope="session")
def ckpt_q8(make_checkpoint) -> Path:
    return make_checkpoint(seed=0, bits=8)


@pytest.fixture(scope="session")
def ckpt_q4(make_checkpoint) -> Path:
    return make_checkpoint(seed=0, bits=4)


def pytest_sessionstart(session):
    # Build (or load) the fused CPU kernels once, before any test: a first build takes ~20 s, which a
    # subprocess test with its own timeout (the CLI, the server) should not have to wait out.
    from nvchat_torch.models import cpu_kernels

    cpu_kernels.status()


# Tests that pace audio in wall-clock time (servers, voice-agent frameworks, the browser, the command line
# against a live server) and bound how late a frame may come. .ci/run runs the rest on two processes
# (pytest-xdist) and these afterwards on their own, so that no other test's work delays their frames.
REALTIME_MODULES = {"test_server", "test_server_safety", "test_server_fuzz", "test_server_requests", "test_server_turns",
                    "test_pipecat", "test_livekit", "test_browser", "test_cli", "test_server_lag", "test_server_tools",
                    "test_ray_serve"}


def pytest_configure(config):
    config.addinivalue_line("markers", "realtime: paced in wall-clock time; .ci/run runs these on their own")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in REALTIME_MODULES:
            item.add_marker(pytest.mark.realtime)


def pytest_runtest_logreport(report):
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI", "").lower() == "true" and _SKIPPED:
        print(f"\nCI=true: {len(_SKIPPED)} test(s) skipped, which CI does not allow:")
        for nodeid in _SKIPPED:
            print(f"  {nodeid}")
        session.exitstatus = 1
