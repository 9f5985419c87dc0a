"""Fused CPU kernels for the float32 streaming step: one kernel where the composite torch code
launches several (``cpu_kernels.cpp``, registered as ``torch.ops.nvchat_cpu.*``).

They are built on first use and self-tested against the composite code. Without a compiler, on a
failed build or self-test, or with ``NVCHAT_CPU_KERNELS=0``, the composite code runs instead, and
:func:`status` says why. Only float32 CPU tensors take these ops.
Design, the ops and their kernel counts: docs/performance.md, "Fused CPU kernels (issue 21)".
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["ENV", "available", "blas", "status", "usable"]

ENV = "NVCHAT_CPU_KERNELS"  # "0": never build or use the fused CPU kernels
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_HEADERS = [_SOURCE.with_suffix(".h"), _SOURCE.with_name("cpu_kernels_codec.h")]  # what the source includes
# -fopenmp-simd: the sums' "omp simd" pragmas only (no OpenMP runtime); no -march: the build runs on
# any CPU of its architecture (the cache folder is per machine type, not per CPU model), and the
# activation loops are compiled per vector width besides, picked at load by what the CPU reports
_CFLAGS = ["-O3", "-fopenmp-simd"]


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these activations: float32, CPU, contiguous (a frame's are)."""
    for t in tensors:  # a loop, not all() over a generator: ~1,400 calls a frame, 1 us each saved
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def available() -> bool:
    """Whether ``torch.ops.nvchat_cpu`` is built, loaded and passed its self-test (built on first call)."""
    return status() is None


@functools.lru_cache(maxsize=None)
def blas() -> bool:
    """Whether the kernels reach torch's BLAS (its exported ``sgemm_``: MKL, OpenBLAS or Accelerate), which
    the ops that include a matrix product (``norm_linear``, ``rvq_assign``) call as torch's linear does."""
    return available() and torch.ops.nvchat_cpu.blas_available()


_UNKNOWN = "not yet built"
_status: str | None = _UNKNOWN


def status() -> str | None:
    """None when the fused CPU kernels are usable, else why not (one line). The first call builds them
    (then loads the cached build) and self-tests them; later calls return what it found."""
    global _status
    if _status is _UNKNOWN:
        _status = _build()
    return _status


def build_directory() -> Path:
    """Where the build lives: one folder per source, torch and Python version and machine, under
    ``TORCH_EXTENSIONS_DIR`` (torch's variable; default ``~/.cache/torch_extensions``)."""
    key = hashlib.sha256(b"".join(path.read_bytes() for path in [_SOURCE, *_HEADERS]))
    key.update(f"{_CFLAGS} {torch.__version__} {sys.version_info[:2]} {platform.machine()} {platform.system()}".encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"nvchat_cpu_kernels-{key.hexdigest()[:16]}"


def _build() -> str | None:
    if os.environ.get(ENV, "1").strip() == "0":
        return f"disabled ({ENV}=0)"
    folder = build_directory()
    built = folder / "nvchat_cpu_kernels.so"
    if built.exists():  # built before: load it (no compiler, no ninja, no import of torch's builder)
        try:
            torch.ops.load_library(str(built))
        except OSError as e:
            return f"the cached build {built} does not load ({e})"
    else:
        reason = _compile(folder)
        if reason is not None:
            return reason
    problem = _self_test()
    if problem is not None:
        warnings.warn(f"nvchat_torch: the fused CPU kernels failed their self-test ({problem}); the composite "
                      f"code runs instead", RuntimeWarning, stacklevel=2)
        return f"self-test failed: {problem}"
    return None


def _compile(folder: Path) -> str | None:
    """Build the extension into ``folder`` with torch's builder (and load it); None, or why not."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel (a dependency) puts it beside this Python
        try:
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        except (ImportError, AttributeError):
            pass
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="nvchat_cpu_kernels", sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                           build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as e:  # a compiler error: report it, run the composite code
        reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        warnings.warn(f"nvchat_torch: the fused CPU kernels are not used ({reason})", RuntimeWarning, stacklevel=3)
        return reason
    return None


def _self_test() -> str | None:
    """Each op against the composite torch code it replaces, on random inputs; the first mismatch."""
    ops = torch.ops.nvchat_cpu
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def close(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> str | None:
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5):
            return f"{name} differs from the composite code by {float((ours - theirs).abs().max()):.3g}"
        return None

    with torch.inference_mode():
        x, w, res = rand(3, 24), rand(24), rand(3, 24)
        checks = [("rms_norm", ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (24,), w, 1e-6)),
                  ("add_rms_norm", ops.add_rms_norm(res, x, w, 1e-6), res + F.rms_norm(x, (24,), w, 1e-6))]
        if ops.blas_available():  # a pre-norm, projection and activation: 3 rows of 24 -> 10
            pw, pb, lb = rand(10, 24), rand(10), rand(24)
            gate, up = F.linear(F.rms_norm(x, (24,), w, 1e-6), pw).chunk(2, -1)
            checks += [("norm_linear layer silu", ops.norm_linear(x, "layer", w, lb, 1e-5, pw, pb, "silu"),
                        F.silu(F.linear(F.layer_norm(x, (24,), w, lb, 1e-5), pw, pb))),
                       ("norm_linear rms relu_square", ops.norm_linear(x, "rms", w, None, 1e-6, pw, None, "relu_square"),
                        torch.relu(F.linear(F.rms_norm(x, (24,), w, 1e-6), pw)) ** 2),
                       ("norm_linear rms gelu_tanh_mul", ops.norm_linear(x, "rms", w, None, 1e-6, pw, None, "gelu_tanh_mul"),
                        F.gelu(gate, approximate="tanh") * up),
                       ("norm_linear", ops.norm_linear(x, "", None, None, 0.0, pw, pb, ""), F.linear(x, pw, pb))]
        # a depthwise conv (2 rows, 3 channels, kernel 4, 9 frames) and an iSTFT overlap-add (n 8, hop 2, 5 frames)
        cx, taps, cbias = rand(2, 3, 9), rand(3, 4), rand(3)
        frames, window, envelope = rand(2, 8, 5), rand(8).abs(), rand(1, 1, 16).abs() + 0.5
        checks += [("depthwise_conv1d", ops.depthwise_conv1d(cx, taps, cbias), F.conv1d(cx, taps[:, None], cbias, groups=3)),
                   ("overlap_add", ops.overlap_add(frames, window, envelope, 2),
                    F.conv_transpose1d(torch.clamp(frames, -window[:, None], window[:, None]),
                                       torch.diag(window)[:, None], stride=2) / envelope)]
        if ops.blas_available():  # a codec ConvNeXt block (2 rows, 4 channels, kernel 3, 5 frames) and an upsampling
            cx, state, taps, db, lw, lb = rand(2, 4, 5), rand(2, 4, 2), rand(4, 3), rand(4), rand(4), rand(4)
            w1, b1, w2, b2 = rand(16, 4), rand(16), rand(4, 16), rand(4)
            padded = torch.cat([state, cx], -1)
            h = F.layer_norm(F.conv1d(padded, taps[:, None], db, groups=4).transpose(1, 2), (4,), lw, lb, 1e-6)
            want = cx + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2).transpose(1, 2)
            out, next_state = ops.convnext_block(cx, state, taps, db, lw, lb, 1e-6, w1, b1, w2, b2)
            up_x, up_w = rand(2, 3, 4), rand(3, 5, 2)
            checks += [("convnext_block", out, want), ("convnext_block state", next_state, padded[..., -2:]),
                       ("upsample_conv1d", ops.upsample_conv1d(up_x, up_w), F.conv_transpose1d(up_x, up_w, stride=2))]
        # the Conformer convolution module's middle: 2 rows, 8 channels, kernel 4
        proj, state, cw, cb, lw, lb = rand(2, 16), rand(2, 8, 3), rand(8, 4), rand(8), rand(8), rand(8)
        window = torch.cat([state, F.glu(proj, -1)[:, :, None]], 2)
        want = F.silu(F.layer_norm((window * cw).sum(-1) + cb, (8,), lw, lb, 1e-5))
        out, next_state = ops.conv_module_step(proj, state, cw, cb, lw, lb, 1e-5)
        checks += [("conv_module_step", out, want), ("conv_module_step state", next_state, window[..., 1:])]
        # a Mamba step: 2 rows, 4 heads of 2 channels, 2 groups of state 3, kernel 4, padding 2
        H, P, G, N, K, pad = 4, 2, 2, 3, 4, 2
        conv_dim = H * P + 2 * G * N
        proj = rand(2, pad + H * P + conv_dim + H)
        conv_state, ssm = rand(2, K - 1, conv_dim), rand(2, H, P, N)
        cw, cb, dtb, A, D, nw = rand(conv_dim, K), rand(conv_dim), rand(H), -rand(H).abs(), rand(H), rand(H * P)
        z, xbc, dt = proj[:, pad:].split((H * P, conv_dim, H), -1)
        window = torch.cat([conv_state, xbc[:, None]], 1)
        xbc = F.silu((window * cw.t()).sum(1) + cb)
        xs, Bm, Cm = xbc.split((H * P, G * N, G * N), -1)
        dt = F.softplus(dt + dtb)
        Bh, Ch = Bm.view(2, G, 1, N).repeat_interleave(H // G, 1), Cm.view(2, G, 1, N).repeat_interleave(H // G, 1)
        new_ssm = ssm * torch.exp(dt * A)[..., None, None] + (xs.view(2, H, P) * dt[..., None])[..., None] * Bh
        y = (new_ssm * Ch).sum(-1) + xs.view(2, H, P) * D[:, None]
        y = (F.silu(z) * y.reshape(2, -1)).view(2, 2, -1)
        want = F.rms_norm(y, (y.shape[-1],), None, 1e-5).flatten(1) * nw
        ours, next_state = ops.mamba_step(proj, conv_state, cw, cb, dtb, A, D, nw, ssm, pad, G, 2, 1e-5, None, None)
        checks += [("mamba_step", ours, want), ("mamba_step ssm_state", ssm, new_ssm),
                   ("mamba_step conv_state", next_state, window[:, 1:])]
        if ops.blas_available():  # the RVQ assignment: 2 rows, quantizers 1..3 of 4, 16 entries of 5 (a padded book row)
            books, r, decided = rand(4, 17, 5), rand(2, 5), rand(2, 5)
            norms = (books[:, :16] ** 2).sum(-1)
            index, total = ops.rvq_assign(r, books, norms, decided, 1, 3)
            want_index, want_total, left = [], decided.clone(), r.clone()
            for q in range(1, 4):
                i = torch.addmm(norms[q], left, books[q, :16].T, alpha=-2.0).argmin(-1)
                want_index.append(i)
                left, want_total = left - books[q, i], want_total + books[q, i]
            if not torch.equal(index, torch.stack(want_index, -1)):
                return "rvq_assign chose other codebook rows than the composite code"
            checks.append(("rvq_assign", total, want_total))
        # a Gemma attention step's q/k: 2 rows, 2 query heads per KV head, 2 KV heads, head 4, 6 slots
        Hq, Hkv, d, S = 4, 2, 4, 6
        qkv, qk_scale, rotation = rand(2, (Hq + 2 * Hkv) * d), rand(Hq + Hkv, d), rand(2, d, d)
        keys, values, slots = rand(2, Hkv, S, d), rand(2, Hkv, S, d), torch.tensor([4, 2])
        qk = F.rms_norm(qkv[:, :(Hq + Hkv) * d].view(2, Hq + Hkv, d), (d,), None, 1e-6)
        qk = (qk.unsqueeze(-2) @ (qk_scale[:, :, None] * rotation[:, None])).squeeze(-2)
        want_keys, want_values = keys.clone(), values.clone()
        want_keys[torch.arange(2), :, slots] = qk[:, Hq:]
        want_values[torch.arange(2), :, slots] = qkv[:, (Hq + Hkv) * d:].view(2, Hkv, d)
        ours = ops.gemma_qk_step(qkv, qk_scale, rotation, keys, values, slots, 1e-6)
        checks += [("gemma_qk_step", ours, qk[:, :Hq]), ("gemma_qk_step keys", keys, want_keys),
                   ("gemma_qk_step values", values, want_values)]
        # a Conformer attention step: 2 rows, 2 heads of 3, a ring of 5 slots, 4 attended, row 1 masked at 0
        H, hd, W, n = 2, 3, 5, 4
        quvkv, kv, table = rand(2, 4 * H * hd), rand(2, 2, H, W, hd), rand(H, hd, 7)
        rows, slot, columns = torch.tensor([0, 1]), torch.tensor([3, 1]), torch.tensor([[6, 0, 2, 5], [1, 4, 3, 3]])
        positions = table[:, :, columns]  # [H, hd, 2, n]
        mask = torch.zeros(2, 1, 1, n)
        mask[1, ..., 0] = float("-inf")
        want_kv = kv.clone()
        q_u, q_v, new = quvkv.split([H * hd, H * hd, 2 * H * hd], -1)
        want_kv[:, rows, :, slot] = new.view(2, 2, H, hd)  # split advanced indices: [B, 2, H, hd]
        bias = q_v.view(2, H, 1, hd) @ positions.permute(2, 0, 1, 3) + mask
        want = F.scaled_dot_product_attention(q_u.view(2, H, 1, hd), want_kv[0, :, :, :n], want_kv[1, :, :, :n],
                                              attn_mask=bias, scale=0.4).reshape(2, H * hd)
        ours = ops.conformer_attention_step(quvkv, kv, rows, slot, table, columns, mask, n, 0.4)
        checks += [("conformer_attention_step", ours, want), ("conformer_attention_step kv", kv, want_kv)]
    for name, ours, theirs in checks:
        problem = close(name, ours, theirs)
        if problem is not None:
            return problem
    return None
