"""The whole NemotronLabs VoiceChat model and its loader.

``VoiceChatModel`` has the checkpoint's module tree (``stt_model``, ``tts_model``), so its
state_dict keys are the checkpoint's. :func:`load_model` builds the tree on the ``meta`` device and
assigns the checkpoint's tensors one at a time, so the model is never held twice; then
:meth:`VoiceChatModel.prepare` applies the speed-up transforms.
Design: docs/api.md, "What each network computes" (the whole model).
"""

from __future__ import annotations

import builtins  # the annotations inside VoiceChatModel, whose float() method hides the type
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .diagnostics import device_memory, model_bytes
from .events import StreamingOptions, VoiceChatResult
from .loading.checkpoint import Checkpoint, CheckpointError, config_field, resolve_checkpoint
from .loading.nvidia_release import ReleaseCheckpoint, base_config, is_release_folder, resolve_tokenizer
from .models.config import QuantSpec, VoiceChatConfig
from .models.quant import QuantizedEmbedding, QuantizedLinear, quantize_modules
from .networks import DuplexSTTModel, VoiceChatNetworks

if TYPE_CHECKING:
    from .engine import BatchEngine
    from .session import StreamingSession

__all__ = ["DuplexSTTModel", "VoiceChatModel", "build_model", "load_model", "open_checkpoint", "default_device"]


class VoiceChatModel(VoiceChatNetworks):
    """NemotronLabs VoiceChat: 16 kHz user audio in, text / function / transcript / 22.05 kHz speech out.

    Use :func:`load_model` (a checkpoint) or :func:`nvchat_torch.load_tiny_model` (random weights),
    then :meth:`generate` (offline) or :meth:`create_streaming_session` (80 ms frames).
    """

    def create_streaming_session(self, options: StreamingOptions | None = None, **kwargs: Any) -> "StreamingSession":
        """A new 80 ms streaming session with its own caches (sessions on one model are independent)."""
        from .session import StreamingSession

        if options is None:
            options = StreamingOptions(**kwargs)
        elif kwargs:
            raise TypeError("pass either a StreamingOptions or keyword options, not both")
        return StreamingSession(self, options)

    def create_engine(self, max_sessions: int = 8, profile: bool = False) -> "BatchEngine":
        """A batched engine: up to ``max_sessions`` streaming sessions stepped as one batch per frame
        (see :mod:`nvchat_torch.engine`); ``profile`` times every step's stages after a device sync."""
        from .engine import BatchEngine

        return BatchEngine(self, max_sessions, profile)

    def generate(self, audio: Any, system_prompt: str | None = None, seed: int = 0, deterministic: bool = False,
                 *, max_frames: int | None = None, extra_decoding_seconds: builtins.float = 0.0,
                 use_language_cache: bool = True, tools: list[dict] | None = None) -> VoiceChatResult:
        """One offline turn over the whole ``audio`` (16 kHz mono array/tensor, or a file path).
        ``tools``: OpenAI-format function tools (see :mod:`nvchat_torch.tools`); the calls the model
        makes are in ``result.tool_calls``."""
        from .session import generate_offline

        return generate_offline(self, audio, system_prompt=system_prompt, seed=seed, deterministic=deterministic,
                                max_frames=max_frames, extra_decoding_seconds=extra_decoding_seconds,
                                use_language_cache=use_language_cache, tools=tools)


# --------------------------------------------------------------------------------------
# Building and loading


def default_device() -> torch.device:
    """mps > cuda > cpu."""
    if torch.backends.mps.is_available():
        return torch.device("mps")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def build_model(config: VoiceChatConfig, device: torch.device | str = "meta",
                packed: dict[str, QuantSpec] | None = None, dtype: torch.dtype | None = None) -> VoiceChatModel:
    """The module tree for ``config`` on ``device`` (``meta``: shapes only), with the modules in
    ``packed`` swapped for their packed counterparts (the checkpoint's quantized layout); packed
    embeddings return ``dtype`` (default: float32)."""
    with torch.device(device):
        model = VoiceChatModel(config)
    if packed:
        quantize_modules(model, packed, embedding_dtype=dtype)
    return model


# What the mlx-community conversions quantize ("LLM + vocabulary heads"): each Linear/Embedding under these.
QUANTIZED_PREFIXES = ("stt_model.llm.", "stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head")


def mlx_community_specs(model: nn.Module, bits: int, group_size: int = 64) -> dict[str, QuantSpec]:
    """The modules of ``model`` an mlx-community conversion packs at ``bits`` (those whose input width
    the group divides), with their affine spec."""
    return {name: QuantSpec(bits, group_size) for name, m in model.named_modules()
            if name.startswith(QUANTIZED_PREFIXES) and isinstance(m, (nn.Linear, nn.Embedding))
            and m.weight.shape[-1] % group_size == 0}


def full_size_bytes(bits: int | None = None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the 11B model as :func:`load_model` returns it in the faithful mode: ``bits`` packed
    (LLM + vocabulary, mlx-community's layout), the rest stored in ``dtype``, after every post-load
    transform of :meth:`VoiceChatModel.prepare` (fused projections, heads, RNNT gate table, float32
    codebooks, derived tables). Built on the ``meta`` device, so nothing is allocated; the 4-bit
    matrices stay in their stored layout (the CPU int4pack layout is the same size for float32 scales)."""
    config = VoiceChatConfig.full_size()
    packed = mlx_community_specs(build_model(config), bits) if bits else None
    model = build_model(config, "meta", packed)
    for module in model.modules():  # meta placeholders take the stored dtypes
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and not name.endswith("A_log"):
                setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=False))
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            module.scales = module.scales.to(dtype)
            module.biases = None if module.biases is None else module.biases.to(dtype)
    model.set_activation_dtype(torch.float32)
    model.init_constants("meta")
    return model_bytes(model.prepare(int4=False))


# Checkpoints converted by other tools may hold convolution weights in MLX's channels-last layout:
# permutations that bring them to PyTorch's, tried only when the stored shape does not fit.
_TO_TORCH_LAYOUT: dict[int, list[tuple[int, ...]]] = {4: [(0, 3, 1, 2)], 3: [(0, 2, 1), (2, 0, 1)]}


def _assign(model: nn.Module, key: str, tensor: torch.Tensor, where: Path) -> None:
    owner_path, _, name = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        owner = None
    slot: dict[str, Any] | None = None if owner is None else (
        owner._parameters if name in owner._parameters else owner._buffers if name in owner._buffers else None)
    if owner is None or slot is None:
        raise CheckpointError(f"{where}: unexpected tensor '{key}' (the model has no such parameter or buffer)")
    current: torch.Tensor = slot[name]
    if tuple(tensor.shape) != tuple(current.shape):
        for perm in _TO_TORCH_LAYOUT.get(tensor.dim(), []):
            if tuple(tensor.permute(perm).shape) == tuple(current.shape):
                tensor = tensor.permute(perm).contiguous()
                break
        else:
            config = getattr(model, "config", None)
            field = "" if config is None else ": " + config_field(config, key, tuple(current.shape),
                                                                   tuple(tensor.shape))
            raise CheckpointError(f"{where}: '{key}' has shape {list(tensor.shape)}, the model expects "
                                  f"{list(current.shape)}{field}")
    if slot is owner._parameters:
        slot[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        slot[name] = tensor


def quantize_spec(quantize: dict[str, Any] | QuantSpec | None) -> QuantSpec | None:
    """``load_model``'s ``quantize`` argument (``{"bits": 4 | 8, "group_size": 64}``) as a checked spec."""
    if quantize is None or isinstance(quantize, QuantSpec):
        spec = quantize
    elif isinstance(quantize, dict) and set(quantize) <= {"bits", "group_size", "mode"} and "bits" in quantize:
        spec = QuantSpec(int(quantize["bits"]), int(quantize.get("group_size", 64)), str(quantize.get("mode", "affine")))
    else:
        raise ValueError(f"quantize must be None or {{'bits': 4 | 8, 'group_size': 64}}, got {quantize!r}")
    if spec is not None:
        if spec.mode != "affine":
            raise ValueError(f"quantize: only MLX's affine mode is made at load (the cards' mode), got {spec.mode!r}")
        spec.validate("quantize")
    return spec


def open_checkpoint(folder: Path, tokenizer: str | os.PathLike | None = None,
                    quantize: QuantSpec | None = None) -> tuple[Checkpoint, Path]:
    """The checkpoint in ``folder``, in either layout, and the folder of its LLM tokenizer.

    NVIDIA's release (nested NeMo config) takes its tokenizer and base LLM config from ``tokenizer``
    (default: Nemotron-Nano-9B-v2's repo); with ``quantize`` it is read as the card made from it:
    what the mlx-community cards quantize, quantized as ``mx.quantize`` does, the rest in bf16."""
    if not is_release_folder(folder):
        if quantize is not None:
            raise ValueError(f"{folder}: quantize= makes a card from NVIDIA's float32 release; this is an "
                             "mlx-community checkpoint, whose layout is already fixed (load it as it is, or load "
                             "the 4-bit or 8-bit card)")
        return Checkpoint(folder), folder if tokenizer is None else resolve_tokenizer(tokenizer)
    tokenizer_folder = resolve_tokenizer(tokenizer)
    ckpt = ReleaseCheckpoint(folder, base_config(tokenizer_folder))
    if quantize is not None:
        ckpt.as_card(mlx_community_specs(build_model(ckpt.config), quantize.bits, quantize.group_size))
    return ckpt, tokenizer_folder


def load_model(path_or_repo_id: str | os.PathLike, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, weights: str = "auto", *, prepare: bool = True,
               tokenizer: str | os.PathLike | None = None,
               quantize: dict[str, Any] | QuantSpec | None = None, compile: bool | str = False) -> VoiceChatModel:
    """Load a NemotronLabs VoiceChat checkpoint (local folder or Hub repo id) for inference.

    Two layouts load: the mlx-community cards (flat config.json, shards), and NVIDIA's own release
    (NeMo's nested config.json, one float32 model.safetensors), detected by its config. The release
    ships no LLM tokenizer: ``tokenizer`` (a folder or Hub repo id, default
    ``nvidia/NVIDIA-Nemotron-Nano-9B-v2``) gives it, and its config.json the LLM sizes. For a card,
    ``tokenizer`` replaces the card's own. ``quantize={"bits": 4 | 8, "group_size": 64}`` reads the
    release as the card made from it (see docs/checkpoints.md): each matrix is quantized as it is
    read, so the load peaks near the quantized size.

    ``device``: None = mps > cuda > cpu. ``dtype`` picks the mode:

    * None (default), the faithful mode: every weight keeps its stored dtype, and each op computes in
      the dtype the MLX reference computes it in (float32 activations almost everywhere, bf16
      arithmetic in the few places it uses it). A bf16-stored checkpoint then gives the reference's
      discrete outputs exactly.
    * ``torch.float32``: every weight upcast to float32 (twice the memory of bf16 weights), float32
      arithmetic everywhere, as the reference computes a float32-stored checkpoint.
    * ``torch.bfloat16``, the fast mode: weights and activations in bf16. Not bit-faithful: near-ties
      flip (see docs/parity.md for how often).

    ``torch.float16`` is refused: fp16's range (65504) cannot hold the models' activations and mask
    constants (-1e30), and no reference computes in it.

    ``weights``: "packed" keeps the checkpoint's quantized matrices packed (4-bit: 8.9 GB instead of
    22 GB); "dequantized" expands them (to ``dtype``, or in the faithful mode to their scales' dtype,
    as MLX dequantizes); "auto" picks the fastest faithful path (:func:`auto_dequantizes`). ``prepare``:
    apply the speed-up transforms (:meth:`VoiceChatModel.prepare`); pass False for a model whose
    state_dict is exactly the checkpoint's.

    ``compile``: run the sessions' and engines' frame step under ``torch.compile``, one graph per frame
    (:meth:`VoiceChatModel.compile_step`; True is inductor, a string names the backend). Off by
    default: the first frames of each graph compile, and only CPU timings exist so far
    (docs/performance.md); on MPS it is a prototype (docs/mps.md).
    """
    if weights not in ("auto", "packed", "dequantized"):
        raise ValueError(f"weights must be 'auto', 'packed' or 'dequantized', got {weights!r}")
    spec = quantize_spec(quantize)
    folder = resolve_checkpoint(path_or_repo_id)
    device = default_device() if device is None else torch.device(device)
    check_dtype(dtype)
    ckpt, tokenizer_folder = open_checkpoint(folder, tokenizer, spec)
    with ckpt:
        quantized = ckpt.quantized_modules()
        if weights == "auto":
            weights = "dequantized" if auto_dequantizes(ckpt, quantized, device, dtype) else "packed"
        packed = quantized if weights == "packed" else {}
        # Placeholders on meta: the checkpoint's tensors replace them, stored dtypes included.
        model = build_model(ckpt.config, "meta", packed, dtype)
        expected = set(model.state_dict())
        seen = set()
        for key, tensor in ckpt.iter_tensors(dtype=dtype, device=device, keep_packed=bool(packed)):
            _assign(model, key, tensor, ckpt.file_of(key) if key in ckpt else folder)
            seen.add(key)
        missing = sorted(expected - seen)
        if missing:
            raise CheckpointError(f"{folder} ({ckpt.layout_name}): the checkpoint lacks {len(missing)} tensor(s) "
                                  f"the model needs, e.g. {', '.join(missing[:5])}")
    for module in model.modules():  # MLX dequantizes to the scales' dtype
        if dtype is None and isinstance(module, QuantizedEmbedding):
            scales = module.get_buffer("scales")
            if scales.is_floating_point():
                module.output_dtype = scales.dtype
    model.set_activation_dtype(torch.float32 if dtype is None else dtype)
    model.init_constants(device)
    model.eval().requires_grad_(False)
    model.source = str(path_or_repo_id)
    model.set_tokenizer(load_tokenizer(tokenizer_folder))
    return compiled(model.prepare() if prepare else model, compile)


def compiled(model: VoiceChatModel, compile: bool | str | Callable[..., Any]) -> VoiceChatModel:
    """``model`` with its frame step compiled as ``compile`` asks (False: as it is)."""
    if compile is False:
        return model
    if not model.prepared:
        raise ValueError("compile=True needs prepare=True: the compiled step runs the prepared model")
    return model.compile_step("inductor" if compile is True else compile)


def auto_dequantizes(ckpt: Checkpoint, quantized: dict[str, QuantSpec], device: torch.device,
                     dtype: torch.dtype | None) -> bool:
    """``weights="auto"``: whether to expand the packed matrices to dense float32 at load.

    With float32 activations (the faithful mode, or ``dtype=torch.float32``) a dense float32 matmul is
    the fastest faithful kernel on a CPU (one 4480x4480 layer, AVX2: 3.3 ms against 22 ms for the
    int4pack kernel with float32 activations) and on CUDA (whose int4pack kernel takes bf16 only),
    and one kernel launch instead of a dequantization per call. So on those devices the weights are
    expanded when every scale is float32 (bf16 scales make the reference sum in bf16, which the
    packed path reproduces) and the dense float32 matrices take at most a quarter of the device's
    memory; the 11B model does not fit that rule on a 24 GB machine and stays packed. On MPS the
    int4pack kernel takes float32 activations and reads a quarter of the bytes: packed. The fast
    mode (bf16 activations) keeps them packed everywhere.
    """
    if not quantized or dtype not in (None, torch.float32) or device.type not in ("cpu", "cuda"):
        return False
    dense = 0
    for path, spec in quantized.items():
        if ckpt.stored_dtype(f"{path}.scales") != "F32":
            return False
        rows, words = ckpt.shape(f"{path}.weight")
        dense += rows * words * 32 // spec.bits * 4
    return dense <= device_memory(device) // 4


def check_dtype(dtype: torch.dtype | None) -> None:
    """The modes :func:`load_model` offers: None (faithful), float32, bfloat16 (fast)."""
    if dtype == torch.float16:
        raise ValueError("dtype=torch.float16 is not supported: fp16 overflows on the models' activations and "
                         "mask constants (-1e30), and the reference never computes in it; use torch.bfloat16 for "
                         "the fast mode, or the default (None) for the faithful one")
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be None (faithful), torch.float32 or torch.bfloat16 (fast), got {dtype}")


def load_tokenizer(folder: Path) -> Any:
    """The LLM tokenizer in ``folder`` (``tokenizer.json`` + ``tokenizer_config.json``): the card's own, or
    the one ``load_model(tokenizer=...)`` names (NVIDIA's release ships none)."""
    from transformers import PreTrainedTokenizerFast

    if not (Path(folder) / "tokenizer.json").exists():
        raise CheckpointError(f"{folder}: no tokenizer.json (the LLM tokenizer: a card ships it; for NVIDIA's "
                              "release pass tokenizer= the Nemotron-Nano-9B-v2 folder or repo id)")
    return PreTrainedTokenizerFast.from_pretrained(str(folder))
