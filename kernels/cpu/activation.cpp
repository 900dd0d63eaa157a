// silu_and_mul (vLLM's op of that name, for the Llama MLP): out[t, i] = silu(x[t, i]) * x[t, d + i]
// with silu(a) = a / (1 + exp(-a)), over x [T, 2 d] fp32 (the fused gate/up projection's output).
//
// Why: at::silu on a strided half of gate_up, then at::mul, allocates two tensors and runs two
// passes (tens of us a layer at 16 decode rows). Here one pass writes the product. exp is
// vec_exp.h's (about 1 ulp), not ATen's, so the per-op Python layer calls this op too
// (kernels.cpu_ops.silu_and_mul) and both paths keep the same bits. Rows are split across
// threads from 16 K elements on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "ops.h"
#include "vec_exp.h"

namespace saltserve_cpu {
namespace {

inline __m256 silu_mul8(__m256 a, __m256 b) {
  const __m256 e = saltserve::exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
  return _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e)), b);
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: x [num_tokens, 2 * d] expected, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
              "silu_and_mul: contiguous float32 x expected");
  const int64_t T = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({T, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* a = xp + t * 2 * d;
      const float* b = a + d;
      float* o = op + t * d;
      int64_t i = 0;
      for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
      if (i < d) {  // the tail through the same lanes, padded
        alignas(32) float ta[8] = {0}, tb[8] = {0}, to[8];
        std::copy(a + i, a + d, ta), std::copy(b + i, b + d, tb);
        _mm256_store_ps(to, silu_mul8(_mm256_load_ps(ta), _mm256_load_ps(tb)));
        std::copy(to, to + (d - i), o + i);
      }
    }
  });
  return out;
}

}  // namespace saltserve_cpu
