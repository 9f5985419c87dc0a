"""One fine-tuning step (both objectives, forward + backward + AdamW) on the deep preset: time and peak memory.

    python -m benchmarks.train_step [--device cpu|cuda|mps] [--seconds 10] [--steps 3] [--threads N]

The deep preset has the real depths (the 56-block Nemotron-H pattern, 28 Gemma layers, the Conformer's 24
layers) at tiny widths, so its time shows the per-layer overheads and its memory the activations' share.
Each configuration runs in its own process (the peak is the process's): full fine-tuning in float32
(NVIDIA's freezing), LoRA r=8 on the LLM and TTS projections of the float32 model, and QLoRA (the same
adapters over the mlx-community 4-bit layout, whose packed base stays packed). Results: docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

CONFIGS = ("full-f32", "lora-f32", "qlora-4bit")


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def run_one(name: str, device: torch.device, seconds: float, steps: int) -> dict:
    from nvchat_torch import adapters
    from nvchat_torch.finetune import set_trainable, train_step
    from nvchat_torch.tiny import random_model
    from nvchat_torch.training_labels import Example

    model = random_model("deep", seed=0, bits=4 if name == "qlora-4bit" else None).to(device)
    model.init_constants(device)
    before = peak_mb(device)
    frames = int(seconds / 0.08)
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    example = Example((torch.randn(frames * 1280, generator=g) * 0.1).numpy(),
                      torch.randint(0, 300, (frames,), generator=g).tolist(), [cfg.pad_token_id] * frames,
                      [True] * frames, "", None, torch.randint(0, 300, (frames,), generator=g).tolist(),
                      torch.randint(0, cfg.tts_config.codebook_size, (frames, cfg.tts_config.num_quantizers),
                                    generator=g).to(device))
    if name == "full-f32":
        set_trainable(model, ["stt", "tts"])
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        adapters.add_lora(model, r=8, alpha=16)
        params = adapters.lora_parameters(model)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.98))
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses = train_step(model, example, ["stt", "tts"], generator)
        optimizer.zero_grad(set_to_none=True)
        losses["loss"].backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"config": name, "frames": frames, "trainable_M": sum(p.numel() for p in params) / 1e6,
            "params_M": sum(p.numel() for p in model.parameters()) / 1e6, "step_s": sorted(times)[len(times) // 2],
            "first_step_s": times[0], "peak_MiB": peak_mb(device), "model_MiB": before}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=10.0, help="conversation length")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--one", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(args.one, torch.device(args.device), args.seconds, args.steps)))
        return 0
    print(f"deep preset, {args.seconds:g} s conversation, device {args.device}, {torch.get_num_threads()} threads")
    print(f"{'config':>11} | {'params M':>8} | {'trained M':>9} | {'step s':>7} | {'1st step s':>10} | "
          f"{'model MiB':>9} | {'peak MiB':>8}")
    for name in CONFIGS:
        cmd = [sys.executable, "-m", "benchmarks.train_step", "--one", name, "--device", args.device,
               "--seconds", str(args.seconds), "--steps", str(args.steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        print(f"{name:>11} | {r['params_M']:8.1f} | {r['trainable_M']:9.2f} | {r['step_s']:7.2f} | "
              f"{r['first_step_s']:10.2f} | {r['model_MiB']:9.0f} | {r['peak_MiB']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
