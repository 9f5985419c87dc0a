"""LiveKit Agents' standard realtime setup, unchanged, against the server on loopback.

The stock ``AgentSession`` with the stock ``livekit.plugins.openai.realtime.RealtimeModel`` (server turn
detection, audio only), started without a room: its audio input is a scripted microphone at 24 kHz
mono, paced in real time, and its audio output a recording speaker that plays at real time and
reports its playback to LiveKit (so no resampler and no native audio pipeline are involved). The
agent greets through ``generate_reply`` when it enters, and has one ``@function_tool``.

As in tests/test_pipecat.py, the tiny random model's RNNT is made to hear loudness
(:func:`voice_activity_rnnt`), and the server runs NVIDIA's policy with short windows, on its real 80 ms
clock. The model calls the tool once, a few frames into the greeting (its function channel is forced, as
a trained model would decide to call), and the tool takes 3 s: NVIDIA's tool pipeline (on by default)
speaks an acknowledgement while the call is written and an on-hold phrase while the tool runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import numpy as np
import soundfile as sf
import torch

import nvchat_torch as nv
from livekit import rtc  # the test extra installs livekit-agents and livekit-plugins-openai
from livekit.agents import Agent, AgentSession, RunContext, function_tool, io
from livekit.plugins.openai.realtime import RealtimeModel
from nvchat_torch.audio_io import pcm16_encode, resample
from nvchat_torch.server.app import Connection
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad
from test_pipecat import POLICY, turns_by_the_policy, voice_activity_rnnt
from test_server import CALL, EXAMPLE, _CallingModel, quiet_function_channel, serve

RATE = 24000  # LiveKit's realtime audio rate, both ways
CHUNK = 1920  # 80 ms
TIMEOUT = float(os.environ.get("NVCHAT_LIVEKIT_TIMEOUT", 120))
TOOL_SECONDS = 3.0


def microphone(speech: np.ndarray) -> list[tuple[str, np.ndarray | None]]:
    """What the user does, as (phase, 16 kHz float32; None: quiet until the microphone's ``until()``):
    quiet while the agent greets, calls the tool (it acknowledges the call and speaks a phrase while the
    tool runs) and starts to reply with its result; a question over the agent (a barge-in); a pause for
    its answer."""
    quiet = lambda frames: np.zeros(frames * 1280, np.float32)  # noqa: E731
    return [("greeting", None), ("speech", speech[:32000]), ("pause", quiet(40))]


class Microphone(io.AudioInput):
    """The scripted microphone: 80 ms frames of 24 kHz pcm16 on a real-time clock. Its first two frames
    start the server's session (LiveKit sends 100 ms appends); the rest of the script plays once
    ``ready()`` says the session's prompt has been prefilled (audio sent during the prefill would
    queue, and the conversation would lag behind it). A phase without audio is silence until ``until()``
    says the agent has done what it waits for."""

    def __init__(self, phases, log, ready, until):
        super().__init__(label="scripted microphone")
        self.chunks = []
        for phase, wave in phases:
            data = None if wave is None else pcm16_encode(resample(wave, 16000, RATE))
            self.chunks += [(phase, None)] if data is None else \
                [(phase if i == 0 else None, data[i:i + 2 * CHUNK]) for i in range(0, len(data), 2 * CHUNK)]
        self.log, self.ready, self.until, self.next_at, self.given = log, ready, until, None, 0
        self.deadline = time.monotonic() + TIMEOUT

    async def __anext__(self) -> rtc.AudioFrame:
        if not self.chunks:
            self.log.append(("phase", "end", time.monotonic()))
            raise StopAsyncIteration
        if self.given >= 2 and self.next_at is not None and not self.ready():
            deadline = time.monotonic() + TIMEOUT
            while not self.ready() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.next_at = None
        now = time.monotonic()
        self.next_at = now if self.next_at is None else self.next_at + CHUNK / RATE
        await asyncio.sleep(max(0.0, self.next_at - now))
        phase, data = self.chunks[0]
        if data is None:  # silence until until(): the phase logged once
            if self.until() or time.monotonic() > self.deadline:
                self.chunks.pop(0)
                return await self.__anext__()
            self.chunks[0], data = (None, None), bytes(2 * CHUNK)
        else:
            self.chunks.pop(0)
        self.given += 1
        if phase is not None:
            self.log.append(("phase", phase, time.monotonic()))
        return rtc.AudioFrame(data=data, sample_rate=RATE, num_channels=1, samples_per_channel=len(data) // 2)


class Speaker(io.AudioOutput):
    """Plays what it is given at real time (a clock, no device) and reports playback to LiveKit: where
    an interrupted segment stopped, and the end of one that played out."""

    def __init__(self, log):
        super().__init__(label="recording speaker", capabilities=io.AudioOutputCapabilities(pause=False),
                         sample_rate=RATE)
        self.log, self.started, self.pushed, self.finish = log, None, 0.0, None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self.started is None:
            self.started, self.pushed = time.monotonic(), 0.0
            self.on_playback_started(created_at=time.time())
        self.pushed += frame.duration
        self.log.append(("audio", frame.duration, time.monotonic()))

    def flush(self) -> None:
        super().flush()
        if self.started is not None:
            left = max(0.0, self.started + self.pushed - time.monotonic())
            self.finish = asyncio.get_running_loop().call_later(left, self._played, False)

    def clear_buffer(self) -> None:
        if self.started is not None:
            if self.finish is not None:
                self.finish.cancel()
            self._played(True)

    def _played(self, interrupted: bool) -> None:
        position = min(self.pushed, time.monotonic() - self.started)
        self.started, self.finish = None, None
        self.log.append(("played", interrupted, time.monotonic()))
        self.on_playback_finished(playback_position=position, interrupted=interrupted)


class Assistant(Agent):
    def __init__(self, calls):
        super().__init__(instructions="You are a helpful voice assistant.")
        self.calls = calls

    async def on_enter(self) -> None:
        self.session.generate_reply()  # the greeting: a response.create with its client_event_id

    @function_tool
    async def get_weather(self, context: RunContext, city: str) -> dict:
        """Current weather in a city."""
        self.calls.append(city)
        await asyncio.sleep(TOOL_SECONDS)  # a slow lookup: the server speaks while it runs
        return "sunny"


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def test_livekit_agents_standard_realtime_setup(make_checkpoint, monkeypatch):
    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    hooks = [voice_activity_rnnt(model), quiet_function_channel(model), *turns_by_the_policy(model)]
    speech, rate = sf.read(EXAMPLE, dtype="float32")
    assert rate == 16000
    trace: list = []  # both, in order, with their times
    sent: list = []  # what the server sent (deltas left out)
    received: list = []  # what LiveKit sent
    send = Connection.send
    handle = Connection._handle

    audio: dict = {}  # per response: the times its audio deltas were sent

    async def record(self, payload):
        if payload["type"] == "response.output_audio.delta":
            audio.setdefault(payload["response_id"], []).append(time.monotonic())
        if not payload["type"].endswith(".delta"):
            sent.append(payload)
            trace.append((time.monotonic(), "<", payload))
        await send(self, payload)

    async def read(self, event):
        if event.get("type") != "input_audio_buffer.append" or not any(e.get("type") == event.get("type")
                                                                          for _, _, e in trace):
            received.append(event)
            trace.append((time.monotonic(), ">", event))
        return await handle(self, event)

    monkeypatch.setattr(Connection, "send", record)
    monkeypatch.setattr(Connection, "_handle", read)
    records = Records()
    logging.getLogger("livekit").addHandler(records)
    log: list = []
    calls: list = []
    states: dict = {"user": [], "agent": []}
    errors: list = []
    executed: list = []
    said: list = []  # the assistant messages LiveKit added to its chat context

    def answered() -> bool:
        """The model answers the tool's result: audio of a response the server opened after the result."""
        output = next((t for t, way, e in trace if way == ">" and e["type"] == "conversation.item.create"
                       and e["item"]["type"] == "function_call_output"), None)
        return output is not None and any(min(times) > output for times in audio.values())

    def conversed() -> bool:
        """The reply after the tool cut by the user, and the agent's answer after the user's pause."""
        cut = [i for i, e in enumerate(sent) if e["type"] == "response.done"
               and e["response"].get("status_details", {}).get("reason") == "turn_detected"]
        return bool(cut) and any(e["type"] == "response.created" for e in sent[cut[0]:])

    async def run(address):
        llm = RealtimeModel(base_url=f"ws://{address}/v1", api_key="unused", modalities=["audio"],
                            turn_detection=ServerVad(type="server_vad"))
        session = AgentSession(llm=llm)
        session.on("user_state_changed", lambda ev: states["user"].append((ev.new_state, time.monotonic())))
        session.on("agent_state_changed", lambda ev: states["agent"].append((ev.new_state, time.monotonic())))
        session.on("error", lambda ev: errors.append(ev))
        session.on("function_tools_executed", lambda ev: executed.append(ev))
        session.input.audio = Microphone(microphone(speech), log,
                                         ready=lambda: bool(calling.sessions) and not calling.sessions[0].prefilling,
                                         until=answered)
        session.output.audio = Speaker(log)
        await session.start(Assistant(calls))
        # until the microphone is done and the server has caught up with it (it may run slower than
        # real time on a busy machine): the tool's reply asked for, and a turn cut by the user; or the deadline
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not (("phase", "end") in [x[:2] for x in log] and conversed()):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        said.extend(item.text_content for item in session.history.items
                    if item.type == "message" and item.role == "assistant")
        await session.aclose()
        await llm.aclose()

    # The model calls the tool as the conversation starts (a call holds the policy until its result has
    # been fed in, so the user's turns come after it): a few frames in, so that the greeting's BOS on the
    # first frame is not held at PAD by the call.
    calling = _CallingModel(model, [CALL], after=3)
    try:
        with serve(calling, turn_taking=POLICY) as (address, _):
            asyncio.run(asyncio.wait_for(run(address), TIMEOUT + 30))
    finally:
        for hook in hooks:
            hook.remove()
        logging.getLogger("livekit").removeHandler(records)
    kinds = [e["type"] for e in sent]
    if os.environ.get("NVCHAT_TRACE"):
        start = trace[0][0]
        for t, way, e in trace + [(t, "mic", p) for kind, p, t in log if kind == "phase"]:
            detail = {k: v for k, v in e.items() if k in ("event_id", "item_id", "previous_item_id")} \
                if isinstance(e, dict) else e
            more = e.get("response", {}).get("metadata") if isinstance(e, dict) and isinstance(
                e.get("response"), dict) else ""
            print(f"{t - start:7.2f} {way} {e['type'] if isinstance(e, dict) else ''} {detail} {more or ''}")
    problems = [line for line in records.lines if "timed out" in line or line.startswith(("ERROR", "CRITICAL"))]
    assert "error" not in kinds and not errors and not problems, ([e for e in sent if e["type"] == "error"],
                                                                   errors, problems)
    # the greeting: generate_reply's response.create, answered by a response.created carrying its id
    creates = [e for e in received if e["type"] == "response.create"]
    assert creates, received
    created = [e["response"] for e in sent if e["type"] == "response.created"]
    ids = [r["metadata"]["client_event_id"] for r in created if r["metadata"]]
    assert creates[0]["event_id"] in ids
    # the user's speaking state from speech_started, the agent's from its responses
    assert "speaking" in [s for s, _ in states["user"]] and "speaking" in [s for s, _ in states["agent"]]
    # a barge-in: a response cancelled by the user's turn, and LiveKit stopped its playback
    cancelled = [e["response"] for e in sent if e["type"] == "response.done" and e["response"]["status"] == "cancelled"]
    assert any(r["status_details"]["reason"] == "turn_detected" for r in cancelled)
    assert ("played", True) in [entry[:2] for entry in log]
    # the tool ran in LiveKit, its output reached the model, and the answer after it was asked for
    assert calls == ["Paris"] and executed
    outputs = [e for e in received if e["type"] == "conversation.item.create"
               and e["item"]["type"] == "function_call_output"]
    assert outputs and outputs[0]["item"]["output"] == "sunny"
    assert calling.sessions[0].pending_tool_calls == []
    assert '<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>' in calling.sessions[0].function_text
    assert len(creates) >= 2 and creates[1]["event_id"] in ids  # the reply after the tool
    # while the call was written and while the tool ran the server spoke: the acknowledgement (in the
    # greeting, which carried the call) and the on-hold phrase (a response of its own, before the tool's
    # output) reached LiveKit as the agent's speech, their transcripts in its chat context
    phrases = {e["reason"]: e for e in sent if e["type"] == "nvchat.hold_speech"}
    assert sorted(phrases) == ["ack", "on_hold"], phrases
    output_at = next(t for t, way, e in trace if way == ">" and e is outputs[0])
    assert max(audio[phrases["on_hold"]["response_id"]]) < output_at
    for phrase in phrases.values():
        assert audio[phrase["response_id"]] and any(phrase["text"] in text for text in said if text), (phrase, said)
    # the model's answer after the result it heard: the reply's audio (sent from its BOS on)
    reply = next(r["id"] for r in created if (r["metadata"] or {}).get("client_event_id") == creates[1]["event_id"])
    assert audio.get(reply) and min(audio[reply]) > output_at
    # an answer after a pause: the policy's turn (a response no client asked for), played by LiveKit
    stopped = [i for i, e in enumerate(sent) if e["type"] == "input_audio_buffer.speech_stopped"]
    assert stopped and any(e["type"] == "response.created" and not e["response"]["metadata"]
                           for e in sent[stopped[-1]:])
    pause_at = next(t for kind, phase, t in log if kind == "phase" and phase == "pause")
    assert any(kind == "audio" and t > pause_at for kind, _, t in log)
