// What our int8-dot linear kernels share (q4_vnni.cpp's 4-bit and int8 tiles, kquant_vnni.cpp's
// GGUF K-quant and Q8_0 tiles): the ISA switch, each row's activation rounding per group of 32
// inputs, the weight prefetch and the row split. One definition, so that every kernel rounds
// activations with the same bits.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace saltserve_cpu {
namespace int8dot {

constexpr int kGroup = 32;
constexpr int kTile = 16;        // outputs per tile: the 16 lanes of a zmm
constexpr int kTileBytes = 256;  // codes of one tile and group
constexpr int kMaxRows = 8;      // rows per register tile
constexpr int kMaxRowsAvx2 = 4;  // the same with AVX2's 16 registers

inline bool cpu_has_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

// The AVX-512 VNNI path where the CPU has it, unless SALTSERVE_VNNI=0 (read once per process:
// the AVX2 path on a VNNI machine, to compare the two).
inline bool use_vnni() {
  static const bool on = [] {
    const char* e = std::getenv("SALTSERVE_VNNI");
    return cpu_has_vnni() && !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

// _mm512_reduce_add_ps's order (GCC's avx512fintrin.h) over 8 + 8 lanes: lo + hi halves, then
// 4 + 4, then (0 + 2) + (1 + 3), so quantize_row_avx2's sums have quantize_row's bits.
inline float reduce_add_like_avx512(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 4 x 8 int32 in [-127, 127] -> 32 int8 in input order.
inline __m256i pack_epi8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// quantize_row with AVX2: the same rounding, clamps and sums (see reduce_add_like_avx512).
inline void quantize_row_avx2(const float* x, int64_t K, int8_t* qx, int8_t* rx, float* dx,
                       float* xsum) {
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m256 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(x + g * kGroup + 8 * i);
    const float amax = reduce_max8(_mm256_max_ps(
        _mm256_max_ps(_mm256_and_ps(a[0], absmask), _mm256_and_ps(a[1], absmask)),
        _mm256_max_ps(_mm256_and_ps(a[2], absmask), _mm256_and_ps(a[3], absmask))));
    const float d = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(d >= FLT_MIN ? 1.f / d : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_max_epi32(_mm256_min_epi32(
          _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv)), hi), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + g * kGroup),
                        pack_epi8(q[0], q[1], q[2], q[3]));
    if (rx) {
      const __m256 dv = _mm256_set1_ps(d), fine = _mm256_mul_ps(inv, _mm256_set1_ps(256.f));
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(
                   _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), dv, a[i]), fine)), hi), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rx + g * kGroup),
                          pack_epi8(r[0], r[1], r[2], r[3]));
    }
    dx[g] = d;
    // quantize_row adds x[i] + x[i + 16] first: lanes 0-7 are a[0] + a[2], 8-15 a[1] + a[3].
    xsum[g] = reduce_add_like_avx512(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
  }
}

// Row m's groups: qx [K] int8, dx [G] and xsum [G] fp32; with rx (fine: 16-bit activations),
// also the rounding residual in 1/256 steps: x ~ dx * (qx + rx / 256).
VNNI_TARGET inline void quantize_row(const float* x, int64_t K, int8_t* qx, int8_t* rx, float* dx,
                                 float* xsum) {
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * kGroup), b = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d >= FLT_MIN ? 1.f / d : 0.f);  // denormal groups: zero
    // cvtps rounds to nearest even (MXCSR default); a NaN converts to INT_MIN, clamped: no UB.
    const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), hi), lo);
    const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), hi), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + g * kGroup + 16),
                     _mm512_cvtsepi32_epi8(qb));
    if (rx) {  // |x - dx q| <= dx / 2, so the residual's code fits [-128, 128]: clamped to 127
      const __m512 dv = _mm512_set1_ps(d), fine = _mm512_mul_ps(inv, _mm512_set1_ps(256.f));
      const __m512 ra = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), dv, a);
      const __m512 rb = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), dv, b);
      const __m512i sa = _mm512_max_epi32(_mm512_min_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(ra, fine)), hi), lo);
      const __m512i sb = _mm512_max_epi32(_mm512_min_epi32(
          _mm512_cvtps_epi32(_mm512_mul_ps(rb, fine)), hi), lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rx + g * kGroup), _mm512_cvtsepi32_epi8(sa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rx + g * kGroup + 16),
                       _mm512_cvtsepi32_epi8(sb));
    }
    dx[g] = d;
    xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One group's weights are read as part of one stream a thread walks in order (its tiles'
// codes, then the next tile's); at one or a few rows a group takes a few ns, too few for the
// hardware prefetcher to keep up from L3 or memory (the layers read well under half of L3's
// bandwidth without it), so each group asks for the lines kAhead bytes on. A prefetch
// past the end of the weights is only a hint: it never faults.
constexpr int64_t kAhead = 8192;

inline void prefetch_ahead(const uint8_t* codes, int64_t bytes, const uint16_t* scale_min) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes + kAhead + b), _MM_HINT_T0);
  if (scale_min)
    _mm_prefetch(reinterpret_cast<const char*>(scale_min) + kAhead / 4, _MM_HINT_T0);
}

template <typename F>
inline void balanced_rows(int64_t M, int64_t max_rows, F&& kernel) {
  const int64_t tiles = (M + max_rows - 1) / max_rows;
  for (int64_t i = 0, m = 0; i < tiles; ++i) {
    const int64_t rows = (M - m) / (tiles - i) + ((M - m) % (tiles - i) != 0);
    kernel(rows, m);
    m += rows;
  }
}

constexpr int64_t kParallelRoundFrom = 4096;  // elements (M * K)
template <typename F>
inline void for_rows(int64_t M, int64_t K, F&& fn) {
  if (M < 2 || M * K < kParallelRoundFrom) {
    for (int64_t m = 0; m < M; ++m) fn(m);
    return;
  }
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) fn(m);
  });
}

}  // namespace int8dot
}  // namespace saltserve_cpu
