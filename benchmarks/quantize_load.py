"""Peak memory of quantizing NVIDIA's float32 release at load: ``load_model(release, quantize={"bits": 4})``.

    python -m benchmarks.quantize_load --threads 1             # quarter size: a 12 GB float32 release
    python -m benchmarks.quantize_load --scale 4 --llm-only    # full vocabulary, speech encoder and TTS
    python -m benchmarks.quantize_load --scale 1               # the full 44 GB release (needs the disk)
    python -m benchmarks.quantize_load --bits 8 --folder /big/disk/release

Phase 1 (once, cached in ``--folder``): a random float32 release in NVIDIA's layout (one
``model.safetensors``, NeMo's nested config.json, a tokenizer folder with the base LLM config.json),
written tensor by tensor from the model's shapes. ``--scale N`` divides the depths (LLM layers, the
Conformer's and the TTS backbone's) and the LLM vocabulary by N and keeps every width: each matrix
has its real row width, so the per-tensor working memory of the load is the full-size one, and only
the number of rows and layers shrinks. ``--llm-only`` divides only the LLM's depth, so every part
whose ``prepare()`` transforms scale with it (the TTS, the vocabulary heads) is full size.
``--scale 1`` is the 11B release itself.

Phase 2, in a fresh process: ``load_model(folder, device="cpu", tokenizer=..., quantize={"bits": B,
"group_size": 64}, weights="packed")`` with ``prepare()``, as a user loads it. A thread samples
``/proc/self/status`` every 5 ms: RssAnon is what the process owns (the model, temporaries), while
the release is read with positioned reads (never mapped), so its pages are the kernel's page cache.
The report gives the peak RssAnon of the read (``prepare=False``: reading, quantizing, converting)
and of the whole load with ``prepare()``, and the model's size after each. The read's overhead over
the model (the runtime, one chunk being quantized, one tensor being converted) does not grow with the
model; ``prepare()``'s transients (fusing the TTS projections and the vocabulary heads) grow with the
TTS depth and the vocabulary, which ``--llm-only`` keeps at full size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.full_memory import PeakSampler

FULL_RELEASE_BYTES = 44.4e9  # NVIDIA's model.safetensors


def scaled_config(scale: int, llm_only: bool = False) -> dict:
    """The 11B flat config with the depths and the LLM vocabulary divided by ``scale`` (``llm_only``: only
    the LLM's depth; the vocabulary, the speech encoder and the TTS keep their full size)."""
    from nvchat_torch.models.config import VoiceChatConfig

    flat = VoiceChatConfig.full_size().to_dict()
    if scale > 1:
        text, audio, tts = flat["text_config"], flat["audio_config"], flat["tts_config"]
        full = text["hybrid_override_pattern"]  # a contiguous run of its layers, with attention layers in it
        pattern = full[len(full) // 4: len(full) // 4 + len(full) // scale]
        text.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
        if llm_only:
            return flat
        text["vocab_size"] //= scale
        audio["encoder"]["n_layers"] //= scale
        tts["num_hidden_layers"] = max(tts["sliding_window_pattern"], tts["num_hidden_layers"] // scale)
    return flat


def full_model_bytes(bits: int) -> int:
    """The 11B model as this load returns it: ``full_size_bytes`` with float32 scales and biases (the cards')."""
    from nvchat_torch.model import build_model, full_size_bytes, mlx_community_specs
    from nvchat_torch.models.config import VoiceChatConfig

    model = build_model(VoiceChatConfig.full_size())
    specs = mlx_community_specs(model, bits)
    scale_elements = sum(2 * model.get_submodule(p).weight.numel() // s.group_size for p, s in specs.items())
    return full_size_bytes(bits) + 2 * scale_elements  # full_size_bytes counts them in bf16


def write_release(folder: Path, scale: int, seed: int, llm_only: bool = False) -> None:
    """A random float32 release of ``scaled_config(scale, llm_only)``, written one tensor at a time."""
    import torch

    from nvchat_torch.convert import write_safetensors
    from nvchat_torch.loading.nvidia_release import release_config
    from nvchat_torch.model import build_model
    from nvchat_torch.models.config import VoiceChatConfig
    from nvchat_torch.tiny import write_tokenizer

    flat = scaled_config(scale, llm_only)
    nested, base = release_config(flat)
    shapes = {k: (tuple(t.shape), t.is_floating_point())
              for k, t in build_model(VoiceChatConfig.from_dict(flat)).state_dict().items()}
    entries = [(k, shape, "F32" if is_float else "I64") for k, (shape, is_float) in sorted(shapes.items())]
    generator = torch.Generator().manual_seed(seed)

    def make(key: str) -> torch.Tensor:
        shape, is_float = shapes[key]
        if not is_float:
            return torch.zeros(shape, dtype=torch.int64)
        return torch.randn(shape, generator=generator) * 0.02

    folder.mkdir(parents=True, exist_ok=True)
    release, tokenizer = folder / "release", folder / "Nemotron-Nano-9B-v2"
    release.mkdir(exist_ok=True)
    write_safetensors(release / "model.safetensors", entries, make, {"format": "pt"})
    (release / "config.json").write_text(json.dumps(nested, indent=2) + "\n")
    write_tokenizer(tokenizer)
    (tokenizer / "config.json").write_text(json.dumps(base, indent=2) + "\n")
    (folder / "DONE").write_text(f"scale {scale}, seed {seed}\n")


def measure(folder: Path, bits: int, threads: int | None) -> dict:
    """Phase 2 (a fresh process): the load under the sampler."""
    import torch

    import nvchat_torch as nv
    from nvchat_torch.diagnostics import model_bytes

    if threads:
        torch.set_num_threads(threads)
    sampler = PeakSampler(period=0.005)
    sampler.start()
    sampler.mark("start (torch imported)")
    t0 = time.perf_counter()
    model = nv.load_model(folder / "release", device="cpu", tokenizer=folder / "Nemotron-Nano-9B-v2",
                          quantize={"bits": bits, "group_size": 64}, weights="packed", prepare=False)
    read_s, read_peak, read_mib = time.perf_counter() - t0, sampler.peak_anon, model_bytes(model) / 2**20
    sampler.mark("read and quantized")
    model = model.prepare()  # as load_model(prepare=True) ends
    load_s = time.perf_counter() - t0
    sampler.mark("prepared")
    sampler.running = False
    sampler.join()
    return {"weights_mib": model_bytes(model) / 2**20, "load_s": load_s, "peak_anon_mib": sampler.peak_anon,
            "read_s": read_s, "read_peak_anon_mib": read_peak, "read_weights_mib": read_mib,
            "peak_file_mib": sampler.peak_file, "marks": sampler.marks,
            "release_bytes": (folder / "release" / "model.safetensors").stat().st_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantize_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=4, help="divide the depths and the vocabulary by this (1: 11B)")
    p.add_argument("--llm-only", action="store_true",
                   help="scale only the LLM's depth: the vocabulary matrices, speech encoder and TTS at full size")
    p.add_argument("--bits", type=int, default=4, choices=[4, 8])
    p.add_argument("--folder", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # phase 2, in the child
    args = p.parse_args(argv)
    folder = args.folder or Path(tempfile.gettempdir()) / "nvchat_torch_bench" / f"release-scale{args.scale}{'-llm' if args.llm_only else ''}"
    if args.measure:
        print(json.dumps(measure(folder, args.bits, args.threads)))
        return 0
    written = time.perf_counter()
    if not (folder / "DONE").exists():  # phase 1, once
        write_release(folder, args.scale, args.seed, args.llm_only)
        print(f"wrote the random float32 release in {time.perf_counter() - written:.0f} s: {folder}")
    child = [sys.executable, "-m", "benchmarks.quantize_load", "--measure", "--bits", str(args.bits),
             "--folder", str(folder), *(["--threads", str(args.threads)] if args.threads else [])]
    done = subprocess.run(child, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    r = json.loads(done.stdout.strip().splitlines()[-1])
    start_anon = r["marks"][0][1]["RssAnon"]
    overhead = r["peak_anon_mib"] - r["weights_mib"]
    print(f"release: {r['release_bytes'] / 1e9:.2f} GB float32 (scale 1/{args.scale} of the 44.4 GB release's "
          f"{'LLM depth' if args.llm_only else 'depths and vocabulary'})")
    print(f"load_model(quantize={args.bits}-bit, weights='packed', prepare): {r['load_s']:.1f} s, "
          f"{r['release_bytes'] / 1e9 / r['load_s']:.2f} GB/s of float32 read")
    print(f"read and quantized (prepare=False): {r['read_s']:.1f} s, model {r['read_weights_mib'] / 1024:.2f} GiB, "
          f"peak RssAnon {r['read_peak_anon_mib'] / 1024:.2f} GiB")
    print(f"model as loaded: {r['weights_mib'] / 1024:.2f} GiB; peak RssAnon {r['peak_anon_mib'] / 1024:.2f} GiB "
          f"(at start {start_anon / 1024:.2f} GiB); overhead over the model {overhead / 1024:.2f} GiB; "
          f"peak RssFile {r['peak_file_mib'] / 1024:.2f} GiB")
    if args.scale > 1 and not args.llm_only:
        full_model = full_model_bytes(args.bits) / 2**30
        print(f"scaled to 11B: model {full_model:.2f} GiB + overhead {overhead / 1024:.2f} GiB = peak "
              f"~{full_model + overhead / 1024:.2f} GiB ({(full_model + overhead / 1024) * 2**30 / 1e9:.2f} GB); "
              f"time ~{r['load_s'] * FULL_RELEASE_BYTES / r['release_bytes'] / 60:.1f} min at the same rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
