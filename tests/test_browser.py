"""The web page in a real headless Chromium whose fake microphone plays examples/question.wav.

Chromium is driven over the DevTools protocol (a WebSocket, no playwright): the test polls the
page's DOM until it shows a connection, audio deltas and a user transcript, or a deadline passes.
Set NVCHAT_SCREENSHOT=path to save a screenshot of the page (docs/server.png is made this way).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest
import torch
import websockets

import nvchat_torch as nv
from test_server import CALL, EXAMPLE, WEATHER, _CallingModel, quiet_function_channel, serve

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def model():
    return nv.load_tiny_model(device="cpu", dtype=torch.float32)


class DevTools:
    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        n = next(self.ids)
        await self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            reply = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
            if reply.get("id") == n:
                assert "error" not in reply, reply
                return reply["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


def test_page_talks_to_the_server_in_chromium(model, tmp_path):
    assert CHROMIUM, "Chromium is needed (.ci/run installs Debian's chromium package)"
    with serve(model) as (address, _):
        profile = tmp_path / "profile"
        browser = subprocess.Popen([
            CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1000,860",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={EXAMPLE}", "--autoplay-policy=no-user-gesture-required",
            f"http://{address}/?autostart=1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            state = asyncio.run(drive(profile, address))
        finally:
            browser.terminate()
            browser.wait(timeout=30)
    assert state["status"] in ("connected", "streaming"), state
    assert state["deltas"] > 0 and state["user"], state
    assert state["rtf"] != "-", state  # the live real-time-factor readout is filled


async def page_socket(profile, address: str, deadline: float) -> str:
    """The DevTools WebSocket URL of Chromium's page at ``address`` (Chromium started with ``profile``)."""
    port_file = profile / "DevToolsActivePort"
    # Chromium creates the file, then writes the port: wait for its first line, not just the file.
    while not (port_file.exists() and port_file.read_text().split()):
        assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
        await asyncio.sleep(0.1)
    port = port_file.read_text().split()[0]
    while True:
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10).read())
        pages = [t for t in targets if t["type"] == "page" and address in t["url"]]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        assert time.monotonic() < deadline, f"the page did not open: {targets}"
        await asyncio.sleep(0.1)


async def drive(profile, address) -> dict:
    deadline = time.monotonic() + 60
    async with websockets.connect(await page_socket(profile, address, deadline), max_size=None) as ws:
        tools = DevTools(ws)
        probe = ("({status: document.body.dataset.status || '', deltas: +document.getElementById('audio-deltas')"
                 ".textContent, user: document.getElementById('user').textContent, rtf: document.getElementById"
                 "('rtf').textContent, errors: document.getElementById('errors').textContent})")
        deadline = time.monotonic() + 90
        while True:
            state = await tools.evaluate(probe)
            if state and state["deltas"] > 25 and state["user"] and state["rtf"] != "-":
                break
            if time.monotonic() > deadline or (state and state["status"].startswith(("closed", "failed"))):
                break
            await asyncio.sleep(0.25)
        if os.environ.get("NVCHAT_SCREENSHOT"):
            shot = await tools.call("Page.captureScreenshot", format="png")
            with open(os.environ["NVCHAT_SCREENSHOT"], "wb") as f:
                f.write(base64.b64decode(shot["data"]))
        await tools.evaluate("document.getElementById('stop').click()")
        return state


EVIL_PAGE = """<!doctype html><title>probing</title><script>
function probe(url) {
  return new Promise(resolve => {
    const ws = new WebSocket(url);
    ws.onmessage = e => { resolve("message:" + JSON.parse(e.data).type); ws.close(); };
    ws.onerror = () => resolve("error");
    setTimeout(() => resolve("timeout"), 20000);
  });
}
Promise.all([probe("ws://%s/v1/realtime"), probe("ws://%s/v1/realtime")]).then(v => { document.title = v.join("|"); });
</script>"""


def test_another_sites_page_cannot_use_the_server_in_chromium(model, tmp_path):
    """Cross-site WebSocket hijacking, as a browser does it: a page on another origin (another port)
    opens a WebSocket to the server. The default server refuses it (403 before any session); one
    started with that origin in --allow-origin takes it (so the probe can tell the two apart)."""
    import http.server
    import threading

    assert CHROMIUM, "Chromium is needed (.ci/run installs Debian's chromium package)"
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    origin = f"http://127.0.0.1:{site.server_address[1]}"
    with serve(model) as (default, _), serve(model, allow_origins=[origin]) as (allowing, _):
        (tmp_path / "evil.html").write_text(EVIL_PAGE % (default, allowing))
        site.RequestHandlerClass = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path),
                                                                                        **kw)
        threading.Thread(target=site.serve_forever, daemon=True).start()
        profile = tmp_path / "profile"
        browser = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                    "--remote-debugging-port=0", f"--user-data-dir={profile}", f"{origin}/evil.html"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            title = asyncio.run(page_title(profile, origin))
        finally:
            browser.terminate()
            browser.wait(timeout=30)
            site.shutdown()
    assert title == "error|message:session.created", title


async def page_title(profile, origin: str) -> str:
    deadline = time.monotonic() + 60
    async with websockets.connect(await page_socket(profile, origin, deadline), max_size=None) as ws:
        tools = DevTools(ws)
        while time.monotonic() < deadline:
            title = await tools.evaluate("document.title")
            if title not in ("probing", "", None):
                return title
            await asyncio.sleep(0.2)
    return "probing"


def chromium(address: str, profile, microphone, autostart: bool = True) -> subprocess.Popen:
    """Headless Chromium on the page (autostarted, or waiting for Start), its fake microphone playing
    ``microphone`` (a WAV)."""
    return subprocess.Popen([
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1000,860",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}", "--autoplay-policy=no-user-gesture-required",
        f"http://{address}/{'?autostart=1' if autostart else ''}"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def test_page_drops_its_playback_at_a_barge_in(make_checkpoint, tmp_path):
    """The user talks over the model: the server cancels the response and says the user speaks; the
    page empties its playback queue at once and shows the turn. Then the same with five seconds of
    audio queued by hand: the queue is empty right after the barge-in."""
    import soundfile as sf
    from test_pipecat import POLICY, voice_activity_rnnt
    from test_server_turns import conversation_audio

    assert CHROMIUM, "Chromium is needed (.ci/run installs Debian's chromium package)"
    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    hook = voice_activity_rnnt(model)
    microphone = tmp_path / "conversation.wav"  # Chromium loops it
    sf.write(microphone, conversation_audio(), 16000, subtype="PCM_16")
    profile = tmp_path / "profile"
    try:
        with serve(model, turn_taking=POLICY) as (address, _):
            browser = chromium(address, profile, microphone)
            try:
                state = asyncio.run(barge_in(profile, address))
            finally:
                browser.terminate()
                browser.wait(timeout=30)
    finally:
        hook.remove()
    # a barge-in: the response was cancelled (the turn shows "interrupted"), then the user's speech
    # started and the queue was dropped; it is empty right after every drop
    cut_in = [b for b in state["bargeIns"] if b["turn"] == "interrupted"]
    assert cut_in and all(b["after"] == 0 for b in state["bargeIns"]), state
    assert state["errors"] == "", state
    injected = state["injected"]
    assert injected["queued"] >= 4 * 24000 and injected["drop"]["before"] >= 4 * 24000, injected
    assert injected["drop"]["after"] == 0 and injected["after"] == 0 and injected["turn"] == "user", injected


async def barge_in(profile, address) -> dict:
    deadline = time.monotonic() + 60
    async with websockets.connect(await page_socket(profile, address, deadline), max_size=None) as ws:
        tools = DevTools(ws)
        probe = ("({bargeIns: window.nvchat ? nvchat.bargeIns : [], turn: document.getElementById('turn').dataset.turn,"
                 " status: document.body.dataset.status || '', errors: document.getElementById('errors').textContent})")
        deadline = time.monotonic() + 120
        while True:
            state = await tools.evaluate(probe)
            if state and any(b["turn"] == "interrupted" for b in state["bargeIns"]):
                break
            if time.monotonic() > deadline or (state and state["status"].startswith(("closed", "failed"))):
                break
            await asyncio.sleep(0.1)
        # five seconds of (quiet) audio queued as a delta, then the user cuts in
        result = await tools.call("Runtime.evaluate", awaitPromise=True, returnByValue=True, expression="""
            (async () => {
              const pcm = new Int16Array(5 * 24000).fill(100);
              nvchat.onEvent({type: 'response.output_audio.delta', delta: toBase64(pcm)});
              const queued = await nvchat.queued();
              const count = nvchat.bargeIns.length;
              nvchat.onEvent({type: 'input_audio_buffer.speech_started', audio_start_ms: 0, item_id: 'item_x'});
              const after = await nvchat.queued();
              while (nvchat.bargeIns.length === count) await new Promise((r) => setTimeout(r, 5));
              return {queued, after, drop: nvchat.bargeIns[count], turn: document.getElementById('turn').dataset.turn};
            })()""")
        state["injected"] = result["result"].get("value")
        await tools.evaluate("document.getElementById('stop').click()")
        return state


def test_page_marks_what_the_model_says_while_a_tool_runs(make_checkpoint, tmp_path):
    """Tools offered from the page: the model calls one (its function channel forced, a few frames in).
    The acknowledgement and the on-hold phrase NVIDIA's tool pipeline speaks show in the assistant's
    transcript, marked as said during the tool call; the call is answered with the page's button."""
    from nvchat_torch.tool_hold import ACKNOWLEDGEMENTS, REMINDERS

    assert CHROMIUM, "Chromium is needed (.ci/run installs Debian's chromium package)"
    model = nv.load_model(make_checkpoint(seed=0, specials=23), device="cpu", dtype=torch.float32)
    hook = quiet_function_channel(model)
    profile = tmp_path / "profile"
    calling = _CallingModel(model, [CALL], after=3)
    try:
        with serve(calling) as (address, _):
            browser = chromium(address, profile, EXAMPLE, autostart=False)
            try:
                state = asyncio.run(tool_call(profile, address, calling.sessions))
            finally:
                browser.terminate()
                browser.wait(timeout=30)
    finally:
        hook.remove()
    held = {h["reason"]: h for h in state["held"]}
    assert held["ack"]["text"] in ACKNOWLEDGEMENTS and held["ack"]["title"] == "acknowledging a tool call", state
    assert held["on_hold"]["text"] in REMINDERS and held["on_hold"]["title"] == "while a tool runs", state
    assert "get_weather" in state["tools"] and state["answered"], state
    assert calling.sessions[0].pending_tool_calls == []  # the page's answer reached the session
    assert state["errors"] == "" and state["notices"] == "", state


async def tool_call(profile, address, sessions: list) -> dict:
    deadline = time.monotonic() + 60
    async with websockets.connect(await page_socket(profile, address, deadline), max_size=None) as ws:
        tools = DevTools(ws)
        while not await tools.evaluate("!!window.nvchat"):  # the page's script has run
            assert time.monotonic() < deadline, "the page did not load"
            await asyncio.sleep(0.1)
        await tools.evaluate(f"document.getElementById('tools-json').value = {json.dumps(json.dumps([WEATHER]))};"
                             "document.getElementById('start').click()")
        probe = ("({held: [...document.querySelectorAll('#assistant .hold')].map(s => ({reason: s.dataset.reason, "
                 "text: s.textContent, title: s.title})), tools: document.getElementById('tools').textContent, "
                 "answered: !!document.querySelector('#tools button[disabled]'), status: document.body.dataset.status "
                 "|| '', errors: document.getElementById('errors').textContent, notices: document.getElementById"
                 "('notices').textContent})")
        deadline = time.monotonic() + 120
        while True:
            state = await tools.evaluate(probe)
            if state and any(h["reason"] == "on_hold" for h in state["held"]):
                break
            if time.monotonic() > deadline or (state and state["status"].startswith(("closed", "failed"))):
                break
            await asyncio.sleep(0.1)
        # answered by hand, as a user would (within the 15 s the model waits)
        await tools.evaluate("document.querySelector('#tools input').value = '{\"temperature_c\": 21}';"
                             "document.querySelector('#tools button').click()")
        while sessions[0].pending_tool_calls and time.monotonic() < deadline:  # the session took the result
            await asyncio.sleep(0.1)
        state = await tools.evaluate(probe)
        await tools.evaluate("document.getElementById('stop').click()")
        return state
