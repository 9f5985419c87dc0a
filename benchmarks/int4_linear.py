"""One decode-step matmul of the 11B model's shapes: packed 4-bit kernels against dequantized weights.

    python -m benchmarks.int4_linear [--device cpu|cuda|mps] [--threads N]

Weights are random, packed in MLX's affine 4-bit format (group 64) exactly as the checkpoints store
them; each path computes the same ``x @ W.T`` for one token (M = 1).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils import benchmark

from nvchat_torch.models.config import QuantSpec
from nvchat_torch.models.quant import Int4PackedLinear, QuantizedLinear, int4pack_available, quantize_affine

SHAPES = {  # (out, in) of the per-token LLM matmuls of NemotronLabs VoiceChat 11B
    "mamba in_proj": (22656, 4480),
    "mamba out_proj": (4480, 10240),
    "mlp up_proj": (15680, 4480),
    "mlp down_proj": (4480, 15680),
}


def packed_linear(out_f: int, in_f: int, device) -> QuantizedLinear:
    w = torch.randn(out_f, in_f) / in_f ** 0.5
    wq, scales, biases = quantize_affine(w.bfloat16(), 4, 64)
    q = QuantizedLinear(in_f, out_f, False, QuantSpec(4, 64), torch.bfloat16)
    q.load_state_dict({"weight": wq, "scales": scales, "biases": biases})
    return q.to(device)


def time_ms(fn, x) -> float:
    t = benchmark.Timer("fn(x)", globals={"fn": fn, "x": x}).blocked_autorange(min_run_time=0.5)
    return t.median * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int4_linear", description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, {torch.get_num_threads()} threads, int4pack kernel: {int4pack_available(device)}")
    header = ["layer", "int4 bf16 x", "int4 fp32 x", "dequant/call fp32", "dense bf16", "dense fp32"]
    print(" | ".join(f"{h:>17}" for h in header))
    with torch.inference_mode():
        for name, (out_f, in_f) in SHAPES.items():
            q = packed_linear(out_f, in_f, device)
            dense32 = q.dequantized(torch.float32)
            dense16 = dense32.bfloat16()
            x32 = torch.randn(1, in_f, device=device)
            x16 = x32.bfloat16()
            row = [name]
            for dtype, x in ((torch.bfloat16, x16), (torch.float32, x32)):
                row.append(f"{time_ms(Int4PackedLinear(q, dtype), x):.2f}" if int4pack_available(device) else "n/a")
            row.append(f"{time_ms(q, x32):.2f}")
            row.append(f"{time_ms(lambda v: torch.nn.functional.linear(v, dense16), x16):.2f}")
            row.append(f"{time_ms(lambda v: torch.nn.functional.linear(v, dense32), x32):.2f}")
            print(" | ".join(f"{c:>17}" for c in row))
    print("(median ms per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
