"""LoRA adapters on the LLM's and the TTS backbone's projections, the packed 4-bit base included.

``y = base(x) + (alpha / r) * B(A(dropout(x)))``, ``A`` Kaiming-uniform and ``B`` zero as peft initialises
them; a packed base stays packed and its backward dequantizes the weight and drops it (QLoRA's
recipe). The layer is our own, with peft's names, because peft does not wrap the packed modules;
:func:`save_adapter` writes peft's files. docs/training.md, "Adapters (LoRA, QLoRA)", has the design."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.config import QuantSpec
from ..models.quant import Int4PackedLinear, QuantizedLinear, quantize_affine

__all__ = ["LLM_TARGETS", "TTS_TARGETS", "LoRALinear", "FrozenPacked", "dense_weight", "add_lora", "freeze_packed", "lora_modules", "lora_parameters",
           "save_adapter", "load_adapter", "merge_lora", "save_merged"]

# Module names (regular expressions, full match) that take an adapter by default.
LLM_TARGETS = r"stt_model\.llm\.layers\.\d+\.mixer\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)"
TTS_TARGETS = r"tts_model\.tts_model\.backbone\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


class _PackedMatmul(torch.autograd.Function):
    """``base(x)`` for a frozen packed base, differentiable in ``x`` only: the backward dequantizes the
    weight, multiplies and drops it (QLoRA), so nothing dense is saved for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, base: nn.Module) -> torch.Tensor:  # type: ignore[override]
        ctx.base = base
        with torch.no_grad():
            return base(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad @ dense_weight(ctx.base, grad.dtype), None


def dense_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` matrix a linear computes with, dequantized from a packed one. An int4pack layout has
    no unpacking model on every device, so it is read through its own matmul on the identity (exact, and
    ``in`` times the work of reading the codes)."""
    if isinstance(base, QuantizedLinear):
        return base.dequantized(torch.float32).to(dtype)
    if isinstance(base, Int4PackedLinear):
        eye = torch.eye(base.in_features, dtype=base.dtype, device=base.packed.device)
        w = base.kernel.mm(eye, base.packed, base.group_size, base.scales_and_zeros)[:, :base.out_features]
        return w.t().to(dtype)
    return base.weight.to(dtype)


class FrozenPacked(nn.Module):
    """A packed linear that takes no adapter but sits where gradients pass (e.g. the vocabulary heads of the
    4-bit card): its input gradient through :class:`_PackedMatmul` (torch's int4pack op has no derivative,
    and an MLX-packed layer would otherwise keep its dequantized weight for the backward)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PackedMatmul.apply(x, self.base_layer) if x.requires_grad else self.base_layer(x)


class LoRALinear(nn.Module):
    """A linear ``base_layer`` (dense, MLX-packed or int4pack) plus a low-rank update (peft's layout)."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {r}")
        self.base_layer = base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        device = next(t for t in [*base.parameters(), *base.buffers()]).device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)  # peft's init of A
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = dropout
        self.generator = generator  # the dropout masks' draws, in training mode
        self.packed = isinstance(base, (QuantizedLinear, Int4PackedLinear))

    @property
    def bias(self) -> torch.Tensor | None:  # read by layers.add_linear
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _PackedMatmul.apply(x, self.base_layer) if self.packed and x.requires_grad else self.base_layer(x)
        h = x.to(self.lora_A.weight.dtype)
        if self.training and self.dropout > 0:  # nn.Dropout's, with the masks from the adapters' generator
            keep = torch.rand(h.shape, generator=self.generator, device=h.device) >= self.dropout
            h = h * keep / (1 - self.dropout)
        update = self.lora_B(self.lora_A(h))
        return y + (update * self.scaling).to(y.dtype)

    def delta(self) -> torch.Tensor:
        """The update as a ``[out, in]`` matrix (float32)."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]


def _forget_speech_tracks(model: nn.Module) -> None:
    """A VoiceChat model's prefill tracks were made by its weights before an adapter changed them."""
    forget = getattr(model, "forget_speech_tracks", None)
    if callable(forget):
        forget()


def _linear_like(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, QuantizedLinear, Int4PackedLinear))


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: str | list[str] = (LLM_TARGETS, TTS_TARGETS), generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32) -> list[str]:
    """Wrap every linear whose name fully matches one of ``targets`` in a :class:`LoRALinear`; freezes the
    whole model first (only the adapters train). Returns the wrapped names (an error if none match). A
    packed model that trains also needs :func:`freeze_packed`."""
    patterns = [re.compile(t) for t in ([targets] if isinstance(targets, str) else targets)]
    model.requires_grad_(False)
    names = [n for n, m in model.named_modules() if _linear_like(m) and any(p.fullmatch(n) for p in patterns)]
    if not names:
        raise ValueError(f"add_lora: no linear module matches {[p.pattern for p in patterns]}")
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent)
        layer = LoRALinear(getattr(holder, child), r, alpha, dropout, generator, dtype)
        setattr(holder, child, layer.train(model.training))  # the model's mode (a new module trains)
    _forget_speech_tracks(model)  # the TTS's weights changed
    return names


def freeze_packed(model: nn.Module) -> list[str]:
    """Put every packed linear that has no adapter behind a :class:`FrozenPacked`, so that gradients pass
    through it (torch's int4pack op has no derivative) without it keeping a dequantized weight for the
    backward. Returns the wrapped names."""
    names = []
    for holder_name, holder in list(model.named_modules()):
        if not isinstance(holder, (LoRALinear, FrozenPacked)):
            for child, m in list(holder.named_children()):
                if isinstance(m, (QuantizedLinear, Int4PackedLinear)):
                    setattr(holder, child, FrozenPacked(m).train(model.training))
                    names.append(f"{holder_name}.{child}" if holder_name else child)
    return names


def _config(model: nn.Module) -> dict[str, Any]:
    wrapped = lora_modules(model)
    if not wrapped:
        raise ValueError("the model has no LoRA adapter")
    first = next(iter(wrapped.values()))
    # peft's LoraConfig fields (what peft.LoraConfig.from_pretrained reads)
    return {"peft_type": "LORA", "r": first.r, "lora_alpha": first.alpha, "lora_dropout": first.dropout,
            "target_modules": sorted(wrapped), "bias": "none", "init_lora_weights": True,
            "fan_in_fan_out": False, "base_model_name_or_path": getattr(model, "source", None),
            "task_type": None, "inference_mode": True}


def save_adapter(model: nn.Module, folder: str | os.PathLike) -> Path:
    """The adapters as peft saves them: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(model)
    tensors = {f"base_model.model.{name}.{part}.weight": getattr(m, part).weight.detach().cpu().contiguous()
               for name, m in lora_modules(model).items() for part in ("lora_A", "lora_B")}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_adapter(model: nn.Module, folder: str | os.PathLike) -> list[str]:
    """Add the adapters a :func:`save_adapter` folder (or peft's, same layout) holds and load their weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    targets = config["target_modules"]
    names = add_lora(model, int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout", 0.0)),
                     [re.escape(t) for t in targets] if isinstance(targets, list) else targets)
    wrapped = lora_modules(model)
    expected = {f"base_model.model.{n}.{p}.weight" for n in wrapped for p in ("lora_A", "lora_B")}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ValueError(f"{folder}/adapter_model.safetensors: missing {missing}, unexpected {extra}")
    for name, m in wrapped.items():
        for part in ("lora_A", "lora_B"):
            src = tensors[f"base_model.model.{name}.{part}.weight"]
            dst = getattr(m, part).weight
            if src.shape != dst.shape:
                raise ValueError(f"{folder}: {name}.{part} has shape {list(src.shape)}, the model {list(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src)
    _forget_speech_tracks(model)
    return names


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base and unwrap it: a dense base takes ``W + (alpha/r) B A`` in its own
    dtype; a packed base becomes a dense float32 ``Linear`` holding the dequantized sum (:func:`save_merged`
    quantizes it back). Returns the merged names."""
    from ..models.layers import Linear

    merged = []
    for name, m in lora_modules(model).items():
        base = m.base_layer
        with torch.no_grad():
            if m.packed:
                dense = Linear(m.in_features, m.out_features, bias=base.bias is not None,
                               device=m.lora_A.weight.device)
                dense.weight.copy_(dense_weight(base, torch.float32) + m.delta())
                if base.bias is not None:
                    dense.bias.copy_(base.bias.float())
                base = dense.requires_grad_(False)
                old = m.base_layer
                base.quantized_spec = (old.spec if isinstance(old, QuantizedLinear) else  # type: ignore[assignment]
                                       QuantSpec(4, old.group_size))
            else:
                base.weight.copy_((base.weight.float() + m.delta()).to(base.weight.dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, base)
        merged.append(name)
    for holder in list(model.modules()):
        for child, m in list(holder.named_children()):
            if isinstance(m, FrozenPacked):
                setattr(holder, child, m.base_layer)
    _forget_speech_tracks(model)
    return merged


def save_merged(model: nn.Module, folder: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Merge the adapters (:func:`merge_lora`) and write the model as a card :func:`~nvchat_torch.load_model`
    reads: every tensor as the model holds it, except that a merged packed base is quantized again with its
    own mode, bits and group size (the merge is then rounded to that grid). The model must be unprepared
    (its state dict the checkpoint's). ``state``: the model's whole state dict, where the model holds only
    its shard of it (a sharded run gathers it first: :mod:`~nvchat_torch.training.distributed`)."""
    from safetensors.torch import save_file

    from ..tiny import write_card_files

    if getattr(model, "prepared", False) or any(isinstance(m, Int4PackedLinear) and not isinstance(p, LoRALinear)
                                                for p in model.modules() for m in p.children()):
        raise ValueError("save_merged: the model's layout is not a card's (prepare() or pack_int4 changed it); "
                         "load it with prepare=False and train without pack_int4 to write a card")
    merge_lora(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    bits = group = None
    for name, module in model.named_modules():
        spec = getattr(module, "quantized_spec", None)
        if spec is not None:
            wq, scales, biases = quantize_affine(module.weight.detach(), spec.bits, spec.group_size)
            tensors.update({f"{name}.weight": wq, f"{name}.scales": scales, f"{name}.biases": biases})
        if isinstance(module, QuantizedLinear) or spec is not None:
            bits, group = (spec or module.spec).bits, (spec or module.spec).group_size
    for key, t in (model.state_dict() if state is None else state).items():
        tensors.setdefault(key, t.detach().cpu())
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {k: "model.safetensors" for k in sorted(tensors)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_card_files(model, folder, bits, group or 64)
    return folder
