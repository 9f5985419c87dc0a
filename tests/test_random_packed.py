"""Random packed models built one module at a time (how the 11B shapes fit a 24 GB machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlx_oracle import synth_audio
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nvchat_torch as nv
from nvchat_torch.models.config import QuantSpec
from nvchat_torch.models.quant import (
    Int4PackedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_affine,
    unpack_codes,
)
from nvchat_torch.tiny import PACK_ELEMENTS, pack_affine, random_model


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_affine_is_quantize_affines_encoding(bits):
    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(bits)) / 16
    w[3, :64] = 0.25  # a constant group (zero range)
    for got, want in zip(pack_affine(w, bits, 64), quantize_affine(w, bits, 64)):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_packed_random_model_has_the_layout_load_model_gives_the_real_4bit_card(make_checkpoint):
    # MLX writes the real 4-bit card's layout (float32 scales, the rest bf16); load it packed, unprepared.
    card = nv.load_model(make_checkpoint(seed=0, bits=4, dtype="bfloat16", scales_dtype="float32"),
                         device="cpu", weights="packed", prepare=False)
    ours = random_model("tiny", seed=0, bits=4)
    want = {k: (tuple(v.shape), v.dtype) for k, v in card.state_dict().items()}
    got = {k: (tuple(v.shape), v.dtype) for k, v in ours.state_dict().items()}
    # The real cards store the preprocessor's window and filterbank in bf16 (full_size_manifest); the
    # tiny MLX oracle keeps them float32. They are read from neither: the log-mel computes its own.
    preprocessor = {k for k in want if ".preprocessor." in k}
    assert preprocessor and all(got[k] == (want[k][0], torch.bfloat16) for k in preprocessor)
    assert {k: v for k, v in got.items() if k not in preprocessor} == \
        {k: v for k, v in want.items() if k not in preprocessor}
    assert ours.dtype == card.dtype == torch.float32
    embed = ours.stt_model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding) and embed.output_dtype == torch.float32
    # The checkpoint buffers the float32 random model gets, from the same vocabulary.
    float_model = random_model("tiny", seed=0)
    for key in ("tts_model._control_codes", "tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation",
                "tts_model.tts_model.embed_subword.bos_eos_emb.special_flags"):
        assert torch.equal(ours.state_dict()[key], float_model.state_dict()[key]), key
    # Random, at the scales randomize_ gives: N(0, 1/fan_in) matrices, norms near their initial 1.
    w = ours.stt_model.llm.layers[1].mixer.down_proj.dequantized(torch.float32)
    assert 0.8 < w.std().item() * w.shape[1] ** 0.5 < 1.2
    norm = ours.stt_model.llm.layers[0].norm.weight.float()
    assert 0.8 < norm.mean().item() < 1.2 and norm.std().item() > 0.05


def test_packed_random_model_is_deterministic_and_streams():
    a, b = random_model("tiny", seed=4, bits=4), random_model("tiny", seed=4, bits=4)
    other = random_model("tiny", seed=5, bits=4)
    sa, sb, so = a.state_dict(), b.state_dict(), other.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["stt_model.lm_head.weight"], so["stt_model.lm_head.weight"])
    a.prepare()
    session = a.create_streaming_session(nv.StreamingOptions(system_prompt="hello", seed=0))
    wave = synth_audio(0.48)
    events = session.push_audio(wave, 16000)
    audio = [e for e in events if e.kind == "audio"]
    assert len(audio) == 6 and all(np.isfinite(e.samples).all() and e.samples.shape == (1764,) for e in audio)


class LargestFloat32(TorchDispatchMode):
    """The largest float32 CPU tensor any op makes while active (bytes)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu":
                self.largest = max(self.largest, t.numel() * 4)
        return out


def test_packed_build_never_holds_a_vocabulary_matrix_in_float32():
    # 32768 x 512 vocabulary matrices: 67 MB each in float32. The packed build makes them
    # PACK_ELEMENTS at a time; every other float32 tensor of this config is smaller still.
    with LargestFloat32() as float32:
        model = random_model("tiny", bits=4, hidden=512, vocab=32768)
    vocab = model.stt_model.lm_head
    assert isinstance(vocab, QuantizedLinear) and (vocab.out_features, vocab.in_features) == (32768, 512)
    assert float32.largest <= PACK_ELEMENTS * 4 < 32768 * 512 * 4
    with LargestFloat32() as float32:  # what the check catches: the model built whole in float32
        random_model("tiny", hidden=512, vocab=32768)
    assert float32.largest >= 32768 * 512 * 4


def test_int4pack_conversion_in_row_blocks_is_the_whole_matrix_conversion():
    # Int4PackedLinear converts 64-row blocks (16 MB of int32 codes at a time, not 4.7 GB for the 11B
    # heads); 1000 rows of 4480 (padded to 1008) take two blocks, the last one partial.
    spec = QuantSpec(4, 64)
    source = QuantizedLinear(4480, 1000, False, spec, torch.float32, device="meta")
    w = torch.randn(1000, 4480, generator=torch.Generator().manual_seed(0)) / 67
    source.weight, source.scales, source.biases = pack_affine(w, 4, 64)
    packed = Int4PackedLinear(source, torch.bfloat16)
    words = F.pad(source.weight.view(torch.int32), (0, 0, 0, 8)).view(torch.uint32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(words, 4).to(torch.int32), 2)
    assert torch.equal(packed.packed, whole)
    x = torch.randn(1, 4480, generator=torch.Generator().manual_seed(1))
    want = F.linear(x, source.dequantized(torch.float32))
    assert (packed(x) - want).abs().max() < 2e-2 * want.abs().max()
