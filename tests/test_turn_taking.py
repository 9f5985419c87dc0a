"""NVIDIA's turn-taking policy (nvchat_torch.turn_taking): the batched tensor version against a plain
reference of the spec's rules written here, and the policy inside sessions and the engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import nvchat_torch as nv
from mlx_oracle import synth_audio
from nvchat_torch import StreamingOptions, TurnTaking, TurnTakingConfig
from nvchat_torch.diagnostics import OpCounter, count_host_reads
from nvchat_torch.turn_taking import REASONS, punctuation_ids, reasons_of
from test_engine import FRAME, Plan, assert_same_events, run_alone, run_engine

BOS, EOS, PAD, WORD = 1, 2, 12, 40


# --------------------------------------------------------------------------------------
# The reference: the spec's rules for one conversation, in plain Python


class Reference:
    """One conversation's policy, step by step as ../shared/reference/TURN_TAKING.md states it (the
    window kept as the list of emitted ids). ``fired`` collects which rules acted, for coverage."""

    def __init__(self, c: TurnTakingConfig):
        self.c = c
        self.blank_count = self.consec = self.total = 0
        self.density = np.float32(0.0)
        self.speaking = self.confirmed = False
        self.first_turn = self.user_first_turn = True
        self.emitted: list[int] = []
        self.was_held = self.exempt = False
        self.in_speech = False  # ours: reported speech (user_speech, barge_in) not yet ended
        self.fired: set[str] = set()

    def step(self, tok: int, user_blank: bool, held: bool) -> tuple[int, list[str]]:
        if self.was_held and not held:
            self.exempt = True
        self.was_held = held
        # 3. RNNT counters
        if not self.speaking:
            self.density = np.float32(np.float32(0.1) * np.float32(not user_blank)) + \
                np.float32(np.float32(0.9) * self.density)
        if user_blank:
            self.blank_count, self.consec = self.blank_count + 1, 0
        else:
            self.blank_count, self.consec, self.total = 0, self.consec + 1, self.total + 1
        t = len(self.emitted)
        out, reasons = self._policy(tok, t) if not held else (tok, [])
        if held:
            self.fired.add("held")
        # ours (a report, no id changes): the reported speech ends when the agent is given the turn, or
        # after eou_frames of silence while it is unconfirmed ("speech_ended")
        self.in_speech = self.in_speech or "user_speech" in reasons or "barge_in" in reasons
        if out == BOS:
            self.in_speech = False
        elif self.in_speech and not held and self.blank_count >= self.c.eou_frames and not self.confirmed:
            self.in_speech = False
            reasons = reasons + ["speech_ended"]
        self.emitted.append(out)
        return out, reasons

    def _policy(self, tok: int, t: int) -> tuple[int, list[str]]:
        c = self.c
        window = self.emitted[max(0, t - c.window):t]
        bos_in_w, eos_in_w = BOS in window, EOS in window
        # 1
        need = c.min_speech_frames_first_turn if self.user_first_turn else c.min_speech_frames
        if not self.first_turn and 0 < float(self.density) < c.density_threshold:
            if need != c.density_low_min_speech:
                self.fired.add("density_low")
            need = c.density_low_min_speech
        # 2
        if c.self_play_suppression and not self.speaking and not self.first_turn and not self.confirmed \
                and tok == BOS:
            if self.exempt:
                self.exempt = False
                self.fired.add("exemption_used")
            else:
                self.fired.add("self_play_suppressed")
                return PAD, ["self_play_suppressed"]
        was_confirmed = self.confirmed
        # 3
        if bos_in_w or tok == BOS:
            self.speaking, self.first_turn = True, False
            if tok == BOS:
                self.confirmed, self.total = False, 0
        if eos_in_w or tok == EOS:
            self.speaking, self.confirmed, self.total = False, False, 0
        # 4
        if self.blank_count >= c.noise_reset_frames and not self.confirmed and not self.speaking:
            if self.total:
                self.fired.add("noise_reset")
            self.total = 0
        # 5
        reasons = []
        if (self.consec >= need or self.total >= need) and not self.speaking:
            self.confirmed = True
            if not was_confirmed:
                reasons.append("user_speech")
        # 6
        if self.first_turn and t >= c.first_turn_fallback_frames and self.confirmed and not bos_in_w:
            self._take()
            return BOS, reasons + ["first_turn_fallback"]
        # 7
        if self.blank_count >= c.eou_frames and self.confirmed and not self.speaking:
            if not bos_in_w and tok != BOS:
                self._take()
                return BOS, reasons + ["end_of_utterance"]
            self.fired.add("eou_already_started")
            return tok, reasons
        # 8
        if self.consec >= c.barge_in_frames and self.speaking:
            if not eos_in_w and tok != EOS:
                self.consec, self.total, self.speaking = 0, 0, False
                return EOS, reasons + ["barge_in"]
            self.fired.add("barge_in_already_stopped")
        return tok, reasons

    def _take(self) -> None:
        self.confirmed, self.total, self.speaking = False, 0, True
        self.first_turn = self.user_first_turn = False


def runs(rng: np.random.Generator, n: int, short: tuple[int, int], long: tuple[int, int], p_long: float) -> np.ndarray:
    """``n`` booleans in alternating runs, each short or (with ``p_long``) long."""
    out, value = [], bool(rng.integers(2))
    while len(out) < n:
        lo, hi = long if rng.random() < p_long else short
        out += [value] * int(rng.integers(lo, hi + 1))
        value = not value
    return np.array(out[:n])


def random_frames(rng: np.random.Generator, batch: int, frames: int, c: TurnTakingConfig):
    """(model ids, user_blank, skip) [frames, batch]: speech and silence in runs around the thresholds,
    the model's own BOS / EOS now and then, holds of a few frames."""
    span = max(c.eou_frames, c.barge_in_frames, c.noise_reset_frames)
    blank = np.stack([runs(rng, frames, (1, 6), (span - 3, span + 15), 0.35) for _ in range(batch)], axis=1)
    # The model's own BOS / EOS: rarely in some rows (the policy's turns dominate), often in others.
    rates = [0.002, 0.01, 0.03] * batch
    ids = np.stack([rng.choice([PAD, WORD, BOS, EOS], p=[0.86 - 2 * r, 0.14, r, r], size=frames)
                    for r in rates[:batch]], axis=1)
    skip = np.zeros((frames, batch), dtype=bool)
    for b in range(batch):
        for t in np.flatnonzero(rng.random(frames) < 0.01):
            skip[t:t + int(rng.integers(1, 40)), b] = True
    return ids, blank, skip


CONFIGS = {
    "stock": TurnTakingConfig(),
    "short": TurnTakingConfig(window=7, eou_frames=6, barge_in_frames=5, min_speech_frames=2,
                              min_speech_frames_first_turn=1, density_threshold=0.4, density_low_min_speech=4,
                              noise_reset_frames=3, first_turn_fallback_frames=9, self_play_suppression=True),
    "suppressing": replace(TurnTakingConfig(), self_play_suppression=True, first_turn_fallback_frames=20,
                           density_threshold=0.3),
}
# The guards "unless BOS / EOS is already there" of steps 7 and 8 cannot act: step 3 has by then marked
# such a row speaking / not speaking (or unconfirmed), so they are not required here.
MUST_FIRE = set(REASONS) | {"density_low", "noise_reset", "held"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_policy_equals_the_reference_frame_by_frame(name):
    config = CONFIGS[name]
    batch, frames = 6, 1500
    fired: set[str] = set()
    for seed in range(3):
        rng = np.random.default_rng(seed)
        ids, blank, skip = random_frames(rng, batch, frames, config)
        policy = TurnTaking(config, bos_id=BOS, eos_id=EOS, pad_id=PAD, batch=batch)
        refs = [Reference(config) for _ in range(batch)]
        reset_at = frames // 2
        for t in range(frames):
            if t == reset_at:  # a reused slot: row 1 starts a new conversation, the others go on
                policy.reset([1])
                fired |= refs[1].fired
                refs[1] = Reference(config)
            got = policy.step(torch.from_numpy(ids[t]), torch.from_numpy(blank[t]), torch.from_numpy(skip[t]))
            want = [r.step(int(ids[t, b]), bool(blank[t, b]), bool(skip[t, b])) for b, r in enumerate(refs)]
            assert got.tolist() == [w[0] for w in want], (name, seed, t)
            assert [reasons_of(int(code)) for code in policy.reason] == [w[1] for w in want], (name, seed, t)
            for _, reasons in want:
                fired |= set(reasons)
        for r in refs:
            fired |= r.fired
    must = MUST_FIRE if config.self_play_suppression else MUST_FIRE - {"self_play_suppressed"}
    if name == "suppressing":
        must = must | {"exemption_used"}
    assert must <= fired, f"never crossed: {sorted(must - fired)}"


def test_rows_are_independent_and_rows_without_a_config_pass_through():
    """Each row of a batch equals the row stepped alone (the density is per row: NVIDIA's wrapper holds it
    for the whole batch while any row speaks); a row without a config emits its ids unchanged."""
    config = CONFIGS["short"]
    rng = np.random.default_rng(5)
    ids, blank, skip = random_frames(rng, 4, 300, config)
    together = TurnTaking(config, bos_id=BOS, eos_id=EOS, pad_id=PAD, batch=4)
    together.configure(3, None)
    alone = [TurnTaking(config, bos_id=BOS, eos_id=EOS, pad_id=PAD) for _ in range(3)]
    for t in range(300):
        got = together.step(torch.from_numpy(ids[t]), torch.from_numpy(blank[t]), torch.from_numpy(skip[t]))
        for b in range(3):
            one = alone[b].step(torch.from_numpy(ids[t, b:b + 1]), torch.from_numpy(blank[t, b:b + 1]),
                                torch.from_numpy(skip[t, b:b + 1]))
            assert int(got[b]) == int(one[0]) and int(together.reason[b]) == int(alone[b].reason[0])
        assert int(got[3]) == ids[t, 3] and int(together.reason[3]) == 0
    assert (together.density[:3] != together.density[0]).any()  # the rows' densities really differ


def test_new_values_keep_the_state_and_a_row_switched_on_starts_fresh():
    policy = TurnTaking(TurnTakingConfig(eou_frames=50), bos_id=BOS, eos_id=EOS, pad_id=PAD, batch=2)
    policy.configure(1, None)
    pad, speech, silence = torch.tensor([PAD, PAD]), torch.tensor([False, False]), torch.tensor([True, True])
    for _ in range(3):
        policy.step(pad, speech)
    for _ in range(5):
        policy.step(pad, silence)
    policy.configure(0, TurnTakingConfig(eou_frames=6))  # confirmed speech and 5 blanks are kept
    policy.configure(1, TurnTakingConfig(eou_frames=6))  # starts fresh: nothing confirmed
    out = policy.step(pad, silence)
    assert out.tolist() == [BOS, PAD] and reasons_of(int(policy.reason[0])) == ["end_of_utterance"]


def test_config_values_are_checked_and_named():
    assert StreamingOptions().turn_taking is None
    assert StreamingOptions(turn_taking={"eou_frames": 20}).turn_taking == TurnTakingConfig(eou_frames=20)
    c = TurnTakingConfig.from_dict(TurnTakingConfig().to_dict())
    assert c == TurnTakingConfig() and c.to_dict()["punctuation_increments"] == {".": 1.5, "?": 1.5, ",": 1.0, "!": 1.0}
    for bad, match in [({"eou_frames": -1}, "eou_frames"), ({"window": 0}, "window"),
                       ({"barge_in_frames": True}, "barge_in_frames"), ({"density_threshold": 2}, "density_threshold"),
                       ({"self_play_suppression": 1}, "self_play_suppression"), ({"eou": 3}, "unknown"),
                       ({"punctuation_increments": {".": "x"}}, "punctuation_increments")]:
        with pytest.raises(ValueError, match=match):
            StreamingOptions(turn_taking=bad)
    with pytest.raises(ValueError, match="turn_taking"):
        StreamingOptions(turn_taking=40)


def test_density_threshold_compares_as_nvidia_reads_it():
    """NVIDIA compares the float32 density, read to a Python float, with the float threshold: a density of
    float32(0.7) = 0.69999998807 is below 0.7 (a float32 comparison would say equal, not below)."""
    for threshold, low in [(0.7, True), (0.69999998, False)]:
        c = TurnTakingConfig(window=1, min_speech_frames_first_turn=1, density_low_min_speech=2,
                             density_threshold=threshold)
        policy = TurnTaking(c, bos_id=BOS, eos_id=EOS, pad_id=PAD)
        policy.step(torch.tensor([BOS]), torch.tensor([True]))  # the agent's turn: first_turn ends
        policy.density.fill_(0.7)
        # The agent stops (its density held this frame) on one speech frame: confirmed unless the
        # density counts as low (then 2 frames are needed).
        policy.step(torch.tensor([EOS]), torch.tensor([False]))
        assert float(policy.density[0]) == float(np.float32(0.7))
        assert reasons_of(int(policy.reason[0])) == ([] if low else ["user_speech"])


def test_punctuation_follows_pauses_after_words():
    """rnnt_punct_bias: from the 5th consecutive blank after words, the bias grows by 1 per blank frame;
    punctuation wins once bias * increment beats blank; any piece resets it."""
    vocabulary = ["a", "\u2581b", ".", "\u2581?", "c"]
    c = TurnTakingConfig()
    assert punctuation_ids(c, vocabulary) == {2: 1.5, 3: 1.5}
    policy = TurnTaking(c, bos_id=BOS, eos_id=EOS, pad_id=PAD, rnnt_vocabulary=vocabulary)
    logits = torch.tensor([[0.0, 0.0, -4.0, -9.0, 0.0, 1.0]])  # blank (last) wins by 5 over "."
    none = torch.full((3, 1), -1)
    word = torch.tensor([[0], [4], [-1]])
    out = []
    for frame in range(12):
        ids, emit = policy.punctuate(logits, word if frame == 0 else none)
        policy.step(torch.tensor([PAD]), (word if frame == 0 else none)[:1, 0] < 0)  # taken before
        out.append(int(ids[0, 0]))
    # blanks 1..4 after the words: no bias; the 5th..: bias 1, 2, 3, 4: "." at 1.5 * 4 = 6 > 5 (the
    # 9th blank frame, bias raised on the 5th-8th), then reset: no words since.
    assert out == [0] + [-1] * 8 + [2] + [-1] * 2


# --------------------------------------------------------------------------------------
# In sessions and the engine, on checkpoints built to make it fire


PROMPT = "you are a helpful assistant"
WAVE_SECONDS = 5.0  # 62 frames: past the first-turn fallback (50) and one stock end of utterance


@pytest.fixture(scope="module")
def speechy(make_checkpoint):
    """RNNT biased towards speech: every frame is non-blank (confirmation, fallback, barge-in)."""
    return nv.load_model(make_checkpoint(seed=0, rnnt_blank_boost=0.5), device="cpu")


@pytest.fixture(scope="module")
def sparse(make_checkpoint):
    """RNNT biased towards blank (the default tiny bias): a few speech frames, then silence (end of utterance)."""
    return nv.load_model(make_checkpoint(seed=0), device="cpu")


def stream(model, options: StreamingOptions, wave: np.ndarray, force_text: list[int] | None = None):
    """Frame by frame: (events, the text id each frame emitted)."""
    session = model.create_streaming_session(options)
    if force_text is not None:
        session.force_tokens("text", force_text)
    events, text_ids = [], []
    for i in range(0, len(wave) - FRAME + 1, FRAME):
        events += session.push_audio(wave[i:i + FRAME], 16000)
        text_ids.append(session.last_ids[0])
    return events, text_ids


def turns(events) -> list[tuple[int, str, int]]:
    return [(e.frame_index, e.reason, e.token_id) for e in events if e.kind == "turn"]


@pytest.mark.parametrize("model_name, expected", [("speechy", {"user_speech", "first_turn_fallback", "barge_in"}),
                                                  ("sparse", {"user_speech", "end_of_utterance"})])
def test_turn_events_fire_and_the_rewritten_id_is_what_the_model_continues_from(request, model_name, expected):
    """With the stock policy the turn events fire, each on the frame whose emitted id it names; the
    rewritten ids are what the TTS speaks and the LLM gets back: the raw model forced to emit the same
    ids gives the same ids, codes and audio."""
    model = request.getfixturevalue(model_name)
    wave = synth_audio(WAVE_SECONDS)
    options = StreamingOptions(system_prompt=PROMPT, deterministic=True, turn_taking=TurnTakingConfig())
    events, text_ids = stream(model, options, wave)
    fired = turns(events)
    assert {reason for _, reason, _ in fired} == expected, fired
    for frame, reason, token in fired:
        assert token == text_ids[frame]
        if reason in ("first_turn_fallback", "end_of_utterance"):
            assert token == model.config.bos_token_id
        elif reason == "barge_in":
            assert token == model.config.eos_token_id
    raw_events, raw_ids = stream(model, replace(options, turn_taking=None), wave)
    assert not turns(raw_events) and raw_ids != text_ids  # the policy changed what the model said
    forced_events, forced_ids = stream(model, replace(options, turn_taking=None), wave, force_text=text_ids)
    assert forced_ids == text_ids
    assert_same_events(forced_events, [e for e in events if e.kind != "turn"], atol=0.0)
    # Switched on before the first frame, it is the same as given at creation.
    session = model.create_streaming_session(replace(options, turn_taking=None))
    session.set_turn_taking({})
    assert turns([e for i in range(0, len(wave) - FRAME + 1, FRAME)
                  for e in session.push_audio(wave[i:i + FRAME], 16000)]) == fired


@dataclass
class TurnPlan(Plan):
    turn_taking: TurnTakingConfig | None = None

    def options(self) -> StreamingOptions:
        return replace(super().options(), turn_taking=self.turn_taking)


def test_engine_rows_with_turn_taking_equal_sessions_alone(speechy):
    """Rows with the stock policy, other values and none, joining at different frames and sitting out
    (odd chunk sizes): each gives what its session gives alone."""
    wave = synth_audio(WAVE_SECONDS)
    short = TurnTakingConfig(first_turn_fallback_frames=6, barge_in_frames=9, eou_frames=5)
    plans = [TurnPlan(PROMPT, 0, wave, (FRAME,), start=0, turn_taking=TurnTakingConfig()),
             TurnPlan("be brief", 1, wave[:40 * FRAME], (3000, 500), start=2, turn_taking=short),
             TurnPlan("", 2, wave[:30 * FRAME], (777,), start=1),
             TurnPlan(PROMPT, 3, wave[:30 * FRAME], (2048, 1), start=4, turn_taking=short)]
    got = run_engine(speechy, plans, max_sessions=4)
    for plan, events in zip(plans, got):
        assert_same_events(events, run_alone(speechy, plan))
        assert bool(turns(events)) == (plan.turn_taking is not None)
    assert {"first_turn_fallback", "barge_in"} <= {reason for _, reason, _ in turns(got[1])}


def test_a_frame_with_turn_taking_reads_the_host_once(speechy):
    wave = synth_audio(1.0)
    ops = {}
    for on in (False, True):
        session = speechy.create_streaming_session(StreamingOptions(
            system_prompt=PROMPT, deterministic=True, turn_taking=TurnTakingConfig() if on else None))
        session.push_audio(wave[:5 * FRAME], 16000)
        with count_host_reads() as reads, OpCounter() as counter:
            events = session.push_audio(wave[5 * FRAME:6 * FRAME], 16000)
        assert events[-1].kind == "audio" and sum(reads.values()) <= 1
        ops[on] = counter.non_view
    assert ops[False] < ops[True] <= ops[False] + 110, ops


def test_an_engine_step_with_turn_taking_reads_the_host_once(make_checkpoint, monkeypatch):
    """Three rows with NVIDIA's policy and its punctuation bias (a vocabulary with "."), one of them
    held by forced text ids: each engine step still reads the host once, for all rows together."""
    model = nv.load_model(make_checkpoint(seed=0), device="cpu")
    model.config.rnnt_vocabulary[7] = "."  # the tiny vocabulary has no punctuation: a piece is renamed
    assert punctuation_ids(TurnTakingConfig(), model.config.rnnt_vocabulary)
    punctuated = []
    punctuate = TurnTaking.punctuate

    def counted(self, logits, transcript_ids):
        punctuated.append(logits.shape[0])
        return punctuate(self, logits, transcript_ids)

    monkeypatch.setattr(TurnTaking, "punctuate", counted)
    engine = model.create_engine(max_sessions=3)
    rows = [engine.open(system_prompt=PROMPT, seed=k, deterministic=True, turn_taking=TurnTakingConfig())
            for k in range(3)]
    waves = [synth_audio(1.0, seed=k) for k in range(3)]

    def step(k: int) -> dict:
        for h, wave in zip(rows, waves):
            h.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
        return engine.step()

    for k in range(5):
        step(k)
    rows[2].force_tokens("text", [WORD] * 4)  # held from the next frame on, for 4 frames
    for k in range(5, 9):
        punctuated.clear()
        with count_host_reads() as reads:
            stepped = step(k)
        assert len(stepped) == 3 and sum(reads.values()) == 1, (k, dict(reads))
        assert punctuated == [3]  # the bias ran, once, for the batch
        assert rows[2].last_ids[0] == WORD  # the held row emits its forced id


def test_a_held_row_keeps_its_forced_ids_and_barge_in_waits(speechy):
    """force_tokens("text", ...) holds the row: its ids pass unchanged and the policy acts after the hold
    (here: the barge-in due at frame 9 comes on the first frame after it)."""
    wave = synth_audio(2.0)
    config = TurnTakingConfig(first_turn_fallback_frames=5, barge_in_frames=10)
    options = StreamingOptions(deterministic=True, turn_taking=config)
    events, ids = stream(speechy, options, wave)
    assert turns(events)[:3] == [(1, "user_speech", ids[1]), (5, "first_turn_fallback", 1), (9, "barge_in", 2)]
    session = speechy.create_streaming_session(options)
    held: list = []
    for i in range(0, len(wave) - FRAME + 1, FRAME):
        if i == 6 * FRAME:
            session.force_tokens("text", [WORD] * 8)  # frames 6-13
        held += session.push_audio(wave[i:i + FRAME], 16000)
        ids[i // FRAME] = session.last_ids[0]
    assert ids[6:14] == [WORD] * 8
    assert turns(held)[:3] == [(1, "user_speech", ids[1]), (5, "first_turn_fallback", 1), (14, "barge_in", 2)]


def test_a_tool_call_holds_the_text_at_pad_and_the_policy_waits_for_its_result(make_checkpoint):
    """From the frame of the start-of-call token (seen on the device, that same frame) until the result has
    been fed in, the text is PAD and the policy waits (NVIDIA: no barge-in during a tool call); the
    end of utterance due meanwhile comes on the first frame after the hold."""
    from test_tools import TOOLS

    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    tok, pad = model.tokenizer, model.config.pad_token_id
    wave = np.concatenate([synth_audio(WAVE_SECONDS)[:20 * FRAME], np.zeros(130 * FRAME, np.float32)])  # then silence
    options = StreamingOptions(deterministic=True, tools=TOOLS, tool_hold=None,  # the frame-by-frame path
                               turn_taking=TurnTakingConfig(eou_frames=8, first_turn_fallback_frames=1000))
    free, _ = stream(model, options, wave[:20 * FRAME])
    assert turns(free) == [(4, "user_speech", turns(free)[0][2]), (13, "end_of_utterance", 1)]
    call = tok.encode('<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
                      '</TOOLCALL><SPECIAL_21>', add_special_tokens=False)
    session = model.create_streaming_session(options)
    events, text = [], []
    for i in range(0, len(wave) - FRAME + 1, FRAME):
        frame = i // FRAME
        if frame == 7:
            session.force_tokens("function", call)  # the call: frames 7 .. 7 + len(call) - 1
        if frame == 7 + len(call) + 2:
            (call_id,) = session.pending_tool_calls
            session.send_tool_result(call_id, {"sky": "clear"})  # fed in over the next frames
        events += session.push_audio(wave[i:i + FRAME], 16000)
        text.append(session.last_ids[0])
    response = tok.encode('<TOOL_RESPONSE>[{"sky": "clear"}]</TOOL_RESPONSE>', add_special_tokens=False)
    first_free = 7 + len(call) + 2 + len(response)
    assert first_free < len(text)
    assert text[7:first_free] == [pad] * (first_free - 7)
    assert turns(events) == [(4, "user_speech", turns(free)[0][2]), (first_free, "end_of_utterance", 1)]


def test_the_transcript_gets_punctuation_after_a_pause_and_blank_frames_stay_blank(make_checkpoint):
    """punctuation_bias on a vocabulary with "." (the tiny one has none: a piece is renamed): after the
    words and 5 blank frames the bias grows until "." wins, once; the turn events (what counts as
    blank) are those without the bias, and the engine's row gives what the session gives alone."""
    model = nv.load_model(make_checkpoint(seed=0), device="cpu")
    vocabulary = model.config.rnnt_vocabulary
    wave = synth_audio(WAVE_SECONDS)
    plain = StreamingOptions(deterministic=True, turn_taking=TurnTakingConfig(punctuation_bias=False))
    events, _ = stream(model, plain, wave)
    heard = {i for e in events if e.kind == "user_transcript_delta" for i in range(len(vocabulary))
             if vocabulary[i].strip("\u2581") and vocabulary[i].strip("\u2581") in e.delta}
    vocabulary[next(i for i in range(len(vocabulary)) if i not in heard)] = "."
    biased = replace(plain, turn_taking=TurnTakingConfig())
    with_bias, _ = stream(model, biased, wave)
    assert turns(with_bias) == turns(events)
    transcript = [e for e in with_bias if e.kind == "user_transcript_delta"]
    assert "." not in "".join(e.delta for e in events if e.kind == "user_transcript_delta")
    assert transcript[-1].text.count(".") == 1 and transcript[-1].text.endswith(".")
    last_word = max(e.frame_index for e in events if e.kind == "user_transcript_delta")
    assert transcript[-1].frame_index >= last_word + 6  # after 5 blank frames, at bias >= 1
    plan = TurnPlan(None, 0, wave, (FRAME,), turn_taking=TurnTakingConfig())
    beside = TurnPlan("hi", 1, wave[:30 * FRAME], (777,), start=3, turn_taking=TurnTakingConfig())
    assert_same_events(run_engine(model, [beside, plan])[1], run_alone(model, plan))


def test_turn_taking_is_chosen_per_session_of_the_engine_and_can_change(speechy):
    """An engine session switched on before its first frame equals one opened with the policy; switched
    off mid-stream it emits no more turn events; a session beside it keeps its own policy."""
    wave = synth_audio(2.0)
    short = TurnTakingConfig(first_turn_fallback_frames=5, barge_in_frames=10)
    want = run_alone(speechy, TurnPlan(None, 0, wave, (FRAME,), turn_taking=short))
    engine = speechy.create_engine(max_sessions=2)
    late, beside = engine.open(deterministic=True), engine.open(deterministic=True, turn_taking=short)
    late.set_turn_taking(short.to_dict())
    got: dict = {late: [], beside: []}
    for k in range(len(wave) // FRAME):
        if k == 12:
            late.set_turn_taking(None)
        for h in (late, beside):
            h.push_audio(wave[k * FRAME:(k + 1) * FRAME], 16000)
        for h, events in engine.step().items():
            got[h] += events
    assert turns(got[beside]) == turns(want) and len(turns(want)) >= 4
    assert turns(got[late]) == [t for t in turns(want) if t[0] < 12]
    assert late.options.turn_taking is None and beside.options.turn_taking == short
