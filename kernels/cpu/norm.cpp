// Fused RMSNorm for the CPU decode step (vLLM's rms_norm and fused_add_rms_norm CPU ops).
//
// Why: torch 2.13's CPU rms_norm is a composite of five ops (pow, mean, add, rsqrt, mul twice),
// about 40 us a call at 576 features against ~1 us of arithmetic, and a decode step of the
// bundled model calls it 61 times (over a tenth of a gguf step).
//
// Arithmetic, fp32, per row of H features, as transformers' LlamaRMSNorm:
//   out = weight * (x * (1 / sqrt(mean(x^2) + eps)))
// The sum of squares runs in 8 AVX2 lanes (then lane order), so it differs from torch's
// reduction order by fp32 rounding only; every row is summed the same way whatever the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "ops.h"

namespace saltserve_cpu {
namespace {

inline float sum_of_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += lanes[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out[i] = w[i] * (x[i] * r)
inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                            _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

inline float inv_rms(const float* x, int64_t n, double eps) {
  const float mean = sum_of_squares(x, n) / static_cast<float>(n);
  return 1.f / std::sqrt(mean + static_cast<float>(eps));
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), op,
              ": x [T, H] and weight [H] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, op,
              ": float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), op, ": contiguous inputs only");
}

constexpr int64_t kGrain = 16;  // rows per parallel task: decode rows run on one thread

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      scale_row(xp + t * H, wp, inv_rms(xp + t * H, H, eps), op + t * H, H);
  });
  return out;
}

// residual += x (in place), then returns rms_norm(residual): the residual add of a decoder layer
// fused into the next norm.
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check(x, weight, "add_rms_norm");
  check(residual, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual and x differ in shape");
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(1);
  float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = rp + t * H;
      const float* d = xp + t * H;
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        _mm256_storeu_ps(r + i, _mm256_add_ps(_mm256_loadu_ps(r + i), _mm256_loadu_ps(d + i)));
      for (; i < H; ++i) r[i] += d[i];
      scale_row(r, wp, inv_rms(r, H, eps), op + t * H, H);
    }
  });
  return out;
}

}  // namespace saltserve_cpu
