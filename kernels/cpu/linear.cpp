// Small-M fp32 linear for CPU decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
//
// Why: a decode step multiplies a few activation rows by every weight matrix. MKL's sgemm on
// AMD CPUs takes its generic path for M in 2..32: two rows cost about twice one row, although
// the step is bound by reading the weights once. This kernel streams each weight row once per
// call and reuses it for up to 4 activation rows from registers, so 2-16 rows cost about what
// one row costs (benchmarks/bench_cpu_linear.py prints the ratios).
//
// Layout: dot-product form on nn.Linear's own [N, K] weight (no repacking): a 3x4 tile of
// (weight rows x activation rows) keeps 12 AVX2 accumulators over K, the weight rows are split
// across torch's intra-op threads (at::parallel_for). Summation order differs from MKL's, so
// results match F.linear to fp32 rounding (|err| ~1e-5 relative), not bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <immintrin.h>

#include "ops.h"

namespace saltserve_cpu {
namespace {

constexpr int kRowsW = 3;  // weight rows per tile (outputs)
constexpr int kRowsX = 4;  // activation rows per tile

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m0 + j, n0 + i] for i < NR, j < MR.
template <int NR, int MR>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K,
                 int64_t N, int64_t n0, int64_t m0) {
  __m256 acc[NR][MR];
  const float* wr[NR];
  const float* xr[MR];
  for (int i = 0; i < NR; ++i) {
    wr[i] = w + (n0 + i) * K;
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  for (int j = 0; j < MR; ++j) xr[j] = x + (m0 + j) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = _mm256_loadu_ps(xr[j] + k);
    for (int i = 0; i < NR; ++i) {
      // The next tile's rows follow these NR rows: ask for them in L2 while computing here
      // (streaming 2-16 rows, this is what keeps the loads at the memory's bandwidth).
      _mm_prefetch(reinterpret_cast<const char*>(wr[i] + NR * K + k), _MM_HINT_T1);
      const __m256 wv = _mm256_loadu_ps(wr[i] + k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += wr[i][kk] * xr[j][kk];
      y[(m0 + j) * N + n0 + i] = bias ? s + bias[n0 + i] : s;
    }
  }
}

// All M rows for outputs n0..n0+NR: ceil(M / 4) tiles of as even a size as possible (6 rows are
// 3 + 3, not 4 + 2: a 2-row tile leaves the FMA units half idle).
template <int NR>
inline void outputs(const float* x, const float* w, const float* bias, float* y, int64_t M,
                    int64_t K, int64_t N, int64_t n0) {
  const int64_t groups = (M + kRowsX - 1) / kRowsX;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t rows = (M - m) / (groups - g) + ((M - m) % (groups - g) != 0);
    switch (rows) {
      case 4: tile<NR, 4>(x, w, bias, y, K, N, n0, m); break;
      case 3: tile<NR, 3>(x, w, bias, y, K, N, n0, m); break;
      case 2: tile<NR, 2>(x, w, bias, y, K, N, n0, m); break;
      default: tile<NR, 1>(x, w, bias, y, K, N, n0, m); break;
    }
    m += rows;
  }
}

}  // namespace

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_small_m: x [M, K] and w [N, K] expected, got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "linear_small_m: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_small_m: contiguous inputs only");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == w.size(0),
                "linear_small_m: bias [N] float32 expected");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = N / kRowsW;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) outputs<kRowsW>(xp, wp, bp, yp, M, K, N, t * kRowsW);
  });
  for (int64_t n = tiles * kRowsW; n < N; ++n) outputs<1>(xp, wp, bp, yp, M, K, N, n);
  return y;
}

}  // namespace saltserve_cpu
