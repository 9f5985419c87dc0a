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
from .distributed import Ranks, keyed_generator
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
    p.add_argument("--fsdp", action="store_true",
                   help="with --full under torchrun: shard the trained layers over the processes (FSDP2)")
    p.add_argument("--freeze", action="append", default=[], help="with --full: also freeze these names (regex)")
    p.add_argument("--train", action="append", default=[], help="with --full: also train these names (regex)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default="llm,tts", help="comma-separated: llm, tts, or regexes")
    p.add_argument("--merge", action="store_true", help="also write the adapters merged into a card (DIR/model)")
    p.add_argument("--int4pack", action="store_true",
                   help="run the 4-bit base on torch's int4pack kernel (faster on GPUs; no --merge then)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="conversations per optimizer step and process (the global batch: processes x this)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="write a checkpoint to DIR/checkpoint.pt every K steps, to --resume from (0: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint (the same settings; any number of processes "
                        "with the same global batch); its loss log goes on in the same file")
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
        conversations = read_manifest(args.data)
        if args.int4pack and (args.full or args.merge):
            raise SystemExit("--int4pack: the adapters then sit over a layout no card has; drop --full / --merge")
        if args.accumulate < 1:
            raise SystemExit(f"--accumulate must be >= 1, got {args.accumulate}")
        if args.fsdp and not args.full:
            raise SystemExit("--fsdp shards full fine-tuning: add --full (adapters train replicated, as DDP does)")
        ranks = self.ranks = Ranks.start(args.device)
        if args.fsdp and ranks.world == 1:
            raise SystemExit("--fsdp shards over processes: run it under torchrun "
                             "(torchrun --nproc_per_node N -m nvchat_torch.finetune ... --full --fsdp)")
        self.global_batch = ranks.world * args.accumulate  # conversations per optimizer step, all ranks
        if len(conversations) < self.global_batch:
            raise SystemExit(f"{args.data}: {len(conversations)} conversation(s), fewer than the global batch of "
                             f"{self.global_batch} ({ranks.world} process(es) x --accumulate {args.accumulate})")
        if ranks.main:
            self.out.mkdir(parents=True, exist_ok=True)
        args.device = ranks.device(args.device)
        model = self.model = _load(args)
        if args.int4pack:
            from ..models.quant import pack_int4
            print(f"int4pack: {pack_int4(model)} packed linears", file=sys.stderr)
        self.examples = [build_example(model, c, advance=args.advance, delay=args.delay,
                                       delay_eos_by=args.delay_eos_by, delay_bos_by=args.delay_bos_by,
                                       speech_delay=args.speech_delay) for c in conversations]
        self.order = torch.Generator().manual_seed(args.seed)  # the conversations' order, the same on every rank
        if args.full:
            set_trainable(model, self.objectives, args.freeze, args.train)
            if args.fsdp:
                self.shards = ranks.shard(model)
            params = [p for p in model.parameters() if p.requires_grad]
        else:
            named = {"llm": adapters.LLM_TARGETS, "tts": adapters.TTS_TARGETS}
            targets = [named.get(t.strip(), t.strip()) for t in args.lora_targets.split(",") if t.strip()]
            adapters.add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, targets,
                              torch.Generator(device=model.device).manual_seed(args.seed))
            adapters.freeze_packed(model)
            params = adapters.lora_parameters(model)
        self.params = params
        self.lora_layers = list(adapters.lora_modules(model).values())  # their dropout draws, per conversation
        model.train()
        self.stt_config = STTLossConfig(args.text_loss_weight, args.function_loss_weight, args.token_weights,
                                        args.function_token_weights)
        self.tts_config = TTSLossConfig(args.max_training_rate, TTSLossConfig.exponent, args.quantizer_dropout,
                                        args.p_uncond, args.label_smoothing)
        # NVIDIA's optimizer: AdamW, betas (0.9, 0.98) (nemotron_voicechat_nano9b.yaml); no schedule here.
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
        self.start_step, self.pending = 0, []
        if args.resume:
            self._resume()
        config = {**vars(args), "trainable_parameters": sum(p.numel() for p in params),
                  "stt_loss": asdict(self.stt_config), "tts_loss": asdict(self.tts_config),
                  "processes": ranks.world, "global_batch": self.global_batch, "source": getattr(model, "source", None)}
        if ranks.main:
            (self.out / "train_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")

    def train(self) -> None:
        args, model, ranks = self.args, self.model, self.ranks
        progress = _Progress(args.steps - self.start_step) if ranks.main else None
        log = None
        if ranks.main:  # resumed: the log goes on from the checkpoint's step (lines past it are redone)
            path = self.out / "loss_log.jsonl"
            kept = path.read_text().splitlines()[:self.start_step] if self.start_step and path.exists() else []
            log = open(path, "w")
            log.writelines(line + "\n" for line in kept)
        try:
            order: list[int] = list(self.pending)
            for step in range(self.start_step, args.steps):
                start = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                batch = []  # the step's global batch: the same conversations whatever the number of processes
                for _ in range(self.global_batch):
                    if not order:
                        order = torch.randperm(len(self.examples), generator=self.order).tolist()
                    batch.append(order.pop())
                totals: dict[str, float] = {}
                for index in ranks.share(batch):  # the mean of the global batch's losses
                    generator = keyed_generator(args.seed, step, index, model.device)
                    for layer in self.lora_layers:  # its dropout masks too
                        layer.generator = generator
                    losses = train_step(model, self.examples[index], self.objectives, generator,
                                        self.stt_config, self.tts_config)
                    (losses["loss"] / self.global_batch).backward()
                    for k, v in losses.items():
                        totals[k] = totals.get(k, 0.0) + float(v.detach()) / self.global_batch
                ranks.sum_gradients(self.params)
                totals = ranks.sum_losses(totals)
                self.optimizer.step()
                if log is not None and progress is not None:
                    log.write(json.dumps({"step": step + 1, **totals, "seconds": time.perf_counter() - start}) + "\n")
                    log.flush()
                    progress.update({k: v for k, v in totals.items() if k.endswith("loss")})
                if args.save_every and (step + 1) % args.save_every == 0:
                    self._checkpoint(step + 1, order)
        finally:
            if log is not None:
                log.close()
            if progress is not None:
                progress.close()

    # ---- checkpoints: what --resume needs to continue a run as if it had not stopped
    def _settings(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint's (the draws are keyed by seed, step and
        conversation, so with these equal the resumed steps are the uninterrupted run's)."""
        a = self.args
        return {"data": str(Path(a.data).resolve()), "model": a.model, "preset": a.preset, "dtype": a.dtype,
                "weights": a.weights, "objectives": self.objectives, "full": a.full, "freeze": a.freeze,
                "train": a.train, "lora_r": a.lora_r, "lora_alpha": a.lora_alpha, "lora_dropout": a.lora_dropout,
                "lora_targets": a.lora_targets, "int4pack": a.int4pack, "global_batch": self.global_batch,
                "lr": a.lr, "weight_decay": a.weight_decay, "seed": a.seed, "fsdp": a.fsdp}

    def _checkpoint(self, step: int, order: list[int]) -> None:
        """``DIR/checkpoint.pt`` after ``step`` steps: the trainable weights, the optimizer, the data order
        and the settings (a sharded run: ``DIR/checkpoint/``, see :meth:`_checkpoint_shards`). Written whole
        and then renamed, so a run killed while writing keeps the last one."""
        if self.args.fsdp:
            return self._checkpoint_shards(step, order)
        if self.ranks.main:
            state = {"step": step, "settings": self._settings(), "order": list(order),
                     "order_generator": self.order.get_state(), "optimizer": self.optimizer.state_dict(),
                     "weights": {n: p.detach().cpu() for n, p in self.model.named_parameters() if p.requires_grad}}
            partial = self.out / "checkpoint.pt.partial"
            torch.save(state, partial)
            partial.replace(self.out / "checkpoint.pt")
        self.ranks.barrier()

    def _checkpoint_shards(self, step: int, order: list[int]) -> None:
        """A sharded run's checkpoint, ``DIR/checkpoint/``: each rank's shards of the model and optimizer
        (``torch.distributed.checkpoint``, which a run on another process count reshards as it loads)
        and ``run.pt`` (the step, the data order, the settings). Written beside, then renamed."""
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        partial, final = self.out / "checkpoint.partial", self.out / "checkpoint"
        if self.ranks.main and partial.exists():
            shutil.rmtree(partial)
        self.ranks.barrier()
        weights, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": weights, "optimizer": optimizer}, checkpoint_id=str(partial))
        if self.ranks.main:
            torch.save({"step": step, "settings": self._settings(), "order": list(order),
                        "order_generator": self.order.get_state()}, partial / "run.pt")
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
        self.ranks.barrier()

    def _resume(self) -> None:
        path = self.out / ("checkpoint/run.pt" if self.args.fsdp else "checkpoint.pt")
        if not path.exists():
            raise SystemExit(f"--resume: {path} does not exist (write one with --save-every K)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, value in self._settings().items():
            was = state["settings"].get(name)
            if was != value:
                raise SystemExit(f"--resume: {path} was written with {name}={was!r}; this run has {name}={value!r}")
        if self.args.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            weights, optimizer = get_state_dict(self.model, self.optimizer)
            shards = {"model": weights, "optimizer": optimizer}
            dcp.load(shards, checkpoint_id=str(path.parent))
            set_state_dict(self.model, self.optimizer, model_state_dict=shards["model"],
                           optim_state_dict=shards["optimizer"])
        else:
            self._load_replicated(path, state)
        self.order.set_state(state["order_generator"])
        self.start_step, self.pending = int(state["step"]), list(state["order"])
        if self.start_step >= self.args.steps:
            raise SystemExit(f"--resume: the checkpoint is at step {self.start_step}; --steps {self.args.steps} "
                             "leaves nothing to run")

    def _load_replicated(self, path: Path, state: dict[str, Any]) -> None:
        trainable = dict((n, p) for n, p in self.model.named_parameters() if p.requires_grad)
        if trainable.keys() != state["weights"].keys():
            raise SystemExit(f"--resume: {path} holds other trainable parameters than this run's")
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(state["weights"][name])
        self.optimizer.load_state_dict(state["optimizer"])

    def save(self) -> None:
        self.model.eval()
        state = self.ranks.whole_state(self.model) if getattr(self, "shards", None) else None
        if self.ranks.main:  # every rank holds the same weights (or its shard of them): rank 0 writes
            if not self.args.full:
                adapters.save_adapter(self.model, self.out / "adapter")
            if self.args.full or self.args.merge:
                adapters.save_merged(self.model, self.out / "model", state=state)
            print(f"wrote {self.out}", file=sys.stderr)
        self.ranks.barrier()


def main(argv: Sequence[str] | None = None) -> int:
    """One process, or one rank of ``torchrun --nproc_per_node N -m nvchat_torch.finetune ...``."""
    recipe = FineTuneRecipe(parse_args(argv))
    try:
        recipe.setup()
        recipe.train()
        recipe.save()
    finally:
        if hasattr(recipe, "ranks"):
            recipe.ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
