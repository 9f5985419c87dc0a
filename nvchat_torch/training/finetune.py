"""Fine-tune NemotronLabs VoiceChat on conversations (docs/training.md).

    python -m nvchat_torch.finetune --data manifest.jsonl --out runs/first [--model weights/...-4bit]

Without ``--model`` it trains the tiny embedded model in seconds. Each step takes a conversation through
NVIDIA's two objectives, teacher-forced; by default LoRA adapters train (a packed base stays packed),
``--full`` trains the weights with NVIDIA's freezing. Writes ``DIR/adapter`` (peft's files) or, with
``--full`` or ``--merge``, ``DIR/model``, and ``DIR/loss_log.jsonl`` and ``DIR/train_config.json``."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from . import adapters
from .labels import Example, build_example, read_manifest
from .objectives import STTLossConfig, TTSLossConfig, stt_forward, stt_loss, tts_forward, tts_loss

__all__ = ["STT_TRAINS", "TTS_TRAINS", "ALWAYS_FROZEN", "set_trainable", "train_step", "FineTuneRecipe", "main"]

# What each objective trains in NVIDIA's recipe (s2s_duplex_stt.yaml freeze_params: the codec only;
# nemotron_voicechat_nano9b.yaml speech_generation.freeze_params: the codec and the TTS's own text embedding,
# which the release does not use). The RNNT came from a separate ASR model: never trained here.
STT_TRAINS = r"stt_model\.(perception\.(encoder|proj)|llm|embed_tokens|lm_head|function_head)\..+"
TTS_TRAINS = r"tts_model\.tts_model\.(?!rvq_embs|audio_prompt_projection_W).+"
ALWAYS_FROZEN = r"(tts_model\.audio_codec|stt_model\.rnnt_(decoder|joint))\..+"


def set_trainable(model: nn.Module, objectives: Sequence[str], freeze: Sequence[str] = (),
                  keep: Sequence[str] = ()) -> list[str]:
    """Full fine-tuning's trainable parameters: those of the ``objectives`` ("stt", "tts"), less ``freeze``
    patterns (full matches), plus ``keep`` patterns (NeMo's ``prevent_freeze_params``); the codec and the
    RNNT stay frozen whatever the patterns say. The TTS's copy of the codec's codebooks (``rvq_embs``, a
    buffer in NeMo: ear_tts_model.py 1148-1149), its frozen prompt projection and the speaker latents
    (``requires_grad=False`` in NeMo: duplex_ear_tts.py 949) stay frozen too."""
    wanted = [STT_TRAINS] * ("stt" in objectives) + [TTS_TRAINS] * ("tts" in objectives)
    names = []
    for name, p in model.named_parameters():
        on = any(re.fullmatch(w, name) for w in wanted) and not any(re.fullmatch(f, name) for f in freeze)
        on = (on or any(re.fullmatch(k, name) for k in keep)) and not re.fullmatch(ALWAYS_FROZEN, name)
        p.requires_grad_(on)
        if on:
            names.append(name)
    if not names:
        raise ValueError(f"no parameter trains for objectives {list(objectives)} with freeze={list(freeze)}")
    return names


def train_step(model: nn.Module, example: Example, objectives: Sequence[str], generator: torch.Generator,
               stt_config: STTLossConfig | None = None, tts_config: TTSLossConfig | None = None,
               ) -> dict[str, torch.Tensor]:
    """One conversation's losses (the backward is the caller's): ``loss`` = the STT loss + the TTS loss
    (the latter only where the example has codes)."""
    out: dict[str, torch.Tensor] = {}
    device = model.device
    if "stt" in objectives:
        audio = torch.from_numpy(example.audio).to(device)
        stt = stt_forward(model, audio, example.text, example.function, example.system_prompt, example.tools)
        losses = stt_loss(model, stt, example.text, example.function, torch.tensor(example.function_mask),
                          config=stt_config)
        out.update({f"stt_{k}" if k == "loss" else k: v for k, v in losses.items()})
    if "tts" in objectives and example.codes is not None:
        tts = tts_forward(model, example.tts_text, example.codes, generator=generator, config=tts_config)
        losses = tts_loss(model, tts, example.codes, config=tts_config)
        out.update({f"tts_{k}" if k == "loss" else k: v for k, v in losses.items()})
    if not out:
        raise ValueError("no objective applies to this example (TTS needs agent audio)")
    out["loss"] = sum(v for k, v in out.items() if k in ("stt_loss", "tts_loss"))  # type: ignore[assignment]
    return out


class _Progress:
    """tqdm's bar when it is installed (the ``train`` extra), else one line per 10 steps."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm
            self.bar: Any = tqdm(total=total, unit="step", dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.total, self.done = total, 0

    def update(self, losses: dict[str, float]) -> None:
        self.done += 1
        text = " ".join(f"{k}={v:.4f}" for k, v in losses.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.done % 10 == 0 or self.done == self.total:
            print(f"step {self.done}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _load(args: argparse.Namespace) -> nn.Module:
    from ..model import load_model
    from ..tiny import load_tiny_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[args.dtype]
    if args.model is None:
        return load_tiny_model(args.device, dtype or torch.float32, preset=args.preset, prepare=False)
    return load_model(args.model, device=args.device, dtype=dtype, weights=args.weights, prepare=False)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nvchat_torch.finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="JSONL manifest (docs/training.md)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=None, help="card folder or Hub id (default: the tiny embedded model)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "deep"], help="embedded model preset")
    p.add_argument("--device", default=None)
    p.add_argument("--weights", default="packed", choices=["packed", "dequantized", "auto"],
                   help="a quantized card's matrices: kept packed (QLoRA, the default) or expanded (load_model's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weights' dtype (default: as the card stores them; the tiny model: float32)")
    p.add_argument("--objectives", default="stt,tts", help="comma-separated: stt, tts")
    p.add_argument("--full", action="store_true", help="train the weights (NVIDIA's freezing) instead of LoRA")
    p.add_argument("--freeze", action="append", default=[], help="with --full: also freeze these names (regex)")
    p.add_argument("--train", action="append", default=[], help="with --full: also train these names (regex)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default="llm,tts", help="comma-separated: llm, tts, or regexes")
    p.add_argument("--merge", action="store_true", help="also write the adapters merged into a card (DIR/model)")
    p.add_argument("--int4pack", action="store_true",
                   help="run the 4-bit base on torch's int4pack kernel (faster on GPUs; no --merge then)")
    p.add_argument("--accumulate", type=int, default=1, help="conversations per optimizer step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-loss-weight", type=float, default=STTLossConfig.text_loss_weight)
    p.add_argument("--function-loss-weight", type=float, default=STTLossConfig.function_loss_weight)
    p.add_argument("--token-weights", type=json.loads, default=None, help='JSON, e.g. {"pad": 0.5}')
    p.add_argument("--function-token-weights", type=json.loads, default=None, help='JSON, e.g. {"pad": 0.1}')
    for name in ("max_training_rate", "quantizer_dropout", "p_uncond", "label_smoothing"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(TTSLossConfig, name))
    for name in ("advance", "delay", "delay_eos_by", "delay_bos_by"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=0, help="text channel shift (frames)")
    p.add_argument("--speech-delay", type=int, default=None, help="TTS audio delay in frames (default: the card's)")
    return p.parse_args(argv)


class FineTuneRecipe:
    """The command's run as torchtune's recipes are: :meth:`setup` (checks, the model, the examples, what
    trains, the optimizer), :meth:`train` (the steps, logged), :meth:`save` (the adapter or the card)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
        self.out = Path(args.out)

    def setup(self) -> None:
        args = self.args
        if not self.objectives or set(self.objectives) - {"stt", "tts"}:
            raise SystemExit(f"--objectives: stt and/or tts, got {args.objectives!r}")
        self.out.mkdir(parents=True, exist_ok=True)
        conversations = read_manifest(args.data)
        if args.int4pack and (args.full or args.merge):
            raise SystemExit("--int4pack: the adapters then sit over a layout no card has; drop --full / --merge")
        if args.accumulate < 1:
            raise SystemExit(f"--accumulate must be >= 1, got {args.accumulate}")
        model = self.model = _load(args)
        if args.int4pack:
            from ..models.quant import pack_int4
            print(f"int4pack: {pack_int4(model)} packed linears", file=sys.stderr)
        self.examples = [build_example(model, c, advance=args.advance, delay=args.delay,
                                       delay_eos_by=args.delay_eos_by, delay_bos_by=args.delay_bos_by,
                                       speech_delay=args.speech_delay) for c in conversations]
        self.generator = torch.Generator(device=model.device).manual_seed(args.seed)  # the objectives' draws
        self.order = torch.Generator().manual_seed(args.seed)  # the conversations' order
        if args.full:
            set_trainable(model, self.objectives, args.freeze, args.train)
            params = [p for p in model.parameters() if p.requires_grad]
        else:
            named = {"llm": adapters.LLM_TARGETS, "tts": adapters.TTS_TARGETS}
            targets = [named.get(t.strip(), t.strip()) for t in args.lora_targets.split(",") if t.strip()]
            adapters.add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, targets,
                              torch.Generator(device=model.device).manual_seed(args.seed))
            adapters.freeze_packed(model)
            params = adapters.lora_parameters(model)
        model.train()
        self.stt_config = STTLossConfig(args.text_loss_weight, args.function_loss_weight, args.token_weights,
                                        args.function_token_weights)
        self.tts_config = TTSLossConfig(args.max_training_rate, TTSLossConfig.exponent, args.quantizer_dropout,
                                        args.p_uncond, args.label_smoothing)
        # NVIDIA's optimizer: AdamW, betas (0.9, 0.98) (nemotron_voicechat_nano9b.yaml); no schedule here.
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
        config = {**vars(args), "trainable_parameters": sum(p.numel() for p in params),
                  "stt_loss": asdict(self.stt_config), "tts_loss": asdict(self.tts_config),
                  "source": getattr(model, "source", None)}
        (self.out / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")

    def train(self) -> None:
        args, model = self.args, self.model
        progress = _Progress(args.steps)
        with open(self.out / "loss_log.jsonl", "w") as log:
            order: list[int] = []
            for step in range(args.steps):
                start = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                totals: dict[str, float] = {}
                for _ in range(args.accumulate):  # the mean of the conversations' losses
                    if not order:
                        order = torch.randperm(len(self.examples), generator=self.order).tolist()
                    losses = train_step(model, self.examples[order.pop()], self.objectives, self.generator,
                                        self.stt_config, self.tts_config)
                    (losses["loss"] / args.accumulate).backward()
                    for k, v in losses.items():
                        totals[k] = totals.get(k, 0.0) + float(v.detach()) / args.accumulate
                self.optimizer.step()
                log.write(json.dumps({"step": step + 1, **totals, "seconds": time.perf_counter() - start}) + "\n")
                log.flush()
                progress.update({k: v for k, v in totals.items() if k.endswith("loss")})
        progress.close()

    def save(self) -> None:
        self.model.eval()
        if not self.args.full:
            adapters.save_adapter(self.model, self.out / "adapter")
        if self.args.full or self.args.merge:
            adapters.save_merged(self.model, self.out / "model")
        print(f"wrote {self.out}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    recipe = FineTuneRecipe(parse_args(argv))
    recipe.setup()
    recipe.train()
    recipe.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
