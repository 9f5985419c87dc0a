"""Check the port against the MLX reference on your own checkpoint and audio.

    python -m nvchat_torch.parity --model weights/NemotronLabs-VoiceChat-11B-4bit --audio examples/question.wav

Runs mlx-vlm's streaming session and ours on the same input, in deterministic mode, and prints
where they agree and the first divergent frame. Needs the ``parity`` extra
(``pip install nvchat_torch[parity]``). What it reports: docs/parity.md, "Checking your own checkpoint".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np

FRAME = 1280

# The largest head-logit error against the reference measured in each mode (docs/parity.md). A
# text or function id that flips where the reference's margin is below it is a near-tie; above, a bug.
MODES = {
    "faithful": ("weights as stored; float32 activations, bf16 where the reference computes in bf16", 1e-4),
    "float32": ("every weight upcast to float32, float32 throughout (faithful for float32 checkpoints)", 1e-4),
    "bfloat16": ("fast mode: bf16 weights and activations (not bit-faithful)", 0.11),
}


@dataclass
class Trace:
    """What one side of the comparison produced, one entry per audio frame in each list."""

    text_ids: list[int] = field(default_factory=list)  # the text head's id
    function_ids: list[int] = field(default_factory=list)  # the function head's id
    transcript: list[str] = field(default_factory=list)  # the user transcript so far, cumulative
    codes: list[np.ndarray] = field(default_factory=list)  # the frame's audio codes
    audio: list[np.ndarray] = field(default_factory=list)  # the frame's samples, float32
    text_logits: list[np.ndarray] = field(default_factory=list)  # the text head's logits
    function_logits: list[np.ndarray] = field(default_factory=list)  # the function head's logits


def run_reference(model_path: str, wave: np.ndarray, prompt: str | None, seed: int) -> Trace:
    import mlx.core as mx
    from mlx_vlm.utils import load

    model, processor = load(model_path)
    tcfg = model.tts_model.tts_model.config
    tcfg.noise_scale, tcfg.top_p = 0.0, 1e-9  # deterministic: argmax component, no noise
    # The reference's cached perception skips the encoder's xscaling (its offline and uncached paths
    # apply it, as NeMo does, and so do both of ours): with xscaling on, compare with its uncached path.
    cached = not model.config.audio_config.encoder.xscaling
    if not cached:
        print("note: the encoder uses xscaling, which the reference's cached perception omits; "
              "comparing with its uncached perception path", file=sys.stderr)
    session = model.create_session(processor).create_streaming_session(
        system_prompt=prompt, seed=seed, use_perception_cache=cached)
    trace = Trace()
    original = session._language_step

    def language(inputs):  # record the logits of audio frames (the prompt prefill ran in __init__)
        out = original(inputs)
        trace.text_logits.append(np.array(out.text_logits[0, -1].astype(mx.float32)))
        trace.function_logits.append(np.array(out.function_logits[0, -1].astype(mx.float32)))
        return out

    session._language_step = language
    for start in range(0, len(wave), FRAME):
        events = session.push_audio(wave[start:start + FRAME])
        if start + FRAME >= len(wave):
            events += session.flush()
        _collect(trace, events)
    prompt_steps = len(session._text_tokens) - session.frame_index
    trace.text_ids = [int(i) for i in session._text_tokens[prompt_steps:]]
    trace.function_ids = [int(i) for i in session._function_tokens[prompt_steps:]]
    return trace


def run_ours(model_path: str, wave: np.ndarray, prompt: str | None, seed: int, device: str | None,
             dtype: str | None) -> Trace:
    import torch

    import nvchat_torch as nv
    from nvchat_torch.models.language_heads import language_heads

    model = nv.load_model(model_path, device=device,
                          dtype=None if dtype in (None, "faithful") else getattr(torch, dtype))
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt=prompt, seed=seed,
                                                                 deterministic=True))
    trace = Trace()
    frames = session.frame_step  # the session's one-row frame step
    original = frames._language_step

    def language_step(*args):  # record both heads' logits (extra host reads: a diagnostic tool)
        hidden = original(*args)
        heads = language_heads(hidden, *frames._heads)
        trace.text_logits.append(heads.text_logits[0, -1].float().cpu().numpy())
        trace.function_logits.append(heads.function_logits[0, -1].float().cpu().numpy())
        return hidden

    frames._language_step = language_step
    for start in range(0, len(wave), FRAME):
        events = session.push_audio(wave[start:start + FRAME], 16000)
        if start + FRAME >= len(wave):
            events += session.flush()
        _collect(trace, events)
    trace.text_ids = [int(np.argmax(l)) for l in trace.text_logits]
    trace.function_ids = [int(np.argmax(l)) for l in trace.function_logits]
    return trace


def _collect(trace: Trace, events) -> None:
    text = trace.transcript[-1] if trace.transcript else ""
    for e in events:
        if e.kind == "user_transcript_delta":
            text = e.text
        elif e.kind == "audio":
            trace.codes.append(np.asarray(e.audio_codes))
            trace.audio.append(np.asarray(e.samples, dtype=np.float32))
            trace.transcript.append(text)


def _top5(logits: np.ndarray) -> str:
    order = np.argsort(-logits, kind="stable")[:5]
    return ", ".join(f"{int(i)}:{logits[i]:.4f}" for i in order)


def compare(ref: Trace, ours: Trace, mode: str = "faithful") -> tuple[bool, str]:
    n = min(len(ref.codes), len(ours.codes))
    tolerance = MODES[mode][1]
    lines = [f"frames: reference {len(ref.codes)}, ours {len(ours.codes)}"]
    rows = {
        "text ids": [ref.text_ids[i] == ours.text_ids[i] for i in range(n)],
        "function ids": [ref.function_ids[i] == ours.function_ids[i] for i in range(n)],
        "transcript": [ref.transcript[i] == ours.transcript[i] for i in range(n)],
        "codes (31/frame)": [bool(np.array_equal(ref.codes[i], ours.codes[i])) for i in range(n)],
    }
    first = min((row.index(False) for row in rows.values() if False in row), default=None)
    for name, row in rows.items():
        lines.append(f"{name:<17} {sum(row)}/{n} frames agree")
    if first is not None:
        lines.append(f"first divergent frame: {first}")
        for side, trace in (("reference", ref), ("ours", ours)):
            for head in ("text", "function"):
                logits = getattr(trace, f"{head}_logits")[first]
                top = np.sort(logits)[-2:]
                lines.append(f"  {side:<9} {head:<8} top-5 {_top5(logits)}  margin {top[1] - top[0]:.4g}")
        for head, same in (("text", ref.text_ids[first] == ours.text_ids[first]),
                           ("function", ref.function_ids[first] == ours.function_ids[first])):
            if not same:
                top = np.sort(getattr(ref, f"{head}_logits")[first])[-2:]
                gap = float(top[1] - top[0])
                verdict = ("within it: a near-tie this mode cannot resolve" if gap <= tolerance else
                           "beyond it: not rounding, a bug to report")
                lines.append(f"  the {head} id flipped at a reference margin of {gap:.3g}; the {mode} mode's "
                             f"measured logit error is {tolerance:g}, so this is {verdict}")
        if not np.array_equal(ref.codes[first], ours.codes[first]):
            diff = np.flatnonzero(ref.codes[first] != ours.codes[first])
            lines.append(f"  codes differ at quantizers {diff.tolist()}")
    a, b = np.concatenate(ref.audio[:n]), np.concatenate(ours.audio[:n])
    err = a - b
    snr = 10 * np.log10(np.sum(a * a) / max(np.sum(err * err), 1e-30))
    lines.append(f"audio: max |diff| {np.abs(err).max():.3g}, SNR {snr:.1f} dB over {n} frames")
    ok = first is None and len(ref.codes) == len(ours.codes)
    lines.append("PARITY OK" if ok else "PARITY MISMATCH")
    return ok, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (both sides load it)")
    p.add_argument("--audio", required=True, help="input audio (resampled to 16 kHz mono)")
    p.add_argument("-p", "--prompt", default=None, help="system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="our side's device (default cpu)")
    p.add_argument("--dtype", default="faithful", choices=("faithful", "float32", "bfloat16"),
                   help="our side's mode: faithful (the default of load_model: the reference's dtype flow), "
                        "float32 (every weight upcast) or the fast bfloat16 mode")
    args = p.parse_args(argv)
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        print("error: the MLX reference is not installed; pip install 'nvchat_torch[parity]'", file=sys.stderr)
        return 2
    from .audio_io import prepare_input

    wave, notes = prepare_input(args.audio, 16000)
    for note in notes:
        print(f"input: {note}", file=sys.stderr)
    from .loading.checkpoint import Checkpoint, resolve_checkpoint

    with Checkpoint(resolve_checkpoint(args.model)) as ckpt:
        print(f"checkpoint layout: {ckpt.layout()}")
    print(f"our mode: {args.dtype} ({MODES[args.dtype][0]})")
    ref = run_reference(args.model, wave, args.prompt, args.seed)
    ours = run_ours(args.model, wave, args.prompt, args.seed, args.device, args.dtype)
    ok, report = compare(ref, ours, args.dtype)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
