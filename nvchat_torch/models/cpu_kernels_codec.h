// The codec decoder's fused ops (included by cpu_kernels.cpp alone, into its anonymous namespace,
// after cpu_kernels.h): its depthwise convs over a step's window, its streaming ConvNeXt block, its
// upsampling and the iSTFT's overlap-add.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <tuple>
#include <vector>

namespace {

// A depthwise conv over the last axis, stride 1, no padding: x [B, C, T], taps [C, K], bias [C]
// (optional) -> [B, C, T - K + 1] (the codec's ConvNeXt convs over a step's window; each output the
// bias plus its K products in order)
at::Tensor depthwise_conv1d(const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& bias) {
  check(x, "x", 3);
  check(taps, "taps", 2);
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), K = taps.size(1);
  check_size(taps, "taps", 0, C);
  TORCH_CHECK(K >= 1 && T >= K, "nvchat_cpu: depthwise_conv1d: ", T, " frames for a kernel of ", K);
  const float* bs = optional_vector(bias, "bias", C);
  const int64_t T_out = T - K + 1;
  at::Tensor out = at::empty({B, C, T_out}, x.options());
  const float *in = x.data_ptr<float>(), *w = taps.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t bc = 0; bc < B * C; ++bc) {
    const int64_t c = bc % C;
    const float *row = in + bc * T, *tap = w + c * K;
    float* y = o + bc * T_out;
    std::fill(y, y + T_out, bs ? bs[c] : 0.f);
    for (int64_t k = 0; k < K; ++k)  // tap by tap: each pass vectorizes over the outputs
      for (int64_t t = 0; t < T_out; ++t) y[t] += row[t + k] * tap[k];
  }
  return out;
}

// A streaming ConvNeXt block of the codec's decoder on x [B, C, T] with its state [B, C, K - 1] (the last
// K - 1 input frames before x): x + pwconv2(gelu(pwconv1(LayerNorm(dwconv(state | x))))), the depthwise
// conv (taps [C, K], bias [C]) written channel-last, the LayerNorm over channels, the pointwise convs
// w1 [4C, C], b1 and w2 [C, 4C], b2 by torch's BLAS (the second straight into x's channel-first layout,
// one product per row) -> (out [B, C, T], the next state [B, C, K - 1])
std::tuple<at::Tensor, at::Tensor> convnext_block(const at::Tensor& x, const at::Tensor& state, const at::Tensor& taps,
                                                  const at::Tensor& dw_bias, const at::Tensor& norm_weight,
                                                  const at::Tensor& norm_bias, double eps, const at::Tensor& w1,
                                                  const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2) {
  check(x, "x", 3);
  check(state, "state", 3);
  check(taps, "taps", 2);
  check(w1, "w1", 2);
  check(w2, "w2", 2);
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), K = taps.size(1), ctx = K - 1, H = w1.size(0);
  check_size(state, "state", 0, B);
  check_size(state, "state", 1, C);
  check_size(state, "state", 2, ctx);
  check_size(taps, "taps", 0, C);
  check_size(w1, "w1", 1, C);
  check_size(w2, "w2", 0, C);
  check_size(w2, "w2", 1, H);
  const float *dwb = optional_vector(dw_bias, "dw_bias", C), *nw = optional_vector(norm_weight, "norm_weight", C),
              *nb = optional_vector(norm_bias, "norm_bias", C), *pb1 = optional_vector(b1, "b1", H),
              *pb2 = optional_vector(b2, "b2", C);
  TORCH_CHECK(dwb && nw && nb && pb1 && pb2, "nvchat_cpu: convnext_block needs every bias and the norm's affine");
  at::Tensor out = at::empty({B, C, T}, x.options()), next_state = at::empty({B, C, ctx}, x.options());
  const float *in = x.data_ptr<float>(), *held = state.data_ptr<float>(), *w = taps.data_ptr<float>();
  float *o = out.data_ptr<float>(), *ns = next_state.data_ptr<float>();
  std::vector<float> normed(B * T * C), hidden(B * T * H), window(ctx + T), conv(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c) {
      const float *prev = held + (b * C + c) * ctx, *now = in + (b * C + c) * T, *tap = w + c * K;
      std::copy(prev, prev + ctx, window.begin());
      std::copy(now, now + T, window.begin() + ctx);
      std::copy(window.end() - ctx, window.end(), ns + (b * C + c) * ctx);
      std::fill(conv.begin(), conv.end(), dwb[c]);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t t = 0; t < T; ++t) conv[t] += window[t + k] * tap[k];
      for (int64_t t = 0; t < T; ++t) normed[(b * T + t) * C + c] = conv[t];
    }
  layer_rows(normed.data(), nw, nb, normed.data(), B * T, C, static_cast<float>(eps));
  linear_rows(normed.data(), w1.data_ptr<float>(), pb1, hidden.data(), B * T, H, C);
  gelu_erf_inplace(hidden.data(), B * T * H);
  for (int64_t b = 0; b < B; ++b) {
    float* ob = o + b * C * T;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t t = 0; t < T; ++t) ob[c * T + t] = in[(b * C + c) * T + t] + pb2[c];
    // out_b [C, T] (column-major [T, C]) += hidden_b [T, H] @ w2^T
    gemm('T', 'N', T, C, H, hidden.data() + b * T * H, H, w2.data_ptr<float>(), H, 1.f, ob, T);
  }
  return {out, next_state};
}

// A transposed conv whose kernel equals its stride (the codec's upsampling, no bias): x [B, Cin, T],
// weight [Cin, Cout, K] -> [B, Cout, T * K], out[b, o, t K + k] = sum_i x[b, i, t] weight[i, o, k]: one
// BLAS product per row into [T, Cout * K], then each frame's K samples per channel put in place
at::Tensor upsample_conv1d(const at::Tensor& x, const at::Tensor& weight) {
  check(x, "x", 3);
  check(weight, "weight", 3);
  const int64_t B = x.size(0), Cin = x.size(1), T = x.size(2), Cout = weight.size(1), K = weight.size(2);
  check_size(weight, "weight", 0, Cin);
  at::Tensor out = at::empty({B, Cout, T * K}, x.options());
  const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::vector<float> frames(T * Cout * K);
  for (int64_t b = 0; b < B; ++b) {
    // frames [T, Cout K] row-major = column-major [Cout K, T] = weight^T (as [Cout K, Cin]) @ x_b ([Cin, T])
    gemm('N', 'T', Cout * K, T, Cin, w, Cout * K, in + b * Cin * T, T, 0.f, frames.data(), Cout * K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < Cout; ++c)
        std::copy(frames.data() + (t * Cout + c) * K, frames.data() + (t * Cout + c + 1) * K,
                  o + (b * Cout + c) * T * K + t * K);
  }
  return out;
}

// The iSTFT's overlap-add of frames [B, n, N] (hop ``hop``): each frame clamped to [-w, w] and
// multiplied by the window w [n], summed at its offset, and divided by the window-square envelope
// [(N - 1) hop + n] -> [B, 1, (N - 1) hop + n]
at::Tensor overlap_add(const at::Tensor& frames, const at::Tensor& window, const at::Tensor& envelope, int64_t hop) {
  check(frames, "frames", 3);
  check(window, "window", 1);
  const int64_t B = frames.size(0), n = frames.size(1), N = frames.size(2), L = (N - 1) * hop + n;
  check_size(window, "window", 0, n);
  TORCH_CHECK(hop >= 1 && N >= 1, "nvchat_cpu: overlap_add: hop ", hop, ", ", N, " frames");
  check(envelope, "envelope", envelope.dim());
  TORCH_CHECK(envelope.numel() == L, "nvchat_cpu: overlap_add: envelope of ", envelope.numel(), " samples for ", L);
  at::Tensor out = at::empty({B, 1, L}, frames.options());
  const float *f = frames.data_ptr<float>(), *w = window.data_ptr<float>(), *env = envelope.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::fill(o, o + B * L, 0.f);
  for (int64_t b = 0; b < B; ++b) {
    float* y = o + b * L;
    for (int64_t i = 0; i < n; ++i) {
      const float* fi = f + (b * n + i) * N;
      for (int64_t t = 0; t < N; ++t) y[t * hop + i] += std::min(std::max(fi[t], -w[i]), w[i]) * w[i];
    }
    for (int64_t s = 0; s < L; ++s) y[s] /= env[s];
  }
  return out;
}

}  // namespace
