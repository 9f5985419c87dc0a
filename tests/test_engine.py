"""The batched engine: sessions stepped together give what each gives alone, and the MLX reference's."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from mlx_oracle import synth_audio
from test_layouts import LAYOUTS, MIN_SNR_DB, snr_db
from test_session import PROMPT, TEXT_CHANNELS, channel, run_reference_stream

import nvchat_torch as nv
from nvchat_torch import ContextLimit, StreamingOptions
from nvchat_torch.diagnostics import OpCounter, count_host_reads
from nvchat_torch.models.nemotron_h import KVCache
from nvchat_torch.runtime.prompt import prompt_ids
from nvchat_torch.runtime.timeline import Timeline

FRAME = 1280


@dataclass
class Plan:
    """One conversation: its options, audio, chunk sizes (cycled, one push per engine step) and the
    step it joins at; ``cancel_at``: the step it is cancelled at instead of finishing."""

    prompt: str | None
    seed: int
    wave: np.ndarray
    sizes: tuple[int, ...]
    start: int = 0
    deterministic: bool = True
    cancel_at: int | None = None
    events: list = field(default_factory=list)

    def options(self) -> StreamingOptions:
        return StreamingOptions(system_prompt=self.prompt, seed=self.seed, deterministic=self.deterministic)

    def chunks(self) -> list[np.ndarray]:
        out, i, k = [], 0, 0
        while i < len(self.wave):
            n = self.sizes[k % len(self.sizes)]
            out.append(self.wave[i:i + n])
            i, k = i + n, k + 1
        return out


def run_engine(model, plans: list[Plan], max_sessions: int = 8) -> list[list]:
    """Drive every plan through one engine (one chunk per session per step, then flush); the events of
    each. Checks on the way that a step returns a session's frames in order, one per step."""
    engine = model.create_engine(max_sessions=max_sessions)
    handles: list = [None] * len(plans)
    queues = [p.chunks() for p in plans]
    events: list[list] = [[] for _ in plans]
    for step in range(1000):
        for i, plan in enumerate(plans):
            if step == plan.start:
                handles[i] = engine.open(plan.options())
            h = handles[i]
            if h is None or h.closed:
                continue
            if plan.cancel_at == step:
                events[i] += h.cancel()
            elif queues[i]:
                h.push_audio(queues[i].pop(0), 16000)
            elif not h.finishing:
                h.flush()
        for i, got in engine.step().items():
            index = handles.index(i)
            frames = [e.frame_index for e in got if e.kind == "audio"]
            assert len(frames) <= 1
            events[index] += got
        if all(h is not None and h.closed for h in handles):
            return events
    raise AssertionError("the engine did not finish the sessions")


def run_alone(model, plan: Plan) -> list:
    session = model.create_streaming_session(plan.options())
    events = []
    for k, chunk in enumerate(plan.chunks()):
        if plan.cancel_at is not None and k == plan.cancel_at - plan.start:
            return events + session.cancel()
        events += session.push_audio(chunk, 16000)
    return events + session.flush()


def assert_same_events(got: list, want: list, atol: float = 1e-5) -> None:
    """Identical events (kinds, frames, ids, text, codes) and audio within ``atol``."""
    def key(e):
        return (e.kind, e.frame_index, e.token_id, e.delta, e.text, e.call_id, e.name, e.arguments, e.reason)

    assert [key(e) for e in got] == [key(e) for e in want]
    audio = [(g, w) for g, w in zip(got, want) if g.kind == "audio"]
    assert audio, "no audio frames ran"
    for g, w in audio:
        np.testing.assert_array_equal(g.audio_codes, w.audio_codes)
        np.testing.assert_allclose(g.samples, w.samples, atol=atol, rtol=0)


def plans_for(waves: list[np.ndarray], deterministic: bool = True) -> list[Plan]:
    """Four conversations: different prompts (none included), seeds, chunkings and join times; the
    third sits out often (777-sample pushes), the last is cancelled mid-way."""
    return [Plan(PROMPT, 0, waves[0], (FRAME,), start=0, deterministic=deterministic),
            Plan("be brief", 1, waves[1], (3000, 500), start=2, deterministic=deterministic),
            Plan("", 2, waves[2], (777,), start=5, deterministic=deterministic),
            Plan("you talk like a pirate", 3, waves[3], (2048, 1), start=1, deterministic=deterministic, cancel_at=9)]


@pytest.fixture(scope="module")
def waves():
    return [synth_audio(s, seed=k) for k, s in enumerate((1.3, 1.05, 0.9, 1.2))]


@pytest.fixture(scope="module")
def tiny():
    return nv.load_tiny_model()


def test_engine_sessions_equal_sessions_alone(tiny, waves):
    plans = plans_for(waves)
    got = run_engine(tiny, plans, max_sessions=4)
    for plan, events in zip(plans, got):
        assert_same_events(events, run_alone(tiny, plan))
    assert got[3][-1].kind == "cancelled" and all(e[-1].kind == "done" for e in got[:3])


@pytest.mark.parametrize("name", ["q4-f32-scales", "bf16"])
def test_engine_equals_sessions_on_the_real_layouts(make_checkpoint, waves, name):
    model = nv.load_model(make_checkpoint(seed=0, **LAYOUTS[name]), device="cpu")
    plans = plans_for(waves)
    for plan, events in zip(plans, run_engine(model, plans)):
        assert_same_events(events, run_alone(model, plan))


@pytest.mark.parametrize("name", ["float32", "q4-f32-scales"])
def test_three_sessions_joining_at_different_frames_match_the_reference(make_checkpoint, reference, waves, name):
    path = make_checkpoint(seed=0, **LAYOUTS.get(name, {}))
    model = nv.load_model(path, device="cpu")
    ref = reference(path)
    plans = [Plan(PROMPT, 0, waves[0], (FRAME,), start=0), Plan("be brief", 0, waves[1], (777, 3000), start=3),
             Plan("", 0, waves[2], (2048,), start=6)]
    for plan, events in zip(plans, run_engine(model, plans)):
        want = run_reference_stream(ref, plan.wave, plan.prompt, sizes=plan.sizes)
        audio = [e for e in events if e.kind == "audio"]
        np.testing.assert_array_equal(np.stack([e.audio_codes for e in audio]), want["codes"])
        for kind in ("text", "function"):
            assert channel(events, f"{'assistant_text' if kind == 'text' else kind}_delta") == want[kind]
        assert [(e.frame_index, e.delta, e.text) for e in events if e.kind == "user_transcript_delta"] == \
            want["transcript"]
        assert snr_db(want["audio"], np.concatenate([e.samples for e in audio])) >= MIN_SNR_DB


def test_sampling_depends_on_the_session_only(tiny, waves):
    """A sampling session gives the same output alone, beside others and as a StreamingSession: each
    row draws from its own generator."""
    plans = plans_for(waves, deterministic=False)
    plans[1].deterministic = True  # rows of both kinds in one batch
    mine = Plan("be brief", 7, waves[0], (FRAME,), start=3, deterministic=False)
    beside = run_engine(tiny, plans + [mine])[-1]
    alone = run_engine(tiny, [Plan(mine.prompt, mine.seed, mine.wave, mine.sizes, deterministic=False)])[0]
    assert_same_events(beside, alone)
    assert_same_events(beside, run_alone(tiny, mine))
    other_seed = run_alone(tiny, Plan(mine.prompt, 8, mine.wave, mine.sizes, deterministic=False))
    codes = [e.audio_codes for e in beside if e.kind == "audio"]
    assert any((a != e.audio_codes).any() for a, e in zip(codes, (e for e in other_seed if e.kind == "audio")))


def _steady_step(model, n: int) -> tuple[int, int, int]:
    """Non-view ops and host reads of a steady-state step with ``n`` sessions, and of a step where one sits out."""
    engine = model.create_engine(max_sessions=n)
    wave = synth_audio(1.0)
    handles = [engine.open(system_prompt=PROMPT if i % 2 else "hi", seed=i, deterministic=True) for i in range(n)]
    for k in range(5):
        for h in handles:
            h.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
        engine.step()
    for h in handles:
        h.push_audio(wave[5 * FRAME:6 * FRAME], 16000)
    with count_host_reads() as reads, OpCounter() as ops:
        assert len(engine.step()) == n
    for h in handles[1:]:
        h.push_audio(wave[6 * FRAME:7 * FRAME], 16000)
    with OpCounter() as sit_out:
        engine.step()
    return ops.non_view, sum(reads.values()), sit_out.non_view


def test_a_step_costs_the_same_ops_and_one_host_read_whatever_the_batch(tiny):
    one, reads, _ = _steady_step(tiny, 1)
    two, _, sit_two = _steady_step(tiny, 2)
    four, reads_four, sit_four = _steady_step(tiny, 4)
    # Every step attends over the whole key/value buffers with masks from the rows' positions (the static
    # step a compiler takes whole), so a lone session runs the very ops of many.
    assert one == two == four
    assert reads == reads_four == 1
    # A row sitting out costs a fixed restore, not per row.
    assert sit_two - two == sit_four - four > 0


def test_slots_are_reused_and_limits_hold(tiny):
    engine = tiny.create_engine(max_sessions=2)
    wave = synth_audio(0.5)
    a = engine.open(system_prompt="hi", deterministic=True)
    b = engine.open(system_prompt="", deterministic=True)
    with pytest.raises(RuntimeError, match="max_sessions"):
        engine.open()
    assert b.cancel()[0].kind == "cancelled" and b.closed and b.cancel() == []
    c = engine.open(system_prompt="hi", deterministic=True)
    assert c.slot == 1  # the cancelled session's slot
    # Bad input names the problem and changes nothing; the engine steps on.
    with pytest.raises(ValueError, match="22050"):
        a.push_audio(wave, 22050)
    with pytest.raises(ValueError, match="mono"):
        a.push_audio(np.zeros((2, 100), np.float32), 16000)
    for h in (a, c):
        h.push_audio(wave, 16000)
    ran = engine.step()
    assert set(ran) == {a, c} and a.pending_frames == c.pending_frames == wave.size // FRAME - 1
    a.flush()
    a.flush()  # again: nothing more
    with pytest.raises(RuntimeError, match="flushed"):
        a.push_audio(wave, 16000)
    events = {}
    while not a.closed:
        for h, got in engine.step().items():
            events.setdefault(h, []).extend(got)
    assert events[a][-1].kind == "done" and events[a][-1].frame_index == a.frame_index == -(-wave.size // FRAME)
    with pytest.raises(RuntimeError, match="closed"):
        a.push_audio(wave, 16000)
    assert engine.sessions == [c]
    with pytest.raises(ValueError, match="max_sessions"):
        tiny.create_engine(max_sessions=0)


def test_context_limit_keeps_the_frames_before_it(tiny):
    engine = tiny.create_engine(max_sessions=1)
    h = engine.open(StreamingOptions(system_prompt="hi", deterministic=True, max_streaming_seconds=0.4))
    with pytest.raises(ContextLimit, match="5 frames"):
        h.push_audio(synth_audio(1.0), 16000)
    frames = []
    while h.pending_frames:
        frames += [e.frame_index for e in engine.step()[h] if e.kind == "audio"]
    assert frames == list(range(5))
    with pytest.raises(ContextLimit):
        h.push_audio(np.zeros(FRAME, np.float32), 16000)
    h.flush()
    kinds = [e.kind for e in engine.step()[h]]  # done, after any text held back at the last frame
    assert kinds[-1] == "done" and set(kinds[:-1]) <= set(TEXT_CHANNELS)


def test_engine_refuses_the_diagnostic_paths(tiny):
    engine = tiny.create_engine()
    with pytest.raises(ValueError, match="use_language_cache"):
        engine.open(use_language_cache=False)


def test_engine_profile_times_each_stage(tiny):
    engine = tiny.create_engine(max_sessions=2, profile=True)
    handles = [engine.open(deterministic=True) for _ in range(2)]
    for h in handles:
        h.push_audio(synth_audio(0.4), 16000)
    while any(h.pending_frames for h in handles):
        engine.step()
    assert len(engine.profile.frames) == 5
    assert all(f.total_ms >= f.perception_ms + f.language_ms > 0 for f in engine.profile.frames)
    engine = tiny.create_engine(max_sessions=2)
    timed, untimed = engine.open(profile=True), engine.open()
    for h in (timed, untimed):
        h.push_audio(synth_audio(0.4), 16000)
    while timed.pending_frames:
        engine.step()
    assert [f.frame_index for f in timed.profile.frames] == list(range(5)) and not untimed.profile.frames


def test_forced_tokens_apply_to_their_row_only(tiny, waves):
    plans = [Plan(PROMPT, 0, waves[0], (FRAME,)), Plan(PROMPT, 0, waves[0], (FRAME,))]
    engine = tiny.create_engine(max_sessions=2)
    a, b = (engine.open(p.options()) for p in plans)
    forced = tiny.tokenizer.encode(" hello", add_special_tokens=False)
    a.force_tokens("text", forced)
    a.push_audio(waves[0], 16000)
    b.push_audio(waves[0], 16000)
    ids = {a: [], b: []}
    while a.pending_frames:
        for h, got in engine.step().items():
            ids[h] += [e.token_id for e in got if e.kind == "assistant_text_delta"]
    assert ids[a][:len(forced)] == forced
    assert ids[b] != ids[a]
    alone = run_alone(tiny, plans[1])
    assert ids[b] == [e.token_id for e in alone if e.kind == "assistant_text_delta" and e.frame_index < b.frame_index]


def test_rows_keep_the_key_dtype_the_reference_keeps(make_checkpoint, waves):
    """On the bf16 card the prompt's keys are bf16, and the reference stores the frames' keys in that
    bf16 buffer until its next 256-slot block: the float32 rows hold them rounded (a prompt-less row
    does not), in the engine as in a session alone (the same row)."""
    model = nv.load_model(make_checkpoint(seed=0, **LAYOUTS["bf16"]), device="cpu")
    engine = model.create_engine(max_sessions=2)
    other = engine.open(system_prompt="", deterministic=True)  # no prompt: float32 keys from the start
    mine = engine.open(system_prompt=PROMPT, deterministic=True)
    session = model.create_streaming_session(system_prompt=PROMPT, deterministic=True)
    timeline = Timeline(model, seed=0, deterministic=True, use_language_cache=True)
    with torch.inference_mode():
        timeline.prefill(timeline.embed(torch.tensor([prompt_ids(model, PROMPT)])))
    prompt_kv = [c for c in timeline.language_cache.layers if isinstance(c, KVCache)]
    assert prompt_kv and all(c.keys.dtype == torch.bfloat16 for c in prompt_kv)  # as the reference's prefill
    for h in (mine, other):
        h.push_audio(waves[0][:4 * FRAME], 16000)
    while mine.pending_frames:
        engine.step()
    session.push_audio(waves[0][:4 * FRAME], 16000)
    rows = engine.frame_step.rows
    caches = [(c, s) for c, s in zip(engine.frame_step._language.layers, session._frame_step._language.layers)
              if isinstance(c, KVCache)]
    for ours, alone in caches:
        end = rows[mine.slot].llm_position
        assert end == session._frame_step.rows[0].llm_position == 4 + session.timeline_index - session.frame_index
        held = ours.keys[mine.slot, :, :end]
        assert held.dtype == torch.float32 and torch.equal(held, held.bfloat16().float())
        assert torch.equal(held, alone.keys[0, :, :end])
        new = ours.keys[other.slot, :, :rows[other.slot].llm_position]
        assert not torch.equal(new, new.bfloat16().float())  # the prompt-less row keeps float32 keys


def test_log_mel_and_conformer_rows_start_each_stream_as_alone(tiny):
    """forward_step with many rows: streams that join at different frames (a row that sits out is put
    back by the caller, here by hand) give each row's encoder frames as its stream alone gives them."""
    perception = tiny.stt_model.perception
    log_mel = perception.log_mel
    rng = np.random.default_rng(0)
    streams, frames, starts = 3, 7, [0, 1, 3]
    audio = torch.from_numpy(rng.standard_normal((streams, frames * FRAME)).astype(np.float32)) * 0.1
    alone = []
    with torch.inference_mode():
        for b in range(streams):
            mel_cache, cache = log_mel.new_cache(), perception.new_cache()
            alone.append([perception.forward_step(log_mel.forward_step(audio[b:b + 1, t * FRAME:(t + 1) * FRAME],
                                                                       mel_cache), cache)[1] for t in range(frames)])
        mel_rows, rows = log_mel.new_cache(streams), perception.new_cache(streams)
        for step in range(frames + max(starts)):
            t = [step - s for s in starts]
            runs = torch.tensor([0 <= k < frames for k in t])
            batch = torch.stack([audio[b, k * FRAME:(k + 1) * FRAME] if runs[b] else torch.zeros(FRAME)
                                 for b, k in enumerate(t)])
            saved = mel_rows.samples.clone(), rows.mel.clone(), rows.frames, list(rows.conv)
            running = [k for k in t if 0 <= k < frames]  # the frames each running row has run
            rows.least, rows.aligned = min(running), min(running) == max(running)
            _, encoded = perception.forward_step(log_mel.forward_step(batch, mel_rows), rows)
            mel_rows.samples.copy_(torch.where(runs[:, None], mel_rows.samples, saved[0]))
            rows.mel.copy_(torch.where(runs[:, None, None], rows.mel, saved[1]))
            rows.conv = [torch.where(runs[:, None, None], now, before) for now, before in zip(rows.conv, saved[3])]
            for b in range(streams):
                if runs[b]:
                    torch.testing.assert_close(encoded[b], alone[b][t[b]][0], rtol=1e-5, atol=1e-5)
            mel_rows.frames = rows.frames = saved[2] + runs  # the rows that sat out keep their frame


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_a_deferred_prefill_joins_in_pieces_while_others_step(tiny, make_checkpoint, waves, name):
    """``open(defer_prefill=True)``: the session sits out, holding no slot, while ``prefill`` runs its
    prompt in pieces between the other session's steps; once joined, its events are those of a
    session prefilled at once (the same pieces), and the other's are untouched. On the bf16 card the
    LLM prefill is token by token, so it spreads over many pieces too."""
    model = tiny if name == "f32" else nv.load_model(make_checkpoint(seed=0, **LAYOUTS["bf16"]), device="cpu")
    prompt = PROMPT * 12  # > 256 tokens: more than one LLM piece on the float32 path
    streaming, joining = Plan("be brief", 1, waves[1], (FRAME,)), Plan(prompt, 0, waves[0], (FRAME,))
    engine = model.create_engine(max_sessions=2)
    a = engine.open(streaming.options())
    b = engine.open(joining.options(), defer_prefill=True)
    assert b.prefilling and b.slot is None and engine.joining == [b] and len(engine.sessions) == 1
    with pytest.raises(RuntimeError, match="full"):
        engine.open(StreamingOptions())  # a joining session counts towards max_sessions
    chunks_a, chunks_b = streaming.chunks(), joining.chunks()
    got_a, got_b, pieces_steps = [], [], 0
    for _ in range(2000):
        if chunks_a:
            a.push_audio(chunks_a.pop(0), 16000)
        elif not a.finishing:
            a.flush()
        if chunks_b:
            b.push_audio(chunks_b.pop(0), 16000)
        elif not b.finishing:
            b.flush()
        out = engine.step()
        got_a += out.get(a, [])
        got_b += out.get(b, [])
        if b.prefilling:
            assert b not in out
            pieces_steps += 1
            joined = engine.prefill(0.0)  # one piece per step
            assert joined in ([], [b])
        if a.closed and b.closed:
            break
    assert pieces_steps > 10 and not engine.joining
    assert_same_events(got_a, run_alone(model, streaming))
    assert_same_events(got_b, run_alone(model, joining))


def test_rows_never_read_memory_nothing_wrote(tiny, waves, monkeypatch):
    """A row reads every slot up to the longest row's end, masked past its own; a masked slot still
    holding NaN from reused memory would poison its attention (0 * NaN). With every uninitialized
    float allocation filled with NaN, a short session beside one with a long prompt (its caches grown
    past the short one's end) still equals itself alone. (CI once saw the short row turn to id 0.)"""
    def poison(make):
        def poisoned(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return poisoned

    short = Plan(None, 0, waves[0], (FRAME,))
    want = run_alone(tiny, short)
    monkeypatch.setattr(torch.Tensor, "new_empty", poison(torch.Tensor.new_empty))
    monkeypatch.setattr(torch, "empty", poison(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poison(torch.empty_like))
    engine = tiny.create_engine(max_sessions=2)
    a, b = engine.open(short.options()), None
    chunks, got = short.chunks(), []
    for step in range(200):
        if chunks:
            a.push_audio(chunks.pop(0), 16000)
        elif not a.finishing:
            a.flush()
        if step == 4:  # joins later, far ahead in LLM and TTS positions
            b = engine.open(StreamingOptions(system_prompt=PROMPT * 4, deterministic=True))
        if b is not None and not b.closed:
            b.push_audio(waves[1][:FRAME], 16000)
        got += engine.step().get(a, [])
        if a.closed:
            break
    assert b is not None and b.frame_index > 5
    assert_same_events(got, want)
