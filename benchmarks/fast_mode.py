"""How far the opt-in fast mode (bf16 activations) strays from the MLX reference, and where.

    python -m benchmarks.fast_mode --seeds 10 --frames 100

For each seed it writes a tiny checkpoint in the real 4-bit layout (LLM and vocabulary 4-bit with
float32 scales, the rest bf16) with MLX, streams ``--frames`` 80 ms frames of a test signal through
the reference and through ``load_model(dtype=torch.bfloat16)`` in deterministic mode, and reports
the first frame where any discrete output (text id, function id, transcript, the 31 codes) differs,
which one it was, and, where a text or function id flipped, the reference's logit margin (top-1
minus top-2) there; also the largest text-logit error before the divergence. The faithful
default is run too, as the control: it must agree on every frame. Needs the ``parity`` extra and a
checkout (it uses ``tests/mlx_oracle.py`` to write the checkpoints).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nvchat_torch.parity import Trace, run_ours, run_reference  # noqa: E402


def first_divergence(ref: Trace, ours: Trace) -> tuple[int | None, str]:
    n = min(len(ref.codes), len(ours.codes))
    for i in range(n):
        for name, same in (("text", ref.text_ids[i] == ours.text_ids[i]),
                           ("function", ref.function_ids[i] == ours.function_ids[i]),
                           ("transcript", ref.transcript[i] == ours.transcript[i]),
                           ("codes", np.array_equal(ref.codes[i], ours.codes[i]))):
            if not same:
                return i, name
    return None, ""


def margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    from mlx_oracle import TinySpec, build_tiny_checkpoint, synth_audio

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            path = build_tiny_checkpoint(Path(tmp) / f"seed{seed}", TinySpec(
                seed=seed, bits=4, dtype="bfloat16", scales_dtype="float32"))
            wave = synth_audio(args.frames * 0.08, seed=seed)
            ref = run_reference(str(path), wave, None, seed)
            faithful = run_ours(str(path), wave, None, seed, "cpu", None)
            fast = run_ours(str(path), wave, None, seed, "cpu", "bfloat16")
            control, _ = first_divergence(ref, faithful)
            frame, channel = first_divergence(ref, fast)
            logit_err = max(float(np.abs(a - b).max()) for a, b in
                            zip(ref.text_logits[:frame or None], fast.text_logits[:frame or None]))
            row = {"seed": seed, "frames": len(ref.codes), "faithful_first_divergence": control,
                   "fast_first_divergence": frame, "channel": channel,
                   # the reference's text-logit margin, where a text or function id flipped
                   "margin_there": margin(ref.text_logits[frame]) if channel in ("text", "function") else None,
                   "max_text_logit_error_before": logit_err}
            rows.append(row)
            print(json.dumps(row), flush=True)
    frames = [r["fast_first_divergence"] for r in rows if r["fast_first_divergence"] is not None]
    print(f"\nfaithful: {sum(r['faithful_first_divergence'] is None for r in rows)}/{len(rows)} seeds agree on "
          f"every frame")
    print(f"fast: {len(rows) - len(frames)}/{len(rows)} seeds agree on every frame; first divergent frame "
          f"median {np.median(frames) if frames else '-'}, min {min(frames, default='-')}, "
          f"max {max(frames, default='-')}; channels: "
          + ", ".join(sorted({r['channel'] for r in rows if r['channel']})))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
