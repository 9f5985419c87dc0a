"""How long a new system prompt keeps the caller waiting: from opening a session to the session ready.

    python -m benchmarks.prefill                       # deep preset, 4-bit, 1 thread, sampling, seed 0
    python -m benchmarks.prefill --chunks 32,64,128,256,0   # the LLM prefill alone per piece size (0: whole)
    python -m benchmarks.prefill --full-pieces         # full-size widths: the parts of the full-size estimate

On the generated deep model (``benchmarks.frame_loop.generated_checkpoint``) in the server's default mode
(sampling, seed 0), each round opens sessions with prompts of ``--chars`` characters that nothing has
seen, and times ``create_streaming_session`` (its prefill runs in it) or ``engine.open``:

- ``sequential``: the prefill tracks off (``model.speech_tracks().max_bytes = 0``): the LLM in pieces
  and one TTS step per prompt token, what every prefill ran before the tracks;
- ``cold track``: the model's tracks dropped first, so this session builds the track (the first
  session of a mode and seed);
- ``warm track``: another unseen prompt once the track exists;
- ``cached prompt``: ``engine.open`` of a prompt the engine's ``PromptCache`` holds.

Times are also given in frames of this machine's frame time: a lone session's median 80 ms frame,
measured in the same run. ``--chunks`` times the LLM half of a prefill alone, per piece size.
``--full-pieces`` builds the 11B widths with a 3-layer LLM (one Mamba, one attention, one MLP layer,
4-bit as the real card) and times each layer kind's prefill per piece size, a TTS step, and a prefill
track copy, from which docs/performance.md estimates the full size's time to a first heard word.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import nvchat_torch as nv
from benchmarks.common import FRAME, generated_checkpoint, machine, test_signal
from nvchat_torch.diagnostics import synchronize
from nvchat_torch.models.language_heads import fused_input
from nvchat_torch.models.layers import grown_capacity
from nvchat_torch.runtime.prompt import PromptCache

PLACES = ["a small bakery", "a bicycle repair shop", "a dental practice", "a city library", "a hotel front desk",
          "a hardware store", "a veterinary clinic", "a flower shop", "a bus company", "a swimming pool",
          "a bookshop", "a music school", "a pharmacy", "a car rental desk", "a museum", "a garden centre"]

TEMPLATE = ("You are a friendly voice assistant for {place}. Greet callers warmly, answer questions about opening "
            "hours, prices and services, and help them book what they need. Keep every answer short: one or two "
            "sentences, spoken naturally. If a caller asks about something you are unsure of, say so plainly and "
            "offer to take a message for the staff. Never invent prices or dates. Confirm each booking by repeating "
            "the details, the day and the caller's name. Be patient with callers who are unsure, speak clearly, "
            "avoid jargon, and thank them before the call ends. Round {round}, caller {caller}, desk {place}.")


def prompt(chars: int, index: int) -> str:
    """An unseen prompt of exactly ``chars`` characters (each ``index`` another)."""
    text = TEMPLATE.format(place=PLACES[index % len(PLACES)], round=index, caller=7 * index + 3)
    while len(text) < chars:
        text += " Speak calmly."
    return text[:chars].rstrip() + "." if len(text) > chars else text


def frame_ms(model: nv.VoiceChatModel, frames: int = 60, warmup: int = 10) -> float:
    """A lone session's median frame time (ms), sampling, seed 0, one frame per push."""
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="you are a helpful assistant"))
    wave = test_signal((frames + warmup) * 0.08)
    times = []
    for i in range(frames + warmup):
        start = time.perf_counter()
        session.push_audio(wave[i * FRAME:(i + 1) * FRAME], 16000)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1000


def open_seconds(model: nv.VoiceChatModel, text: str) -> float:
    start = time.perf_counter()
    model.create_streaming_session(nv.StreamingOptions(system_prompt=text, seed=0))
    return time.perf_counter() - start


def unseen_prompt_times(model: nv.VoiceChatModel, chars: int, rounds: int) -> dict[str, Any]:
    """Seconds to open a session with an unseen prompt, per case and round, and the track's bytes."""
    tracks = model.speech_tracks()
    budget = tracks.max_bytes
    times: dict[str, list[float]] = {"sequential": [], "cold track": [], "warm track": [], "cached prompt": []}
    index = 0

    def unseen() -> str:
        nonlocal index
        index += 1
        return prompt(chars, index)

    for _ in range(rounds):
        tracks.max_bytes = 0
        times["sequential"].append(open_seconds(model, unseen()))
        tracks.max_bytes = budget
        model.forget_speech_tracks()
        times["cold track"].append(open_seconds(model, unseen()))
        times["warm track"].append(open_seconds(model, unseen()))
        engine = model.create_engine(max_sessions=2)
        engine.prompt_cache = PromptCache()
        text = unseen()
        engine.open(nv.StreamingOptions(system_prompt=text, seed=0)).cancel()
        start = time.perf_counter()
        engine.open(nv.StreamingOptions(system_prompt=text, seed=0))
        times["cached prompt"].append(time.perf_counter() - start)
        assert engine.prompt_cache.hits == 1
    steps = max(tracks.steps_held(0, False) or 0, 1)
    tokens = len(model.tokenizer.encode(prompt(chars, 1), add_special_tokens=False)) + 2
    return {"seconds": times, "prompt_tokens": tokens, "track_steps": steps,
            "track_bytes": tracks.nbytes, "track_bytes_per_step": tracks.nbytes / steps}


def language_seconds(model: nv.VoiceChatModel, ids: list[int], chunk: int, rounds: int) -> float:
    """Median seconds of the LLM half of a prefill of ``ids`` in pieces of ``chunk`` positions (0: whole)."""
    stt, cfg = model.stt_model, model.config
    with torch.inference_mode():
        user = stt.embed_tokens(torch.tensor([ids], device=model.device))
        pad = torch.full((1, len(ids)), cfg.pad_token_id, dtype=torch.long, device=model.device)
        fused = fused_input(stt.embed_tokens, pad, user, pad, cfg.function_channel_weight)
        size = chunk or len(ids)
        times = []
        for _ in range(rounds):
            cache = stt.llm.new_cache()
            synchronize(model.device)
            start = time.perf_counter()
            for first in range(0, len(ids), size):
                stt.llm(fused[:, first:first + size], cache)
            synchronize(model.device)  # a GPU runs the calls queued
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def track_bytes(tts_config: Any, positions: int, warmup: int = 37, limit: int = 131072 + 37,
                extra_per_step: int = 0) -> dict[str, int]:
    """A prefill track's bytes after ``positions`` prompt steps: keys and values of both guidance rows in
    float32, for the positions held (``at_rest``: the track compacted) and at the capacities the
    sequential growth gives (``extending``: global layers in whole blocks, sliding ones up to their
    window), plus ``extra_per_step`` (codes, generator state) per step."""
    c = tts_config
    layers = c.num_hidden_layers
    sliding = sum(1 for i in range(layers) if (i + 1) % c.sliding_window_pattern != 0)
    slot = 2 * 2 * c.num_key_value_heads * c.head_dim * 4  # keys + values, two rows, float32
    capacity = {True: 0, False: 0}
    for end in [warmup] + list(range(warmup + 1, warmup + positions + 1)):
        for is_global, lim in ((True, limit), (False, c.sliding_window)):
            needed = end if is_global else min(end, lim)
            if needed > capacity[is_global]:
                capacity[is_global] = grown_capacity(capacity[is_global], needed, lim)
    end = warmup + positions
    extra = extra_per_step * positions
    at_rest = slot * ((layers - sliding) * end + sliding * min(end, c.sliding_window))
    extending = slot * ((layers - sliding) * capacity[True] + sliding * capacity[False])
    return {"per_position": slot * layers, "capacity_global": capacity[True], "at_rest": at_rest + extra,
            "extending": extending + extra}


# --------------------------------------------------------------------------------------
# The full size, measured on pieces


def full_pieces(chunks: list[int], positions: int, dtype: torch.dtype | None) -> dict[str, Any]:
    """The 11B widths with one LLM layer of each kind (Mamba, attention, MLP; 4-bit as the real card, the
    rest bf16): each kind's seconds for a ``positions``-token prefill per piece size, a TTS prefill step,
    the speaker warmup, and a prefill track's copy of its start (256 slots per layer)."""
    import dataclasses

    from nvchat_torch.runtime.timeline import Timeline
    from nvchat_torch.tiny import random_model, random_packed_model

    config = nv.VoiceChatConfig.full_size()
    config = dataclasses.replace(config, text_config=dataclasses.replace(
        config.text_config, hybrid_override_pattern="M*-", num_hidden_layers=3))
    tokenizer = random_model("tiny").tokenizer  # ids below 300 are enough for timing
    start = time.perf_counter()
    model = random_packed_model(config, 4, 64, 0, tokenizer.get_vocab(), "cpu", dtype)
    model.set_tokenizer(tokenizer)
    model.prepare()
    built = time.perf_counter() - start
    layers = list(model.stt_model.llm.layers)
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    spent: dict[str, float] = {}
    marks: dict[int, float] = {}

    def before(module: torch.nn.Module, args: Any) -> None:
        marks[id(module)] = time.perf_counter()

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        kind = kinds[config.text_config.hybrid_override_pattern[layers.index(module)]]
        spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - marks[id(module)]

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
    ids = [config.bos_token_id] + [21 + (7 * i) % 270 for i in range(positions - 2)] + [config.eos_token_id]
    language: dict[int, dict[str, float]] = {}
    for chunk in chunks:
        spent.clear()
        total = language_seconds(model, ids, chunk, 1)
        language[chunk] = {**spent, "total": total}
    for h in hooks:
        h.remove()
    out: dict[str, Any] = {"build_s": built, "positions": positions, "language": language}
    with torch.inference_mode():
        start = time.perf_counter()
        model.tts_model.start(model.tts_prompt())
        out["warmup_s"] = time.perf_counter() - start
        timeline = Timeline(model, 0, False, True)  # makes the track (its warmup)
        steps = []
        for _ in range(4):  # position 0 runs no TTS
            start = time.perf_counter()
            timeline.speech(timeline.pad.view(1))
            steps.append(time.perf_counter() - start)
        out["tts_step_s"] = statistics.median(steps[1:])
        tracks = model.speech_tracks()
        start = time.perf_counter()
        cache, _ = tracks.start(0, False)
        out["track_copy_s"] = time.perf_counter() - start
        out["track_copy_bytes"] = cache.nbytes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chars", type=int, default=600, help="characters of each unseen prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunks", default="32,64,128,256,0", help="LLM piece sizes to time (0: the whole prompt)")
    p.add_argument("--full-pieces", action="store_true", help="the full-size parts instead (builds 11B widths)")
    p.add_argument("--positions", type=int, default=600, help="with --full-pieces: prompt tokens")
    p.add_argument("--dtype", default=None, choices=("bfloat16",), help="with --full-pieces: the fast mode")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if args.full_pieces:
        pieces = full_pieces(chunks, args.positions, getattr(torch, args.dtype) if args.dtype else None)
        print(f"machine: {machine()}, {args.threads} thread(s); full widths, 3 LLM layers, 4-bit, "
              f"{args.dtype or 'faithful'}; built in {pieces['build_s']:.0f} s")
        print(f"LLM prefill of {args.positions} tokens, seconds per layer of each kind:")
        print("| piece | mamba | attention | mlp |\n|---|---|---|---|")
        for c, row in pieces["language"].items():
            print(f"| {c or 'whole'} | {row['mamba']:.2f} | {row['attention']:.2f} | {row['mlp']:.2f} |")
        print(f"TTS prefill step: {pieces['tts_step_s']:.3f} s; speaker warmup {pieces['warmup_s']:.3f} s; track "
              f"start copy {pieces['track_copy_s'] * 1000:.0f} ms for {pieces['track_copy_bytes'] / 2**20:.0f} MiB")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "threads": args.threads, **pieces},
                                                  indent=1) + "\n")
        return 0
    model = nv.load_model(generated_checkpoint("deep", 4), device="cpu")
    frame = frame_ms(model)
    out = unseen_prompt_times(model, args.chars, args.rounds)
    ids = [model.config.bos_token_id, *model.tokenizer.encode(prompt(args.chars, 0), add_special_tokens=False),
           model.config.eos_token_id]
    language = {c: language_seconds(model, ids, c, args.rounds + 2) for c in chunks}
    full = nv.VoiceChatConfig.full_size().tts_config
    extra = 8 * full.num_quantizers + torch.Generator().get_state().nbytes  # codes + a CPU generator's state
    memory = {"deep": track_bytes(model.config.tts_config, out["track_steps"], extra_per_step=extra),
              **{f"full {n}": track_bytes(full, n, extra_per_step=extra) for n in (600, 1000, 2000)}}
    print(f"machine: {machine()}, {args.threads} thread(s); deep preset, 4-bit, sampling, seed 0")
    print(f"frame time: {frame:.1f} ms (a lone session's median frame)")
    print(f"unseen prompt: {args.chars} characters, {out['prompt_tokens']} tokens; median of {args.rounds} rounds")
    print("| case | seconds | frames |\n|---|---|---|")
    for case, times in out["seconds"].items():
        s = statistics.median(times)
        print(f"| {case} | {s:.3f} | {s * 1000 / frame:.1f} |")
    print(f"\nLLM half alone ({len(ids)} positions), median of {args.rounds + 2}:")
    print("| piece | seconds | ms per position |\n|---|---|---|")
    for c, s in language.items():
        print(f"| {c or 'whole'} | {s:.3f} | {s * 1000 / len(ids):.3f} |")
    deep = memory["deep"]
    print(f"\ntrack (deep): {out['track_steps']} steps, {out['track_bytes'] / 2**20:.2f} MiB held at rest "
          f"(computed: {deep['at_rest'] / 2**20:.2f} MiB = keys/values {deep['per_position'] / 1024:.1f} KiB "
          f"per position + codes and generator state {extra / 1024:.1f} KiB per step)")
    for name, m in memory.items():
        if name.startswith("full"):
            print(f"{name} positions: {m['per_position'] / 1024:.0f} KiB per position; {m['at_rest'] / 2**20:.0f} MiB "
                  f"at rest, {m['extending'] / 2**20:.0f} MiB while extending (global capacity "
                  f"{m['capacity_global']} slots)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "threads": args.threads, "frame_ms": frame,
                                               **out, "language": language, "memory": memory}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
