"""How long a tool call keeps the caller waiting, with NVIDIA's two-phase pipeline and without it.

    python -m benchmarks.tool_latency                        # deep preset, 4-bit, 1 thread
    python -m benchmarks.tool_latency --preset tiny --json tool.json

A session with one tool streams the test signal; at a frame the model's function channel starts a call
(forced: a random model writes none), and once it is written the tool's result is sent while the
session is silent. Measured, for results of several lengths, with ``tool_hold`` on (the default) and
``None`` (a call and its result a token per frame):

* from the call's first token to the first frame of the acknowledgement's audio, in steps and in
  frames of input audio (the steps off the clock run within the push of the frame that started the
  call), and the wall time of that push;
* from the result's arrival to the model's first step on the clock after it (its first chance of an
  answer token), in frames of input audio, and the wall time of the push that injects it (the
  injection's compute: one step per token, off the clock).

Frames are the session's timeline; the wall times are this machine's, on the chosen preset.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

import nvchat_torch as nv
from benchmarks.common import FRAME, generated_checkpoint, machine, test_signal
from nvchat_torch.tool_hold import tool_response_text

TOOLS = [{"type": "function", "name": "lookup", "description": "Look something up",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}]
CALL = '<SPECIAL_20><TOOLCALL>[{"name": "lookup", "arguments": {"q": "weather in Paris"}}]</TOOLCALL><SPECIAL_21>'
START = 5  # the frame whose step starts the call


def tool_model(preset: str) -> nv.VoiceChatModel:
    """The generated ``preset`` (4-bit), with a tokenizer that has the tool-call markers."""
    from transformers import PreTrainedTokenizerFast

    from nvchat_torch.tiny import SPECIAL_TOKENS_MAP, build_tokenizer

    model = nv.load_model(generated_checkpoint(preset, 4))
    model.set_tokenizer(PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(300, specials=23),
                                                **SPECIAL_TOKENS_MAP))
    return model


def result_of(tokens: int) -> dict:
    """A result whose ``<TOOL_RESPONSE>`` is about ``tokens`` long on the byte-level tokenizer."""
    return {"answer": "x" * max(1, tokens - 40), "temperature_c": 21}


def one_call(model: nv.VoiceChatModel, wave: np.ndarray, tokens: int, tool_hold: Any) -> dict:
    session = model.create_streaming_session(nv.StreamingOptions(tools=TOOLS, tool_hold=tool_hold, seed=0))
    frame = 0

    def push() -> tuple[list, float]:
        nonlocal frame
        start = time.perf_counter()
        events = session.push_audio(wave[frame * FRAME:(frame + 1) * FRAME], 16000)
        frame += 1
        return events, time.perf_counter() - start

    for _ in range(START):
        push()
    session.force_tokens("function", model.tokenizer.encode(CALL, add_special_tokens=False))
    call_frame, first_audio = None, None
    started = session.frame_index
    out: dict[str, Any] = {}
    for _ in range(400):  # to the call written (bounded)
        before = session.frame_index
        events, seconds = push()
        if call_frame is None:
            out["start_push_ms"] = seconds * 1000
            call_frame = frame - 1
        said = [e for e in events if e.kind == "hold_speech" and e.reason == "ack"]
        if said and first_audio is None:
            first_audio = said[0].frame_index
            out["ack_after_steps"] = first_audio - started
            out["ack_after_frames"] = frame - 1 - call_frame
        if any(e.kind == "tool_call" for e in events):
            out["call_steps"] = session.frame_index - before if tool_hold is not None else None
            break
    (call_id,) = session.pending_tool_calls
    for _ in range(200):  # until the phrases are spoken (bounded): the result comes in silence
        events, _ = push()
        if tool_hold is None or not any(e.kind == "audio" and e.samples.any() for e in events):
            break
    session.send_tool_result(call_id, result_of(tokens))
    sent = frame
    text = tool_response_text([result_of(tokens)], spell=tool_hold is not None)
    out["result_tokens"] = tokens_in = len(model.tokenizer.encode(text, add_special_tokens=False))
    injected = 0
    for _ in range(tokens_in + 10):  # until the response is in (bounded)
        events, seconds = push()
        injected += sum(e.kind == "function_delta" for e in events)
        if injected >= tokens_in:
            out["inject_push_ms"] = seconds * 1000  # the pipeline: one push; else the last frame's
            # with the pipeline this push's frame runs on the clock right after the injection; without,
            # the next frame is the first free of it
            out["answer_after_frames"] = frame - sent + (tool_hold is None)
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deep", choices=("tiny", "deep"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="20,60,120", help="result lengths, tokens")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tool_model(args.preset)
    wave = test_signal(60.0)
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="", deterministic=True))
    session.push_audio(wave[:10 * FRAME], 16000)
    start = time.perf_counter()
    session.push_audio(wave[10 * FRAME:40 * FRAME], 16000)
    frame_ms = (time.perf_counter() - start) * 1000 / 30
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for mode, hold in (("pipeline", nv.ToolHold()), ("tool_hold=None", None)):
            rows.append({"mode": mode, **one_call(model, wave, tokens, hold)})
    print(f"machine: {machine()}; {args.preset} preset, 4-bit, {args.threads} thread(s); a frame step {frame_ms:.1f} ms")
    print("| mode | result tokens | call start -> ack audio (steps / input frames) | start push ms | result -> "
          "first step on the clock (input frames) | injecting push ms |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        ack = f"{r.get('ack_after_steps', '-')} / {r.get('ack_after_frames', '-')}" if r["mode"] == "pipeline" else "none"
        print(f"| {r['mode']} | {r['result_tokens']} | {ack} | {r.get('start_push_ms', 0):.0f} | "
              f"{r.get('answer_after_frames', '-')} | {r.get('inject_push_ms', 0):.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "preset": args.preset, "frame_ms": frame_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
