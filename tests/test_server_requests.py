"""What frameworks ask of the server beyond audio (issue 32): ``response.create`` (the agent's turn on
request, its metadata, its validation), a full server refused before the upgrade, a replayed history,
reconnects that leave no engine row behind, the client's ``turn_detection`` mapped onto NVIDIA's
policy, and items as GA reports them (``previous_item_id``, truncation at the playback position)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import pytest
import websockets

from nvchat_torch.client import main as client_main
from nvchat_torch.server.session_config import NEVER
from nvchat_torch.turn_taking import TurnTakingConfig
from test_server import EXAMPLE, TIMEOUT, b64, get_json, model, serve, wait_idle  # noqa: F401 (model: a fixture)

GA_16K = {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                        "output": {"format": {"type": "audio/pcm", "rate": 22050}}}}
QUIET = np.zeros(1280, np.int16)  # one 80 ms frame at 16 kHz


async def until(ws, kind: str, log: list | None = None) -> dict:
    """The next event of type ``kind`` (every event read is added to ``log``); an ``error`` fails."""
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        if log is not None:
            log.append(event)
        assert event["type"] != "error" or kind == "error", event
        if event["type"] == kind:
            return event


def test_response_create_gives_the_agent_the_turn(model):
    """Announced at once with its metadata, the agent's BOS on the next frame; a request while the
    agent speaks joins its response; bad fields are errors naming the request's event_id; every GA
    field is taken (null as not given)."""

    async def run(address):
        log: list = []
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {
                **GA_16K, "nvchat": {"turn_taking": False, "deterministic": True}}}))
            await until(ws, "session.updated")
            # before the start: announced at once, and the agent speaks from the first frame
            await ws.send(json.dumps({"type": "response.create", "event_id": "ask_1", "response": {
                "metadata": {"client_event_id": "ask_1"}, "instructions": None, "conversation": "none",
                "output_modalities": ["audio"], "tool_choice": "none", "tools": [], "max_output_tokens": "inf"}}))
            created = await until(ws, "response.created", log)
            assert created["response"]["metadata"] == {"client_event_id": "ask_1"}
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}))
            delta = await until(ws, "response.output_audio.delta", log)
            assert delta["response_id"] == created["response"]["id"]
            # a second request while it speaks joins it: no second response, its metadata on the open one
            # (which the commit then closes: each commit ends with a response.done)
            await ws.send(json.dumps({"type": "response.create", "event_id": "ask_2",
                                      "response": {"metadata": {"client_event_id": "ask_2"}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            done = await until(ws, "response.done", log)
            assert done["response"]["id"] == created["response"]["id"]
            assert done["response"]["metadata"] == {"client_event_id": "ask_2"}
            assert [e["type"] for e in log].count("response.created") == 1
            # a running session: the BOS lands on the next frame, whose audio is the response's first
            await ws.send(json.dumps({"type": "response.create", "response": {"metadata": {"k": "v"}}}))
            second = await until(ws, "response.created", log)
            assert second["response"]["metadata"] == {"k": "v"}
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}))
            first = await until(ws, "response.output_audio.delta", log)
            assert first["response_id"] == second["response"]["id"]
            # invalid requests: one error each, naming the request
            for bad, code in ((["x"], "invalid_value"), ({"voice": "x"}, "unknown_parameter"),
                              ({"metadata": {"k": 1}}, "invalid_value"), ({"output_modalities": []}, "invalid_value"),
                              ({"metadata": {str(i): "v" for i in range(17)}}, "invalid_value")):
                await ws.send(json.dumps({"type": "response.create", "event_id": f"bad_{code}", "response": bad}))
                error = await until(ws, "error")
                assert error["error"]["code"] == code and error["error"]["event_id"] == f"bad_{code}", (bad, error)

    with serve(model, clock=0) as (address, _):
        asyncio.run(run(address))


def test_a_request_cancelled_before_its_bos_is_not_spoken(model):
    """response.cancel closes the waiting response; the BOS already queued still reaches the model,
    and the turn it starts is not sent (as the rest of a cancelled turn is not)."""

    async def run(address):
        log: list = []
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {
                **GA_16K, "nvchat": {"turn_taking": False, "deterministic": True}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await until(ws, "response.done")  # the commit's: the session runs
            await ws.send(json.dumps({"type": "response.create", "response": {"metadata": {"k": "v"}}}))
            await ws.send(json.dumps({"type": "response.cancel"}))
            done = await until(ws, "response.done", log)
            assert done["response"]["status"] == "cancelled" and done["response"]["metadata"] == {"k": "v"}
            for _ in range(4):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await until(ws, "input_audio_buffer.committed", log)
            await until(ws, "response.done", log)  # the commit's own, empty
            return log

    with serve(model, clock=0) as (address, _):
        log = asyncio.run(run(address))
    assert not [e for e in log if e["type"] in ("response.output_audio.delta", "response.output_audio_transcript.delta")]


def test_a_full_server_refuses_the_upgrade_and_reconnects_leave_no_row(model, capsys):
    async def run(address, app):
        realtime = app.state.realtime
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await until(ws, "session.created")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}))
            # at the limit: HTTP 503 before the upgrade, with a JSON reason; nothing was accepted
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(f"ws://{address}/v1/realtime"):
                    pass
            response = refused.value.response
            assert response.status_code == 503
            assert json.loads(response.body)["error"]["code"] == "server_busy"
            assert realtime.active == 1
            # the command-line client says why, instead of a traceback
            code = await asyncio.to_thread(client_main, ["--url", f"ws://{address}/v1/realtime",
                                                         "--audio", str(EXAMPLE), "--output", os.devnull])
            assert code == 1
        await wait_idle(address)
        # closed mid-session (and mid-prefill): its engine row is released, as a reconnect needs
        for prompt in ("", "x" * 400):
            async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
                await until(ws, "session.created")
                await ws.send(json.dumps({"type": "session.update", "session": {**GA_16K, "instructions": prompt}}))
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.tile(QUIET, 3))}))
                await until(ws, "session.updated")
            deadline = time.monotonic() + TIMEOUT
            engine = realtime.scheduler.engine
            while (engine.sessions or engine.joining) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not engine.sessions and not engine.joining
        await wait_idle(address)
        # "full" is also the step time: a median step near the frame refuses a new session
        realtime.scheduler._steps.extend([(time.perf_counter(), 0.079)] * 25)
        realtime.active += 1  # as if a session were streaming (and one more slot, so only the step is full)
        realtime.max_sessions += 1
        try:
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(f"ws://{address}/v1/realtime"):
                    pass
            assert refused.value.response.status_code == 503
            assert "real-time limit" in json.loads(refused.value.response.body)["error"]["message"]
            assert get_json(f"http://{address}/health")["median_step_ms"] == 79.0
        finally:
            realtime.active -= 1
            realtime.max_sessions -= 1

    with serve(model, clock=0, max_sessions=1) as (address, app):
        asyncio.run(run(address, app))
    assert "refused the connection (HTTP 503): all 1 sessions are in use" in capsys.readouterr().err


def test_a_replayed_history_and_items_as_ga_reports_them(model):
    """LiveKit's reconnect replays its history from "root": messages of every role, a function call and
    its output; all taken without an error. conversation.item.added answers "root" with null. A
    truncation cuts an assistant item's transcript where the client's playback stopped."""
    history = [{"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
               {"type": "function_call", "call_id": "call_old", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_old", "output": "sunny"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]

    async def run(address):
        log: list = []
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {
                **GA_16K, "nvchat": {"turn_taking": False, "deterministic": True}}}))
            previous = "root"
            for i, item in enumerate(history):
                await ws.send(json.dumps({"type": "conversation.item.create", "previous_item_id": previous,
                                          "item": {**item, "id": f"item_old_{i}"}}))
                added = await until(ws, "conversation.item.added", log)
                assert added["previous_item_id"] == (None if previous == "root" else previous)
                previous = added["item"]["id"]
            await ws.send(json.dumps({"type": "response.create"}))
            created = await until(ws, "response.created", log)
            for _ in range(12):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(QUIET)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            done = await until(ws, "response.done", log)
            item = done["response"]["output"][0]
            # played up to the frame before the last text: the transcript said by then
            played, last = 0, 0
            for e in log:
                played += e["type"] == "response.output_audio.delta"
                if e["type"] == "response.output_audio_transcript.delta":
                    last = played
            await ws.send(json.dumps({"type": "conversation.item.truncate", "item_id": item["id"],
                                      "content_index": 0, "audio_end_ms": 80 * last}))
            await until(ws, "conversation.item.truncated", log)
            await ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": item["id"]}))
            kept = (await until(ws, "conversation.item.retrieved", log))["item"]["content"][0]["transcript"]
            return created, log, item["content"][0]["transcript"], kept, last

    with serve(model, clock=0) as (address, _):
        created, log, whole, kept, last = asyncio.run(run(address))
    notices = [e for e in log if e["type"] == "nvchat.notice"]
    assert [n["item_id"] for n in notices] == ["item_old_3"]  # the old tool result answers no call
    # what was said by the end of the audio delta that ends at audio_end_ms (80 ms each at 22.05 kHz)
    said, played = [], 0
    for e in log:
        if e.get("response_id") != created["response"]["id"]:
            continue
        if e["type"] == "response.output_audio.delta":
            played += 1
        elif e["type"] == "response.output_audio_transcript.delta":
            said.append((played, e["delta"]))
    assert whole == "".join(d for _, d in said)
    assert kept == "".join(d for before, d in said if before < last) and kept != whole


def test_turn_detection_is_mapped_onto_the_policy(model):
    base = TurnTakingConfig(eou_frames=40)

    async def run(address):
        updates = []
        async with websockets.connect(f"ws://{address}/v1/realtime") as ws:
            await until(ws, "session.created")
            for detection in ({"type": "server_vad", "silence_duration_ms": 800, "threshold": 0.5},
                              {"type": "semantic_vad", "eagerness": "auto"}, {"type": "semantic_vad", "eagerness": "high"},
                              {"type": "server_vad", "create_response": False, "interrupt_response": False}, None):
                await ws.send(json.dumps({"type": "session.update", "session": {
                    "type": "realtime", "audio": {"input": {"turn_detection": detection}}}}))
                updates.append((await until(ws, "session.updated"))["session"])
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "nvchat": {"turn_taking": {"eou_frames": 7}},
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}}}}}))
            updates.append((await until(ws, "session.updated"))["session"])
        return updates

    with serve(model, clock=0, turn_taking=base) as (address, _):
        updates = asyncio.run(run(address))
    policies = [u["nvchat"]["turn_taking"] for u in updates]
    assert policies[0]["eou_frames"] == 10 and policies[0]["barge_in_frames"] == 40  # 800 ms; the rest kept
    assert policies[1]["eou_frames"] == 40 and policies[2]["eou_frames"] == 20  # stock at auto; high halves it
    assert policies[3]["eou_frames"] == NEVER and policies[3]["barge_in_frames"] == NEVER
    assert policies[3]["first_turn_fallback_frames"] == NEVER
    assert policies[4]["eou_frames"] == policies[4]["barge_in_frames"] == NEVER  # null: manual turns
    assert updates[4]["audio"]["input"]["turn_detection"] is None
    assert updates[0]["nvchat"]["not_applied"] == ["audio.input.turn_detection.threshold"]
    assert policies[5]["eou_frames"] == 7  # nvchat.turn_taking wins
    assert "audio.input.turn_detection" in updates[5]["nvchat"]["not_applied"]
