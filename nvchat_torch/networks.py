"""The whole NemotronLabs VoiceChat network: the checkpoint's module tree (``stt_model``, ``tts_model``)
and what the frame loop drives of it. Sessions and the engine take this; :mod:`nvchat_torch.model`
adds the ways to run it and the loader."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from .diagnostics import model_bytes, return_freed_memory
from .loading.checkpoint import cast
from .models import cpu_kernels
from .models.config import VoiceChatConfig
from .models.int4pack import Int4Kernel
from .models.language_heads import fuse_heads
from .models.layers import FusedOnCpu, Linear, fused_cpu_paths, swap_modules
from .models.nemotron_h import NemotronHModel
from .models.perception import Perception
from .models.quant import Int4PackedLinear, QuantizedEmbedding, QuantizedLinear, pack_int4
from .models.rnnt import FusedRnntDecoder, RnntDecoder, RnntJoint, RnntTranscriber
from .models.tts import SpeechDecoder, TTSPrompt
from .runtime.compiled_step import StepCompiler
from .runtime.speech_track import SpeechTracks

__all__ = ["DuplexSTTModel", "VoiceChatNetworks", "recast_error"]

_MAKING_TRACKS = threading.Lock()  # sessions on several threads may ask a model for its tracks first at once


class DuplexSTTModel(nn.Module):
    """``stt_model``: perception, the RNNT transcript branch, and the Nemotron-H LLM with its
    shared token embedding and two vocabulary heads (text and function call)."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        t = config.text_config
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.llm = NemotronHModel(t)
        self.lm_head = Linear(t.hidden_size, t.vocab_size, bias=False)
        self.function_head = Linear(t.hidden_size, t.vocab_size, bias=False)
        self.perception = Perception(config.audio_config)
        self.rnnt_decoder = RnntDecoder(config.audio_config.decoder)
        self.rnnt_joint = RnntJoint(config.audio_config.joint)


class VoiceChatNetworks(nn.Module):
    """Beside the module tree, the state the sessions read: devices, dtypes, the post-load transforms and
    the tokenizer."""

    def __init__(self, config: VoiceChatConfig):
        super().__init__()
        self.config = config
        self.stt_model = DuplexSTTModel(config)
        self.tts_model = SpeechDecoder(config.tts_config, config.codec_config, pad_token_id=config.pad_token_id,
                                       eos_token_id=config.eos_token_id, speaker=config.speaker)
        # The TTS timeline is the speaker prompt, then one position per LLM position: its rotary
        # tables are built for all of them now, never while a session steps.
        self.tts_model.tts_model.backbone.reserve_positions(
            config.text_config.max_position_embeddings + self.tts_model.audio_prompt_latents.latents().shape[1])
        self.tokenizer = None
        self.fused_heads: nn.Module | None = None  # set by prepare(): lm_head and function_head as one matmul
        self._tts_prompt: TTSPrompt | None = None
        self._speech_tracks: SpeechTracks | None = None
        self._silence: torch.Tensor | None = None  # silence_embedding()
        self.source = "random weights"
        self.prepared = False
        self.fused_cpu_off: str | None = "not prepared"  # why the fused CPU kernels don't run (None: they do)
        self.step_compiler: StepCompiler | None = None  # compile_step(): the frame step runs compiled

    # ---- parts the sessions drive (not registered: their weights live in stt_model)
    @property
    def transcriber(self) -> RnntTranscriber:
        stt = self.stt_model
        return RnntTranscriber(stt.rnnt_decoder, stt.rnnt_joint, self.config.rnnt_blank_id,
                               self.config.audio_config.max_symbols)

    @property
    def device(self) -> torch.device:
        return self.stt_model.perception.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype: float32 (the reference's flow) unless the opt-in fast mode set bf16/fp16."""
        return self.stt_model.perception.encoder.activation_dtype

    def set_activation_dtype(self, dtype: torch.dtype) -> None:
        """Where the reference promotes to float32 (perception, RNNT, TTS backbone and heads), compute in
        ``dtype`` instead: float32 is the faithful default, bf16/fp16 the fast mode. Call before
        :meth:`init_constants` and :meth:`prepare`."""
        for module in self.modules():
            if hasattr(module, "activation_dtype"):
                setattr(module, "activation_dtype", dtype)
        self.forget_speech_tracks()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        """(Re)compute every derived constant (windows, DFT bases, rotary tables) on ``device``."""
        self.stt_model.perception.init_constants(device)
        self.stt_model.rnnt_decoder.init_constants(device)
        self.tts_model.init_constants(device)
        self.forget_speech_tracks()

    def prepare(self, int4: bool = True, kernel: Int4Kernel | None = None, fused_cpu: bool | None = None) -> Self:
        """Speed-up transforms applied after loading (they change the state_dict layout, not the outputs):
        fused QKV / gate-up / MoG head projections, both vocabulary heads as one matmul (which replaces
        them: no second copy), stacked codebooks, the RNNT gate table, and 4-bit packed linears on
        torch's int4pack kernel where the device has one that passes its self-test (computing in the
        activation dtype: see :func:`~nvchat_torch.models.quant.pack_int4`). ``kernel``: the int4pack layout and
        op to pack for (default: the device's, :func:`~nvchat_torch.models.int4pack.int4_kernel`; its stand-in runs
        the MPS or CUDA branch on a CPU). ``fused_cpu`` (default: on a CPU in float32): the streaming step's
        fused CPU kernels (:mod:`~nvchat_torch.models.cpu_kernels`; built on first use, and skipped, with the
        reason in :meth:`describe`, where they can't be built or fail their self-test)."""
        return_freed_memory()  # what the load freed: the transforms below then start from what is held
        self.stt_model.perception.fuse()
        swap_modules(self.stt_model, RnntDecoder, FusedRnntDecoder)
        self.stt_model.llm.fuse()
        self.tts_model.fuse()
        if self.fused_heads is None:
            self.fused_heads = fuse_heads(self.stt_model.lm_head, self.stt_model.function_head, release=True)
            del self.stt_model.lm_head, self.stt_model.function_head
        if int4:
            pack_int4(self, dtype=self.dtype, kernel=kernel)
        if fused_cpu is None:
            fused_cpu = self.device.type == "cpu" and self.dtype == torch.float32
        self.fused_cpu_off = cpu_kernels.status() if fused_cpu else "not asked for"
        if self.fused_cpu_off is None:
            for module in self.modules():  # each module that has a fused step decides on its own tensors
                if isinstance(module, FusedOnCpu):
                    module.use_cpu_kernels()
        # Streaming runs the codec's encoder once, for the speaker prompt (deterministic per checkpoint):
        # made now, the encoder is released, as the heads were above (175 MiB at full size).
        self.tts_prompt()
        self.tts_model.audio_codec.release_encoder()
        return_freed_memory()
        self.prepared = True
        self.forget_speech_tracks()  # made by the unprepared layers, which round differently
        return self.requires_grad_(False)  # the fused modules' new parameters too

    def compile_step(self, backend: str | Callable[..., Any] = "inductor", mode: str | None = None) -> Self:
        """Run every frame step of this model's sessions and engines (those made from now on) under
        ``torch.compile`` whole, one graph per frame (:mod:`~nvchat_torch.runtime.compiled_step`). ``backend``:
        "inductor" (generated kernels: C++ on a CPU, Triton on CUDA, Metal on MPS), or "aot_eager" /
        "eager" (traced only: what the graph-count tests use). ``mode``: default ``"reduce-overhead"``
        (CUDA graphs) on CUDA. The fused CPU kernels are switched off: the compiler fuses the composite
        code, the path MPS and CUDA run. The first frames of each new graph compile (see
        docs/performance.md for how long); the compiler's caches let a second process start warm."""
        if not self.prepared:
            raise RuntimeError("compile_step: prepare() the model first (load_model does)")
        compiler = StepCompiler(self.device, backend, mode)
        for module, flag in fused_cpu_paths(self):
            setattr(module, flag, False)
        self.fused_cpu_off = "not used under compile_step (the compiled step fuses the composite code)"
        self.step_compiler = compiler
        self.forget_speech_tracks()  # made with the fused CPU kernels, which the prefill now goes without
        return self

    # ---- casts. A prepared model computes in the dtypes load_model chose, so it refuses a cast that
    # would round its float32 islands. An unprepared one casts as the reference casts a model (A_log
    # stays float32, see checkpoint.cast); then call set_activation_dtype, init_constants (the cast
    # rounded the float32 constants too) and prepare, as load_tiny_model does.
    def to(self, *args: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if not self.prepared:
            self.forget_speech_tracks()
            return cast(self, *args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            raise recast_error(f".to({dtype})")
        if device is None or torch.device(device) == self.device:
            return self  # the activation dtype already: nothing to convert (and no constant to round)
        if self.int4_packed():
            raise RuntimeError(f"model.to({device}): the 4-bit weights are packed for {self.device}'s int4 kernel, "
                               f"in a layout other devices read differently; load the model there instead: "
                               f"nvchat_torch.load_model(path, device={str(device)!r})")
        return super().to(device=device)

    def _cast(self, dtype: torch.dtype, call: str) -> Self:
        if self.prepared:
            raise recast_error(call)
        self.forget_speech_tracks()
        return cast(self, dtype)

    def half(self) -> Self:  # type: ignore[override]
        return self._cast(torch.float16, ".half()")

    def bfloat16(self) -> Self:  # type: ignore[override]
        return self._cast(torch.bfloat16, ".bfloat16()")

    def float(self) -> Self:  # type: ignore[override]
        return self._cast(torch.float32, ".float()")

    def double(self) -> Self:  # type: ignore[override]
        return self._cast(torch.float64, ".double()")

    def int4_packed(self) -> bool:
        return any(isinstance(m, Int4PackedLinear) for m in self.modules())

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tts_model.tts_model.set_vocabulary(tokenizer.get_vocab())

    def vocabulary_heads(self) -> tuple[nn.Module, nn.Module | None]:
        """What :func:`~nvchat_torch.models.language_heads.language_heads` takes: the fused heads once
        :meth:`prepare` made them (and the second None), else the text and function heads."""
        if self.fused_heads is not None:
            return self.fused_heads, None
        return self.stt_model.lm_head, self.stt_model.function_head

    def tts_prompt(self) -> TTSPrompt:
        """The speaker warmup prompt: deterministic per checkpoint, so computed once (it runs the codec
        encoder; :meth:`prepare` makes it, then releases the encoder), on the model's device."""
        if self._tts_prompt is None:
            with torch.inference_mode():
                self._tts_prompt = self.tts_model.prompt()
            return_freed_memory()  # the codec encoder's transients (~280 MB of heap at full size, kept by glibc)
        elif self._tts_prompt.codes.device != self.device:  # the model moved since
            self._tts_prompt = self._tts_prompt.to(self.device)
        return self._tts_prompt

    def silence_embedding(self) -> torch.Tensor:
        """What a step off the clock hears on the user channel, ``[1, 1, H]`` in the activation dtype:
        NVIDIA's silence embedding (:meth:`Perception.silence`), the same for every session, so computed
        once, on the model's device."""
        if self._silence is None or self._silence.device != self.device:
            with torch.inference_mode():
                self._silence = self.stt_model.perception.silence().to(self.dtype)
        return self._silence

    def speech_tracks(self) -> SpeechTracks:
        """The TTS prefill tracks this model's sessions share (:mod:`~nvchat_torch.runtime.speech_track`), made on
        first use; ``speech_tracks().max_bytes`` bounds them (0: none kept, each session runs its own steps)."""
        if self._speech_tracks is None:
            with _MAKING_TRACKS:
                if self._speech_tracks is None:
                    self._speech_tracks = SpeechTracks(self.tts_model, self.tts_prompt)
        return self._speech_tracks

    def forget_speech_tracks(self) -> None:
        """Drop the prefill tracks (if any were made): what changes the TTS's weights or how it computes
        (a cast, ``prepare``, ``compile_step``, adapters; a training step in place: call this) makes them stale."""
        if self._speech_tracks is not None:
            self._speech_tracks.clear()

    def describe(self) -> str:
        """The model in one paragraph: size, mode, and the kernel path each kind of layer takes."""
        t = self.config.text_config
        n = sum(p.numel() for p in self.parameters())
        mode = "faithful (float32 activations, weights as stored)" if self.dtype == torch.float32 else \
            f"fast ({self.dtype} activations)"
        paths: dict[str, int] = {}
        for m in self.modules():
            if isinstance(m, Int4PackedLinear):
                key = f"4-bit linears: {m.kernel.name} with {m.dtype} activations"
            elif isinstance(m, QuantizedLinear):  # a fallback says which kernel failed and why
                key = (f"{m.spec.mode} {m.spec.bits}-bit linears: dequantized on every call "
                       f"({m.scales.dtype} scales)" + (f"; fallback: {m.fallback}" if m.fallback else ""))
            elif isinstance(m, QuantizedEmbedding):
                key = f"{m.spec.mode} {m.spec.bits}-bit embedding: rows dequantized when read"
            elif isinstance(m, nn.Linear):
                key = f"dense linears: {m.weight.dtype} weights"
            else:
                continue
            paths[key] = paths.get(key, 0) + 1
        lines = [f"{self.source}: {len(t.hybrid_override_pattern)}-layer Nemotron-H (hidden {t.hidden_size}), "
                 f"{n / 1e6:.1f} M parameters ({model_bytes(self) / 1e9:.2f} GB as held), {mode}, on {self.device}"]
        lines += [f"  {key}: {count}" for key, count in sorted(paths.items())]
        fused = sum(1 for m in self.modules() if getattr(m, "fused_on_cpu", False))
        lines.append(f"  fused CPU kernels: {fused} modules" if self.fused_cpu_off is None else
                     f"  fused CPU kernels: not used ({self.fused_cpu_off})")
        lines.append(f"  {self.step_compiler.describe()}" if self.step_compiler is not None else
                     "  frame step: eager (load_model(..., compile=True) compiles it)")
        # ops the MPS backend ran on the CPU, as diagnostics.CpuFallbackRecorder saw them
        lines += [f"  fallback: {op} ran on the CPU ({cost})"
                  for op, cost in sorted(getattr(self, "cpu_fallbacks", {}).items())]
        return "\n".join(lines)


def recast_error(call: str) -> RuntimeError:
    """Why a loaded (prepared) model refuses ``call``, a cast that would round its float32 islands."""
    return RuntimeError(
        f"model{call}: a loaded model computes in the dtypes load_model chose for it (float32 islands such "
        f"as the Mamba A and state and the RVQ distance search included), and a cast would round them; "
        f"load it in the mode you want instead: nvchat_torch.load_model(path, dtype=None) (faithful), "
        f"dtype=torch.float32, or dtype=torch.bfloat16 (fast)")
