"""load_checkpoint against what mlx-vlm's own loader holds, on checkpoints written by MLX."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

from nvchat_torch import CheckpointError, ConfigError, VoiceChatConfig, load_checkpoint
from nvchat_torch.loading.checkpoint import Checkpoint, resolve_checkpoint


def mlx_params(path: Path) -> dict[str, mx.array]:
    """The parameters mlx-vlm's loader holds after its own sanitize and quantization."""
    from mlx_vlm.utils import load_model

    model = load_model(Path(path))
    return dict(tree_flatten(model.parameters()))


def to_mlx_layout(key: str, value: np.ndarray, codec_cfg) -> tuple[str, np.ndarray] | None:
    """Our (checkpoint-named, PyTorch-layout) tensor -> the reference's key and layout.

    The documented inverse direction of ``Model.sanitize``; LSTM biases are summed by the caller.
    """
    if key.startswith("stt_model.perception.preprocessor."):
        return None  # the reference drops the NeMo featurizer buffers
    if ".dec_rnn.lstm." in key:
        stem, name = key.rsplit(".", 1)
        layer = name.rsplit("_l", 1)[1]
        kind = {"weight_ih": "Wx", "weight_hh": "Wh"}.get(name.rsplit("_l", 1)[0], "bias")
        return f"{stem}.{layer}.{kind}", value
    if key == "tts_model._control_codes":
        return "tts_model.control_codes", value
    if key.startswith("tts_model.audio_codec."):
        key = key.replace("prvq._variance_list.", "prvq.variance_list.")
        if key.endswith(".weight") and value.ndim == 3:
            index = int(key.split(".")[4])
            width = codec_cfg.blocks_per_stage + 1
            transposed = (".decoder.layers." in key and index < width * len(codec_cfg.downsample_rates)
                          and index % width == 0 and "dwconv" not in key)
            value = value.transpose(1, 2, 0) if transposed else value.transpose(0, 2, 1)
        return key, value
    if key.startswith("stt_model.perception.") and value.ndim == 4:
        return key, value.transpose(0, 2, 3, 1)
    if value.ndim == 3 and (key.startswith("stt_model.perception.") or
                            ("stt_model.llm." in key and key.endswith(".conv1d.weight"))):
        return key, value.transpose(0, 2, 1)
    return key, value


def assert_loads_like_mlx(path: Path, dtype=torch.float32, rtol=1e-6):
    config, state = load_checkpoint(path, dtype=dtype)
    ref = mlx_params(path)
    quantized = {k[: -len(".scales")] for k in ref if k.endswith(".scales")}
    seen = set()
    lstm_bias: dict[str, np.ndarray] = {}
    for key, tensor in state.items():
        mapped = to_mlx_layout(key, tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy(),
                               config.codec_config)
        if mapped is None:
            continue
        mkey, ours = mapped
        if mkey.endswith(".bias") and ".dec_rnn.lstm." in mkey:
            lstm_bias[mkey] = lstm_bias.get(mkey, 0) + ours
            continue
        module = mkey[: -len(".weight")] if mkey.endswith(".weight") else None
        if module in quantized:
            spec = config.quant_spec(module, stored=True)
            want = mx.dequantize(ref[f"{module}.weight"], ref[f"{module}.scales"], ref.get(f"{module}.biases"),
                                 group_size=spec.group_size, bits=spec.bits, mode=spec.mode, dtype=mx.float32)
            seen.update(f"{module}.{n}" for n in ("weight", "scales", "biases") if f"{module}.{n}" in ref)
        else:
            want = ref[mkey]
            seen.add(mkey)
        want = np.array(want.astype(mx.float32)) if mx.issubdtype(want.dtype, mx.floating) else np.array(want)
        assert ours.shape == want.shape, mkey
        if tensor.is_floating_point():
            if dtype == torch.float32 or key.endswith("A_log"):
                np.testing.assert_allclose(ours, want, rtol=rtol, atol=0, err_msg=mkey)
            else:
                want_cast = torch.from_numpy(want).to(dtype).float().numpy()
                np.testing.assert_array_equal(ours, want_cast, err_msg=mkey)
        else:
            np.testing.assert_array_equal(ours, want, err_msg=mkey)
    for mkey, summed in lstm_bias.items():
        # the reference sums bias_ih + bias_hh in the stored dtype (one rounding in bf16/fp16)
        tol = 1e-6 if ref[mkey].dtype == mx.float32 else 2.0**-8 * np.abs(summed).max()
        np.testing.assert_allclose(summed, np.array(ref[mkey].astype(mx.float32)), rtol=0, atol=tol)
        seen.add(mkey)
    assert seen == set(ref), sorted(set(ref) ^ seen)[:10]
    return config, state


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8", "q4", "q4_sharded", "q4_bf16"])
def test_tiny_checkpoints_load_equal_to_mlx(make_checkpoint, kind):
    spec = {"f32": {}, "bf16": {"dtype": "bfloat16"}, "q8": {"bits": 8}, "q4": {"bits": 4},
            "q4_sharded": {"bits": 4, "max_shard_kb": 300}, "q4_bf16": {"bits": 4, "dtype": "bfloat16"}}[kind]
    path = make_checkpoint(seed=0, **spec)
    if kind == "q4_sharded":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 3
    config, state = assert_loads_like_mlx(path)
    assert config.text_config.hybrid_override_pattern == "M-M*-MM-"
    assert "stt_model.lm_head.scales" not in state  # triplets became one float weight
    if kind.startswith("q"):
        assert state["stt_model.lm_head.weight"].shape == (320, 64)


@pytest.mark.parametrize("spec", [
    dict(seed=101, bits=2, group_size=32),
    dict(seed=102, bits=3, group_size=64, dtype="float16"),
    dict(seed=103, bits=5, group_size=128, hidden=128),
    dict(seed=104, bits=6, group_size=32, dtype="bfloat16"),
    dict(seed=105, bits=4, group_size=32, mode="mxfp4"),
    dict(seed=106, bits=8, group_size=32, mode="mxfp8"),
    dict(seed=107, bits=4, group_size=16, mode="nvfp4"),
    dict(seed=108, bits=4, group_size=64,
         overrides={"stt_model.embed_tokens": {"bits": 8, "group_size": 32}, "stt_model.lm_head": False}),
], ids=["2bit-g32", "3bit-fp16", "5bit-g128", "6bit-bf16", "mxfp4", "mxfp8", "nvfp4", "overrides"])
def test_every_quantization_kind_loads_equal_to_mlx(make_checkpoint, spec):
    path = make_checkpoint(**spec)
    config, state = assert_loads_like_mlx(path)
    ckpt_quant = Checkpoint(path).quantized_modules()
    assert ckpt_quant, "the checkpoint should hold packed modules"
    if "overrides" in spec:
        assert ckpt_quant["stt_model.embed_tokens"].bits == 8
        assert ckpt_quant["stt_model.embed_tokens"].group_size == 32
        assert "stt_model.lm_head" not in ckpt_quant
        assert ckpt_quant["stt_model.function_head"].bits == 4


def test_dtype_and_device_of_loaded_tensors(ckpt_q4):
    config, state = load_checkpoint(ckpt_q4, dtype=torch.bfloat16, device="cpu")
    assert state["stt_model.lm_head.weight"].dtype == torch.bfloat16
    assert state["stt_model.perception.proj.weight"].dtype == torch.bfloat16
    assert state["stt_model.llm.layers.0.mixer.A_log"].dtype == torch.float32  # as the reference keeps it
    assert state["tts_model.codec_silence_tokens"].dtype == torch.int32
    assert state["stt_model.perception.encoder.pre_encode.conv.0.weight"].shape == (16, 1, 3, 3)  # torch layout
    assert config.quantization["bits"] == 4


def test_keep_packed_yields_stored_triplets(ckpt_q4):
    with Checkpoint(ckpt_q4) as ckpt:
        tensors = dict(ckpt.iter_tensors(dtype=torch.float32, keep_packed=True))
    assert tensors["stt_model.lm_head.weight"].dtype == torch.uint32
    assert tensors["stt_model.lm_head.weight"].shape == (320, 8)
    assert tensors["stt_model.lm_head.scales"].shape == (320, 1)
    assert "stt_model.lm_head.biases" in tensors


# ---------------------------------------------------------------------------------- bad files


@pytest.fixture()
def sharded_copy(make_checkpoint, tmp_path):
    src = make_checkpoint(seed=0, bits=4, max_shard_kb=300)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_missing_shard_names_the_file(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(sharded_copy)


def test_truncated_shard_names_the_file(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(sharded_copy)


def test_corrupt_shard_names_the_file(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\xff" * 64 + shard.read_bytes()[64:])
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(sharded_copy)


def test_index_entry_missing_from_shard_names_file_and_key(sharded_copy):
    index = _index(sharded_copy)
    shard = index["weight_map"]["stt_model.norm_does_not_exist"] = sorted(set(index["weight_map"].values()))[0]
    (sharded_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{shard}.*stt_model\.norm_does_not_exist"):
        load_checkpoint(sharded_copy)


@pytest.mark.parametrize("quant,match", [
    ({"group_size": 64, "bits": 4, "mode": "int4_awq"}, "unknown quantization mode 'int4_awq'"),
    ({"group_size": 64, "bits": 7}, "unsupported affine bit width 7"),
    ({"group_size": 64, "bits": 4, "stt_model.lm_head": {"bits": 7, "group_size": 64}}, "stt_model.lm_head"),
])
def test_unknown_mode_or_bit_width_is_an_error(sharded_copy, quant, match):
    cfg = json.loads((sharded_copy / "config.json").read_text())
    cfg["quantization"] = quant
    (sharded_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((CheckpointError, ConfigError), match=match) as info:
        load_checkpoint(sharded_copy)
    assert "config.json" in str(info.value) or ".safetensors" in str(info.value)


def test_packed_shape_contradicting_config_names_file_and_key(sharded_copy):
    cfg = json.loads((sharded_copy / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 8}  # the shards hold 4-bit codes
    (sharded_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: 'stt_model\.[a-z_.0-9]+\.weight'.*"
                                              r"implies 4 bits.*8-bit"):
        load_checkpoint(sharded_copy)


def test_scales_without_quantization_config_is_an_error(sharded_copy):
    cfg = json.loads((sharded_copy / "config.json").read_text())
    cfg.pop("quantization")
    cfg.pop("quantization_config", None)
    (sharded_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"\.safetensors: 'stt_model\..*stored quantized"):
        load_checkpoint(sharded_copy)


def test_missing_folder_and_config_errors(tmp_path, sharded_copy):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load_checkpoint(tmp_path / "nope")
    cfg = json.loads((sharded_copy / "config.json").read_text())
    del cfg["text_config"]["hidden_size"]
    (sharded_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json.*'text_config.hidden_size' is required"):
        load_checkpoint(sharded_copy)


@pytest.mark.parametrize("mutate,key", [
    (lambda c: c["text_config"].update(hybrid_override_pattern="M-X"), "text_config.hybrid_override_pattern"),
    (lambda c: c["audio_config"]["encoder"].update(n_heads=5), "audio_config.encoder.n_heads"),
    (lambda c: c.update(frame_duration=0.05), "frame_duration"),
    (lambda c: c["codec_config"].update(downsample_rates=[7, 7, 8]), "codec_config.downsample_rates"),
    (lambda c: c.update(rnnt_vocabulary=["a"]), "rnnt_vocabulary"),
    (lambda c: c["tts_config"].update(top_p=1.5), "tts_config.top_p"),
])
def test_impossible_config_values_name_the_key(ckpt_f32, mutate, key):
    cfg = json.loads((ckpt_f32 / "config.json").read_text())
    mutate(cfg)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        VoiceChatConfig.from_dict(cfg)


# ---------------------------------------------------------------------------------- the Hub


def test_hub_offline_without_cache_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match=r"mlx-community/NemotronLabs-VoiceChat-11B-4bit.*HF_HUB_OFFLINE"):
        load_checkpoint("mlx-community/NemotronLabs-VoiceChat-11B-4bit")


def test_hub_offline_uses_the_cache(tmp_path, monkeypatch, ckpt_q4):
    """A repo id resolves through the Hugging Face cache layout (models--owner--name/snapshots/<rev>)."""
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-voicechat"
    revision = "0" * 40
    shutil.copytree(ckpt_q4, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert resolve_checkpoint("someone/tiny-voicechat") == repo / "snapshots" / revision
    config, state = load_checkpoint("someone/tiny-voicechat", dtype=torch.float32)
    _, local = load_checkpoint(ckpt_q4, dtype=torch.float32)
    assert state.keys() == local.keys()
    assert all(torch.equal(state[k], local[k]) for k in local)
