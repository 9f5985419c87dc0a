"""Stream a WAV through NemotronLabs VoiceChat and write the spoken answer.

    python -m nvchat_torch.stream --audio examples/question.wav --output-audio answer.wav --profile
    python -m nvchat_torch.stream --model weights/NemotronLabs-VoiceChat-11B-4bit --audio IN.wav --output-audio OUT.wav

Without ``--model`` it runs a tiny embedded model with random weights (no download): its text,
transcript and speech are noise, but every stage of the real pipeline runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

DTYPES = ("float32", "bfloat16")  # default: the faithful mode (weights as stored); float16 is refused


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--audio", required=True, help="input audio file (any rate/channels; resampled to 16 kHz mono)")
    p.add_argument("--output-audio", required=True, help="where to write the 22,050 Hz answer (WAV)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hub repo id (default: the embedded tiny random model)")
    p.add_argument("-p", "--prompt", default=None, help="system prompt")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="offline", action="store_false", help="80 ms streaming session (default)")
    mode.add_argument("--offline", dest="offline", action="store_true", help="one offline pass over the whole input")
    p.set_defaults(offline=False)
    p.add_argument("--profile", action="store_true", help="print per-stage timings and the real-time factor")
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: mps > cuda > cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="float32 (every weight upcast) or bfloat16 (the fast mode); default: the faithful mode, "
                        "weights as stored (docs/parity.md)")
    p.add_argument("--weights", default="auto", choices=("auto", "packed", "dequantized"),
                   help="keep quantized weights packed or expand them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true", help="most likely TTS component, no sampling noise")
    p.add_argument("--max-streaming-seconds", type=float, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    add_compile_argument(p)
    return p


def add_compile_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", nargs="?", const="inductor", default=False, choices=("inductor", "aot_eager", "eager"),
                   help="run the frame step under torch.compile, one graph per frame (default backend: inductor; "
                        "its first frames compile: see docs/performance.md)")


def load_from_args(args):
    import torch

    import nvchat_torch as nv

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.model is None:
        print("No --model given: running the embedded tiny model with random weights. Its text, transcript\n"
              "and speech are noise; it only exercises the pipeline. For real answers, download a checkpoint:\n"
              "  hf download mlx-community/NemotronLabs-VoiceChat-11B-4bit "
              "--local-dir weights/NemotronLabs-VoiceChat-11B-4bit\n"
              "and pass --model weights/NemotronLabs-VoiceChat-11B-4bit", file=sys.stderr)
        return nv.load_tiny_model(device=args.device, dtype=dtype, compile=getattr(args, "compile", False))
    return nv.load_model(args.model, device=args.device, dtype=dtype, weights=args.weights,
                         compile=getattr(args, "compile", False))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import nvchat_torch as nv
    from nvchat_torch.audio_io import prepare_input, write_wav

    try:
        samples, notes = prepare_input(args.audio, 16000)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"input: {note}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        model = load_from_args(args)
    except (nv.CheckpointError, nv.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    print(f"model: {model.describe()} (loaded in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(f"input: {len(samples) / cfg.input_sample_rate:.2f} s, "
          f"{len(samples) // cfg.input_frame_samples} full 80 ms frames", file=sys.stderr)

    if args.offline:
        t1 = time.perf_counter()
        result = model.generate(samples, system_prompt=args.prompt, seed=args.seed, deterministic=args.deterministic)
        elapsed = time.perf_counter() - t1
        audio, text, function_text, transcript = result.audio, result.text, result.function_text, result.user_transcript
        frames = len(result.text_ids)
        print(f"offline: {frames} frames in {elapsed:.2f} s", file=sys.stderr)
    else:
        session = model.create_streaming_session(nv.StreamingOptions(
            system_prompt=args.prompt, seed=args.seed, max_streaming_seconds=args.max_streaming_seconds,
            profile=args.profile, deterministic=args.deterministic))
        step = cfg.input_frame_samples
        total = max(1, -(-len(samples) // step))
        events = []
        try:
            for i, start in enumerate(range(0, len(samples), step)):
                new = session.push_audio(samples[start:start + step], cfg.input_sample_rate)
                if start + step >= len(samples):
                    new += session.flush(pad_partial=True)
                events += new
                if not args.quiet:
                    _print_events(new, i + 1, total)
        except nv.ContextLimit as e:
            print(f"\nstopped: {e}", file=sys.stderr)
            events += e.events + session.flush(pad_partial=False)  # the frames of that push that ran
        chunks = [e.samples for e in events if e.kind == "audio"]
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        text, function_text, transcript = session.text, session.function_text, session.user_transcript
        frames = session.frame_index
        if not args.quiet:
            print(file=sys.stderr)
    write_wav(args.output_audio, audio, cfg.output_sample_rate)
    print(f"assistant: {text!r}")
    if function_text:
        print(f"function:  {function_text!r}")
    print(f"user (transcript): {transcript!r}")
    print(f"wrote {args.output_audio}: {len(audio)} samples = {frames} frames x {cfg.output_frame_samples} "
          f"at {cfg.output_sample_rate} Hz")
    if args.profile and not args.offline:
        print(session.profile.table(drop_first=min(5, max(0, frames - 1))))
    return 0


def _print_events(events, done: int, total: int) -> None:
    for e in events:
        if e.kind == "assistant_text_delta":
            print(f"\n[{e.frame_index:5d}] assistant: {e.delta!r}", end="", file=sys.stderr)
        elif e.kind == "function_delta":
            print(f"\n[{e.frame_index:5d}] function:  {e.delta!r}", end="", file=sys.stderr)
        elif e.kind == "user_transcript_delta":
            print(f"\n[{e.frame_index:5d}] user:      {e.delta!r}", end="", file=sys.stderr)
    print(f"\r{'':60}\rframes {done}/{total}", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
