// argmax_rows: the index of each row's maximum, for greedy sampling: out[t] = the first i with
// x[t, i] == max(x[t, :]), or the first NaN's index where the row has one, as torch's
// x.max(dim=-1).indices and x.argmax(dim=-1) on CPU (equal maxima: the first; -0.0 == +0.0).
//
// Why: torch's argmax over a [1, 49,152] row of logits takes tens of us, about 1% of a
// one-stream gguf decode step, for a row that sits in L2. Here: one
// pass for the row's maximum (and whether it has a NaN), one pass to the first lane equal to it.
// Rows are split across threads from 4 rows on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "ops.h"

namespace saltserve_cpu {
namespace {

int64_t argmax_row(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();  // lanes that saw a NaN (all ones)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = -INFINITY;
  for (int k = 0; k < 8; ++k) m = lanes[k] > m ? lanes[k] : m;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    has_nan |= std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  // The first position equal to m (or the first NaN): 8 lanes at a time, then the tail.
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                               : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < n; ++i)
    if (has_nan ? std::isnan(x[i]) : x[i] == m) return i;
  return 0;  // n == 0 is refused by the caller
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0,
              "argmax_rows: x [rows, n] with n > 0 expected, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
              "argmax_rows: contiguous float32 x expected");
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) op[t] = argmax_row(xp + t * n, n);
  });
  return out;
}

}  // namespace saltserve_cpu
