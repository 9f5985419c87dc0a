"""The TTS prefill track (nvchat_torch.runtime.speech_track): a session that takes its prompt's TTS state from the
model's shared track is, frame by frame and bit for bit, the session whose prefill ran every TTS step
itself (the tracks off: ``max_bytes = 0``), whether the track was longer (a prefix), shorter (extended),
bounded (the session goes on alone), shared between threads, or taken by the engine's deferred prefill;
and on the real card's layout it is the MLX reference's session."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from mlx_oracle import synth_audio
from test_layouts import LAYOUTS, MIN_SNR_DB, snr_db
from test_long_sessions import tiny_model_with
from test_session import channel, run_reference_stream

import nvchat_torch as nv
from nvchat_torch.model import VoiceChatModel
from nvchat_torch.runtime.prompt import prompt_ids
from nvchat_torch.runtime.speech_track import TRACK_BYTES
from nvchat_torch.runtime.timeline import PREFILL_CHUNK, Timeline
from nvchat_torch.training import adapters

FRAME = 1280
SHORT = "be brief and kind to every caller"
# ~300 tokens of the tiny tokenizer: past the TTS buffers' first 256-slot block (37 warmup positions +
# the steps), so a prefix of it is taken at another capacity than the track's own.
LONG = ("You are a friendly voice assistant for a small bakery. Greet callers warmly, answer questions about "
        "opening hours, prices and ingredients, and take orders for cakes and bread. Keep every answer short: "
        "one or two sentences, spoken naturally. Confirm each order.")


def narrow_window_model(window: int) -> VoiceChatModel:
    """The tiny model with sliding TTS layers of ``window`` positions, fewer than the speaker warmup's 37:
    their rings wrap during every prefill."""
    return tiny_model_with("tts_config", sliding_window=window)


@pytest.fixture(scope="module")
def tiny():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def narrow():
    return narrow_window_model(8)


@pytest.fixture(scope="module")
def wave():
    return synth_audio(1.2)


@pytest.fixture(params=["tiny", "narrow"])
def model(request):
    """Each test starts with no track and the default bound."""
    model = request.getfixturevalue(request.param)
    model.forget_speech_tracks()
    model.speech_tracks().max_bytes = TRACK_BYTES
    yield model
    model.forget_speech_tracks()
    model.speech_tracks().max_bytes = TRACK_BYTES


def tokens(model, prompt: str) -> int:
    return len(prompt_ids(model, prompt))


def options(prompt: str, deterministic: bool, seed: int = 3) -> nv.StreamingOptions:
    return nv.StreamingOptions(system_prompt=prompt, seed=seed, deterministic=deterministic)


def frames(events) -> dict:
    """What a session's frames gave: per frame the text and function ids, the transcript, the codes, the
    samples (bytes: compared bit for bit)."""
    audio = [e for e in events if e.kind == "audio"]
    assert audio, "no frames ran"
    return {"text": channel(events, "assistant_text_delta"), "function": channel(events, "function_delta"),
            "transcript": [(e.frame_index, e.delta, e.text) for e in events if e.kind == "user_transcript_delta"],
            "codes": [e.audio_codes.tolist() for e in audio], "audio": [e.samples.tobytes() for e in audio]}


def stream(model, prompt: str, deterministic: bool, wave: np.ndarray, seed: int = 3) -> dict:
    session = model.create_streaming_session(options(prompt, deterministic, seed))
    ids = []
    events = []
    for i in range(0, len(wave) - FRAME + 1, FRAME):
        events += session.push_audio(wave[i:i + FRAME], 16000)
        ids.append(session.last_ids)
    return {**frames(events + session.flush(pad_partial=False)), "ids": ids}


def sequential(model, prompt: str, deterministic: bool, wave: np.ndarray, seed: int = 3) -> dict:
    """The session with the tracks off: its prefill runs every TTS step itself."""
    tracks = model.speech_tracks()
    bound, tracks.max_bytes = tracks.max_bytes, 0
    try:
        return stream(model, prompt, deterministic, wave, seed)
    finally:
        tracks.max_bytes = bound


def prefilled(model, prompt: str, deterministic: bool, seed: int = 3) -> Timeline:
    timeline = Timeline(model, seed, deterministic, True)
    with torch.inference_mode():
        timeline.prefill(timeline.embed(torch.tensor([prompt_ids(model, prompt)])))
    return timeline


def assert_same_state(got: Timeline, want: Timeline) -> None:
    """The TTS state a prefill left, bit for bit: every layer's buffers (their capacity included), the
    position, the previous codes, the generator, the timeline index."""
    a, b = got.tts_cache, want.tts_cache
    assert (a.offset, a.windows, got.index) == (b.offset, b.windows, want.index)
    for mine, theirs in zip(a.keys + a.values, b.keys + b.values):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)
    assert torch.equal(got.previous_code, want.previous_code)
    assert torch.equal(got.generator.get_state(), want.generator.get_state())


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "sampling"])
def test_a_prefix_or_an_extension_of_the_track_is_the_sequential_prefill(model, deterministic):
    """The state after the prompt, as the track gives it: first made (cold), extended by a longer prompt,
    a prefix for a shorter one (taken at the buffers' capacity of its own length, and, in the narrow
    model, with rings whose slots later steps overwrote)."""
    tracks = model.speech_tracks()
    tracks.max_bytes = 0
    want = {p: prefilled(model, p, deterministic) for p in (SHORT, LONG)}
    tracks.max_bytes = TRACK_BYTES
    short, long = tokens(model, SHORT), tokens(model, LONG)
    assert want[LONG].tts_cache.capacities() != want[SHORT].tts_cache.capacities()
    assert_same_state(prefilled(model, SHORT, deterministic), want[SHORT])
    assert tracks.steps_held(3, deterministic) == short - 1
    assert_same_state(prefilled(model, LONG, deterministic), want[LONG])
    assert tracks.steps_held(3, deterministic) == long - 1
    steps = tracks.steps_run
    assert_same_state(prefilled(model, SHORT, deterministic), want[SHORT])
    assert tracks.steps_run == steps  # the prefix ran no step


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "sampling"])
def test_sessions_from_the_track_stream_the_frames_of_sequential_prefills(model, wave, deterministic):
    want = {p: sequential(model, p, deterministic, wave) for p in (SHORT, LONG)}
    other_seed = sequential(model, SHORT, deterministic, wave, seed=4)
    for prompt in (SHORT, LONG, SHORT):  # made, extended, a prefix
        assert stream(model, prompt, deterministic, wave) == want[prompt]
    # a seed is a track of its own when sampling; one track serves every seed when deterministic
    assert stream(model, SHORT, deterministic, wave, seed=4) == other_seed
    assert len(model.speech_tracks()) == (1 if deterministic else 2)


def test_a_bounded_track_leaves_the_rest_of_the_prefill_to_the_session(model, wave):
    """The bound stops the track's growth: a longer prompt takes the track's end and runs its remaining
    steps itself, with the same frames; a track of another seed takes the room of the least recently
    used one."""
    tracks = model.speech_tracks()
    want = sequential(model, LONG, False, wave)
    stream(model, SHORT, False, wave)
    tracks.max_bytes = tracks.nbytes + 200_000  # its buffers back at capacity, and some 20 more steps
    assert stream(model, LONG, False, wave) == want
    held = tracks.steps_held(3, False)
    assert tokens(model, SHORT) - 1 < held < tokens(model, LONG) - 1
    assert tracks.nbytes <= tracks.max_bytes
    assert stream(model, LONG, False, wave) == want  # again, from the bounded track
    stream(model, SHORT, False, wave, seed=9)  # another seed's track: the first goes
    assert tracks.steps_held(3, False) is None and tracks.steps_held(9, False) == tokens(model, SHORT) - 1
    tracks.max_bytes = 1  # too small for any track: every step the session's own
    assert len(tracks) == 0  # a lower bound drops what it no longer holds at once
    assert stream(model, LONG, False, wave) == want and len(tracks) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        tracks.max_bytes = -1


def deferred(model, prompt: str, deterministic: bool, wave: np.ndarray) -> tuple[int, dict]:
    """An engine session opened with ``defer_prefill`` beside one already streaming, one prefill piece per
    step: how many pieces it took, and its frames once joined."""
    engine = model.create_engine(max_sessions=2)
    other = engine.open(options("", deterministic, seed=5))  # no prompt: no step on any track
    handle = engine.open(options(prompt, deterministic), defer_prefill=True)
    pieces = 0
    while handle.prefilling:
        other.push_audio(wave[:FRAME], 16000)
        engine.step()
        engine.prefill(0.0)  # one piece
        pieces += 1
    handle.push_audio(wave, 16000)
    handle.flush(pad_partial=False)
    events = []
    while not handle.closed:
        events += engine.step().get(handle, [])
    return pieces, frames(events)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "sampling"])
def test_the_deferred_prefill_takes_the_track_in_pieces(tiny, wave, deterministic):
    """In the engine's deferred prefill each step the track lacks is one piece and the copy one more, and
    the joined session's frames are those of a deferred prefill that ran every step itself."""
    tiny.forget_speech_tracks()
    n = {p: tokens(tiny, p) for p in (SHORT, LONG)}
    llm = {p: -(-n[p] // PREFILL_CHUNK) for p in (SHORT, LONG)}
    tracks = tiny.speech_tracks()
    tracks.max_bytes = 0
    want = {p: deferred(tiny, p, deterministic, wave) for p in (SHORT, LONG)}
    assert [want[p][0] for p in (SHORT, LONG)] == [llm[p] + n[p] for p in (SHORT, LONG)]  # a piece per step
    tracks.max_bytes = TRACK_BYTES
    expected = [(SHORT, llm[SHORT] + n[SHORT] - 1 + 1),  # the track holds only its start: a piece per step
                (LONG, llm[LONG] + n[LONG] - n[SHORT] + 1),  # extended from SHORT's end
                (SHORT, llm[SHORT] + 1)]  # a prefix: one piece
    for prompt, pieces in expected:
        assert deferred(tiny, prompt, deterministic, wave) == (pieces, want[prompt][1])
    tiny.forget_speech_tracks()


def test_sessions_on_several_threads_share_one_track(tiny, wave):
    """Sessions made at once on four threads (sampling, one seed: one track) each equal their
    sequential prefill."""
    tiny.forget_speech_tracks()
    prompts = [LONG, SHORT, LONG[:150], LONG[:40]]
    want = [sequential(tiny, p, False, wave) for p in prompts]
    got: list = [None] * len(prompts)
    failures: list = []

    def run(i: int) -> None:
        try:
            got[i] = stream(tiny, prompts[i], False, wave)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert got == want
    assert len(tiny.speech_tracks()) == 1 and tiny.speech_tracks().steps_held(3, False) == tokens(tiny, LONG) - 1
    tiny.forget_speech_tracks()


def test_what_changes_the_weights_drops_the_tracks(tiny, wave):
    tiny.forget_speech_tracks()
    stream(tiny, SHORT, True, wave)
    assert len(tiny.speech_tracks()) == 1
    lora = narrow_window_model(16)
    stream(lora, SHORT, True, wave)
    adapters.add_lora(lora, r=2, alpha=4, targets=adapters.TTS_TARGETS, generator=torch.Generator().manual_seed(0))
    assert len(lora.speech_tracks()) == 0
    tiny.forget_speech_tracks()


def test_a_long_prompt_from_the_track_streams_the_references_frames(make_checkpoint, reference, wave):
    """The real card's layout (4-bit with float32 scales, the rest bf16), deterministic: a prompt of ~300
    tokens opened after other sessions built the track past it, so its TTS state is a prefix copy, gives
    the MLX reference's ids, codes and transcript, and its audio."""
    path = make_checkpoint(seed=0, **LAYOUTS["q4-f32-scales"])
    model = nv.load_model(path, device="cpu")
    prompt = LONG
    n = tokens(model, prompt)
    assert n > 250
    for other in (SHORT, LONG + " Thank every caller by name before the call ends."):  # made, then extended past it
        model.create_streaming_session(options(other, True, seed=0))
    tracks = model.speech_tracks()
    held, steps = tracks.steps_held(0, True), tracks.steps_run
    assert held > n - 1
    session = model.create_streaming_session(options(prompt, True, seed=0))
    assert tracks.steps_run == steps  # taken as a prefix
    events = []
    for i in range(0, len(wave), 1280):
        events += session.push_audio(wave[i:i + 1280], 16000)
    events += session.flush()
    want = run_reference_stream(reference(path), wave, prompt, sizes=(1280,))
    assert session.timeline_index - session.frame_index == want["prompt_steps"] == n
    audio = [e for e in events if e.kind == "audio"]
    np.testing.assert_array_equal(np.stack([e.audio_codes for e in audio]), want["codes"])
    assert channel(events, "assistant_text_delta") == want["text"]
    assert channel(events, "function_delta") == want["function"]
    assert [(e.frame_index, e.delta, e.text) for e in events if e.kind == "user_transcript_delta"] == want["transcript"]
    assert snr_db(want["audio"], np.concatenate([e.samples for e in audio])) >= MIN_SNR_DB


def test_an_idle_server_makes_its_default_track_for_its_first_caller(wave):
    """The server's worker, with nothing else to do, extends the default mode's track (sampling, seed 0) for
    a prompt of ``warm_prompt_tokens``; its first caller's prefill then runs no TTS step, and its frames
    are those of a sequential prefill."""
    from nvchat_torch.server.scheduler import FrameScheduler, Output

    model = nv.load_tiny_model(device="cpu", dtype=torch.float32)  # its own tracks
    n = tokens(model, LONG)
    scheduler = FrameScheduler(model, max_sessions=1, clock=0, warm_prompt_tokens=n + 5)
    tracks = model.speech_tracks()
    try:
        for _ in range(2000):  # bounded: about 5 s
            if tracks.steps_held(0, False) == n + 4:
                break
            time.sleep(0.0025)
        assert tracks.steps_held(0, False) == n + 4 and tracks.steps_run == n + 4
        outputs: list[Output] = []
        done = threading.Event()

        def deliver(out: Output) -> None:
            outputs.append(out)
            if out.kind == "events" and any(e.kind == "done" for e in out.events):
                done.set()

        handle = scheduler.open(options(LONG, False, seed=0), deliver)
        scheduler.push(handle, wave)
        scheduler.flush(handle, pad_partial=False)
        assert done.wait(30)
        assert tracks.steps_run == n + 4  # the caller's prefill took the track as it was
        got = frames([e for out in outputs if out.kind == "events" for e in out.events])
        want = sequential(model, LONG, False, wave, seed=0)
        assert {k: got[k] for k in got} == {k: want[k] for k in got}
    finally:
        scheduler.stop()
