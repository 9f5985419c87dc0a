// Fused CPU kernels for the streaming step (float32), loaded by cpu_kernels.py.
//
// Each op is one pass over its data, doing what the composite torch code beside its caller does in
// several ATen kernels, in the same order of float operations where the order is the reference's
// (sequential sums and updates); reductions (dot products, means) are summed left to right, which
// differs from ATen's blocked sums in the last bits only. Inputs are checked for device, dtype,
// contiguity and shape: the Python side only calls an op on what it accepts.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_kernels_codec.h"

#include <string>
#include <tuple>
#include <vector>

namespace {

// One token of the Mamba-2 mixer after its input projection, for B rows at once:
//   projected [B, pad + d_inner + conv_dim + H] = [padding | z | xBC | dt]
//   xBC <- silu(conv_bias + causal depthwise conv over (conv_state [B, K-1, conv_dim], xBC))
//   next conv state = its last K-2 rows and this xBC (a new tensor: the caller's stays as it was)
//   x, B, C = xBC split (d_inner, G*N, G*N); dt <- clamp(softplus(dt + dt_bias))
//   S <- exp(dt A) S + (dt x) (x) B (in place, ssm_state [B, H, P, N]); y = S C + D x
//   out = rms_norm per norm group of (silu(z) y), times norm_weight   -> ([B, d_inner], next conv state)
std::tuple<at::Tensor, at::Tensor> mamba_step(const at::Tensor& projected, const at::Tensor& conv_state, const at::Tensor& conv_weight,
                      const c10::optional<at::Tensor>& conv_bias, const at::Tensor& dt_bias, const at::Tensor& A,
                      const at::Tensor& D, const at::Tensor& norm_weight, at::Tensor& ssm_state, int64_t pad,
                      int64_t groups, int64_t norm_groups, double eps, const c10::optional<double>& dt_min,
                      const c10::optional<double>& dt_max) {
  check(projected, "projected", 2);
  check(conv_state, "conv_state", 3);
  check(conv_weight, "conv_weight", 2);
  check(ssm_state, "ssm_state", 4);
  check(dt_bias, "dt_bias", 1);
  check(A, "A", 1);
  check(D, "D", 1);
  check(norm_weight, "norm_weight", 1);
  const int64_t Bn = projected.size(0), H = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3);
  const int64_t d_inner = H * P, gn = groups * N, conv_dim = d_inner + 2 * gn, K = conv_weight.size(1);
  check_size(projected, "projected", 1, pad + d_inner + conv_dim + H);
  check_size(conv_state, "conv_state", 0, Bn);
  check_size(conv_state, "conv_state", 1, K - 1);
  check_size(conv_state, "conv_state", 2, conv_dim);
  check_size(conv_weight, "conv_weight", 0, conv_dim);
  check_size(ssm_state, "ssm_state", 0, Bn);
  check_size(dt_bias, "dt_bias", 0, H);
  check_size(A, "A", 0, H);
  check_size(D, "D", 0, H);
  check_size(norm_weight, "norm_weight", 0, d_inner);
  TORCH_CHECK(groups > 0 && H % groups == 0 && norm_groups > 0 && d_inner % norm_groups == 0,
              "nvchat_cpu: mamba_step groups do not divide the heads / channels");
  const float* bias = optional_vector(conv_bias, "conv_bias", conv_dim);
  at::Tensor out = at::empty({Bn, d_inner}, projected.options());
  std::vector<float> xbc(Bn * conv_dim);
  const float* proj = projected.data_ptr<float>();
  at::Tensor next_state = at::empty(conv_state.sizes(), conv_state.options());
  const float* state = conv_state.data_ptr<float>();
  float* next = next_state.data_ptr<float>();
  const float* w = conv_weight.data_ptr<float>();
  const int64_t width = projected.size(1);
  // the convolution, then the shifted state
  for (int64_t b = 0; b < Bn; ++b) {
    const float* fresh = proj + b * width + pad + d_inner;
    const float* st = state + b * (K - 1) * conv_dim;
    float* nx = next + b * (K - 1) * conv_dim;
    float* o = xbc.data() + b * conv_dim;
    for (int64_t c = 0; c < conv_dim; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K - 1; ++k) acc += st[k * conv_dim + c] * w[c * K + k];
      acc += fresh[c] * w[c * K + K - 1];
      o[c] = silu(bias ? bias[c] + acc : acc);
    }
    if (K > 2) std::copy(st + conv_dim, st + (K - 1) * conv_dim, nx);
    if (K > 1) std::copy(fresh, fresh + conv_dim, nx + (K - 2) * conv_dim);
  }
  // the recurrence, per (row, head)
  float* S = ssm_state.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const float *dtb = dt_bias.data_ptr<float>(), *a = A.data_ptr<float>(), *d = D.data_ptr<float>();
  const int64_t per_group = H / groups;
  at::parallel_for(0, Bn * H, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, P * N)), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / H, h = i % H, g = h / per_group;
      const float* x = xbc.data() + b * conv_dim + h * P;
      const float* Bm = xbc.data() + b * conv_dim + d_inner + g * N;
      const float* Cm = Bm + gn;
      float dt = softplus(proj[b * width + pad + d_inner + conv_dim + h] + dtb[h]);
      dt = clamp_keep_nan(dt, dt_min, dt_max);
      const float decay = std::exp(dt * a[h]);
      for (int64_t p = 0; p < P; ++p) {
        float* s = S + ((b * H + h) * P + p) * N;
        const float dtx = x[p] * dt;
        float acc = 0.f;
        NVCHAT_SIMD_SUM(acc)
        for (int64_t n = 0; n < N; ++n) {
          const float v = s[n] * decay + dtx * Bm[n];
          s[n] = v;
          acc += v * Cm[n];
        }
        y[b * d_inner + h * P + p] = acc + x[p] * d[h];
      }
    }
  });
  // the gated, grouped RMS norm
  const float* nw = norm_weight.data_ptr<float>();
  const int64_t size = d_inner / norm_groups;
  for (int64_t b = 0; b < Bn; ++b) {
    const float* z = proj + b * width + pad;
    float* row = y + b * d_inner;
    for (int64_t j = 0; j < norm_groups; ++j) {
      float* v = row + j * size;
      const float* zg = z + j * size;
      float sq = 0.f;
      NVCHAT_SIMD_SUM(sq)
      for (int64_t i = 0; i < size; ++i) {
        v[i] = silu(zg[i]) * v[i];
        sq += v[i] * v[i];
      }
      const float r = 1.f / std::sqrt(sq / static_cast<float>(size) + static_cast<float>(eps));
      for (int64_t i = 0; i < size; ++i) v[i] = v[i] * r * nw[j * size + i];
    }
  }
  return {out, next_state};
}

// The greedy residual assignment of ``count`` consecutive quantizers from ``start``: per row, each
// quantizer takes the codebook row nearest the residual (argmin of |c|^2 - 2 r.c, the first on a tie),
// and the residual loses it. Returns the indices [B, count] and ``decided`` plus the chosen rows in
// order (or the chosen rows' sum when ``decided`` is None), [B, latent].
std::tuple<at::Tensor, at::Tensor> rvq_assign(const at::Tensor& residual, const at::Tensor& books,
                                              const at::Tensor& sq_norms, const c10::optional<at::Tensor>& decided,
                                              int64_t start, int64_t count) {
  check(residual, "residual", 2);
  check(books, "books", 3);
  check(sq_norms, "sq_norms", 2);
  const int64_t Bn = residual.size(0), L = residual.size(1), K = sq_norms.size(1), stride = books.size(1);
  check_size(books, "books", 2, L);
  TORCH_CHECK(stride >= K && sq_norms.size(0) == books.size(0) && start >= 0 && count > 0 &&
                  start + count <= books.size(0),
              "nvchat_cpu: rvq_assign: quantizers ", start, "..", start + count, " of books ", books.sizes(),
              " and norms ", sq_norms.sizes());
  at::Tensor index = at::empty({Bn, count}, residual.options().dtype(at::kLong));
  at::Tensor sum = at::empty({Bn, L}, residual.options());
  const float* dec = nullptr;
  if (decided.has_value() && decided->defined()) {
    check(*decided, "decided", 2);
    check_size(*decided, "decided", 0, Bn);
    check_size(*decided, "decided", 1, L);
    dec = decided->data_ptr<float>();
  }
  const float *cb = books.data_ptr<float>(), *norms = sq_norms.data_ptr<float>(), *res = residual.data_ptr<float>();
  int64_t* idx = index.data_ptr<int64_t>();
  float* out = sum.data_ptr<float>();
  // Per quantizer, all rows' distances as one matrix product (the codebook read once for the batch),
  // |c|^2 - 2 r.c formed as the composite code's addmm forms it (beta 1 on the norms, alpha -2).
  std::vector<float> left(res, res + Bn * L), dist(Bn * K);
  for (int64_t q = start; q < start + count; ++q) {
    const float* book = cb + q * stride * L;
    const float* nq = norms + q * K;
    for (int64_t b = 0; b < Bn; ++b) std::copy(nq, nq + K, dist.begin() + b * K);
    gemm_rows(left.data(), L, book, dist.data(), Bn, K, L, -2.f, 1.f);
    for (int64_t b = 0; b < Bn; ++b) {
      const float* d = dist.data() + b * K;
      const int64_t best = first_argmin(d, K);
      idx[b * count + (q - start)] = best;
      const float* row = book + best * L;
      float* acc = out + b * L;
      if (q == start && dec == nullptr) {
        std::copy(row, row + L, acc);
      } else {
        const float* base = q == start ? dec + b * L : acc;
        for (int64_t i = 0; i < L; ++i) acc[i] = base[i] + row[i];
      }
      float* r = left.data() + b * L;
      if (q + 1 < start + count)
        for (int64_t i = 0; i < L; ++i) r[i] = r[i] - row[i];
    }
  }
  return {index, sum};
}


// x / rms(x) * weight over the last dim (weight optional), and the same added to ``residual``
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  check(x, "x", x.dim());
  const int64_t d = x.size(-1);
  const float* w = optional_vector(weight, "weight", d);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_rows(x.data_ptr<float>(), w, nullptr, out.data_ptr<float>(), x.numel() / d, d, static_cast<float>(eps));
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, "x", x.dim());
  check(residual, "residual", x.dim());
  TORCH_CHECK(residual.sizes() == x.sizes(), "nvchat_cpu: add_rms_norm: residual ", residual.sizes(), " vs x ",
              x.sizes());
  const int64_t d = x.size(-1);
  check(weight, "weight", 1);
  check_size(weight, "weight", 0, d);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_rows(x.data_ptr<float>(), weight.data_ptr<float>(), residual.data_ptr<float>(), out.data_ptr<float>(),
           x.numel() / d, d, static_cast<float>(eps));
  return out;
}

// The Conformer convolution module's middle for one frame per row: glu of the first pointwise conv's
// output ``projected [B, 2d]``, the causal depthwise conv over (state [B, d, K-1], glu), LayerNorm
// over the channels, SiLU -> ([B, d], next state: the state's last K-2 columns and the glu, a new tensor).
std::tuple<at::Tensor, at::Tensor> conv_module_step(const at::Tensor& projected, const at::Tensor& state, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const at::Tensor& norm_weight,
                            const at::Tensor& norm_bias, double eps) {
  check(projected, "projected", 2);
  check(state, "state", 3);
  check(weight, "weight", 2);
  check(norm_weight, "norm_weight", 1);
  check(norm_bias, "norm_bias", 1);
  const int64_t Bn = projected.size(0), d = state.size(1), K = weight.size(1);
  check_size(projected, "projected", 1, 2 * d);
  check_size(state, "state", 0, Bn);
  check_size(state, "state", 2, K - 1);
  check_size(weight, "weight", 0, d);
  check_size(norm_weight, "norm_weight", 0, d);
  check_size(norm_bias, "norm_bias", 0, d);
  const float* bs = optional_vector(bias, "bias", d);
  at::Tensor out = at::empty({Bn, d}, projected.options());
  const float *in = projected.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float *lw = norm_weight.data_ptr<float>(), *lb = norm_bias.data_ptr<float>();
  at::Tensor next_state = at::empty(state.sizes(), state.options());
  const float* st = state.data_ptr<float>();
  float *nx = next_state.data_ptr<float>(), *o = out.data_ptr<float>();
  for (int64_t b = 0; b < Bn; ++b) {
    float* v = o + b * d;
    for (int64_t c = 0; c < d; ++c) {
      const float glu = in[b * 2 * d + c] * sigmoid(in[b * 2 * d + d + c]);
      const float* s = st + (b * d + c) * (K - 1);
      float* n = nx + (b * d + c) * (K - 1);
      float acc = 0.f;
      for (int64_t k = 0; k < K - 1; ++k) acc += s[k] * w[c * K + k];
      acc += glu * w[c * K + K - 1];
      v[c] = bs ? bs[c] + acc : acc;
      for (int64_t k = 0; k + 1 < K - 1; ++k) n[k] = s[k + 1];
      if (K > 1) n[K - 2] = glu;
    }
    const auto [mean, r] = row_moments(v, d, static_cast<float>(eps));
    for (int64_t c = 0; c < d; ++c) v[c] = silu((v[c] - mean) * r * lw[c] + lb[c]);
  }
  return {out, next_state};
}


// A Gemma attention step's queries and keys per row, after the fused q|k|v projection
// ``qkv [R, (Hq + 2 Hkv) d]``: each q and k head RMS-normed (no weight), then ``(n * scale_head) @ M``
// (the norm's 1 + w per head, ``qk_scale [Hq + Hkv, d]``, and the row's rotation ``M [1 or R, d, d]``);
// the row's key and value written at its slot of ``keys, values [R, Hkv, S, d]`` (in place). Returns the
// queries ``[R, Hq, d]``: the attention over the held slots stays torch's SDPA (vectorized for long
// histories).
at::Tensor gemma_qk_step(const at::Tensor& qkv, const at::Tensor& qk_scale, const at::Tensor& rotation,
                         at::Tensor& keys, at::Tensor& values, const at::Tensor& slots, double eps) {
  check(qkv, "qkv", 2);
  check(qk_scale, "qk_scale", 2);
  check(rotation, "rotation", 3);
  check(keys, "keys", 4);
  check(values, "values", 4);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1,
              "nvchat_cpu: slots must be a 1-D int64 CPU tensor");
  const int64_t R = qkv.size(0), Hkv = keys.size(1), S = keys.size(2), d = keys.size(3);
  const int64_t Hq = qk_scale.size(0) - Hkv;
  TORCH_CHECK(Hq > 0 && Hq % Hkv == 0, "nvchat_cpu: gemma_qk_step: ", Hq, " query heads for ", Hkv,
              " key/value heads");
  check_size(qkv, "qkv", 1, (Hq + 2 * Hkv) * d);
  check_size(qk_scale, "qk_scale", 1, d);
  check_size(rotation, "rotation", 1, d);
  check_size(rotation, "rotation", 2, d);
  TORCH_CHECK(rotation.size(0) == 1 || rotation.size(0) == R, "nvchat_cpu: rotation rows ", rotation.size(0));
  check_size(keys, "keys", 0, R);
  TORCH_CHECK(values.sizes() == keys.sizes(), "nvchat_cpu: values ", values.sizes(), " vs keys ", keys.sizes());
  check_size(slots, "slots", 0, R);
  const int64_t heads = Hq + Hkv, width = (Hq + 2 * Hkv) * d;
  at::Tensor out = at::empty({R, Hq, d}, qkv.options());
  const float *in = qkv.data_ptr<float>(), *sc = qk_scale.data_ptr<float>(), *rot = rotation.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float *K = keys.data_ptr<float>(), *V = values.data_ptr<float>(), *o = out.data_ptr<float>();
  std::vector<float> qk(heads * d), normed(d);
  for (int64_t r = 0; r < R; ++r) {
    const float* M = rot + (rotation.size(0) == 1 ? 0 : r * d * d);
    const int64_t at_slot = slot[r];
    TORCH_CHECK(at_slot >= 0 && at_slot < S, "nvchat_cpu: slot ", at_slot, " of ", S);
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = in + r * width + h * d;
      float sq = 0.f;
      NVCHAT_SIMD_SUM(sq)
      for (int64_t i = 0; i < d; ++i) sq += v[i] * v[i];
      const float s = 1.f / std::sqrt(sq / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) normed[i] = v[i] * s;
      float* dst = qk.data() + h * d;
      std::fill(dst, dst + d, 0.f);
      for (int64_t i = 0; i < d; ++i) {
        const float n = normed[i], w = sc[h * d + i];
        const float* Mi = M + i * d;
        for (int64_t j = 0; j < d; ++j) dst[j] += n * (w * Mi[j]);
      }
    }
    std::copy(qk.data(), qk.data() + Hq * d, o + r * Hq * d);
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t base = ((r * Hkv + g) * S + at_slot) * d;
      std::copy(qk.data() + (Hq + g) * d, qk.data() + (Hq + g + 1) * d, K + base);
      const float* v = in + r * width + (Hq + Hkv + g) * d;
      std::copy(v, v + d, V + base);
    }
  }
  return out;
}

// A Conformer attention step per row, after the fused projection ``quvkv [B, 4d]`` = (q + u, q + v,
// k, v): the row's key and value written at its ring slot of ``kv [2, B', H, W, hd]`` (row ``batch[r]``,
// in place), then per head softmax over ring slots ``0 .. length - 1`` of
// ``scale (q + u).k_j + (q + v).P[h, :, columns[r, j]] + mask[r, j]`` (``table`` P ``[H, hd, D]``, the
// layer's distance table, pre-scaled, read at each row's slots' columns ``[B, length]``; ``mask`` additive
// ``[B, 1, 1, length]``) -> ``[B, d]``. The ring is bounded (left context + 1 slots), so one pass per
// head is cheap.
at::Tensor conformer_attention_step(const at::Tensor& quvkv, at::Tensor& kv, const at::Tensor& batch,
                                    const at::Tensor& slot, const at::Tensor& table, const at::Tensor& columns,
                                    const c10::optional<at::Tensor>& mask, int64_t length, double scale) {
  check(quvkv, "quvkv", 2);
  check(kv, "kv", 5);
  check(table, "table", 3);
  for (const at::Tensor* t : {&batch, &slot})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 &&
                    t->size(0) == quvkv.size(0),
                "nvchat_cpu: conformer_attention_step: batch and slot must be [B] int64 CPU tensors");
  TORCH_CHECK(columns.device().is_cpu() && columns.scalar_type() == at::kLong && columns.is_contiguous() &&
                  columns.dim() == 2 && columns.size(0) == quvkv.size(0) && columns.size(1) == length,
              "nvchat_cpu: conformer_attention_step: columns must be [B, length] int64 (contiguous), got ",
              columns.sizes());
  const int64_t B = quvkv.size(0), rows = kv.size(1), H = kv.size(2), W = kv.size(3), hd = kv.size(4), d = H * hd;
  check_size(kv, "kv", 0, 2);
  check_size(quvkv, "quvkv", 1, 4 * d);
  check_size(table, "table", 0, H);
  check_size(table, "table", 1, hd);
  const int64_t D = table.size(2);
  TORCH_CHECK(length > 0 && length <= W, "nvchat_cpu: length ", length, " of ", W, " ring slots");
  const float* add = nullptr;
  if (mask.has_value() && mask->defined()) {
    check(*mask, "mask", 4);
    TORCH_CHECK(mask->size(0) == B && mask->size(3) == length, "nvchat_cpu: mask ", mask->sizes());
    add = mask->data_ptr<float>();
  }
  at::Tensor out = at::empty({B, d}, quvkv.options());
  const float *in = quvkv.data_ptr<float>(), *P = table.data_ptr<float>();
  const int64_t *row_of = batch.data_ptr<int64_t>(), *slot_of = slot.data_ptr<int64_t>(),
                *column = columns.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * length; ++i)
    TORCH_CHECK(column[i] >= 0 && column[i] < D, "nvchat_cpu: distance column ", column[i], " of ", D);
  float *Kv = kv.data_ptr<float>(), *o = out.data_ptr<float>();
  const int64_t plane = rows * H * W * hd;  // keys, then values
  for (int64_t r = 0; r < B; ++r) {
    const int64_t row = row_of[r], at_slot = slot_of[r];
    TORCH_CHECK(row >= 0 && row < rows && at_slot >= 0 && at_slot < W, "nvchat_cpu: row ", row, " slot ", at_slot);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = ((row * H + h) * W + at_slot) * hd;
      std::copy(in + r * 4 * d + 2 * d + h * hd, in + r * 4 * d + 2 * d + (h + 1) * hd, Kv + base);
      std::copy(in + r * 4 * d + 3 * d + h * hd, in + r * 4 * d + 3 * d + (h + 1) * hd, Kv + plane + base);
    }
  }
  std::vector<float> scores(length);
  for (int64_t r = 0; r < B; ++r) {
    const int64_t row = row_of[r];
    for (int64_t h = 0; h < H; ++h) {
      const float* qu = in + r * 4 * d + h * hd;
      const float* qv = qu + d;
      const float* keys = Kv + (row * H + h) * W * hd;
      const float* values = keys + plane;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < length; ++j) {
        const float* k = keys + j * hd;
        float content = 0.f, position = 0.f;
        NVCHAT_SIMD_SUM(content)
        for (int64_t c = 0; c < hd; ++c) content += qu[c] * k[c];
        const float* at = P + h * hd * D + column[r * length + j];
        for (int64_t c = 0; c < hd; ++c) position += qv[c] * at[c * D];
        float score = content * static_cast<float>(scale) + position;
        if (add != nullptr) score += add[r * length + j];
        scores[j] = score;
        top = std::max(top, score);
      }
      float total = 0.f;
      for (int64_t j = 0; j < length; ++j) {
        scores[j] = std::exp(scores[j] - top);
        total += scores[j];
      }
      float* dst = o + r * d + h * hd;
      std::fill(dst, dst + hd, 0.f);
      for (int64_t j = 0; j < length; ++j) {
        const float p = scores[j] / total;
        if (p == 0.f) continue;  // a masked slot (its memory may hold anything)
        const float* v = values + j * hd;
        for (int64_t c = 0; c < hd; ++c) dst[c] += p * v[c];
      }
    }
  }
  return out;
}

// activation(norm(x) @ weight^T + bias) for the rows of x [..., in] in one op: the pre-norm the
// projection's input takes ("rms": x / rms(x) * norm_weight; "layer": LayerNorm with norm_weight and
// norm_bias; "": none), the projection as torch's linear computes it (the bias copied in, then BLAS
// with beta 1), and the activation on its output ("silu", "relu_square", "gelu_tanh_mul": the halves
// [gate | up] -> gelu_tanh(gate) * up; "": none), the output still in cache.
at::Tensor norm_linear(const at::Tensor& x, c10::string_view norm, const c10::optional<at::Tensor>& norm_weight,
                       const c10::optional<at::Tensor>& norm_bias, double eps, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, c10::string_view activation) {
  TORCH_CHECK(x.dim() >= 1, "nvchat_cpu: norm_linear needs x [..., in]");
  check(x, "x", x.dim());
  check(weight, "weight", 2);
  const int64_t in = x.size(-1), n = weight.size(0), rows = in > 0 ? x.numel() / in : 0;
  check_size(weight, "weight", 1, in);
  const float* bs = optional_vector(bias, "bias", n);
  const bool rms = norm == "rms", layer = norm == "layer";
  TORCH_CHECK(rms || layer || norm.empty(), "nvchat_cpu: norm_linear: unknown norm '", std::string(norm), "'");
  const float* nw = optional_vector(norm_weight, "norm_weight", in);
  const float* nb = optional_vector(norm_bias, "norm_bias", in);
  const bool gated = activation == "gelu_tanh_mul";
  TORCH_CHECK(gated || activation == "silu" || activation == "relu_square" || activation.empty(),
              "nvchat_cpu: norm_linear: unknown activation '", std::string(activation), "'");
  TORCH_CHECK(!gated || n % 2 == 0, "nvchat_cpu: norm_linear: gelu_tanh_mul needs an even output width, got ", n);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = gated ? n / 2 : n;
  at::Tensor out = at::empty(shape, x.options());
  const float* src = x.data_ptr<float>();
  std::vector<float> normed;
  if (rms || layer) {
    normed.resize(rows * in);
    if (rms) rms_rows(src, nw, nullptr, normed.data(), rows, in, static_cast<float>(eps));
    if (layer) layer_rows(src, nw, nb, normed.data(), rows, in, static_cast<float>(eps));
    src = normed.data();
  }
  std::vector<float> scratch(gated ? rows * n : 0);
  float* y = gated ? scratch.data() : out.data_ptr<float>();
  linear_rows(src, weight.data_ptr<float>(), bs, y, rows, n, in);
  if (activation == "silu") silu_inplace(y, rows * n);
  if (activation == "relu_square") relu_square_inplace(y, rows * n);
  if (gated) gelu_tanh_mul_rows(y, out.data_ptr<float>(), rows, n / 2);
  return out;
}

}  // namespace

TORCH_LIBRARY(nvchat_cpu, m) {
  m.def("mamba_step(Tensor projected, Tensor conv_state, Tensor conv_weight, Tensor? conv_bias, Tensor dt_bias, "
        "Tensor A, Tensor D, Tensor norm_weight, Tensor(a!) ssm_state, int pad, int groups, int norm_groups, "
        "float eps, float? dt_min, float? dt_max) -> (Tensor, Tensor)");
  m.def("rvq_assign(Tensor residual, Tensor books, Tensor sq_norms, Tensor? decided, int start, int count) "
        "-> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("conformer_attention_step(Tensor quvkv, Tensor(a!) kv, Tensor batch, Tensor slot, Tensor table, "
        "Tensor columns, Tensor? mask, int length, float scale) -> Tensor");
  m.def("gemma_qk_step(Tensor qkv, Tensor qk_scale, Tensor rotation, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor slots, float eps) -> Tensor");
  m.def("blas_available() -> bool", &blas_available);
  m.def("depthwise_conv1d(Tensor x, Tensor taps, Tensor? bias) -> Tensor");
  m.def("convnext_block(Tensor x, Tensor state, Tensor taps, Tensor dw_bias, Tensor norm_weight, Tensor norm_bias, "
        "float eps, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> (Tensor, Tensor)");
  m.def("upsample_conv1d(Tensor x, Tensor weight) -> Tensor");
  m.def("overlap_add(Tensor frames, Tensor window, Tensor envelope, int hop) -> Tensor");  // no tensor: one kernel for every dispatch key
  m.def("norm_linear(Tensor x, str norm, Tensor? norm_weight, Tensor? norm_bias, float eps, Tensor weight, "
        "Tensor? bias, str activation) -> Tensor");
  m.def("conv_module_step(Tensor projected, Tensor state, Tensor weight, Tensor? bias, Tensor norm_weight, "
        "Tensor norm_bias, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nvchat_cpu, CPU, m) {
  m.impl("mamba_step", &mamba_step);
  m.impl("rvq_assign", &rvq_assign);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("conv_module_step", &conv_module_step);
  m.impl("norm_linear", &norm_linear);
  m.impl("depthwise_conv1d", &depthwise_conv1d);
  m.impl("overlap_add", &overlap_add);
  m.impl("convnext_block", &convnext_block);
  m.impl("upsample_conv1d", &upsample_conv1d);
  m.impl("gemma_qk_step", &gemma_qk_step);
  m.impl("conformer_attention_step", &conformer_attention_step);
}
