"""Reading mlx-community NemotronLabs VoiceChat checkpoints (bf16, 8-bit, 4-bit, mx/nv fp) into torch.

The shards store PyTorch/NeMo names and layouts (conv ``[out, in, k]``, ConvTranspose1d
``[in, out, k]``, LSTM ``weight_ih_l0`` ...); only the LLM and vocabulary matrices are packed
by MLX's quantizer (``<path>.weight`` uint32 + ``<path>.scales`` [+ ``<path>.biases``]).
Tensors are read one at a time through safetensors' memory map, converted, and only then is
the next one read, so the raw and the converted checkpoint never sit in memory together.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from ..models.config import ConfigError, QuantSpec, VoiceChatConfig
from ..models.quant import dequantize
from .safetensors_file import SafetensorsFile

__all__ = [
    "CheckpointError",
    "BadWeightsWarning",
    "is_release_config",
    "config_field",
    "Checkpoint",
    "resolve_checkpoint",
    "load_checkpoint",
    "KEEP_FLOAT32",
    "cast",
]

# NeMo's featurizer buffers: kept in the cards, dropped by the reference's sanitize, unused here.
UNUSED_PREFIX = "stt_model.perception.preprocessor."

# Tensors the reference keeps in float32 whatever the load dtype (its cast predicate).
KEEP_FLOAT32 = ("A_log",)

M = TypeVar("M", bound=nn.Module)


def cast(module: M, *args: Any, **kwargs: Any) -> M:
    """``module.to(*args, **kwargs)`` as the reference casts a model: the parameters named in
    :data:`KEEP_FLOAT32` keep float32 (they move, they are not rounded). Like any cast it also rounds
    the module's float32 constants: call ``init_constants`` on it afterwards."""
    kept = {name: p.data for name, p in module.named_parameters()
            if name.endswith(KEEP_FLOAT32) and p.dtype == torch.float32}
    nn.Module.to(module, *args, **kwargs)
    for name, data in kept.items():
        parameter = module.get_parameter(name)
        parameter.data = data.to(parameter.device)
    return module


_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "special_tokens_map.json", "rnnt_tokenizer/*"]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or inconsistent; the message names the file (and key)."""


class BadWeightsWarning(UserWarning):
    """A checkpoint holds all-zero or non-finite tensors (a broken upload: the model then emits only PAD)."""


def is_release_config(values: Any) -> bool:
    """Whether a parsed config.json is NVIDIA's NeMo training config (``model.stt``/``model.speech_generation``,
    no ``model_type``) rather than the flat runtime config of the mlx-community cards."""
    return (isinstance(values, dict) and "model_type" not in values and isinstance(values.get("model"), dict)
            and "stt" in values["model"] and "speech_generation" in values["model"])


# Which config section sizes the tensors under a key prefix (first match wins).
_CONFIG_SECTIONS = (
    ("stt_model.perception.preprocessor.", ("audio_config.preprocessor",)),
    ("stt_model.perception.proj", ("audio_config", "text_config")),
    ("stt_model.perception.", ("audio_config.encoder",)),
    ("stt_model.rnnt_decoder.", ("audio_config.decoder",)),
    ("stt_model.rnnt_joint.", ("audio_config.joint",)),
    ("stt_model.", ("text_config",)),
    ("tts_model.audio_codec.", ("codec_config",)),
    ("tts_model.", ("tts_config", "text_config")),
)


def config_field(config: VoiceChatConfig, key: str, expected: tuple[int, ...], got: tuple[int, ...]) -> str:
    """The config field(s) that set the size in which tensor ``key``'s ``got`` shape disagrees with the
    ``expected`` one, e.g. ``text_config.hidden_size = 4480``; else the config section that sizes it."""
    sections = next((names for prefix, names in _CONFIG_SECTIONS if key.startswith(prefix)), ("text_config",))
    sizes = {e for i, e in enumerate(expected) if i >= len(got) or got[i] != e} or set(expected)
    found: list[str] = []

    def visit(obj: Any, name: str) -> None:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                visit(value, f"{name}.{f.name}")
            elif isinstance(value, int) and not isinstance(value, bool) and value in sizes:
                found.append(f"{name}.{f.name} = {value}")

    for section in sections:
        obj: Any = config
        for part in section.split("."):
            obj = getattr(obj, part)
        if section == "audio_config":  # only its own top-level sizes (output_dim), not the sub-configs'
            found += [f"audio_config.output_dim = {obj.output_dim}"] if obj.output_dim in sizes else []
        else:
            visit(obj, section)
    if found:
        return "config field " + " or ".join(found[:3])
    return f"a size set by config section {sections[0]}"


class WeightAudit:
    """All-zero and non-finite floating tensors seen while a checkpoint is read, warned about once."""

    CHUNK = 1 << 24

    def __init__(self, where: Path):
        self.where = where
        self.all_zero: dict[str, bool] = {}
        self.non_finite: set[str] = set()
        self.warned = False

    def see(self, key: str, t: torch.Tensor) -> None:
        """Record tensor ``key`` (or one more piece of it: it is all zero only if every piece is). The NeMo
        featurizer buffers are not checked: neither the reference nor this port reads them."""
        if not t.is_floating_point() or t.numel() == 0 or key.startswith(UNUSED_PREFIX):
            return
        finite, zero = True, True
        for part in t.reshape(-1).split(self.CHUNK):
            finite = finite and bool(torch.isfinite(part).all())
            zero = zero and not bool(part.count_nonzero())
        if not finite:
            self.non_finite.add(key)
        self.all_zero[key] = self.all_zero.get(key, True) and zero

    def see_packed(self, path: str, raw: "PackedTensors") -> None:
        """A packed module is all zero when its codes and biases are (how MLX encodes zeros)."""
        for name, t in (("scales", raw.scales), ("biases", raw.biases)):
            if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                self.non_finite.add(f"{path}.{name}")
        codes = raw.weight.view(torch.int32) if raw.weight.dtype == torch.uint32 else raw.weight
        zero = raw.biases is not None and not bool(raw.biases.count_nonzero()) and not bool(codes.count_nonzero())
        self.all_zero[f"{path}.weight"] = self.all_zero.get(f"{path}.weight", True) and zero

    def warn(self) -> None:
        zero = sorted(k for k, z in self.all_zero.items() if z)
        if self.warned or not (zero or self.non_finite):
            return
        self.warned = True
        parts = [f"{len(zero)} all-zero tensor(s): {', '.join(zero)}"] if zero else []
        if self.non_finite:
            parts.append(f"{len(self.non_finite)} tensor(s) with NaN/inf values: {', '.join(sorted(self.non_finite))}")
        warnings.warn(f"{self.where}: the checkpoint holds {'; and '.join(parts)}. A broken or partial upload? "
                      "The model's output is then meaningless (e.g. only PAD); download it again or use "
                      "another revision.", BadWeightsWarning, stacklevel=3)


def resolve_checkpoint(path_or_repo_id: str | os.PathLike, allow_patterns: list[str] | None = None) -> Path:
    """A local checkpoint folder, or a Hub repo id fetched with ``huggingface_hub.snapshot_download``.

    The Hub cache and ``HF_HUB_OFFLINE`` are honoured; offline with nothing cached is a
    ``CheckpointError`` that says so. ``allow_patterns``: the files to fetch (default: a checkpoint's).
    """
    text = os.fspath(path_or_repo_id)
    local = Path(text).expanduser()
    if local.exists():
        if not local.is_dir():
            raise CheckpointError(f"{local}: expected a checkpoint folder (with config.json and *.safetensors), "
                                  "got a file")
        return local
    parts = text.split("/")
    looks_like_repo = (len(parts) == 2 and all(parts) and not text.startswith((".", "~"))
                       and not local.is_absolute())
    if not looks_like_repo:
        raise CheckpointError(f"{text}: no such checkpoint folder (and it is not a Hub repo id like "
                              "'mlx-community/NemotronLabs-VoiceChat-11B-4bit')")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError(f"{text}: downloading from the Hub needs huggingface_hub ({e})") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(text, allow_patterns=allow_patterns or _HUB_PATTERNS,
                                      local_files_only=offline))
    except LocalEntryNotFoundError:
        hint = ("HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of it"
                if offline else "the Hub could not be reached and the Hugging Face cache has no copy of it")
        raise CheckpointError(f"{text}: cannot load this Hub checkpoint: {hint}. Download it on a connected "
                              f"machine first, e.g. `hf download {text} --local-dir weights/{parts[1]}`, "
                              "and pass that folder.") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{text}: no such repository on the Hugging Face Hub (or it is private)") from None
    except Exception as e:  # network errors and the like: keep the repo id in the message
        raise CheckpointError(f"{text}: could not fetch from the Hugging Face Hub: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class PackedTensors:
    """The stored tensors of one quantized module (raw, as on disk)."""

    weight: torch.Tensor  # the packed codes, uint32
    scales: torch.Tensor  # one per group; uint8 outside the affine mode
    biases: torch.Tensor | None  # one per group in the affine mode; None: the mode has none
    spec: QuantSpec  # how the module is packed


class Checkpoint:
    """An opened checkpoint folder: its config, its shards and where every key lives.

    Shards are never mapped: their headers are read when the folder is opened, and :meth:`get` reads
    one tensor with positioned reads (``safetensors_file.py``).
    """

    layout_name = "mlx-community layout (flat config.json)"

    def __init__(self, folder: str | os.PathLike, config: VoiceChatConfig | None = None):
        self.folder = Path(folder)
        if config is None:
            self._refuse_release_config()
        self.config = config if config is not None else VoiceChatConfig.from_file(self.folder / "config.json")
        self.audit = WeightAudit(self.folder)
        index = self.folder / "model.safetensors.index.json"
        self._files: dict[str, SafetensorsFile] = {}  # each shard's header; its tensors read on demand
        self.key_to_file: dict[str, str] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (self.folder / name).exists():
                    key = next(k for k, v in weight_map.items() if v == name)
                    raise CheckpointError(f"{self.folder / name}: shard listed in {index.name} is missing "
                                          f"(it holds e.g. '{key}')")
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.folder}: no model.safetensors.index.json and no *.safetensors files")
            weight_map = None
        for name in files:
            path = self.folder / name
            try:
                handle = SafetensorsFile(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None
            self._files[name] = handle
            keys = set(handle.keys())
            if weight_map is None:
                for k in keys:
                    if k in self.key_to_file:
                        raise CheckpointError(f"{path}: key '{k}' is also in {self.key_to_file[k]}")
                    self.key_to_file[k] = name
            else:
                for k in keys:
                    if weight_map.get(k) == name:
                        self.key_to_file[k] = name
        if weight_map is not None:
            for k, name in weight_map.items():
                if k not in self.key_to_file:
                    raise CheckpointError(f"{self.folder / name}: has no tensor '{k}', which "
                                          f"model.safetensors.index.json places there")

    def _refuse_release_config(self) -> None:
        try:
            values = json.loads((self.folder / "config.json").read_text())
        except (OSError, ValueError):
            return  # VoiceChatConfig.from_file names the problem
        if is_release_config(values):
            raise CheckpointError(f"{self.folder / 'config.json'}: NVIDIA release layout (NeMo's nested training "
                                  "config, no model_type): open it with nvchat_torch.load_model, "
                                  "nvchat_torch.loading.nvidia_release.ReleaseCheckpoint, or convert it with "
                                  "`python -m nvchat_torch.convert`")

    # ---- raw access
    def keys(self) -> list[str]:
        return sorted(self.key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def file_of(self, key: str) -> Path:
        return self.folder / self.key_to_file[key]

    def get(self, key: str) -> torch.Tensor:
        name = self.key_to_file.get(key)
        if name is None:
            raise CheckpointError(f"{self.folder}: no tensor '{key}' in any shard")
        try:  # positioned reads into the tensor's own memory: no file page stays mapped (safetensors_file.py)
            return self._files[name].read(key)
        except Exception as e:
            raise CheckpointError(f"{self.folder / name}: cannot read '{key}' (truncated or corrupt?): {e}") from None

    def shape(self, key: str) -> tuple[int, ...]:
        name = self.key_to_file[key]
        try:
            return self._files[name].shape(key)
        except Exception as e:
            raise CheckpointError(f"{self.folder / name}: cannot read '{key}': {e}") from None

    def stored_dtype(self, key: str) -> str:
        """The dtype ``key`` is stored in, as safetensors names it (``F32``, ``BF16``, ``U32``...), read from the header."""
        return self._files[self.key_to_file[key]].dtype_name(key)

    # ---- structure
    def layout(self) -> str:
        """The storage layout in words: what is packed, in which mode and with which scale dtype, and
        the dtype(s) of every other floating tensor, weighted by size (the mode the port computes in
        depends on it; see docs/parity.md)."""
        names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "U8": "uint8"}
        quantized = self.quantized_modules()
        packed = {f"{p}.{n}" for p in quantized for n in ("weight", "scales", "biases")}
        parts = []
        if quantized:
            specs = sorted({f"{s.mode} {s.bits}-bit (group {s.group_size})" for s in quantized.values()})
            scales = sorted({names.get(self.stored_dtype(f"{p}.scales"), "?") for p in quantized})
            parts.append(f"{len(quantized)} matrices packed {', '.join(specs)} with {'/'.join(scales)} scales")
        sizes: dict[str, int] = {}
        for key in self.keys():
            dtype = self.stored_dtype(key)
            if key not in packed and dtype in ("F32", "BF16", "F16"):
                n = 1
                for d in self.shape(key):
                    n *= d
                sizes[names[dtype]] = sizes.get(names[dtype], 0) + n
        total = sum(sizes.values()) or 1
        parts.append("other weights " + ", ".join(f"{name} ({100 * n / total:.0f}%)" for name, n in
                                                   sorted(sizes.items(), key=lambda kv: -kv[1])))
        return "; ".join(parts)

    def quantized_modules(self) -> dict[str, QuantSpec]:
        """Every module stored packed, with its spec (config overrides, checked against the shapes)."""
        out = {}
        for key in self.keys():
            if not key.endswith(".scales"):
                continue
            path = key[: -len(".scales")]
            where = f"{self.file_of(key)}: '{path}'"
            if f"{path}.weight" not in self:
                raise CheckpointError(f"{where}: has .scales but no .weight")
            try:
                spec = self.config.quant_spec(path, stored=True)
            except ConfigError as e:
                raise CheckpointError(f"{self.file_of(key)}: {e}") from None
            if spec is None:
                raise CheckpointError(f"{where}: stored quantized (has .scales) but config.json's 'quantization' "
                                      "does not quantize it")
            self._check_packed_shapes(path, spec)
            out[path] = spec
        return out

    def _check_packed_shapes(self, path: str, spec: QuantSpec) -> None:
        w_shape, s_shape = self.shape(f"{path}.weight"), self.shape(f"{path}.scales")
        where = f"{self.file_of(path + '.weight')}: '{path}.weight'"
        n_in = s_shape[-1] * spec.group_size
        if w_shape[:-1] != s_shape[:-1] or w_shape[-1] * 32 != n_in * spec.bits:
            implied = w_shape[-1] * 32 / max(n_in, 1)
            raise CheckpointError(
                f"{where}: packed shape {list(w_shape)} with scales {list(s_shape)} implies "
                f"{implied:g} bits at group size {spec.group_size}, but the config says "
                f"{spec.mode} {spec.bits}-bit, group {spec.group_size}")
        has_biases = f"{path}.biases" in self
        if spec.has_biases and not has_biases:
            raise CheckpointError(f"{where}: affine quantization needs '{path}.biases', which is missing")
        if not spec.has_biases and has_biases:
            raise CheckpointError(f"{where}: mode {spec.mode} has no biases but '{path}.biases' is stored")

    def read_packed(self, path: str, spec: QuantSpec) -> PackedTensors:
        w = self.get(f"{path}.weight")
        if w.dtype not in (torch.uint32, torch.int32):
            raise CheckpointError(f"{self.file_of(path + '.weight')}: '{path}.weight' is {w.dtype}, "
                                  "expected uint32 packed codes")
        w = w.view(torch.uint32)
        s = self.get(f"{path}.scales")
        b = self.get(f"{path}.biases") if spec.has_biases else None
        if spec.mode != "affine" and s.dtype != torch.uint8:
            raise CheckpointError(f"{self.file_of(path + '.scales')}: '{path}.scales' is {s.dtype}; "
                                  f"mode {spec.mode} stores uint8 scales")
        return PackedTensors(w, s, b, spec)

    def iter_tensors(
        self,
        dtype: torch.dtype | None = torch.bfloat16,
        device: torch.device | str = "cpu",
        keep_packed: Callable[[str], bool] | bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(checkpoint key, tensor)`` one at a time.

        Floating tensors are cast to ``dtype`` (``A_log`` stays float32, as in the reference), or keep
        their stored dtype with ``dtype=None``; integer buffers keep their dtype. A quantized module
        yields one dequantized ``<path>.weight`` (``dtype=None``: in its scales' dtype, as MLX
        dequantizes), or, where ``keep_packed(path)`` is true, its raw ``weight``/``scales``/``biases``
        as stored.
        """
        quantized = self.quantized_modules()
        packed_keys = {f"{p}.{n}" for p in quantized for n in ("weight", "scales", "biases")}
        for path, spec in quantized.items():
            keep = keep_packed(path) if callable(keep_packed) else bool(keep_packed)
            try:
                raw = self.read_packed(path, spec)
                if keep:
                    yield f"{path}.weight", raw.weight.to(device)
                    yield f"{path}.scales", raw.scales.to(device)
                    if raw.biases is not None:
                        yield f"{path}.biases", raw.biases.to(device)
                else:
                    w = dequantize(raw.weight, raw.scales, raw.biases, spec)
                    yield f"{path}.weight", w.to(device, w.dtype if dtype is None else dtype)
            except ValueError as e:
                raise CheckpointError(f"{self.file_of(path + '.weight')}: '{path}': {e}") from None
            self.audit.see_packed(path, raw)
            del raw
        for key in self.keys():
            if key in packed_keys:
                continue
            t = self.get(key)
            self.audit.see(key, t)
            if t.is_floating_point() and dtype is None:
                t = t.to(device)
            elif t.is_floating_point():
                keep32 = any(key.endswith(n) for n in KEEP_FLOAT32)
                t = t.to(device, torch.float32 if keep32 and t.dtype == torch.float32 else dtype)
            else:
                t = t.to(device)
            yield key, t
        self.audit.warn()

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_checkpoint(
    path_or_repo_id: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> tuple[VoiceChatConfig, dict[str, torch.Tensor]]:
    """Load a NemotronLabs VoiceChat checkpoint as ``(config, state_dict)``.

    Every tensor comes under its checkpoint name in PyTorch layout; each quantized triplet
    (``weight``/``scales``/``biases``) becomes one ``<path>.weight`` in ``dtype``, equal to
    ``mx.dequantize`` of the stored tensors. Works on a local folder or a Hub repo id.
    """
    folder = resolve_checkpoint(path_or_repo_id)
    with Checkpoint(folder) as ckpt:
        state = dict(ckpt.iter_tensors(dtype=dtype, device=device))
        return ckpt.config, state

