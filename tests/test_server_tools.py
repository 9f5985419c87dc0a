"""NVIDIA's tool pipeline over the GA protocol (docs/server.md, "Speech during a tool call"), on raw
WebSockets against the server on loopback, on its real 80 ms clock: the acknowledgement in the response
that carries the call, the rest of it and the on-hold phrase in server-initiated responses of their own,
a ``response.create`` sent mid-phrase (answered at once; the phrase's rest is its first audio, the answer
after the injected result its next), a timeout that wall-time ticks bring with no client audio, a result
after it (a notice, not an error), and ``nvchat.tool_hold``'s validation.

The model is the tiny random one, whose function channel is held at PAD (``quiet_function_channel``) and
then forced to call the tool a few frames in, as a trained model would decide to.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch
import websockets

import nvchat_torch as nv
from nvchat_torch.server.responses import ResponseEvents
from nvchat_torch.tool_hold import ToolHold
from test_server import (CALL, EXAMPLE, GA_16K_22K, TIMEOUT, WEATHER, _CallingModel, b64, get_json,
                         quiet_function_channel, serve)

# Longer than the call's 79 steps off the clock: its rest is spoken once the call is written.
ACK = "Sure, one moment, I am looking that up for you right now, please hold on."
ON_HOLD = "Still looking that up for you, thanks for waiting."
FRAME = 1280


@pytest.fixture(scope="module")
def calling(make_checkpoint):
    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    hook = quiet_function_channel(model)
    yield _CallingModel(model, [CALL], after=3)  # from its fourth frame
    hook.remove()


@pytest.fixture(scope="module")
def server(calling):
    """One server for the module: its prompt cache prefills the tool prompt once (the tiny model takes
    seconds for it), and the later sessions join at once."""
    with serve(calling) as (address, _):
        yield address


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    import soundfile as sf

    pcm, rate = sf.read(EXAMPLE, dtype="int16")
    assert rate == 16000
    return pcm


class Client:
    """A raw GA connection that records every event it reads."""

    def __init__(self, ws):
        self.ws, self.events = ws, []

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, test) -> dict:
        """The next event ``test(event)`` holds for; an ``error`` fails."""
        while True:
            event = json.loads(await asyncio.wait_for(self.ws.recv(), TIMEOUT))
            self.events.append(event)
            assert event["type"] != "error", event
            if test(event):
                return event

    def of(self, kind: str, **fields) -> list[dict]:
        return [e for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in fields.items())]


async def append(client: Client, pcm: np.ndarray) -> None:
    await client.send({"type": "input_audio_buffer.append", "audio": b64(pcm)})


async def stream(client: Client, pcm: np.ndarray, frames: int) -> None:
    """``frames`` frames of ``pcm`` (looped), one every 80 ms, as a microphone sends them."""
    start = time.monotonic()
    for k in range(frames):
        await asyncio.sleep(max(0.0, start + 0.08 * k - time.monotonic()))
        i = k * FRAME % (len(pcm) - FRAME)
        await append(client, pcm[i:i + FRAME])


def session_update(**nvchat) -> dict:
    return {"type": "session.update", "session": {**GA_16K_22K, "tools": [WEATHER], "instructions": "Be brief.",
                                                  "nvchat": {"deterministic": True, "turn_taking": False, **nvchat}}}


def test_a_slow_tool_speaks_while_it_runs_and_a_request_mid_phrase_is_answered(server, calling, speech):
    hold = {"acknowledgements": [ACK], "on_hold": {"default": ON_HOLD}, "timeout_s": 10}

    async def run():
        async with websockets.connect(f"ws://{server}/v1/realtime", max_size=None) as ws:
            client = Client(ws)
            await client.until(lambda e: e["type"] == "session.created")
            await client.send(session_update(tool_hold=hold, stats=True))
            updated = await client.until(lambda e: e["type"] == "session.updated")
            microphone = asyncio.create_task(stream(client, speech, 400))
            try:
                call = await client.until(lambda e: e["type"] == "response.function_call_arguments.done")
                on_hold = await client.until(lambda e: e["type"] == "nvchat.hold_speech" and e["reason"] == "on_hold")
                health = await asyncio.to_thread(get_json, f"http://{server}/health")  # during the tool call
                await asyncio.sleep(1.0)  # the tool runs a second: the phrase is half spoken
                await client.send({"type": "conversation.item.create", "item": {
                    "type": "function_call_output", "call_id": call["call_id"], "output": '{"temperature_c": 21}'}})
                await client.send({"type": "response.create", "event_id": "ask_answer",
                                   "response": {"metadata": {"client_event_id": "ask_answer"}}})
                asked = await client.until(lambda e: e["type"] == "response.created"
                                           and e["response"]["metadata"] == {"client_event_id": "ask_answer"})
                # the phrase's rest, then (the result injected) the answer's audio after its BOS
                steps = on_hold["audio_ms"] // 80
                await client.until(lambda e: e["type"] == "response.output_audio.delta"
                                   and e["response_id"] == asked["response"]["id"]
                                   and len(client.of("response.output_audio.delta", response_id=e["response_id"]))
                                   > steps + 5)
            finally:
                microphone.cancel()
            return client, updated, call, on_hold, asked, health

    client, updated, call, on_hold, asked, health = asyncio.run(run())
    assert updated["session"]["nvchat"]["tool_hold"] == ToolHold.from_mapping(hold).to_dict()
    session = calling.sessions[-1]
    events = client.events
    responses = {e["response"]["id"]: e["response"] for e in client.of("response.done")}
    deltas = lambda rid: client.of("response.output_audio.delta", response_id=rid)  # noqa: E731
    text = lambda rid: "".join(e["delta"] for e in client.of("response.output_audio_transcript.delta",  # noqa: E731
                                                                response_id=rid))
    # the acknowledgement is spoken in the response that then carries the call, which ends at the call
    (ack,) = client.of("nvchat.hold_speech", reason="ack")
    first = ack["response_id"]
    assert ack["text"] == ACK and ack["call_id"] is None and text(first).endswith(ACK)
    assert call["response_id"] == first and deltas(first)
    done = responses[first]
    assert done["status"] == "completed" and [item["type"] for item in done["output"]] == ["message", "function_call"]
    assert done["output"][0]["content"][0]["transcript"] == text(first)
    # its rest, once the call is written, in a response of its own; then the on-hold phrase in its own
    created = [e["response"]["id"] for e in client.of("response.created")]
    rest, phrase = created[created.index(first) + 1:created.index(first) + 3]
    assert phrase == on_hold["response_id"] and on_hold["text"] == ON_HOLD and on_hold["call_id"] == call["call_id"]
    assert responses[rest]["status"] == "completed" and text(rest) == "" and deltas(rest)
    spoken = [e for e in events[events.index(ack):] if e["type"] == "response.output_audio.delta"
              and e["response_id"] in (first, rest)]
    assert len(spoken) == ack["audio_ms"] // 80  # one delta a step, all of them
    assert text(phrase) == ON_HOLD and responses[phrase]["metadata"] is None
    # the request mid-phrase: the phrase's response ends there, the request's is announced at once, and
    # the phrase's rest is its first audio; then the result, injected, and the answer after it
    assert responses[phrase]["status"] == "completed"
    order = [(e["type"], e["response"]["id"]) for e in events if e["type"] in ("response.done", "response.created")]
    assert order.index(("response.created", asked["response"]["id"])) == order.index(("response.done", phrase)) + 1
    assert 0 < len(deltas(phrase)) < on_hold["audio_ms"] // 80
    assert len(deltas(phrase)) + len(deltas(asked["response"]["id"])) > on_hold["audio_ms"] // 80 + 5
    assert '<TOOL_RESPONSE>[{"temperature_c": "twenty-one"}]</TOOL_RESPONSE>' in session.function_text
    assert session.pending_tool_calls == []
    # the phrases' responses are the server's (no metadata), and nothing of the call was an error
    assert not client.of("error") and not client.of("nvchat.notice")
    assert health["active_sessions"] >= 1 and client.of("nvchat.stats")
    # every frame heard was counted once in the stats, none of the steps off the clock
    assert client.of("nvchat.stats")[-1]["frames"] <= session.input_frames < session.frame_index


def test_a_timeout_comes_by_wall_time_and_a_late_result_gets_a_notice(server, calling, speech):
    hold = {"acknowledgements": [], "on_hold": {}, "timeout_s": 0.8}

    async def run():
        async with websockets.connect(f"ws://{server}/v1/realtime", max_size=None) as ws:
            client = Client(ws)
            await client.until(lambda e: e["type"] == "session.created")
            await client.send(session_update(tool_hold=hold))
            await client.until(lambda e: e["type"] == "session.updated")
            for k in range(6):  # the call starts on the fourth frame; then the client sends nothing
                await append(client, speech[k * FRAME:(k + 1) * FRAME])
            call = await client.until(lambda e: e["type"] == "response.function_call_arguments.done")
            session = calling.sessions[-1]
            deadline = time.monotonic() + TIMEOUT
            while '"error": "timeout"' not in session.function_text and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the timeout result injected
            heard = session.input_frames
            await client.send({"type": "conversation.item.create", "event_id": "late", "item": {
                "type": "function_call_output", "call_id": call["call_id"], "output": '"sunny"'}})
            notice = await client.until(lambda e: e["type"] == "nvchat.notice")
            # the session goes on
            for k in range(6, 12):
                await append(client, speech[k * FRAME:(k + 1) * FRAME])
            await client.send({"type": "input_audio_buffer.commit"})
            await client.until(lambda e: e["type"] == "input_audio_buffer.committed")
            return client, call, notice, heard

    client, call, notice, heard = asyncio.run(run())
    session = calling.sessions[-1]
    # no audio came after the sixth frame (the call's writing and two frames of silence): the ticks
    # stepped the session to its timeout, whose result the model heard
    assert heard == 6 and '<TOOL_RESPONSE>[{"error": "timeout"' in session.function_text
    assert notice["code"] == "tool_result_too_late" and notice["call_id"] == call["call_id"]
    (output,) = [e["item"] for e in client.of("conversation.item.added") if e["item"]["type"] == "function_call_output"]
    assert notice["item_id"] == output["id"]
    assert "timed out after 0.8 s" in notice["message"] and not client.of("error")
    assert session.input_frames == 12 and client.of("response.done")  # it went on


def test_tool_hold_is_validated_like_every_other_key(server):
    bad = [({"timeout_s": -1}, "invalid_value", "session.nvchat.tool_hold.timeout_s"),
           ({"timeout": 3}, "unknown_parameter", "session.nvchat.tool_hold.timeout"),
           ({"generic": ["Almost there.", ""]}, "invalid_value", "session.nvchat.tool_hold.generic[1]"),
           ({"acknowledgements": "Sure."}, "invalid_value", "session.nvchat.tool_hold.acknowledgements"),
           ({"on_hold": {"get_time": "One moment."}}, "invalid_value", "session.nvchat.tool_hold.on_hold"),
           ({"spell_numbers": "yes"}, "invalid_value", "session.nvchat.tool_hold.spell_numbers"),
           (5, "invalid_value", "session.nvchat.tool_hold")]

    async def run():
        async with websockets.connect(f"ws://{server}/v1/realtime", max_size=None) as ws:
            client = Client(ws)
            await client.until(lambda e: e["type"] == "session.created")
            errors = []
            for i, (value, _, _) in enumerate(bad):
                event = session_update(tool_hold=value)
                await client.send({**event, "event_id": f"bad_{i}"})
                errors.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT)))
            shown = []
            for value in ({"timeout_s": 5, "acknowledgements": ["Sure."]}, None):
                await client.send(session_update(tool_hold=value))
                shown.append((await client.until(lambda e: e["type"] == "session.updated"))["session"]["nvchat"])
            # fixed once the session has started: a new value is taken, not applied, and listed
            await append(client, np.zeros(FRAME, np.int16))
            await client.send(session_update(tool_hold={"timeout_s": 3}))
            shown.append((await client.until(lambda e: e["type"] == "session.updated"))["session"]["nvchat"])
            return errors, shown

    errors, shown = asyncio.run(run())
    for i, ((value, code, param), error) in enumerate(zip(bad, errors)):
        assert error["type"] == "error", (value, error)
        assert (error["error"]["code"], error["error"]["param"], error["error"]["event_id"]) == \
            (code, param, f"bad_{i}")
    assert shown[0]["tool_hold"] == ToolHold(timeout_s=5, acknowledgements=("Sure.",)).to_dict()
    assert shown[1]["tool_hold"] is None
    assert shown[2]["tool_hold"] is None and "tool_hold" in shown[2]["not_applied"]


def test_the_mlx_dialect_passes_a_phrase_through_as_an_event_of_its_own():
    event = nv.VoiceChatEvent("hold_speech", 12, text=ON_HOLD, reason="on_hold", call_id="call_1", frames=77)
    assert ResponseEvents._mlx_event(event) == {"type": "nvchat.hold_speech", "frame_index": 12, "text": ON_HOLD,
                                               "reason": "on_hold", "call_id": "call_1", "frames": 77}
