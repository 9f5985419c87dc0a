"""Training data for fine-tuning: a :class:`Conversation` (user audio, agent turns, tool calls, optional
agent audio), the JSONL manifest that lists them, and the per-frame label channels NVIDIA's NeMo recipe
builds from them (branch ``nemotron-labs-voicechat`` of NeMo, ``nemo/collections/speechlm2``).

Every function here re-implements NeMo's rule it names (file and lines in its docstring), without
NeMo: the channels are lists of ids, one per 80 ms frame. ``docs/training.md`` shows the manifest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..audio_io import read_wav
from ..tool_prompt import CALL_END, CALL_START, RESPONSE_END

__all__ = ["AgentTurn", "ToolCall", "Conversation", "read_manifest", "num_frames", "agent_channel",
           "delay_eos", "shift_channel", "FunctionChannel", "function_channel", "insert_frames",
           "FUNCTION_MARKERS", "function_marker_ids", "Example", "build_example"]

# NeMo's start-of-call, end-of-call and end-of-result markers (duplex_stt_model.py 903-933).
FUNCTION_MARKERS = (CALL_START, CALL_END, RESPONSE_END)


@dataclass
class AgentTurn:
    start: float  # seconds from the start of the conversation
    end: float  # seconds, likewise
    text: str  # what the agent says


@dataclass
class ToolCall:
    """A call the agent makes, and the tool's result."""

    time: float  # when the agent makes it, seconds from the start of the conversation
    call: str  # the text between the call markers, e.g. its JSON
    result: str = ""  # the tool's result
    result_time: float | None = None  # when the result is fed in, seconds; None: right after the call


@dataclass
class Conversation:
    """One training example."""

    user_audio: np.ndarray  # 16 kHz mono
    turns: list[AgentTurn]  # the agent's turns, times and text
    agent_audio: np.ndarray | None = None  # 22,050 Hz; needed for the TTS objective only
    system_prompt: str | None = None  # the prompt the conversation starts from
    tool_calls: list[ToolCall] = field(default_factory=list)  # the agent's calls, in order
    tools: list[dict] | None = None  # the function tools offered in the prompt
    id: str = ""  # names it in errors: the manifest's ``id``, else its line number

    @property
    def duration(self) -> float:
        return len(self.user_audio) / 16000.0


def function_marker_ids(tokenizer: Any) -> tuple[int, int, int]:
    """The ids of :data:`FUNCTION_MARKERS` in ``tokenizer``; an error naming a marker it lacks."""
    vocab = tokenizer.get_vocab()
    missing = [m for m in FUNCTION_MARKERS if m not in vocab]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s), which the function channel's "
                         "labels need (NeMo's call markers, duplex_stt_model.py 903-933)")
    start, end, result_end = (int(vocab[m]) for m in FUNCTION_MARKERS)
    return start, end, result_end


def _read_audio(path: Path, rate: int, what: str) -> np.ndarray:
    samples, sr = read_wav(path)
    if samples.ndim == 2 and samples.shape[1] == 1:
        samples = samples[:, 0]
    if sr != rate:
        raise ValueError(f"{path}: {what} must be {rate} Hz, got {sr} Hz (resample it first: "
                         "nvchat_torch.audio_io.resample)")
    if samples.ndim != 1:
        raise ValueError(f"{path}: {what} must be mono, got shape {tuple(samples.shape)}")
    return samples.astype(np.float32)


def _need(entry: dict, key: str, where: str) -> Any:
    if key not in entry:
        raise ValueError(f"{where}: missing key {key!r}")
    return entry[key]


def read_manifest(path: str | os.PathLike) -> list[Conversation]:
    """The conversations of a JSONL manifest, one JSON object per line (see docs/training.md); audio
    paths are relative to the manifest's folder. Bad entries raise naming the line and the key."""
    path = Path(path)
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        user = _read_audio(path.parent / _need(entry, "user_audio", where), 16000, "user_audio")
        agent = entry.get("agent_audio")
        turns = []
        for i, t in enumerate(_need(entry, "turns", where)):
            turn = AgentTurn(float(_need(t, "start", f"{where} turns[{i}]")), float(_need(t, "end", f"{where} turns[{i}]")),
                             str(_need(t, "text", f"{where} turns[{i}]")))
            if not 0 <= turn.start < turn.end:
                raise ValueError(f"{where} turns[{i}]: need 0 <= start < end, got {turn.start}, {turn.end}")
            turns.append(turn)
        calls = [ToolCall(float(_need(c, "time", f"{where} tool_calls[{i}]")),
                          c["call"] if isinstance(c.get("call"), str) else json.dumps(_need(c, "call", where)),
                          c.get("result", "") if isinstance(c.get("result", ""), str) else json.dumps(c["result"]),
                          c.get("result_time"))
                 for i, c in enumerate(entry.get("tool_calls", []))]
        out.append(Conversation(user, turns, None if agent is None else _read_audio(path.parent / agent, 22050,
                                                                                    "agent_audio"),
                                entry.get("system_prompt"), calls, entry.get("tools"), str(entry.get("id", number))))
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def num_frames(seconds: float, frame: float = 0.08, rate: int = 16000) -> int:
    """lhotse's ``compute_num_frames`` as NeMo calls it (s2s_dataset.py 2261, 2274, 2281): samples and hop
    rounded, then ``(samples + hop // 2) // hop``: a time maps to the nearest frame boundary."""
    samples, hop = round(seconds * rate), round(frame * rate)
    return int((samples + hop // 2) // hop)


def agent_channel(turns: Sequence[tuple[float, float, Sequence[int]]], frames: int, *, bos: int, eos: int,
                  pad: int, tts: bool = False, rate: int = 16000) -> list[int]:
    """The agent text channel of the STT data's ``build_token_channel`` (s2s_dataset.py 2235-2351, no
    timestamps): PAD everywhere; each turn ``(start, end, ids)`` writes BOS then one subword per frame from
    ``num_frames(start)``, cut to the frames before ``num_frames(end)``, and EOS at ``num_frames(end)``
    when that is inside the conversation (2337-2340). A turn starting past the end is skipped (2262-2266).

    ``tts``: the TTS data's ``build_token_channel`` (duplex_ear_tts_dataset.py 843-927): the text is not cut at
    the turn's end (only at the conversation's), the EOS written after it, and only a turn starting past the
    last frame is skipped; ``rate``: the cut's sampling rate, which the rounding of times depends on (the
    TTS data is read at 22,050 Hz)."""
    tokens = [pad] * frames
    for start, end, ids in turns:
        pos, eos_pos = num_frames(start, rate=rate), num_frames(end, rate=rate)
        if pos > frames or (pos == frames and not tts):
            continue
        available = eos_pos - pos
        text = [bos, *ids]
        if not tts and available > 0:
            text = text[:available]
        elif not tts:
            text = []
        text = text[:frames - pos]
        tokens[pos:pos + len(text)] = text
        if eos_pos < frames:
            tokens[eos_pos] = eos
    return tokens


def delay_eos(tokens: Sequence[int], marker: int, pad: int, shift: int) -> list[int]:
    """``label_prep.delay_eos`` (label_prep.py 22-61): each ``marker`` moves ``shift`` frames later (PAD left
    behind) unless that is past the end or lands on another ``marker`` (judged on the channel before any move)."""
    out = list(tokens)
    moves = [p for p, t in enumerate(tokens) if t == marker and p + shift < len(tokens) and tokens[p + shift] != marker]
    for p in moves:
        out[p] = pad
    for p in moves:
        out[p + shift] = marker
    return out


def shift_channel(tokens: Sequence[int], *, pad: int, eos: int, bos: int, advance: int = 0, delay: int = 0,
                  delay_eos_by: int = 0, delay_bos_by: int = 0) -> list[int]:
    """The agent text channel's shifts of ``prepare_labels`` (label_prep.py 121-224) for one conversation,
    without a protected prompt: ``advance`` drops the first frames and pads the end (158); ``delay`` first
    moves an EOS in the last ``delay`` frames to frame ``-delay`` (177-181), then pads the start (209);
    then EOS and BOS markers move later by ``delay_eos_by`` / ``delay_bos_by`` (220-224)."""
    out = list(tokens)
    n = len(out)
    if advance:
        out = out[advance:] + [pad] * min(advance, n)
    if delay > 0:
        tail = [p for p in range(max(0, n - delay), n) if out[p] == eos]
        if tail:
            out[n - delay] = eos
            for p in tail:
                out[p] = pad
        out = [pad] * delay + out[:n - delay]
    if delay_eos_by:
        out = delay_eos(out, eos, pad, delay_eos_by)
    if delay_bos_by:
        out = delay_eos(out, bos, pad, delay_bos_by)
    return out[:n]


@dataclass
class FunctionChannel:
    """The function channel after NeMo's insertions."""

    ids: list[int]  # per frame of the expanded timeline
    loss_mask: list[bool]  # per frame of the expanded timeline: whether its id is trained on
    insertions: list[tuple[int, int]]  # (frame of the original timeline, frames inserted there), in order


def function_channel(calls: Sequence[tuple[int, Sequence[int], int, Sequence[int]]], frames: int, *, pad: int,
                     start: int, end: int, result_end: int, prompt_frames: int = 0) -> FunctionChannel:
    """``_build_function_calling_channel`` (duplex_stt_model.py 936-1131). Each call ``(call frame, call ids,
    result frame, result ids)`` (frames of the original timeline; a result frame < 0 or empty ids: none) is
    inserted as ``start + call + end`` with loss (1010-1020), its result as the result ids without loss
    then ``result_end`` with loss (1030-1044). Between insertions the channel is PAD with loss (1059-1061,
    1076-1078), so the timeline grows by the inserted frames; positions are offset by the system prompt's
    frames (1000-1006). The events keep the calls' order (no sort: 1006-1044)."""
    events: list[tuple[int, list[int], bool]] = []
    for call_at, call_ids, result_at, result_ids in calls:
        if call_at >= 0 and len(call_ids) > 0:
            events.append((call_at + prompt_frames, [start, *call_ids, end], True))
        if result_at >= 0 and len(result_ids) > 0:
            events.append((result_at + prompt_frames, list(result_ids), False))
            events.append((result_at + prompt_frames, [result_end], True))
    ids: list[int] = []
    mask: list[bool] = []
    insertions = []
    current = 0
    for at, tokens, with_loss in events:
        if at - current > 0:
            ids += [pad] * (at - current)
            mask += [True] * (at - current)
        ids += tokens
        mask += [with_loss] * len(tokens)
        insertions.append((at, len(tokens)))
        current = at
    if frames - current > 0:
        ids += [pad] * (frames - current)
        mask += [True] * (frames - current)
    return FunctionChannel(ids, mask, insertions)


def insert_frames(channel: Sequence[Any], insertions: Sequence[tuple[int, int]], fill: Any) -> list[Any]:
    """``_expand_channels_with_insertions`` (duplex_stt_model.py 1566-1588) on one channel: at each (frame,
    count), in order, ``count`` ``fill`` frames go in at ``frame`` plus what earlier insertions added."""
    out = list(channel)
    offset = 0
    for at, count in insertions:
        out[at + offset:at + offset] = [fill] * count
        offset += count
    return out


@dataclass
class Example:
    """One conversation's tensors for :func:`~nvchat_torch.training.stt_forward` and ``tts_forward``.

    The STT fields count frames of the timeline after tool-call insertions. Their labels are NeMo's target
    channels from frame 1: frame ``t``'s label is the channel's frame ``t + 1`` (label_prep.py 316-317).
    The TTS fields count frames of the original timeline and are None without agent audio."""

    audio: np.ndarray  # STT: 16 kHz samples
    text: list[int]  # STT: per frame, the text label
    function: list[int]  # STT: per frame, the function label
    function_mask: list[bool]  # STT: per frame, whether the function label is trained on
    system_prompt: str | None  # the conversation's
    tools: list[dict] | None  # the conversation's
    tts_text: list[int] | None = None  # TTS: each step's text id
    codes: Any = None  # TTS: ``[S, Q]``, each step's codes


def build_example(model: Any, conversation: Conversation, *, advance: int = 0, delay: int = 0,
                  delay_eos_by: int = 0, delay_bos_by: int = 0, speech_delay: int | None = None) -> Example:
    """NeMo's labels for one conversation (see the functions above): the agent channel and its shifts, the
    function channel with its insertions (PAD text and silent user audio inserted alongside,
    duplex_stt_model.py 1566-1588; NeMo inserts the encoder's silence, here zero samples), and for the TTS
    the codec's codes of the agent audio delayed by ``speech_delay`` frames (default the card's
    ``num_delay_speech_tokens``; add_speech_delay, duplex_ear_tts_dataset.py 506-566) and the text of the
    next frame (``subword_ids = target[:, 1:]``, duplex_ear_tts.py 449) from the TTS data's own agent
    channel (``agent_channel(..., tts=True)``)."""
    import torch

    cfg, tok = model.config, model.tokenizer
    frame = cfg.input_frame_samples
    frames = num_frames(conversation.duration)
    if frames < 2:
        raise ValueError(f"conversation {conversation.id!r}: {conversation.duration:.3f} s gives {frames} frame(s); "
                         "at least 2 are needed")
    user = np.zeros(frames * frame, dtype=np.float32)
    user[:min(len(user), len(conversation.user_audio))] = conversation.user_audio[:len(user)]

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    channel = agent_channel([(t.start, t.end, encode(t.text)) for t in conversation.turns], frames,
                            bos=cfg.bos_token_id, eos=cfg.eos_token_id, pad=cfg.pad_token_id)
    channel = shift_channel(channel, pad=cfg.pad_token_id, eos=cfg.eos_token_id, bos=cfg.bos_token_id,
                            advance=advance, delay=delay, delay_eos_by=delay_eos_by, delay_bos_by=delay_bos_by)
    start, end, result_end = function_marker_ids(tok) if conversation.tool_calls else (-1, -1, -1)
    calls = [(num_frames(c.time), encode(c.call), num_frames(c.time if c.result_time is None else c.result_time),
              encode(c.result)) for c in conversation.tool_calls]
    fn = function_channel(calls, frames, pad=cfg.pad_token_id, start=start, end=end, result_end=result_end)
    text = insert_frames(channel, fn.insertions, cfg.pad_token_id)
    silent = insert_frames(list(user.reshape(frames, frame)), fn.insertions, np.zeros(frame, np.float32))
    example = Example(np.concatenate(silent), text[1:], fn.ids[1:], fn.loss_mask[1:],
                      conversation.system_prompt, conversation.tools)
    if conversation.agent_audio is not None:
        codec = model.tts_model.audio_codec
        per = codec.samples_per_frame
        delay_frames = cfg.tts_config.num_delay_speech_tokens if speech_delay is None else speech_delay
        agent = np.zeros(frames * per, dtype=np.float32)
        audio = np.concatenate([np.zeros(delay_frames * per, np.float32), conversation.agent_audio])[:len(agent)]
        agent[:len(audio)] = audio
        with torch.no_grad():
            codes = codec.encode(torch.from_numpy(agent).to(model.device).view(1, 1, -1)).transpose(1, 2)[0]
        tts_channel = agent_channel([(t.start, t.end, encode(t.text)) for t in conversation.turns], frames,
                                    bos=cfg.bos_token_id, eos=cfg.eos_token_id, pad=cfg.pad_token_id, tts=True,
                                    rate=cfg.output_sample_rate)
        example.tts_text, example.codes = tts_channel[1:], codes[:frames - 1].long()
    return example
