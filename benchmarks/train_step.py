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

CONFIGS = ("full-f32", "lora-f32", "qlora-4bit", "full-fsdp")  # full-fsdp: run under torchrun (--fsdp N)


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def run_one(name: str, device: torch.device, seconds: float, steps: int) -> dict:
    from nvchat_torch.tiny import random_model
    from nvchat_torch.training import adapters
    from nvchat_torch.training.finetune import set_trainable, train_step
    from nvchat_torch.training.labels import Example

    ranks = None
    if name == "full-fsdp":  # one rank of torchrun; the process group even for one process, which FSDP needs
        import torch.distributed as dist

        from nvchat_torch.training.distributed import Ranks

        dist.init_process_group("gloo")
        ranks = Ranks(dist.get_rank(), dist.get_world_size())
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
    if name in ("full-f32", "full-fsdp"):
        set_trainable(model, ["stt", "tts"])
        if ranks is not None:
            ranks.shard(model)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        adapters.add_lora(model, r=8, alpha=16)
        adapters.freeze_packed(model)
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
        if ranks is not None:
            ranks.sum_gradients(params)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if ranks is not None:
        ranks.close()
    return {"config": name, "frames": frames, "trainable_M": sum(p.numel() for p in params) / 1e6,
            "params_M": sum(p.numel() for p in model.parameters()) / 1e6, "step_s": sorted(times)[len(times) // 2],
            "first_step_s": times[0], "peak_MiB": peak_mb(device), "model_MiB": before}


def llm_activations(positions: int) -> dict[str, float]:
    """Bytes per position that autograd keeps for the backward of one full-size Nemotron-H block of each kind
    (float32, input gradients only, as LoRA needs; the weights themselves not counted), measured with
    saved-tensor hooks over ``positions`` positions: the full-size model's share, without building it."""
    from nvchat_torch.loading.nvidia_release import FULL_SIZE_TEXT_CONFIG
    from nvchat_torch.models.nemotron_h import NemotronHModel
    from nvchat_torch.models.network_config import TextConfig

    per: dict[str, float] = {}
    for block in "M*-":
        values = {k: v for k, v in FULL_SIZE_TEXT_CONFIG.items() if k != "model_type"}
        values.update(hybrid_override_pattern=block, num_hidden_layers=1, vocab_size=320)
        llm = NemotronHModel(TextConfig.from_dict(values)).requires_grad_(False)
        held = {t.untyped_storage().data_ptr() for t in [*llm.parameters(), *llm.buffers()]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in held:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, positions, values["hidden_size"], requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            llm(x)
        per[block] = sum(saved.values()) / positions
    pattern = FULL_SIZE_TEXT_CONFIG["hybrid_override_pattern"]
    per["all 56 blocks"] = sum(per[c] * pattern.count(c) for c in "M*-")
    return per


def fsdp_memory(args) -> int:
    """Full fine-tuning of the deep preset sharded over 1 .. N processes: each process's peak memory."""
    import os

    print(f"deep preset, full fine-tuning with FSDP2 over gloo, {args.seconds:g} s conversation, 1 thread a process")
    print(f"{'processes':>9} | {'step s':>7} | {'peak MiB per process':>20}")
    for n in range(1, args.fsdp + 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), "-m",
               "benchmarks.train_step", "--one", "full-fsdp", "--seconds", str(args.seconds), "--steps",
               str(args.steps), "--threads", "1"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        peaks = ", ".join(f"{r['peak_MiB']:.0f}" for r in rows)
        print(f"{n:>9} | {max(r['step_s'] for r in rows):7.2f} | {peaks:>20}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=10.0, help="conversation length")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--one", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--activations", type=int, default=None, metavar="POSITIONS",
                   help="instead: the full-size LLM's activation bytes per position (needs ~2 GB)")
    p.add_argument("--fsdp", type=int, default=None, metavar="N",
                   help="instead: full fine-tuning sharded over 1 to N CPU processes (torchrun, FSDP2), each "
                        "process's peak memory")
    args = p.parse_args(argv)
    if args.fsdp:
        return fsdp_memory(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.activations:
        for name, size in llm_activations(args.activations).items():
            print(f"{name:>13}: {size / 1e3:8.1f} kB per position ({args.activations} positions)")
        return 0
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
