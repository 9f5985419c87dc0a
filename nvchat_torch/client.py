"""Talk to a realtime server (this package's, or any OpenAI Realtime GA one) from a file or the microphone.

    python -m nvchat_torch.client --audio examples/question.wav --output answer.wav
    python -m nvchat_torch.client --mic --duration 20 --output answer.wav     # needs the `mic` extra
    python -m nvchat_torch.client --audio q.wav --tools tools.py              # run tools.py's functions as tools

It prints the transcript and the assistant's text, and writes its audio to a WAV. The full-duplex
model needs audio to answer in, so a file is followed by ``--tail-seconds`` of silence.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np

INPUT_RATE = 16000  # the model's rate: sent as it is, no resampling on the server
AHEAD_SECONDS = 10.0  # how far ahead of real time a file is sent (the server buffers at most 30 s)
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="the server's realtime WebSocket")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--audio", help="audio file to send (any rate/channels; sent as 16 kHz mono)")
    source.add_argument("--mic", action="store_true", help="stream the microphone (sounddevice)")
    p.add_argument("--output", default="answer.wav", help="where to write the assistant's audio (WAV)")
    p.add_argument("--output-rate", type=int, default=24000, choices=(24000, 22050))
    p.add_argument("-p", "--prompt", default=None, help="instructions (the system prompt)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--tail-seconds", type=float, default=3.0, help="silence sent after a file (default 3)")
    p.add_argument("--realtime", action="store_true", help="pace a file at 80 ms per frame, as a microphone")
    p.add_argument("--duration", type=float, default=None, help="stop the microphone after this many seconds")
    p.add_argument("--tools", default=None, help="a Python file: its public functions become tools")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    return p


def load_tools(path: str) -> dict:
    """The public functions of a Python file, by name."""
    spec = importlib.util.spec_from_file_location("nvchat_client_tools", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: fn for name, fn in vars(module).items()
            if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == module.__name__}


def tool_schema(name: str, fn) -> dict:
    """An OpenAI function tool from a Python signature: annotated scalars map to JSON types."""
    properties, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        properties[pname] = {"type": JSON_TYPES.get(param.annotation, "string")}
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return {"type": "function", "name": name, "description": inspect.getdoc(fn) or "",
            "parameters": {"type": "object", "properties": properties, "required": required}}


async def run(args) -> int:
    try:
        import websockets
    except ImportError:
        print("error: the client needs websockets: pip install 'nvchat_torch[mic]'", file=sys.stderr)
        return 2
    from .audio_io import pcm16_decode, prepare_input, write_wav

    tools = load_tools(args.tools) if args.tools else {}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    session = {"type": "realtime",
               "audio": {"input": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}},
                         "output": {"format": {"type": "audio/pcm", "rate": args.output_rate}}}}
    if args.prompt is not None:
        session["instructions"] = args.prompt
    extension = {k: v for k, v in (("seed", args.seed), ("deterministic", args.deterministic or None)) if v is not None}
    if extension:
        session["nvchat"] = extension
    if tools:
        session["tools"] = [tool_schema(name, fn) for name, fn in tools.items()]
        session["tool_choice"] = "auto"

    answer: list[np.ndarray] = []
    async with websockets.connect(args.url, additional_headers=headers, max_size=None) as ws:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            print(f"error: expected session.created, got {created}", file=sys.stderr)
            return 1
        await ws.send(json.dumps({"type": "session.update", "session": session}))

        async def send_audio(chunks) -> None:
            async for chunk in chunks:
                pcm = np.round(np.clip(chunk, -1, 1) * 32767).astype("<i2").tobytes()
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm).decode("ascii")}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

        async def receive() -> int:
            committed = False
            while True:
                event = json.loads(await ws.recv())
                kind = event.get("type")
                if kind == "conversation.item.input_audio_transcription.delta":
                    print(f"[user] {event['delta']}", flush=True)
                elif kind == "response.output_audio_transcript.delta":
                    print(event["delta"], end="", flush=True)
                elif kind == "response.output_audio.delta":
                    answer.append(pcm16_decode(base64.b64decode(event["delta"])))
                elif kind == "response.function_call_arguments.done":
                    await answer_tool(ws, tools, event)
                elif kind == "response.done":
                    print(f"\n[response {event['response']['status']}]", flush=True)
                    if committed:
                        return 0
                elif kind == "input_audio_buffer.committed":
                    committed = True
                elif kind == "error":
                    print(f"\n[error {event['error'].get('code')}] {event['error']['message']}", file=sys.stderr)
                    if event["error"].get("code") in ("session_failed", "context_limit"):  # the session is over
                        return 1

        chunks = mic_chunks(args.duration) if args.mic else file_chunks(args, prepare_input)
        sender = asyncio.create_task(send_audio(chunks))
        try:
            status = await asyncio.wait_for(receive(), args.timeout)
        finally:
            sender.cancel()
    audio = np.concatenate(answer) if answer else np.zeros(0, np.float32)
    write_wav(args.output, audio, args.output_rate)
    print(f"wrote {args.output}: {len(audio) / args.output_rate:.2f} s at {args.output_rate} Hz")
    return status


async def answer_tool(ws, tools: dict, event: dict) -> None:
    name, call_id = event["name"], event["call_id"]
    try:
        result = tools[name](**json.loads(event["arguments"] or "{}"))
    except Exception as e:  # the model sees the failure, as it would see any result
        result = {"error": f"{type(e).__name__}: {e}"}
    print(f"\n[tool] {name}({event['arguments']}) -> {result!r}", flush=True)
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": call_id, "output": json.dumps(result)}}))


async def file_chunks(args, prepare_input):
    samples, notes = prepare_input(args.audio, INPUT_RATE)
    for note in notes:
        print(f"input: {note}", file=sys.stderr)
    samples = np.concatenate([samples, np.zeros(round(args.tail_seconds * INPUT_RATE), np.float32)])
    step = INPUT_RATE * 8 // 100
    began = time.monotonic()
    for start in range(0, len(samples), step):
        yield samples[start:start + step]
        if args.realtime:
            await asyncio.sleep(step / INPUT_RATE)
        else:  # as fast as the server takes it: at most AHEAD_SECONDS ahead of real time (its input bound is 30 s)
            ahead = (start + step) / INPUT_RATE - (time.monotonic() - began)
            if ahead > AHEAD_SECONDS:
                await asyncio.sleep(ahead - AHEAD_SECONDS)


async def mic_chunks(duration: float | None):
    try:
        import sounddevice
    except ImportError:
        raise SystemExit("error: --mic needs sounddevice: pip install 'nvchat_torch[mic]'") from None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    step = INPUT_RATE * 8 // 100

    def callback(indata, frames, time_info, status) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, indata[:, 0].copy())

    end = None if duration is None else loop.time() + duration
    print("listening (Ctrl-C to stop)", file=sys.stderr)
    with sounddevice.InputStream(samplerate=INPUT_RATE, channels=1, dtype="float32", blocksize=step,
                                 callback=callback):
        try:
            while end is None or loop.time() < end:
                yield await queue.get()
        except asyncio.CancelledError:
            return


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.audio and not Path(args.audio).exists():
        print(f"error: {args.audio}: no such file", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the server refused the handshake: a full server answers 503 with its reason
        response = getattr(e, "response", None)
        if response is None or not hasattr(response, "status_code"):
            raise
        try:
            reason = json.loads(response.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = response.body.decode(errors="replace")
        print(f"error: the server refused the connection (HTTP {response.status_code}): {reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
