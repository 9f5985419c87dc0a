"""pipecat's standard OpenAI Realtime setup, unchanged, against the server on loopback.

The pipeline is the one pipecat's ``examples/realtime/realtime-openai.py`` builds: an ``LLMContext``
with a system and a user message and one tool, the context aggregator pair, the stock
``OpenAIRealtimeLLMService`` (server turn detection on, its default), an ``LLMRunFrame`` to start.
The transport is replaced by a source that plays the microphone (speech, a pause, a second burst of
speech over the assistant, a pause) and a sink that records what reaches the speaker.

The tiny random model's RNNT does not tell speech from silence, so :func:`voice_activity_rnnt`
makes its blank follow the input's loudness (the one thing a real transcriber does that the policy
reads), and :func:`turns_by_the_policy` keeps its text channel from taking or ending turns by itself.
The server runs NVIDIA's policy with shorter windows than the stock 3.2 s, so the test stays
a few seconds of audio, on its real 80 ms clock. The model calls the tool a few frames into its
greeting (its function channel forced, as a trained model would decide to call), and the tool takes
3 s: NVIDIA's tool pipeline (on by default) speaks an acknowledgement while the call is written and an
on-hold phrase while the tool runs.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import soundfile as sf
import torch
from loguru import logger  # pipecat logs with loguru

import nvchat_torch as nv
from nvchat_torch.audio_io import pcm16_encode, resample
from nvchat_torch.server.app import Connection
from nvchat_torch.turn_taking import TurnTakingConfig
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema  # the test extra installs pipecat
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (EndFrame, ErrorFrame, InputAudioRawFrame, InterruptionFrame, LLMRunFrame,
                                   StartFrame, TTSAudioRawFrame, UserStartedSpeakingFrame, UserStoppedSpeakingFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from test_server import CALL, EXAMPLE, WEATHER, _CallingModel, quiet_function_channel, serve, text_logit_bias

RATE = 24000  # pipecat's realtime audio rate, both ways
CHUNK = 1920  # 80 ms
TIMEOUT = 120.0
TOOL_SECONDS = 3.0
# NVIDIA's rules with shorter windows (0.8 s of silence ends an utterance, 0.64 s of speech over the
# agent stops it); no first-turn fallback and no punctuation bias, so only the audio decides.
POLICY = TurnTakingConfig(window=10, eou_frames=10, barge_in_frames=8, first_turn_fallback_frames=10_000,
                          punctuation_bias=False)


def voice_activity_rnnt(model, threshold: float = 0.01, strength: float = 40.0):
    """Make the model's RNNT blank on quiet frames and never blank on loud ones (RMS ``threshold``),
    by a bias on the joint's blank logit that follows each row's frame: a stand-in for a trained
    transcriber, with tensor ops only (no host read). Returns the hook's handle."""
    stt = model.stt_model
    log_mel, joint_net = stt.perception.log_mel, stt.rnnt_joint.joint_net
    loud: dict = {}
    step = log_mel.forward_step

    def heard(frames, cache):
        loud["rows"] = frames.float().pow(2).mean(dim=-1).sqrt() > threshold
        return step(frames, cache)

    def bias(module, inputs, logits):
        rows = loud.get("rows")
        if rows is None or logits.dim() != 2 or logits.shape[0] != rows.shape[0]:
            return logits
        blank = torch.where(rows, -strength, strength).to(logits.dtype)
        return torch.cat([logits[:, :-1], logits[:, -1:] + blank[:, None]], dim=1)

    log_mel.forward_step = heard
    return joint_net.register_forward_hook(bias)


def turns_by_the_policy(model) -> list:
    """Keep the random model from taking or ending a turn by itself (its text channel's BOS and EOS made
    unlikely), so that the policy and the client's requests decide the turns, as the conversation below
    expects. Left alone, its own BOS lands now and then while the user speaks; NVIDIA's policy turns it
    into a barge-in that leaves the speech unconfirmed, and the agent does not answer it
    (tests/test_server_turns.py covers that case). Returns the hooks' handles."""
    return [text_logit_bias(model, model.config.bos_token_id, -1e4),
            text_logit_bias(model, model.config.eos_token_id, -1e4)]


def microphone(speech: np.ndarray) -> list[tuple[str, np.ndarray | None]]:
    """What the user does, as (phase, 16 kHz float32; None: quiet until the microphone's ``until()``):
    quiet while the agent greets, calls the tool and starts to answer with its result; a question, a
    pause long enough for the agent to take the turn, a second question over the agent, a pause for its
    next turn."""
    quiet = lambda frames: np.zeros(frames * 1280, np.float32)  # noqa: E731
    return [("greeting", None), ("speech", speech[:32000]), ("pause", quiet(15)),
            ("burst", speech[:25600]), ("pause 2", quiet(40))]


class Microphone(FrameProcessor):
    """The transport's input: 80 ms frames of 24 kHz pcm16, a little faster than real time (silence
    for a phase without audio, until ``until()`` says the agent has done what it waits for); records the
    upstream errors that reach the pipeline's start."""

    def __init__(self, phases, log, ready, until):
        super().__init__()
        self.phases, self.log, self.ready, self.until, self.task = phases, log, ready, until, None

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            self.log.append(("error", frame.error, time.monotonic()))
        if isinstance(frame, StartFrame):
            self.task = self.create_task(self._play())
        await self.push_frame(frame, direction)

    async def _play(self):
        deadline = time.monotonic() + TIMEOUT
        while not self.ready() and time.monotonic() < deadline:  # the service has set up its conversation
            await asyncio.sleep(0.05)
        for phase, wave in self.phases:
            pcm = pcm16_encode(resample(wave, 16000, RATE)) if wave is not None else bytes(2 * CHUNK)
            self.log.append(("phase", phase, time.monotonic()))
            i = 0
            while i < len(pcm) or (wave is None and not self.until() and time.monotonic() < deadline):
                await self.push_frame(InputAudioRawFrame(audio=pcm[i % len(pcm):i % len(pcm) + 2 * CHUNK],
                                                         sample_rate=RATE, num_channels=1))
                i += 2 * CHUNK
                await asyncio.sleep(0.04)
        self.log.append(("phase", "end", time.monotonic()))


class Speaker(FrameProcessor):
    """The transport's output: records the frames that reach it."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, (TTSAudioRawFrame, InterruptionFrame, UserStartedSpeakingFrame,
                              UserStoppedSpeakingFrame, ErrorFrame)):
            self.log.append((type(frame).__name__, len(getattr(frame, "audio", b"")), time.monotonic()))
        await self.push_frame(frame, direction)


def turns(log: list) -> list[str]:
    """The pipeline's frames in order, runs of audio as one "audio"."""
    kinds = [kind for kind, _, _ in log if kind not in ("phase", "error")]
    return [k for i, k in enumerate(kinds) if k != "TTSAudioRawFrame" or i == 0 or kinds[i - 1] != k]


def find(sequence: list[str], pattern: list[str]) -> list[int] | None:
    """The positions of ``pattern``'s items in ``sequence``, each after the last (a subsequence)."""
    at, found = 0, []
    for item in pattern:
        try:
            at = sequence.index(item, at)
        except ValueError:
            return None
        found.append(at)
        at += 1
    return found


# the user speaks and stops, the assistant answers; the user speaks over it, which interrupts it,
# stops, and the assistant answers again
CONVERSATION = ["UserStartedSpeakingFrame", "UserStoppedSpeakingFrame", "TTSAudioRawFrame",
                "UserStartedSpeakingFrame", "InterruptionFrame", "UserStoppedSpeakingFrame", "TTSAudioRawFrame"]


def test_pipecat_standard_realtime_setup(make_checkpoint, monkeypatch):
    # a checkpoint whose tokenizer has the tool-call markers, so the tool is taken
    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    hooks = [voice_activity_rnnt(model), quiet_function_channel(model), *turns_by_the_policy(model)]
    # the model calls the tool a few frames into its greeting (the greeting's BOS on the first frame)
    calling = _CallingModel(model, [CALL], after=3)
    speech, rate = sf.read(EXAMPLE, dtype="float32")
    assert rate == 16000
    server_errors: list = []
    send_error = Connection.send_error

    async def record_error(self, code, message, **kwargs):
        server_errors.append((code, message))
        await send_error(self, code, message, **kwargs)

    monkeypatch.setattr(Connection, "send_error", record_error)
    sent: list = []
    send = Connection.send

    audio: dict = {}  # per response: the times its audio deltas were sent

    async def record(self, payload):
        if payload["type"] == "response.output_audio.delta":
            audio.setdefault(payload["response_id"], []).append(time.monotonic())
        if not payload["type"].endswith(".delta"):
            sent.append((time.monotonic(), payload))
        await send(self, payload)

    monkeypatch.setattr(Connection, "send", record)
    log: list = []
    calls: list = []
    pipecat_log: list = []  # what pipecat logged (loguru), at INFO and above
    sink = logger.add(lambda message: pipecat_log.append(f"{message.record['level'].name} {message.record['message']}"),
                      level="INFO")

    def answered() -> bool:
        """The model answers the tool's result: audio of a response the server opened after the result."""
        output = next((t for t, e in sent if e["type"] == "conversation.item.added"
                       and e["item"]["type"] == "function_call_output"), None)
        return output is not None and any(min(times) > output for times in audio.values())

    async def get_weather(params):
        calls.append(params.arguments)
        await asyncio.sleep(TOOL_SECONDS)  # a slow lookup: the server speaks while it runs
        await params.result_callback({"temperature_c": 21})

    async def run(address):
        llm = OpenAIRealtimeLLMService(api_key="unused", base_url=f"ws://{address}/v1/realtime")
        llm.register_function("get_weather", get_weather)
        weather = FunctionSchema(name=WEATHER["name"], description=WEATHER["description"],
                                 properties=WEATHER["parameters"]["properties"],
                                 required=WEATHER["parameters"]["required"])
        context = LLMContext(messages=[{"role": "system", "content": "You are a helpful voice assistant."},
                                       {"role": "user", "content": "Say hello, then answer my questions."}],
                             tools=ToolsSchema(standard_tools=[weather]))
        aggregators = LLMContextAggregatorPair(context)
        mic = Microphone(microphone(speech), log, ready=lambda: any(
            e["type"] == "conversation.item.added" and e["item"].get("role") == "user" for _, e in sent),
            until=answered)
        pipeline = Pipeline([mic, aggregators.user(), llm, Speaker(log), aggregators.assistant()])
        task = PipelineTask(pipeline, params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE))
        await task.queue_frames([LLMRunFrame()])
        runner = PipelineRunner(handle_sigint=False)
        play = asyncio.create_task(runner.run(task))
        # until the assistant has spoken after the second user turn (the server may run slower than
        # real time on a busy machine), or the deadline
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not play.done() and find(turns(log), CONVERSATION) is None:
            await asyncio.sleep(0.1)
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(play, TIMEOUT)
        return context

    try:
        with serve(calling, turn_taking=POLICY) as (address, _):
            context = asyncio.run(run(address))
    finally:
        for hook in hooks:
            hook.remove()
        logger.remove(sink)
    sent_at = {id(e): t for t, e in sent}
    sent = [e for _, e in sent]
    kinds = [entry[0] for entry in log]
    assert not server_errors and "error" not in kinds and "ErrorFrame" not in kinds, (server_errors, log)
    problems = [line for line in pipecat_log if "timed out" in line or line.startswith(("ERROR", "CRITICAL"))]
    assert not problems, problems
    # the tool ran in pipecat: while its call was written and while it ran the server spoke, the
    # acknowledgement (in the greeting, which carried the call) and the on-hold phrase (a response of its
    # own) reaching pipecat as assistant audio and transcript; then its result reached the model, and the
    # model's answer came after it (the response pipecat asked for with the result: its audio from its BOS)
    assert calls == [{"city": "Paris"}]
    session = calling.sessions[0]
    assert session.pending_tool_calls == []
    assert '<TOOL_RESPONSE>[{"temperature_c": "twenty-one"}]</TOOL_RESPONSE>' in session.function_text
    phrases = {e["reason"]: e for e in sent if e["type"] == "nvchat.hold_speech"}
    assert sorted(phrases) == ["ack", "on_hold"], phrases
    spoken = "".join(m["content"] for m in context.get_messages() if m["role"] == "assistant"
                     and isinstance(m.get("content"), str))
    for phrase in phrases.values():
        assert audio[phrase["response_id"]] and phrase["text"] in spoken, (phrase, context.get_messages())
    output = next(e for e in sent if e["type"] == "conversation.item.added"
                  and e["item"]["type"] == "function_call_output")
    answer = next(e["response"]["id"] for e in sent if e["type"] == "response.created"
                  and sent_at[id(e)] > sent_at[id(output)])
    assert audio.get(answer) and min(audio[answer]) > sent_at[id(output)]
    # pipecat saw the conversation: its user turn frames, the assistant's audio, the interruption
    assert find(turns(log), CONVERSATION), turns(log)
    # the server ended the interrupted response as cancelled by the turn, and pipecat truncated it
    cancelled = [r for r in sent if r["type"] == "response.done" and r["response"]["status"] == "cancelled"]
    assert cancelled and cancelled[0]["response"]["status_details"]["reason"] == "turn_detected"
    truncated = [e for e in sent if e["type"] == "conversation.item.truncated"]
    assert truncated and truncated[0]["item_id"] == cancelled[0]["response"]["output"][0]["id"]
    # the user message of the context was created as an item before the audio: it joined the prompt
    users = [e["item"] for e in sent if e["type"] == "conversation.item.added" and e["item"].get("role") == "user"]
    assert users[0]["content"][0] == {"type": "input_text", "text": "Say hello, then answer my questions."}
    assert not [e for e in sent if e["type"] == "nvchat.notice"], sent
    assert [m["role"] for m in context.get_messages()[:2]] == ["system", "user"]
