"""NVIDIA's own release (nested NeMo config, one float32 model.safetensors, no tokenizer), against MLX.

The tiny release is written here: random float32 weights of the tiny preset in one file (integer
buffers int64, as NeMo saves them), NeMo's nested config, and a separate tokenizer folder standing in
for Nemotron-Nano-9B-v2 (its tokenizer and config.json). Its TTS has 6 layers: the mapping leaves
``sliding_window_pattern`` to the default 6, and mlx-vlm's Gemma-3 needs at least that many layers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_oracle import full_size_manifest, synth_audio
from safetensors.torch import load_file, save_file
from test_layouts import assert_same_stream
from test_session import PROMPT, run_reference_stream, run_stream

import nvchat_torch as nv
from nvchat_torch.convert import main as convert_main
from nvchat_torch.loading.checkpoint import BadWeightsWarning, Checkpoint, CheckpointError
from nvchat_torch.loading.nvidia_release import (
    NANO_9B_V2,
    NANO_9B_V2_BASE,
    ReleaseCheckpoint,
    release_config,
    runtime_config,
)
from nvchat_torch.loading.quantize import mlx_quantize, mlx_quantize_rows
from nvchat_torch.model import QUANTIZED_PREFIXES, VoiceChatModel
from nvchat_torch.models.config import QuantSpec, VoiceChatConfig
from nvchat_torch.tiny import RNNT_VOCABULARY, randomize_, tiny_config_dict, write_tokenizer

TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_release_source(seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """A flat config (tiny preset, 6 TTS layers) and random float32 weights for it, int buffers int64."""
    flat = tiny_config_dict()
    flat["tts_config"].update(num_hidden_layers=6, sliding_window_pattern=6)
    with torch.device("cpu"):
        model = VoiceChatModel(VoiceChatConfig.from_dict(flat))
    randomize_(model, seed)
    return flat, {k: v.float() if v.is_floating_point() else v.to(torch.int64) for k, v in model.state_dict().items()}


def write_release(source: tuple[dict, dict[str, torch.Tensor]], out: Path, edit=None, config_edit=None) -> Path:
    """The release of ``source`` (flat config, tensors); ``edit(tensors)`` and ``config_edit(nested)``
    change them before they are written."""
    flat, tensors = source[0], {k: v.clone() for k, v in source[1].items()}
    nested, _ = release_config(flat)
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(nested)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(nested, indent=2))
    (out / "rnnt_tokenizer").mkdir()
    (out / "rnnt_tokenizer" / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(RNNT_VOCABULARY)}))
    return out


def write_tokenizer_folder(source: tuple[dict, dict], out: Path, with_config: bool = True) -> Path:
    write_tokenizer(out)
    if with_config:
        _, base = release_config(source[0])
        (out / "config.json").write_text(json.dumps(base, indent=2))
    return out


@pytest.fixture(scope="module")
def source():
    return tiny_release_source()


@pytest.fixture(scope="module")
def release(source, tmp_path_factory) -> Path:
    return write_release(source, tmp_path_factory.mktemp("release") / "VoiceChat-11B")


@pytest.fixture(scope="module")
def nano(source, tmp_path_factory) -> Path:
    return write_tokenizer_folder(source, tmp_path_factory.mktemp("tok") / "Nano-9B-v2")


@pytest.fixture(scope="module")
def card4(release, nano, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("card") / "q4"
    assert convert_main([str(release), str(out), "--bits", "4", "--tokenizer", str(nano)]) == 0
    return out


def same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype, key
        if x.dtype == torch.uint32:
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), key


# --------------------------------------------------------------------------------------
# The config mapping and the quantizer against the reference's


@pytest.mark.parametrize("preset", ["tiny", "deep", "full"])
def test_config_mapping_is_mlx_vlms_build_runtime_config(preset):
    from mlx_vlm.models.nemotron_voicechat.convert import build_runtime_config

    flat = VoiceChatConfig.full_size().to_dict() if preset == "full" else tiny_config_dict(preset)
    nested, base = release_config(flat)
    nested["mlx_conversion"] = {"quantization": {"group_size": 64, "bits": 4,
                                                 "modules": {"stt_model.lm_head": {"group_size": 32, "bits": 8}}}}
    ours = runtime_config(json.loads(json.dumps(nested)), base)
    want = build_runtime_config(json.loads(json.dumps(nested)), base)
    # The one deliberate difference: blank is the RNNT vocabulary size, which the reference fixes at 1024.
    assert ours["rnnt_blank_id"] == flat["audio_config"]["decoder"]["vocab_size"]
    assert want["rnnt_blank_id"] == 1024
    want["rnnt_blank_id"] = ours["rnnt_blank_id"]
    assert json.dumps(ours, sort_keys=True) == json.dumps(want, sort_keys=True)
    # What the mapping leaves to the defaults is the defaults mlx-vlm's config gives.
    from mlx_vlm.models.nemotron_voicechat.config import ModelConfig

    theirs = ModelConfig.from_dict(want).tts_config
    mine = VoiceChatConfig.from_dict(ours).tts_config
    for key in ("sliding_window_pattern", "rms_norm_eps", "query_pre_attn_scalar", "rope_global_base_freq",
                "rope_local_base_freq", "num_iterations"):
        assert getattr(mine, key) == getattr(theirs, key), key


def test_default_base_config_is_nemotron_nano_9b_v2():
    from mlx_vlm.models.nemotron_voicechat.convert import build_runtime_config

    nested, _ = release_config(VoiceChatConfig.full_size().to_dict())
    ours = runtime_config(nested, NANO_9B_V2_BASE)
    assert ours["text_config"] == build_runtime_config(nested, NANO_9B_V2_BASE)["text_config"]
    assert VoiceChatConfig.from_dict(ours).text_config == VoiceChatConfig.full_size().text_config
    assert ours["rnnt_blank_id"] == 1024


def adversarial(dtype: torch.dtype, group: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 4 * group, generator=g)
    w[0, :group] = 0  # all zero
    w[1, :group] = 3.0  # constant
    w[2, :group] = -1e-9 * torch.arange(group)  # range below MLX's eps
    w[3, :group] = torch.tensor([1.0, -1.0]).repeat(group // 2)  # |min| == |max|
    w[4, :group] = torch.linspace(-2, 2, group)  # exact ties on the code grid
    w[5, :group] = torch.linspace(0, 1, group)  # min is 0: q0 = 0 on one side
    w[6] *= 1e4
    w[7] *= 1e-30
    w[8, :group] = torch.linspace(-7, 8, group)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantizer_is_mx_quantize_bit_for_bit(dtype, bits, group):
    w = torch.cat([adversarial(dtype, group), torch.randn(20, 4 * group).to(dtype)])
    wq, scales, biases = mlx_quantize(w, bits, group)
    mx_dtype = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}[dtype]
    want = mx.quantize(mx.array(w.float().numpy()).astype(mx_dtype), group, bits)
    np.testing.assert_array_equal(wq.view(torch.int32).numpy().view(np.uint32), np.array(want[0]))
    assert scales.dtype == biases.dtype == dtype
    np.testing.assert_array_equal(scales.float().numpy(), np.array(want[1].astype(mx.float32)))
    np.testing.assert_array_equal(biases.float().numpy(), np.array(want[2].astype(mx.float32)))
    # in row chunks, as the loaders quantize: the same tensors
    chunked = mlx_quantize_rows(lambda i, j: w[i:j], w.shape[0], w.shape[1], bits, group, dtype, chunk_elements=500)
    same_state(dict(zip("wsb", (wq, scales, biases))), dict(zip("wsb", chunked)))


# --------------------------------------------------------------------------------------
# Loading the release, converting it, and the reference on the converted card


@pytest.mark.parametrize("bits", [4, 8])
def test_release_quantized_at_load_matches_the_reference_on_its_converted_card(release, nano, card4, reference, bits,
                                                                               tmp_path):
    card = card4
    if bits != 4:
        card = tmp_path / f"q{bits}"
        assert convert_main([str(release), str(card), "--bits", str(bits), "--tokenizer", str(nano)]) == 0
    ours = nv.load_model(release, device="cpu", tokenizer=nano, quantize={"bits": bits, "group_size": 64})
    assert ours.tokenizer.get_vocab() == nv.load_model(card, device="cpu").tokenizer.get_vocab()
    wave = synth_audio(2.5)
    assert_same_stream(run_stream(ours, wave, PROMPT), run_reference_stream(reference(card), wave, PROMPT))
    # Quantized at load is the card, tensor for tensor (in the cards' dtypes), as our loader reads it.
    direct = nv.load_model(release, device="cpu", tokenizer=nano, quantize={"bits": bits, "group_size": 64},
                           prepare=False, weights="packed")
    same_state(direct.state_dict(), nv.load_model(card, device="cpu", prepare=False, weights="packed").state_dict())


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_at_load_takes_the_modules_the_cards_quantize(bits):
    """The modules ``quantize=`` packs are those mlx-vlm's own quantizer packs on the full-size model
    (the cards' layout: the LLM and the vocabulary matrices; 123 modules, as the published manifests)."""
    from nvchat_torch.model import build_model, mlx_community_specs

    manifest = full_size_manifest(f"{bits}bit")
    want = {key.removesuffix(".scales") for key in manifest if key.endswith(".scales")}
    specs = mlx_community_specs(build_model(VoiceChatConfig.full_size()), bits)
    assert set(specs) == want and len(want) == 123
    assert {(s.bits, s.group_size) for s in specs.values()} == {(bits, 64)}


def test_converted_card_is_the_card_mlx_makes(release, card4, reference):
    """Codes, scales and biases are mx.quantize's of the release's float32 weights; every other float
    tensor is the release's in bf16; mlx-vlm loads it (its own sanitize and quantized modules)."""
    source = load_file(str(release / "model.safetensors"))
    config = json.loads((card4 / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    index = json.loads((card4 / "model.safetensors.index.json").read_text())
    stored = {}
    for name in sorted(set(index["weight_map"].values())):
        stored.update(load_file(str(card4 / name)))
    assert set(stored) == set(index["weight_map"])
    packed = sorted(k[: -len(".scales")] for k in stored if k.endswith(".scales"))
    assert packed and all(p.startswith(QUANTIZED_PREFIXES) for p in packed)
    assert len(packed) == sum(1 for k in source if k.startswith(QUANTIZED_PREFIXES) and source[k].dim() == 2)
    for path in packed:
        want = mx.quantize(mx.array(source[f"{path}.weight"].numpy()), 64, 4)
        np.testing.assert_array_equal(stored[f"{path}.weight"].view(torch.int32).numpy().view(np.uint32),
                                      np.array(want[0]))
        assert stored[f"{path}.scales"].dtype == torch.float32
        np.testing.assert_array_equal(stored[f"{path}.scales"].numpy(), np.array(want[1]))
        np.testing.assert_array_equal(stored[f"{path}.biases"].numpy(), np.array(want[2]))
    for key, t in stored.items():
        if key.rpartition(".")[0] in packed:
            continue
        want = source[key]
        if key.endswith("A_log"):
            assert t.dtype == torch.float32 and torch.equal(t, want)
        elif want.is_floating_point():
            assert t.dtype == torch.bfloat16 and torch.equal(t, want.to(torch.bfloat16)), key
        else:
            assert t.dtype == torch.int32 and torch.equal(t.long(), want), key
    tokenizer_config = json.loads((card4 / "tokenizer_config.json").read_text())
    assert tokenizer_config["fix_mistral_regex"] is True
    assert (card4 / "rnnt_tokenizer" / "vocab.json").read_text() == (release / "rnnt_tokenizer" / "vocab.json").read_text()
    mlx_params = reference(card4).params()
    assert mlx_params["stt_model.lm_head.scales"].dtype == np.float32


def test_release_loads_as_stored_by_default(release, nano):
    model = nv.load_model(release, device="cpu", tokenizer=nano, prepare=False)
    state = model.state_dict()
    source = load_file(str(release / "model.safetensors"))
    assert state.keys() == source.keys()
    for key, t in source.items():
        got = state[key]
        assert got.dtype == (t.dtype if t.is_floating_point() else torch.int32), key
        assert torch.equal(got.to(t.dtype), t), key
    assert model.config.rnnt_blank_id == len(model.config.rnnt_vocabulary)
    assert model.config.tts_config.sliding_window_pattern == 6  # left to the default, as the reference does


def test_release_in_float32_matches_the_reference_on_mlx_vlms_own_artifact(release, nano, tmp_path, reference):
    """The default mode on the release as stored (float32) against mlx-vlm reading the same float32 file
    through its own converter's artifact (``prepare_artifact``: its runtime config, the shards linked)."""
    from mlx_vlm.models.nemotron_voicechat.convert import prepare_artifact

    indexed = tmp_path / "indexed"  # prepare_artifact reads an index; the release has one file
    indexed.mkdir()
    for name in ("model.safetensors", "config.json", "rnnt_tokenizer"):
        (indexed / name).symlink_to(release / name)
    keys = load_file(str(release / "model.safetensors")).keys()
    (indexed / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
    artifact = prepare_artifact(indexed, nano, tmp_path / "artifact")
    config = json.loads((artifact / "config.json").read_text())
    config["rnnt_blank_id"] = len(config["rnnt_vocabulary"])  # its fixed 1024 is the real model's only
    (artifact / "config.json").write_text(json.dumps(config))
    wave = synth_audio(2.5)
    ours = run_stream(nv.load_model(release, device="cpu", tokenizer=nano), wave, PROMPT)
    assert_same_stream(ours, run_reference_stream(reference(artifact), wave, PROMPT))


def test_convert_cli(release, nano, tmp_path, capsys):
    out = tmp_path / "card8"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert convert_main([str(release), str(out), "--bits", "8", "--tokenizer", str(nano)]) == 1
    assert "--force" in capsys.readouterr().err and not (out / "config.json").exists()
    assert convert_main([str(release), str(out), "--bits", "none", "--tokenizer", str(nano), "--force"]) == 0
    err = capsys.readouterr().err
    assert "(100%)" in err and "GB" in err  # progress of the read
    assert (out / "notes.txt").exists()  # --force replaces the card, nothing else
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config
    with Checkpoint(out) as ckpt:
        assert {ckpt.stored_dtype(k) for k in ckpt.keys()} == {"BF16", "F32", "I32"}
        assert {k for k in ckpt.keys() if ckpt.stored_dtype(k) == "F32"} == {k for k in ckpt.keys() if k.endswith("A_log")}
    # As a user runs it.
    done = subprocess.run([sys.executable, "-m", "nvchat_torch.convert", str(release), str(tmp_path / "c8"),
                           "--bits", "8", "--tokenizer", str(nano)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == (tmp_path / "c8").resolve()
    direct = nv.load_model(release, device="cpu", tokenizer=nano, quantize={"bits": 8}, prepare=False, weights="packed")
    same_state(direct.state_dict(), nv.load_model(tmp_path / "c8", device="cpu", prepare=False, weights="packed").state_dict())


# --------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_layout_and_the_keys(source, ckpt_f32, release, nano, tmp_path):
    def extra(t):
        t["stt_model.llm.layers.0.mixer.extra.weight"] = torch.ones(2)
        t["stt_model.perception.preprocessor.featurizer.seq_len"] = torch.ones(1, dtype=torch.int64)  # dropped

    bad = write_release(source, tmp_path / "extra", edit=extra)
    with pytest.raises(CheckpointError, match=r"NVIDIA release layout.*1 unexpected.*mixer\.extra\.weight"):
        nv.load_model(bad, device="cpu", tokenizer=nano)
    bad = write_release(source, tmp_path / "missing", edit=lambda t: t.pop("stt_model.lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"NVIDIA release layout.*missing: stt_model\.lm_head\.weight"):
        nv.load_model(bad, device="cpu", tokenizer=nano)
    with pytest.raises(CheckpointError, match="NVIDIA release layout.*nvchat_torch.load_model"):
        Checkpoint(release)
    with pytest.raises(ValueError, match="mlx-community checkpoint"):
        nv.load_model(ckpt_f32, device="cpu", quantize={"bits": 4, "group_size": 64})
    with pytest.raises(ValueError, match="quantize must be"):
        nv.load_model(release, device="cpu", tokenizer=nano, quantize={"bit": 4})
    with pytest.raises(nv.ConfigError, match="unsupported affine bit width 7"):
        nv.load_model(release, device="cpu", tokenizer=nano, quantize={"bits": 7})
    bad = write_release(source, tmp_path / "cfg", config_edit=lambda c: c["_rnnt_merge_info"].pop("joint_config"))
    with pytest.raises(nv.ConfigError, match=r"NVIDIA release layout.*'_rnnt_merge_info.joint_config'"):
        nv.load_model(bad, device="cpu", tokenizer=nano)


def test_shape_disagreeing_with_the_config_names_key_shape_and_field(source, ckpt_f32, release, nano, tmp_path):
    def narrow(t):
        t["stt_model.lm_head.weight"] = t["stt_model.lm_head.weight"][:, :32].contiguous()

    bad = write_release(source, tmp_path / "narrow", edit=narrow)
    with pytest.raises(CheckpointError, match=r"'stt_model\.lm_head\.weight' has shape \[320, 32\].*\[320, 64\].*"
                                              r"text_config\.hidden_size = 64"):
        nv.load_model(bad, device="cpu", tokenizer=nano)
    # A tokenizer folder without config.json: the Nemotron-Nano-9B-v2 sizes, which the tiny weights contradict.
    bare = write_tokenizer_folder(source, tmp_path / "bare", with_config=False)
    with pytest.raises(CheckpointError, match=r"'stt_model\.embed_tokens\.weight' has shape \[320, 64\].*"
                                              r"\[131072, 4480\].*text_config\.vocab_size = 131072"):
        nv.load_model(release, device="cpu", tokenizer=bare)
    # The same check on an mlx-community card.
    card = tmp_path / "card"
    shutil.copytree(ckpt_f32, card)
    config = json.loads((card / "config.json").read_text())
    config["tts_config"]["hidden_size"] = config["tts_config"]["character_encoder"]["hidden_size"] = 48
    (card / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tts_model\..*has shape .*expects .*tts_config\.\S*hidden_size = 48"):
        nv.load_model(card, device="cpu")


def test_default_tokenizer_is_nano_9b_v2_and_offline_says_so(release, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(CheckpointError, match=f"tokenizer: {NANO_9B_V2}: .*HF_HUB_OFFLINE"):
        nv.load_model(release, device="cpu")


def test_bad_weights_are_named_in_one_warning(source, ckpt_f32, nano, tmp_path):
    def spoil(t):
        t["stt_model.llm.layers.0.mixer.in_proj.weight"].zero_()
        t["tts_model.tts_model.backbone.norm.weight"].zero_()
        t["stt_model.perception.encoder.layers.0.norm_out.weight"][3] = float("nan")

    bad = write_release(source, tmp_path / "spoiled", edit=spoil)
    for kwargs in ({}, {"quantize": {"bits": 4, "group_size": 64}}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nv.load_model(bad, device="cpu", tokenizer=nano, prepare=False, **kwargs)
        found = [w for w in caught if issubclass(w.category, BadWeightsWarning)]
        assert len(found) == 1, kwargs
        text = str(found[0].message)
        assert "2 all-zero tensor(s): stt_model.llm.layers.0.mixer.in_proj.weight, " \
               "tts_model.tts_model.backbone.norm.weight" in text
        assert "1 tensor(s) with NaN/inf values: stt_model.perception.encoder.layers.0.norm_out.weight" in text
    # A card the same: its zeroed quantized matrix (codes and biases 0) is named by its weight.
    card = tmp_path / "card"
    with pytest.warns(BadWeightsWarning, match="in_proj.weight"):  # convert names them too
        assert convert_main([str(bad), str(card), "--bits", "4", "--tokenizer", str(nano)]) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nv.load_model(card, device="cpu", prepare=False)
    found = [w for w in caught if issubclass(w.category, BadWeightsWarning)]
    assert len(found) == 1 and "stt_model.llm.layers.0.mixer.in_proj.weight" in str(found[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadWeightsWarning)
        nv.load_model(ckpt_f32, device="cpu", prepare=False)  # a sound checkpoint: no warning


def test_release_checkpoint_reads_a_packed_matrix_once(release, nano, monkeypatch):
    from nvchat_torch.loading import nvidia_release

    calls = []
    real = nvidia_release.mlx_quantize_rows
    monkeypatch.setattr(nvidia_release, "mlx_quantize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    ckpt = ReleaseCheckpoint(release, json.loads((nano / "config.json").read_text()))
    ckpt.as_card({"stt_model.lm_head": QuantSpec(4, 64)})
    assert ckpt.shape("stt_model.lm_head.weight") == (320, 8) and ckpt.stored_dtype("stt_model.lm_head.scales") == "F32"
    for leaf in ("biases", "scales", "weight"):
        ckpt.get(f"stt_model.lm_head.{leaf}")
    assert len(calls) == 1


def test_the_release_is_read_without_mapping_the_file(release, nano, monkeypatch):
    """NVIDIA's 44 GB file is never mapped: Linux's overcommit heuristic refuses a map larger than the
    machine's memory outright ("Cannot allocate memory", seen on a 24 GB machine), so every tensor is
    read with positioned reads, a chunk of rows at a time."""
    import mmap

    import safetensors
    import safetensors.torch

    def refused(*args, **kwargs):
        raise AssertionError("the release was mapped")

    for module, name in ((safetensors, "safe_open"), (safetensors.torch, "load_file"), (safetensors.torch, "safe_open"),
                         (mmap, "mmap")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, refused)
    model = nv.load_model(release, device="cpu", tokenizer=nano, quantize={"bits": 4, "group_size": 64},
                          weights="packed")
    assert "4-bit linears" in model.describe()
