// The helpers cpu_kernels.cpp's ops share (included by it alone, into its anonymous namespace): input
// checks, the scalar activations, torch's BLAS, row statistics, and the loops built per vector width.

#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

namespace {

// A sum the compiler may split into vector lanes (-fopenmp-simd: no OpenMP runtime): a different order
// of float additions than left to right, as ATen's vectorized sums have too.
#define NVCHAT_SIMD_SUM(var) _Pragma(NVCHAT_STR(omp simd reduction(+ : var)))
#define NVCHAT_STR(x) #x

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "nvchat_cpu: ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "nvchat_cpu: ", name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, "nvchat_cpu: ", name, " must have ", dim, " dims, got ", t.sizes());
}

void check_size(const at::Tensor& t, const char* name, int64_t axis, int64_t size) {
  TORCH_CHECK(t.size(axis) == size, "nvchat_cpu: ", name, " has ", t.size(axis), " at dim ", axis,
              ", expected ", size, " (shape ", t.sizes(), ")");
}

// An optional 1-D float32 vector of ``size`` entries (a bias, a norm weight): its data, or nullptr.
const float* optional_vector(const c10::optional<at::Tensor>& t, const char* name, int64_t size) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check(*t, name, 1);
  check_size(*t, name, 0, size);
  return t->data_ptr<float>();
}

inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }
inline float silu(float v) { return v / (1.f + std::exp(-v)); }
// torch's softplus (beta 1, threshold 20)
inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }
inline float clamp_keep_nan(float v, const c10::optional<double>& lo, const c10::optional<double>& hi) {
  if (lo.has_value() && v < *lo) return static_cast<float>(*lo);
  if (hi.has_value() && v > *hi) return static_cast<float>(*hi);
  return v;
}

// The BLAS torch links (MKL, OpenBLAS or Accelerate) does the matrix products, as torch's own linear
// and addmm do: weak, so a torch without an exported sgemm_ still loads the other ops (blas_available).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

bool blas_available() { return sgemm_ != nullptr; }

// C [rows, n] = alpha * A [rows, k] @ W [n, k]^T + beta * C, all row-major with contiguous rows (A's
// rows ``lda`` apart): column-major, C^T = W^T^T A^T, torch's call for a linear's row-major output.
void gemm_rows(const float* A, int64_t lda, const float* W, float* C, int64_t rows, int64_t n, int64_t k,
               float alpha, float beta) {
  TORCH_CHECK(blas_available(), "nvchat_cpu: this torch build exports no BLAS sgemm_");
  TORCH_CHECK(rows < INT32_MAX && n < INT32_MAX && k < INT32_MAX && lda < INT32_MAX,
              "nvchat_cpu: a matrix product over 2^31 rows or columns");
  const char ta = 'T', tb = 'N';
  const int m_ = static_cast<int>(n), n_ = static_cast<int>(rows), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(k > 0 ? k : 1), ldb_ = static_cast<int>(lda > 0 ? lda : 1),
            ldc_ = static_cast<int>(n > 0 ? n : 1);
  if (rows == 0 || n == 0) return;
  sgemm_(&ta, &tb, &m_, &n_, &k_, &alpha, W, &lda_, A, &ldb_, &beta, C, &ldc_);
}

// C = alpha * op(A) @ op(B) + beta * C in BLAS's column-major terms (``trans``: 'N' or 'T'), for the
// products whose layout gemm_rows does not cover (the codec's channel-first outputs)
void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  TORCH_CHECK(blas_available(), "nvchat_cpu: this torch build exports no BLAS sgemm_");
  for (const int64_t v : {m, n, k, lda, ldb, ldc})
    TORCH_CHECK(v < INT32_MAX, "nvchat_cpu: a matrix product over 2^31 rows or columns");
  if (m == 0 || n == 0) return;
  const int m_ = static_cast<int>(m), n_ = static_cast<int>(n), k_ = static_cast<int>(k);
  const int lda_ = static_cast<int>(std::max<int64_t>(lda, 1)), ldb_ = static_cast<int>(std::max<int64_t>(ldb, 1)),
            ldc_ = static_cast<int>(std::max<int64_t>(ldc, 1));
  const float alpha = 1.f;
  sgemm_(&transa, &transb, &m_, &n_, &k_, &alpha, A, &lda_, B, &ldb_, &beta, C, &ldc_);
}

// y [rows, n] = A [rows, k] @ W [n, k]^T + bias (optional) as torch's linear computes it: the bias copied
// into every row, then BLAS with beta 1
void linear_rows(const float* A, const float* W, const float* bias, float* y, int64_t rows, int64_t n, int64_t k) {
  if (bias)
    for (int64_t r = 0; r < rows; ++r) std::copy(bias, bias + n, y + r * n);
  gemm_rows(A, k, W, y, rows, n, k, 1.f, bias ? 1.f : 0.f);
}

// LayerNorm's statistics of a row: its mean and 1 / sqrt(biased variance + eps)
inline std::pair<float, float> row_moments(const float* v, int64_t d, float eps) {
  float mean = 0.f;
  NVCHAT_SIMD_SUM(mean)
  for (int64_t c = 0; c < d; ++c) mean += v[c];
  mean /= static_cast<float>(d);
  float var = 0.f;
  NVCHAT_SIMD_SUM(var)
  for (int64_t c = 0; c < d; ++c) var += (v[c] - mean) * (v[c] - mean);
  return {mean, 1.f / std::sqrt(var / static_cast<float>(d) + eps)};
}

// The activation loops after a projection, built for the CPU's vector width too and chosen when loaded
// by what the CPU reports (GCC/Clang function clones on x86-64 Linux; one build elsewhere).
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define NVCHAT_VECTOR_CLONES __attribute__((noinline, target_clones("avx512f", "avx2", "default")))
#else
#define NVCHAT_VECTOR_CLONES
#endif

// exp(v) without a libm call, so a loop of it vectorizes: Cephes' expf (reduction by ln 2 in two parts,
// degree-6 polynomial), within 2 ulp of libm's; inputs clamped to [-87.3, 88.3] (no inf or denormal).
inline float exp_poly(float v) {
  v = std::min(std::max(v, -87.3f), 88.3f);
  const float n = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;  // nearest integer (+- 1.5 * 2^23)
  const float r = (v - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = p * r + c;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return (p * r * r + r + 1.f) * scale;
}

// gelu_tanh: 0.5 v (1 + tanh(z)) as v sigmoid(2 z), one exp
inline float gelu_tanh(float v) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  return v / (1.f + exp_poly(-2.f * (beta * (v + kappa * v * v * v))));
}

NVCHAT_VECTOR_CLONES void silu_inplace(float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] / (1.f + exp_poly(-y[i]));
}

NVCHAT_VECTOR_CLONES void relu_square_inplace(float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] > 0.f ? y[i] * y[i] : 0.f;
}

// o [rows, h] = gelu_tanh(gate) * up of y [rows, 2h] = [gate | up]
NVCHAT_VECTOR_CLONES void gelu_tanh_mul_rows(const float* y, float* o, int64_t rows, int64_t h) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < h; ++i) o[r * h + i] = gelu_tanh(y[r * 2 * h + i]) * y[r * 2 * h + h + i];
}

// The exact (erf) GELU, v Phi(v) = v erfc(-v / sqrt 2) / 2, with erfc from Numerical Recipes' Chebyshev
// fit (fractional error < 1.2e-7 for every argument, so the product keeps float32's relative precision
// on both tails: within 1e-6 of float64's from -12 to 12) and exp_poly: no libm call, so the loop
// vectorizes
inline float gelu_erf(float v) {
  const float a = std::fabs(v) * static_cast<float>(M_SQRT1_2), t = 1.f / (1.f + 0.5f * a);
  float p = 0.17087277f;
  for (const float c : {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f, 0.09678418f,
                        0.37409196f, 1.00002368f})
    p = p * t + c;
  // The exponent's -a^2 = -v^2 / 2 from v itself, as -s^2 / 2 - (|v| - s)(|v| + s) / 2 with s = |v| cut to
  // 12 significant bits (s^2 exact): the large part carries no rounding into the tail (as Cephes' erfcf)
  const float m = std::fabs(v);
  uint32_t bits;
  std::memcpy(&bits, &m, sizeof bits);
  bits &= 0xfffff000u;
  float s;
  std::memcpy(&s, &bits, sizeof s);
  const float tail = t * exp_poly(-0.5f * (s * s)) * exp_poly(-0.5f * ((m - s) * (m + s)) - 1.26551223f + t * p);
  return 0.5f * v * (v <= 0.f ? tail : 2.f - tail);  // erfc(-v / sqrt 2): the tail for v <= 0
}

NVCHAT_VECTOR_CLONES void gelu_erf_inplace(float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = gelu_erf(y[i]);
}

// The first index of the minimum of d [K] (a NaN, the first, wins, as torch's argmin's does)
NVCHAT_VECTOR_CLONES int64_t first_argmin(const float* d, int64_t K) {
  float lo = std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(min : lo) reduction(| : nan)
  for (int64_t k = 0; k < K; ++k) {
    lo = std::min(lo, d[k]);
    nan |= d[k] != d[k];
  }
  for (int64_t k = 0; k < K; ++k)
    if (nan ? d[k] != d[k] : d[k] == lo) return k;
  return 0;
}

// LayerNorm of each row of x [rows, d] into o (o may be x): (x - mean) / sqrt(var + eps) * w + b, w and b
// optional
void layer_rows(const float* x, const float* w, const float* b, float* o, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * d;
    float* out = o + r * d;
    const auto [mean, s] = row_moments(v, d, eps);
    for (int64_t c = 0; c < d; ++c) {
      const float y = (v[c] - mean) * s;
      out[c] = (w ? y * w[c] : y) + (b ? b[c] : 0.f);
    }
  }
}

void rms_rows(const float* x, const float* w, const float* residual, float* o, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * d;
    float sq = 0.f;
    NVCHAT_SIMD_SUM(sq)
    for (int64_t i = 0; i < d; ++i) sq += v[i] * v[i];
    const float s = 1.f / std::sqrt(sq / static_cast<float>(d) + eps);
    float* out = o + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const float n = w ? v[i] * s * w[i] : v[i] * s;
      out[i] = residual ? residual[r * d + i] + n : n;
    }
  }
}

}  // namespace
