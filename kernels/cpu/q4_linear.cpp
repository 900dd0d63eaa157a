// 4-bit grouped weight-only linear for CPU decode: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// Why: torch ships no fast int4 CPU kernel for fp32 activations on AVX2 (its int4pack kernel
// wants bf16 inputs and still costs 2-3x what reading 4.5-bit weights costs), so a single
// decode stream of --quantization gguf would spend most of its step there.
//
// Weights: GGUF's Q4_1 groups of 32 inputs, w = code * scale + minimum, code in [0, 15].
//   codes   [N, K / 2] uint8: group g of row n is 16 bytes, byte j = code[j] | code[j + 16] << 4
//           (GGUF's own nibble order);
//   scale, minimum [N, K / 32] float16 (GGUF stores them so: exact for a GGUF's blocks, and
//   4 bytes per group to read instead of 8).
// Activations: each group of 32 inputs of a row is quantized to int8 with its own scale
// (dx = max|x| / 127, round to nearest), as llama.cpp does for its Q4_1 x Q8_1 dot product, and
// its exact fp32 sum is kept for the minimum's term:
//   y[m, n] = sum_g scale[n, g] * dx[m, g] * sum_i code[n, g, i] * qx[m, g, i]
//           + sum_g minimum[n, g] * xsum[m, g]  (+ bias[n]).
// The inner sum is exact integer arithmetic (pmaddubsw: 15 * 127 * 2 fits int16), so the only
// approximation beyond the weights' own is the activations' int8 rounding (at most 1 / 254 of the
// group's largest |x| per input; benchmarks/bench_quantization.py reports its effect on greedy
// agreement and perplexity). Each weight row is read once per call for up to 4 activation rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <immintrin.h>

#include <c10/util/Half.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace saltserve_cpu {
namespace {

constexpr int kGroup = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 bytes of codes: low nibbles first (code 0..15), then high (16..31).
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

struct QuantizedActs {
  const int8_t* qx;    // [M, K]
  const float* dx;     // [M, G]
  const float* xsum;   // [M, G]
};

// y[m0 + j, n0 + i] for i < NR, j < MR.
// count fp16 values -> fp32 (8 at a time with F16C).
inline void halves_to_floats(const uint16_t* h, float* f, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(
        f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < count; ++i) f[i] = _cvtsh_ss(h[i]);
}

// scale, minimum: this tile's NR rows in fp32, [NR, G].
template <int NR, int MR>
inline void tile(const QuantizedActs& a, const uint8_t* codes, const float* scale,
                 const float* minimum, const float* bias, float* y, int64_t K, int64_t N,
                 int64_t n0, int64_t m0) {
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i qxv[MR];
    float dxg[MR];
    for (int j = 0; j < MR; ++j) {
      qxv[j] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.qx + (m0 + j) * K + g * kGroup));
      dxg[j] = a.dx[(m0 + j) * G + g];
    }
    for (int i = 0; i < NR; ++i) {
      const int64_t n = n0 + i;
      const __m256i w = unpack_nibbles(codes + n * (K / 2) + g * (kGroup / 2));
      const float d = scale[i * G + g];
      for (int j = 0; j < MR; ++j) {
        const __m256i p16 = _mm256_maddubs_epi16(w, qxv[j]);
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[i][j] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dxg[j]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    const int64_t n = n0 + i;
    for (int j = 0; j < MR; ++j) {
      float s = hsum(acc[i][j]);
      const float* xs = a.xsum + (m0 + j) * G;
      const float* mn = minimum + i * G;
      for (int64_t g = 0; g < G; ++g) s += mn[g] * xs[g];
      y[(m0 + j) * N + n] = bias ? s + bias[n] : s;
    }
  }
}

// All M rows for outputs n0..n0+NR, in ceil(M / 4) balanced row groups; the tile's fp16 scales
// and minimums are widened once into a per-thread buffer.
template <int NR>
inline void outputs(const QuantizedActs& a, const uint8_t* codes, const uint16_t* scale,
                    const uint16_t* minimum, const float* bias, float* y, int64_t M, int64_t K,
                    int64_t N, int64_t n0) {
  const int64_t G = K / kGroup;
  thread_local std::vector<float> buffer;
  buffer.resize(2 * NR * G);
  float* sc = buffer.data();
  float* mn = sc + NR * G;
  halves_to_floats(scale + n0 * G, sc, NR * G);
  halves_to_floats(minimum + n0 * G, mn, NR * G);
  const int64_t groups = (M + 3) / 4;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t rows = (M - m) / (groups - g) + ((M - m) % (groups - g) != 0);
    switch (rows) {
      case 4: tile<NR, 4>(a, codes, sc, mn, bias, y, K, N, n0, m); break;
      case 3: tile<NR, 3>(a, codes, sc, mn, bias, y, K, N, n0, m); break;
      case 2: tile<NR, 2>(a, codes, sc, mn, bias, y, K, N, n0, m); break;
      default: tile<NR, 1>(a, codes, sc, mn, bias, y, K, N, n0, m); break;
    }
    m += rows;
  }
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& minimum, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scale.dim() == 2 && minimum.dim() == 2,
              "q4_linear: x [M, K], codes [N, K / 2], scale and minimum [N, K / 32] expected");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && codes.size(1) * 2 == K && scale.size(0) == N &&
                  scale.size(1) == G && minimum.sizes() == scale.sizes(),
              "q4_linear: shapes do not match: x ", x.sizes(), ", codes ", codes.sizes(),
              ", scale ", scale.sizes(), ", minimum ", minimum.sizes(),
              " (K must be a multiple of 32)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf,
              "q4_linear: x float32, codes uint8, scale and minimum float16 expected");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scale.is_contiguous() &&
                  minimum.is_contiguous(),
              "q4_linear: contiguous inputs only");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "q4_linear: bias [N] float32 expected");
    bp = bias->data_ptr<float>();
  }
  // The activations' int8 groups, their scales and exact sums.
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * G), xsum(M * G);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = xp + m * K + g * kGroup;
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < kGroup; ++i) {
        amax = std::fmax(amax, std::fabs(xg[i]));
        sum += xg[i];
      }
      const float d = amax / 127.f;
      const float inv = d >= FLT_MIN ? 1.f / d : 0.f;  // denormal groups count as zero
      int8_t* q = qx.data() + m * K + g * kGroup;
      // fmin/fmax clamp (and map a NaN from an inf input to a bound): no undefined cast.
      for (int i = 0; i < kGroup; ++i)
        q[i] = static_cast<int8_t>(
            std::fmin(std::fmax(std::nearbyint(xg[i] * inv), -127.f), 127.f));
      dx[m * G + g] = d;
      xsum[m * G + g] = sum;
    }
  }
  const QuantizedActs a{qx.data(), dx.data(), xsum.data()};
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  // One row: 4 weight rows per tile keep 4 independent FMA chains; more rows: 2 (registers).
  if (M == 1) {
    const int64_t tiles = N / 4;
    at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) outputs<4>(a, cp, sp, mp, bp, yp, M, K, N, t * 4);
    });
    for (int64_t n = tiles * 4; n < N; ++n) outputs<1>(a, cp, sp, mp, bp, yp, M, K, N, n);
  } else {
    const int64_t tiles = N / 2;
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) outputs<2>(a, cp, sp, mp, bp, yp, M, K, N, t * 2);
    });
    for (int64_t n = tiles * 2; n < N; ++n) outputs<1>(a, cp, sp, mp, bp, yp, M, K, N, n);
  }
  return y;
}

}  // namespace saltserve_cpu
