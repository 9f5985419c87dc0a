"""The checkpoint reader's own safetensors access: the same tensors as the safetensors package, the file's
pages never left mapped, and a damaged file named."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvchat_torch.loading.safetensors_file import SafetensorsFile


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(),
        "u32": torch.randint(0, 2**31, (4, 3), generator=g).to(torch.int64).to(torch.uint32),
        "i64": torch.arange(-3, 3),
        "u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "mlx"})
    return path, tensors


def test_reads_what_safetensors_reads(stored):
    path, tensors = stored
    f = SafetensorsFile(path)
    theirs = load_file(str(path))
    assert sorted(f.keys()) == sorted(tensors) and f.metadata == {"format": "mlx"}
    for key, want in tensors.items():
        got = f.read(key)
        assert got.dtype == want.dtype and got.shape == want.shape == f.shape(key)
        assert torch.equal(got.view(torch.uint8) if got.dim() else got, theirs[key].view(torch.uint8)
                           if got.dim() else theirs[key])
        assert f.dtype_name(key) == {"f32": "F32", "bf16": "BF16", "f16": "F16", "u32": "U32", "i64": "I64",
                                     "u8": "U8", "bool": "BOOL", "scalar": "F32", "empty": "F32"}[key]


def test_tensors_own_their_memory_and_no_file_stays_mapped(stored):
    path, _ = stored
    f = SafetensorsFile(path)
    a, b = f.read("f32"), f.read("f32")
    assert a.data_ptr() != b.data_ptr()
    a.add_(1)  # writable, and not the file's bytes
    assert torch.equal(f.read("f32"), b)
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()


def test_a_truncated_file_is_named(stored, tmp_path):
    path, _ = stored
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"cut\.safetensors.*past the end of the file.*truncated"):
        SafetensorsFile(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"junk\.safetensors: not a safetensors file"):
        SafetensorsFile(junk)


def test_rows_are_read_alone(stored):
    """``read_rows``: any row range of a tensor, what slicing the whole gives; a range it lacks is named."""
    path, tensors = stored
    f = SafetensorsFile(path)
    theirs = load_file(str(path))
    for key in ("f32", "u32", "u8", "bool", "empty"):
        n = tensors[key].shape[0]
        for start, stop in ((0, n), (1, n), (0, 1), (n // 2, n // 2), (n - 1, n)):
            if not 0 <= start <= stop <= n:
                continue
            got = f.read_rows(key, start, stop)
            assert got.dtype == theirs[key].dtype and torch.equal(got.view(torch.uint8),
                                                                  theirs[key][start:stop].view(torch.uint8)), key
    with pytest.raises(ValueError, match=r"'f32' of shape \[3, 5\] has no rows 2:4"):
        f.read_rows("f32", 2, 4)
    with pytest.raises(ValueError, match="has no rows"):
        f.read_rows("scalar", 0, 1)
