"""The engine's cache of prefilled prompts (nvchat_torch.runtime.prompt): a session with a prompt kept there
joins at once, and its frames equal those of a fresh prefill; the cache is keyed by what determines a
prefill and bounded in bytes, least recently used first out."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch
from test_server import EXAMPLE

import nvchat_torch as nv
from nvchat_torch.runtime.prompt import PromptCache

PROMPT = "You are a helpful voice assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


def run(engine, options, audio):
    """Open a session, prefill it, run ``audio`` through it alone, close it: (was it prefilling when
    opened, its text, its samples)."""
    handle = engine.open(options, defer_prefill=True)
    prefilling = handle.prefilling
    while handle.prefilling:
        engine.prefill(None)
    handle.push_audio(audio, 16000)
    events = []
    while handle.pending_frames:
        events += engine.step().get(handle, [])
    handle.cancel()
    samples = np.concatenate([e.samples for e in events if e.kind == "audio"])
    return prefilling, handle.text, samples


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_kept_prompt_joins_at_once_with_the_frames_of_a_fresh_prefill(model, deterministic):
    speech, _ = sf.read(EXAMPLE, dtype="float32")
    audio = speech[:16 * 1280]
    options = nv.StreamingOptions(system_prompt=PROMPT, seed=7, deterministic=deterministic)
    fresh = model.create_engine(max_sessions=2)
    cached = model.create_engine(max_sessions=2)
    cached.prompt_cache = cache = PromptCache()
    want = run(fresh, options, audio)
    first = run(cached, options, audio)  # prefilled, and kept
    second = run(cached, options, audio)  # from the cache
    assert want[0] and first[0] and not second[0]
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    for got in (first, second):
        assert got[1] == want[1]
        assert np.array_equal(got[2], want[2])
    # another seed or mode is another prefill
    other = run(cached, nv.StreamingOptions(system_prompt=PROMPT, seed=8, deterministic=deterministic), audio)
    assert other[0] and len(cache) == 2


def test_the_cache_is_bounded_least_recently_used_first(model):
    engine = model.create_engine(max_sessions=1)
    engine.prompt_cache = cache = PromptCache()
    audio = np.zeros(1280, np.float32)
    run(engine, nv.StreamingOptions(system_prompt=PROMPT, deterministic=True), audio)
    size = cache.nbytes
    assert size > 0
    run(engine, nv.StreamingOptions(system_prompt=PROMPT + " A", deterministic=True), audio)
    cache.max_bytes = cache.nbytes  # these two entries, exactly
    run(engine, nv.StreamingOptions(system_prompt=PROMPT, deterministic=True), audio)  # used again
    run(engine, nv.StreamingOptions(system_prompt=PROMPT + " B", deterministic=True), audio)  # evicts " A"
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert not run(engine, nv.StreamingOptions(system_prompt=PROMPT, deterministic=True), audio)[0]
    assert run(engine, nv.StreamingOptions(system_prompt=PROMPT + " A", deterministic=True), audio)[0]
    small = PromptCache(max_bytes=size - 1)  # an entry over the bound is not kept
    engine.prompt_cache = small
    run(engine, nv.StreamingOptions(system_prompt=PROMPT, deterministic=True), audio)
    assert len(small) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PromptCache(max_bytes=-1)
