"""Nemotron-H (``stt_model.llm``), the fused input and both vocabulary heads against the MLX reference.

The reference is ``DuplexSTTModel`` (``ref.model.stt_model``) run on the same tiny random
checkpoints (float32, 8-bit, 4-bit), stepped with its own caches.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_oracle import Reference, full_size_manifest, to_np
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nvchat_torch.loading.checkpoint import Checkpoint, cast
from nvchat_torch.models.config import QuantSpec, TextConfig, VoiceChatConfig
from nvchat_torch.models.language_heads import fuse_heads, fused_input, language_heads
from nvchat_torch.models.layers import KV_BLOCK
from nvchat_torch.models.nemotron_h import KVCache, LanguageRows, MambaCache, NemotronHAttention, NemotronHModel
from nvchat_torch.models.quant import quantize_modules

LANGUAGE = ("stt_model.embed_tokens", "stt_model.llm.", "stt_model.lm_head", "stt_model.function_head")
# (checkpoint fixture, packed): a float checkpoint has nothing to keep packed.
VARIANTS = [("ckpt_f32", False), ("ckpt_q8", False), ("ckpt_q8", True), ("ckpt_q4", False), ("ckpt_q4", True)]
VARIANT_IDS = ["f32", "q8-dequantized", "q8-packed", "q4-dequantized", "q4-packed"]
MX_DTYPES = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16}


class Language(nn.Module):
    """The ``stt_model`` language pieces under their checkpoint names (less the ``stt_model.`` prefix)."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.llm = NemotronHModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.function_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def at(model, position: int, batch: int = 1, cache=None) -> LanguageRows:
    """``batch`` rows at ``position``: a streaming step's placement, with room for it reserved in ``cache``
    (the frame step does that before each step; a new cache holds one 256-slot block)."""
    capacity = KV_BLOCK
    if cache is not None:
        cache.reserve(position + 1)
        capacity = cache.capacity
    return LanguageRows.make(torch.full((batch,), position), capacity)

def _strip(key: str) -> str:
    return key[len("stt_model."):]


def load_language(path, packed: bool, dtype: torch.dtype = torch.float32) -> Language:
    """Strict load of the language tensors, dequantized, or packed into QuantizedLinear/Embedding."""
    ckpt = Checkpoint(path)
    model = cast(Language(ckpt.config.text_config), dtype)  # A_log stays float32, as the reference casts
    if packed:
        specs = {_strip(p): s for p, s in ckpt.quantized_modules().items() if p.startswith(LANGUAGE)}
        assert specs, "a packed load needs a quantized checkpoint"
        quantize_modules(model, specs)
    state = {_strip(k): v for k, v in ckpt.iter_tensors(dtype=dtype, keep_packed=packed) if k.startswith(LANGUAGE)}
    model.load_state_dict(state, strict=True)
    return model.eval()


def inputs(seed: int, steps: int, hidden: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, steps, hidden)).astype(np.float32)


def rel_err(ours: torch.Tensor, ref: np.ndarray) -> float:
    """Max abs error relative to the reference's scale (max |ref|)."""
    return float(np.abs(ours.detach().float().numpy() - ref).max() / np.abs(ref).max())


def reference_steps(ref, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    stt = ref.model.stt_model
    cache = stt.make_cache()
    out = []
    for t in range(x.shape[1]):
        o = stt(mx.array(x[:, t:t + 1]), cache=cache)
        out.append((to_np(o.hidden_states), to_np(o.text_logits), to_np(o.function_logits)))
    return out


# --------------------------------------------------------------------------------------
# Parity with the reference


@pytest.mark.parametrize("ckpt_name,packed", VARIANTS, ids=VARIANT_IDS)
def test_steps_and_offline_pass_match_reference(request, reference, ckpt_name, packed):
    path = request.getfixturevalue(ckpt_name)
    ref = reference(path)
    model = load_language(path, packed)
    x = inputs(1, 16)
    cache = model.llm.new_cache()
    with torch.no_grad():
        for t, (ref_h, ref_text, ref_func) in enumerate(reference_steps(ref, x)):
            h = model.llm(torch.from_numpy(x[:, t:t + 1]), cache)
            heads = language_heads(h, model.lm_head, model.function_head)
            assert rel_err(h, ref_h) <= 1e-4, f"step {t}: hidden"
            assert rel_err(heads.text_logits, ref_text) <= 1e-4, f"step {t}: text logits"
            assert rel_err(heads.function_logits, ref_func) <= 1e-4, f"step {t}: function logits"
        full = ref.model.stt_model(mx.array(x))
        h = model.llm(torch.from_numpy(x))
        assert rel_err(h, to_np(full.hidden_states)) <= 1e-4
        assert rel_err(model.lm_head(h), to_np(full.text_logits)) <= 1e-4
        assert rel_err(model.function_head(h), to_np(full.function_logits)) <= 1e-4


def reference_closed_loop(ref, audio: np.ndarray, weight: float, pad: int):
    stt = ref.model.stt_model
    cache = stt.make_cache()
    text, func, ids, fused_inputs = pad, pad, [], []
    for t in range(audio.shape[1]):
        fused = (stt.embed_tokens(mx.array([[text]])) + mx.array(audio[:, t:t + 1])
                 + weight * stt.embed_tokens(mx.array([[func]])))
        out = stt(fused, cache=cache)
        text, func = int(mx.argmax(out.text_logits[:, -1])), int(mx.argmax(out.function_logits[:, -1]))
        ids.append((text, func))
        fused_inputs.append(to_np(fused))
    return ids, fused_inputs


@pytest.mark.parametrize("ckpt_name,packed", VARIANTS, ids=VARIANT_IDS)
def test_closed_loop_greedy_ids_match_reference(request, reference, ckpt_name, packed):
    path = request.getfixturevalue(ckpt_name)
    config = Checkpoint(path).config
    audio = inputs(2, 40)
    ref_ids, ref_fused = reference_closed_loop(reference(path), audio, config.function_channel_weight,
                                               config.pad_token_id)
    model = load_language(path, packed)
    cache = model.llm.new_cache()
    text = func = torch.full((1, 1), config.pad_token_id)
    ids = []
    with torch.no_grad():
        for t in range(audio.shape[1]):
            fused = fused_input(model.embed_tokens, text, torch.from_numpy(audio[:, t:t + 1]), func,
                                config.function_channel_weight)
            assert rel_err(fused, ref_fused[t]) <= 1e-6, f"step {t}: fused input"
            out = language_heads(model.llm(fused, cache), model.lm_head, model.function_head)
            text, func = out.text_ids, out.function_ids
            ids.append(out.ids)
    ids = [tuple(row) for row in torch.cat(ids).reshape(-1, 2).tolist()]
    assert ids == ref_ids
    assert len(set(ids)) > 5, "the loop should visit several ids, or it checks little"


def test_finite_time_step_limit_clamps_dt_like_reference(ckpt_f32):
    """With finite ``time_step_limit`` bounds, dt is clipped (the real checkpoint has none)."""
    limit = (0.7, 1.2)
    ref = Reference(ckpt_f32)  # a private copy: its mixers are changed below
    for layer in ref.model.stt_model.llm.layers:
        if layer.block_type == "M":
            layer.mixer.time_step_limit = limit
    plain = load_language(ckpt_f32, packed=False)
    config = Checkpoint(ckpt_f32).config.text_config
    clamped = Language(TextConfig(**{**config.__dict__, "time_step_limit": limit}))
    clamped.load_state_dict(plain.state_dict())
    x = inputs(8, 12)
    with torch.no_grad():
        h = clamped.llm(torch.from_numpy(x))
        assert rel_err(h, to_np(ref.model.stt_model(mx.array(x)).hidden_states)) <= 1e-4
        assert (h - plain.llm(torch.from_numpy(x))).abs().max() > 1e-2  # the clip did change dt
        cache = clamped.llm.new_cache()
        for t, (ref_h, _, _) in enumerate(reference_steps(ref, x)):
            assert rel_err(clamped.llm(torch.from_numpy(x[:, t:t + 1]), cache), ref_h) <= 1e-4


def test_step_run_equals_offline_and_prefill_past_a_kv_block(ckpt_f32):
    """300 single steps (the KV cache grows past its first 256-slot block, the SSD scan takes two
    chunks) equal one offline pass and a two-part cached prefill."""
    model = load_language(ckpt_f32, packed=False)
    x = torch.from_numpy(inputs(3, 300))
    with torch.no_grad():
        offline = model.llm(x)
        cache = model.llm.new_cache()
        steps = torch.cat([model.llm(x[:, t:t + 1], cache) for t in range(x.shape[1])], 1)
        # the streaming step (one row at its position, as a session's frame runs it)
        rows_cache = model.llm.new_cache(dtype=torch.float32)
        streamed = torch.cat([model.llm.forward_step(x[:, t:t + 1], rows_cache, at(model, t, cache=rows_cache))
                              for t in range(x.shape[1])], 1)
        prefill_cache = model.llm.new_cache()
        prefill = torch.cat([model.llm(x[:, :100], prefill_cache), model.llm(x[:, 100:], prefill_cache)], 1)
    scale = offline.abs().max()
    assert (steps - offline).abs().max() <= 1e-5 * scale
    assert (streamed - offline).abs().max() <= 1e-5 * scale
    assert (prefill - offline).abs().max() <= 1e-5 * scale
    assert cache.offset == prefill_cache.offset == 300
    kv = [c for c in cache.layers if isinstance(c, KVCache)]
    assert kv and all(c.offset == 300 and c.keys.shape[2] == 512 for c in kv)
    for a, b in zip(cache.layers, prefill_cache.layers):  # the caches themselves agree too
        if isinstance(a, MambaCache):
            torch.testing.assert_close(a.ssm_state, b.ssm_state, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.conv_state, b.conv_state, rtol=1e-4, atol=1e-5)
        elif isinstance(a, KVCache):
            torch.testing.assert_close(a.keys[:, :, :300], b.keys[:, :, :300], rtol=1e-4, atol=1e-4)


def test_cache_dtypes_follow_reference_promotion_bf16(make_checkpoint, reference):
    """bf16 weights (4-bit, bf16 scales): bf16 steps (as the streaming prompt prefill), then fp32 steps
    (as audio frames). Policy, as in MLX: SSM state float32 always; conv state in the first input's
    dtype, promoted by a wider input; KV buffer in the first write's dtype (fp32 writes are rounded
    to it) until it grows by a block, which promotes it."""
    path = make_checkpoint(seed=0, bits=4, dtype="bfloat16")
    model = load_language(path, packed=True, dtype=torch.bfloat16)
    assert all(layer.mixer.A_log.dtype == torch.float32 for layer in model.llm.layers if layer.block_type == "M")
    stt = reference(path).model.stt_model
    # A float32 cache: the first (bf16) writes must still set bf16 buffers, as MLX allocates on first use.
    ref_cache, cache = stt.make_cache(), model.llm.new_cache(dtype=torch.float32)
    ours = [c for c in cache.layers if c is not None]
    x = inputs(4, 266)
    errors = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            xm, xt = mx.array(x[:, t:t + 1]), torch.from_numpy(x[:, t:t + 1])
            if t < 4:
                xm, xt = xm.astype(mx.bfloat16), xt.to(torch.bfloat16)
            ref_h = stt(xm, cache=ref_cache).hidden_states
            h = model.llm(xt, cache)
            assert h.dtype == MX_DTYPES[ref_h.dtype]
            for i, (a, b) in enumerate(zip(ours, ref_cache)):
                if isinstance(a, MambaCache):
                    got, want = (a.conv_state.dtype, a.ssm_state.dtype), (b[0].dtype, b[1].dtype)
                else:
                    got, want = (a.keys.dtype, a.values.dtype), (b.keys.dtype, b.values.dtype)
                assert got == tuple(MX_DTYPES[d] for d in want), f"step {t}, cache {i}: {got} vs {want}"
            ref_h = to_np(ref_h)
            errors.append(np.linalg.norm(h.float().numpy() - ref_h) / np.linalg.norm(ref_h))
    kv = next(c for c in ours if isinstance(c, KVCache))
    assert kv.keys.dtype == torch.float32 and kv.keys.shape[2] == 512  # promoted when it grew
    assert ours[0].conv_state.dtype == torch.float32
    # bf16 rounding (and MLX's bf16 quantized matmul) disturbs the first steps; fp32 steps settle,
    # up to rare spikes where the random tiny model amplifies rounding.
    assert max(errors[:64]) < 0.3
    assert np.median(errors[64:]) < 2e-3 and max(errors[64:]) < 3e-2


# --------------------------------------------------------------------------------------
# Layout


def test_full_size_layout_matches_checkpoint_manifest():
    config = VoiceChatConfig.full_size().text_config
    with torch.device("meta"):
        model = cast(Language(config), torch.bfloat16)

    def layout(module):
        return {f"stt_model.{k}": (tuple(v.shape), str(v.dtype).replace("torch.", ""))
                for k, v in module.state_dict().items()}

    def expected(kind):
        return {k: v for k, v in full_size_manifest(kind).items() if k.startswith(LANGUAGE)}

    assert layout(model) == expected("bf16")
    specs = {name: QuantSpec(bits=4, group_size=64) for name, m in model.named_modules()
             if isinstance(m, (nn.Linear, nn.Embedding))}
    quantize_modules(model, specs)
    assert layout(model) == expected("4bit")


def test_padded_in_proj_is_tolerated(ckpt_f32):
    """Leading 2*d_mlp padding rows of a Mamba in_proj (some Nemotron-H exports) are skipped."""
    plain = load_language(ckpt_f32, packed=False)
    state = plain.state_dict()
    rng = torch.Generator().manual_seed(0)
    keys = [k for k in state if k.endswith("mixer.in_proj.weight")]
    for k in keys:
        state[k] = torch.cat([torch.randn(6, state[k].shape[1], generator=rng), state[k]])
    padded = Language(Checkpoint(ckpt_f32).config.text_config)
    padded.load_state_dict(state, strict=True)
    x = torch.from_numpy(inputs(5, 12))
    with torch.no_grad():
        torch.testing.assert_close(padded.llm(x), plain.llm(x), rtol=1e-6, atol=1e-6)
    state[keys[0]] = state[keys[0]][1:]  # an odd surplus is not a padding
    with pytest.raises(ValueError, match=r"in_proj\.weight.*even padding"):
        Language(Checkpoint(ckpt_f32).config.text_config).load_state_dict(state)


@pytest.mark.parametrize("ckpt_name,packed", [("ckpt_f32", False), ("ckpt_q4", True)])
def test_fuse_keeps_outputs(request, ckpt_name, packed):
    path = request.getfixturevalue(ckpt_name)
    model, fused = load_language(path, packed), load_language(path, packed)
    fused.llm.fuse()
    heads = fuse_heads(fused.lm_head, fused.function_head)
    attention = [l.mixer for l in fused.llm.layers if isinstance(l.mixer, NemotronHAttention)]
    assert attention and all(a.qkv_proj is not None and not hasattr(a, "q_proj") for a in attention)
    x = torch.from_numpy(inputs(6, 20))
    with torch.no_grad():
        torch.testing.assert_close(fused.llm(x), model.llm(x), rtol=1e-6, atol=1e-6)
        c1, c2 = model.llm.new_cache(), fused.llm.new_cache()
        for t in range(x.shape[1]):
            a = language_heads(model.llm(x[:, t:t + 1], c1), model.lm_head, model.function_head)
            b = language_heads(fused.llm(x[:, t:t + 1], c2), heads)
            torch.testing.assert_close(b.text_logits, a.text_logits, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(b.function_logits, a.function_logits, rtol=1e-6, atol=1e-6)
            assert torch.equal(b.ids, a.ids)


# --------------------------------------------------------------------------------------
# Step path and errors


class _NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor value back to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                    torch.ops.aten.item.default):
            raise AssertionError(f"host sync in the step path: {func}")
        return func(*args, **(kwargs or {}))


def test_step_path_has_no_host_sync(ckpt_q4):
    model = load_language(ckpt_q4, packed=True)
    model.llm.fuse()
    heads = fuse_heads(model.lm_head, model.function_head)
    cache = model.llm.new_cache()
    text = func = torch.full((1, 1), 12)
    audio = torch.from_numpy(inputs(7, 3))
    with torch.no_grad(), _NoHostSync():
        for t in range(3):
            fused = fused_input(model.embed_tokens, text, audio[:, t:t + 1], func, 2.0)
            out = language_heads(model.llm(fused, cache), heads)
            text, func = out.text_ids, out.function_ids
    assert out.ids.shape == (1, 1, 2)


def test_bad_input_raises_clear_errors(ckpt_f32):
    model = load_language(ckpt_f32, packed=False)
    cache = model.llm.new_cache()
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, time, 64\], got \[1, 1, 32\]"):
        model.llm(torch.zeros(1, 1, 32))
    with pytest.raises(ValueError, match=r"one position.*got \[1, 2, 64\]"):
        model.llm.forward_step(torch.zeros(1, 2, 64), cache, at(model, 0))
    with pytest.raises(ValueError, match="batch 2, the cache batch 1"):
        model.llm.forward_step(torch.zeros(2, 1, 64), cache, at(model, 0, 2))
    config = Checkpoint(ckpt_f32).config.text_config
    other = NemotronHModel(TextConfig(**{**config.__dict__, "hybrid_override_pattern": "*-M"}))
    with pytest.raises(ValueError, match="cache has 3 layers, the model 8"):
        model.llm.forward_step(torch.zeros(1, 1, 64), other.new_cache(), at(model, 0))
    wrong = model.llm.new_cache()
    wrong.layers[0], wrong.layers[3] = wrong.layers[3], wrong.layers[0]
    with pytest.raises(ValueError, match=r"cache layer 0 is KVCache, layer 0 \('M'\) needs MambaCache"):
        model.llm.forward_step(torch.zeros(1, 1, 64), wrong, at(model, 0))
    with pytest.raises(ValueError, match=r"ids \[1, 2\] \(text\) and \[1, 1\] \(function\)"):
        fused_input(model.embed_tokens, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1, 64),
                    torch.zeros(1, 1, dtype=torch.long), 2.0)
    with pytest.raises(ValueError, match="unsupported layer type 'E'"):
        NemotronHModel(TextConfig(**{**config.__dict__, "hybrid_override_pattern": "ME"}))
