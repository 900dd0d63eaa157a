// GGUF K-quant and Q8_0 weights served exactly as the file stores them: y[M, N] = x[M, K] @ w^T
// for Q4_K, Q5_K, Q6_K and Q8_0 tensors, with no rounding of the weights and in about the file's
// memory (kernels.cpu_linear.pack_kquant writes the layout; 1.00-1.06x the file's bytes).
//
// Why: llama.cpp's K-quants are two-level (ggml-common.h): a super-block of 256 inputs has fp16
// scales d (and dmin), each sub-block of 32 (Q6_K: 16) inputs an integer scale sc (and minimum
// m), and w = d * sc * q - dmin * m. Regrouping them into per-channel int8 rounds every weight a
// second time, and one fp32 scale per sub-block costs 1-2 bits a weight more than the file.
// Here the integer scales stay integers and the dots stay exact: per group of 32 inputs and
// tile of 16 outputs, vpdpbusd chains give the integer dot of the unsigned codes with the row's
// int8 activations (quantize_row, int8_dot.h: the same rounding as our other int8-dot kernels),
// and the epilogue applies (d * sc) * dx in fp32, (d * sc) formed in fp32 from an fp32 d and an
// integer sc (exact: an fp16 times a 6- or 8-bit integer), then the minimum's term.
//
// One weight may mix formats by tiles of 16 output rows (a fused q/k/v whose v is Q6_K and q, k
// Q4_K, as a Q4_K_M file stores them): meta [T, 3] int64 gives each tile its ggml type and the
// byte offsets of its codes and scales in the two byte buffers.
//
// Per tile (16 outputs) and group g of 32 inputs, the codes: operand o (o = 0..7) is inputs
// 4 o .. 4 o + 3 of the 16 outputs, 64 bytes in vpdpbusd's order (byte 4 l + b: output l,
// input 4 o + b).
//   Q4_K, Q5_K, Q6_K: a 256-byte nibble plane (byte 64 s + i: operand 2 s's byte i in the low
//     nibble, operand 2 s + 1's in the high one) and then P bit planes of 64 bytes (Q5_K 1,
//     Q6_K 2): plane p holds 8 bytes per operand o, bit i = bit 4 + p of operand o's code i.
//     Codes are unsigned: Q4_K, Q5_K q; Q6_K q in [0, 63] (the file's; w = d sc (q - 32)).
//   Q8_0: 512 bytes, operand o's 64 codes u = q + 128 in turn.
// The scales of a tile, in super-block records (Q8_0: one record a group):
//   Q4_K, Q5_K: 384 bytes: d [16] fp32, dmin [16] fp32, then per group sc [16] u8, m [16] u8.
//   Q6_K: 320 bytes: d [16] fp32, then per group sc [16] int8 (inputs 0-15), sc [16] (16-31).
//   Q8_0: 32 bytes: d [16] fp16 (the file's own).
// Offsets: Q6_K's w = d sc (q - 32) and Q8_0's w = d (u - 128) subtract 32 (128) times the
// activations' integer sum over the sub-block from the integer dot, exactly.
//
// Each row's result takes the same operations in the same order whatever the other rows of the
// call, and the AVX2 path (vpmaddubsw + vpmaddwd, for CPUs without VNNI or SALTSERVE_VNNI=0)
// forms the same integer dots and the same fp32 operations: the same bits
// (tests/kernels/test_kquant.py compares them).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_dot.h"
#include "ops.h"

namespace saltserve_cpu {
namespace {

using namespace int8dot;

// ggml's type ids (ggml.h), the values meta holds.
constexpr int64_t kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

template <int64_t F>
struct Format;
template <>
struct Format<kQ4_K> {
  static constexpr int kPlanes = 0, kCodeBytes = 256, kRecordBytes = 384, kGroupsPerRecord = 8;
};
template <>
struct Format<kQ5_K> {
  static constexpr int kPlanes = 1, kCodeBytes = 320, kRecordBytes = 384, kGroupsPerRecord = 8;
};
template <>
struct Format<kQ6_K> {
  static constexpr int kPlanes = 2, kCodeBytes = 384, kRecordBytes = 320, kGroupsPerRecord = 8;
};
template <>
struct Format<kQ8_0> {
  static constexpr int kPlanes = 0, kCodeBytes = 512, kRecordBytes = 32, kGroupsPerRecord = 1;
};

// One call's rounded activations, shared by every tile.
struct Acts {
  const int8_t* qx;     // [M, K]
  const int8_t* rx;     // [M, K] residuals (16-bit activations) or null
  const float* dx;      // [M, K / 32]
  const float* xsum;    // [M, K / 32]
  const int32_t* isum;  // [M, K / 16]: sum(qx), or 256 sum(qx) + sum(rx) with residuals
  int64_t K;
};

// ---- AVX-512 VNNI ----

// Group g's 8 operands (unsigned codes, one byte each) of one tile.
template <int64_t F>
VNNI_TARGET inline void operands(const uint8_t* c, __m512i (&w)[8]) {
  if constexpr (F == kQ8_0) {
    for (int o = 0; o < 8; ++o) w[o] = _mm512_loadu_si512(c + 64 * o);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s) {
      const __m512i z = _mm512_loadu_si512(c + 64 * s);
      w[2 * s] = _mm512_and_si512(z, low);
      w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
    }
    for (int p = 0; p < Format<F>::kPlanes; ++p) {
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << p));
      for (int o = 0; o < 8; ++o) {
        uint64_t m;
        std::memcpy(&m, c + 256 + 64 * p + 8 * o, sizeof m);
        w[o] = _mm512_mask_add_epi8(w[o], _cvtu64_mask64(m), w[o], bit);
      }
    }
  }
}

// The integer dot of operands lo .. hi - 1 with the row's activations a (two chains).
template <int Lo, int Hi>
VNNI_TARGET inline __m512i idot(const __m512i (&w)[8], const int8_t* a) {
  __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
  for (int o = Lo; o < Hi; o += 2) {
    i0 = _mm512_dpbusd_epi32(i0, w[o], _mm512_set1_epi32(load4(a + 4 * o)));
    i1 = _mm512_dpbusd_epi32(i1, w[o + 1], _mm512_set1_epi32(load4(a + 4 * o + 4)));
  }
  return _mm512_add_epi32(i0, i1);
}

template <int Lo, int Hi, bool Fine>
VNNI_TARGET inline __m512i row_idot(const __m512i (&w)[8], const int8_t* q, const int8_t* r) {
  __m512i d = idot<Lo, Hi>(w, q);
  if (Fine) d = _mm512_add_epi32(_mm512_slli_epi32(d, 8), idot<Lo, Hi>(w, r));
  return d;
}

// Rows m0 .. m0 + MR of one tile (outputs n0 .. n0 + 15) in format F.
template <int64_t F, int MR, bool Fine>
VNNI_TARGET void tile(const Acts& a, const uint8_t* codes, const uint8_t* scales,
                      const float* bias, float* y, int64_t N, int64_t m0, int64_t n0) {
  using Fm = Format<F>;
  const int64_t K = a.K, G = K / kGroup;
  __m512 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = codes + g * Fm::kCodeBytes;
    const uint8_t* rec = scales + (g / Fm::kGroupsPerRecord) * Fm::kRecordBytes;
    if (m0 == 0) prefetch_ahead(c, Fm::kCodeBytes, nullptr);
    __m512i w[8];
    operands<F>(c, w);
    __m512 s0, s1 = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
    if constexpr (F == kQ8_0) {
      s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    } else if constexpr (F == kQ6_K) {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec));
      const uint8_t* sc = rec + 64 + (g % 8) * 32;
      s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))), d);
      s1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)))), d);
    } else {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec));
      const __m512 dmin = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 64));
      const uint8_t* sc = rec + 128 + (g % 8) * 32;
      s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))), d);
      mn = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)))), dmin);
    }
    for (int j = 0; j < MR; ++j) {
      const int64_t m = m0 + j, mg = m * G + g;
      const int8_t* q = a.qx + m * K + g * kGroup;
      const int8_t* r = Fine ? a.rx + m * K + g * kGroup : nullptr;
      const float dxs = Fine ? a.dx[mg] * (1.f / 256.f) : a.dx[mg];  // exact: a power of two
      const int32_t* is = a.isum + m * 2 * G + 2 * g;
      if constexpr (F == kQ6_K) {
        const __m512i lo = _mm512_sub_epi32(row_idot<0, 4, Fine>(w, q, r),
                                            _mm512_set1_epi32(32 * is[0]));
        const __m512i hi = _mm512_sub_epi32(row_idot<4, 8, Fine>(w, q, r),
                                            _mm512_set1_epi32(32 * is[1]));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s0, _mm512_set1_ps(dxs)),
                                 acc[j]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s1, _mm512_set1_ps(dxs)),
                                 acc[j]);
      } else if constexpr (F == kQ8_0) {
        const __m512i d = _mm512_sub_epi32(row_idot<0, 8, Fine>(w, q, r),
                                           _mm512_set1_epi32(128 * (is[0] + is[1])));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s0, _mm512_set1_ps(dxs)),
                                 acc[j]);
      } else {
        const __m512i d = row_idot<0, 8, Fine>(w, q, r);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s0, _mm512_set1_ps(dxs)),
                                 acc[j]);
        acc[j] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.xsum[mg]), acc[j]);
      }
    }
  }
  for (int j = 0; j < MR; ++j) {
    __m512 v = acc[j];
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    _mm512_storeu_ps(y + (m0 + j) * N + n0, v);
  }
}

// ---- AVX2: the same integer dots by vpmaddubsw (u8 x s8 pairs into int16) + vpmaddwd ----
// Per chain of vpmaddubsw sums, the int16 bound: Q4_K 4 x 2 x 15 x 127 = 15,240; Q5_K 4 x 2 x 31
// x 127 = 31,496; Q6_K (its sub-blocks of 16: 2 a chain) 2 x 2 x 63 x 127 = 32,004; Q8_0's codes
// (up to 255) split into nibbles, 15,240 each: no saturation anywhere, so each dot is tile's.

// Byte i = 0xFF where bit i of bits is set.
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_and_si256(
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread), select);
  return _mm256_cmpeq_epi8(v, select);
}

// Half h (outputs 8 h .. 8 h + 7) of group g's operands; Q8_0: the codes' low nibbles in w, high
// ones in wh.
template <int64_t F>
inline void operands_avx2(const uint8_t* c, int h, __m256i (&w)[8], __m256i (&wh)[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (F == kQ8_0) {
    for (int o = 0; o < 8; ++o) {
      const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * o + 32 * h));
      w[o] = _mm256_and_si256(z, low);
      wh[o] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    }
  } else {
    for (int s = 0; s < 4; ++s) {
      const __m256i z =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * s + 32 * h));
      w[2 * s] = _mm256_and_si256(z, low);
      w[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    }
    for (int p = 0; p < Format<F>::kPlanes; ++p) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << p));
      for (int o = 0; o < 8; ++o) {
        uint32_t m;
        std::memcpy(&m, c + 256 + 64 * p + 8 * o + 4 * h, sizeof m);
        w[o] = _mm256_or_si256(w[o], _mm256_and_si256(bytes_from_bits(m), bit));
      }
    }
  }
}

template <int Lo, int Hi>
inline __m256i idot_avx2(const __m256i (&w)[8], const int8_t* a) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int o = Lo; o < Hi; o += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[o], _mm256_set1_epi32(load4(a + 4 * o))));
    s1 = _mm256_add_epi16(s1,
                          _mm256_maddubs_epi16(w[o + 1], _mm256_set1_epi32(load4(a + 4 * o + 4))));
  }
  return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
}

template <int64_t F, int Lo, int Hi>
inline __m256i codes_dot_avx2(const __m256i (&w)[8], const __m256i (&wh)[8], const int8_t* a) {
  __m256i d = idot_avx2<Lo, Hi>(w, a);
  if constexpr (F == kQ8_0) d = _mm256_add_epi32(d, _mm256_slli_epi32(idot_avx2<Lo, Hi>(wh, a), 4));
  return d;
}

template <int64_t F, int Lo, int Hi, bool Fine>
inline __m256i row_idot_avx2(const __m256i (&w)[8], const __m256i (&wh)[8], const int8_t* q,
                             const int8_t* r) {
  __m256i d = codes_dot_avx2<F, Lo, Hi>(w, wh, q);
  if (Fine) d = _mm256_add_epi32(_mm256_slli_epi32(d, 8), codes_dot_avx2<F, Lo, Hi>(w, wh, r));
  return d;
}

template <int64_t F, int MR, bool Fine>
void tile_avx2(const Acts& a, const uint8_t* codes, const uint8_t* scales, const float* bias,
               float* y, int64_t N, int64_t m0, int64_t n0) {
  using Fm = Format<F>;
  const int64_t K = a.K, G = K / kGroup;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* c = codes + g * Fm::kCodeBytes;
      const uint8_t* rec = scales + (g / Fm::kGroupsPerRecord) * Fm::kRecordBytes;
      if (m0 == 0 && h == 0) prefetch_ahead(c, Fm::kCodeBytes, nullptr);
      __m256i w[8], wh[8];
      operands_avx2<F>(c, h, w, wh);
      __m256 s0, s1 = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
      if constexpr (F == kQ8_0) {
        s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
      } else if constexpr (F == kQ6_K) {
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(rec) + 8 * h);
        const uint8_t* sc = rec + 64 + (g % 8) * 32 + 8 * h;
        s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))), d);
        s1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)))), d);
      } else {
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(rec) + 8 * h);
        const __m256 dmin = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 64) + 8 * h);
        const uint8_t* sc = rec + 128 + (g % 8) * 32 + 8 * h;
        s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))), d);
        mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)))), dmin);
      }
      for (int j = 0; j < MR; ++j) {
        const int64_t m = m0 + j, mg = m * G + g;
        const int8_t* q = a.qx + m * K + g * kGroup;
        const int8_t* r = Fine ? a.rx + m * K + g * kGroup : nullptr;
        const float dxs = Fine ? a.dx[mg] * (1.f / 256.f) : a.dx[mg];
        const int32_t* is = a.isum + m * 2 * G + 2 * g;
        if constexpr (F == kQ6_K) {
          const __m256i lo = _mm256_sub_epi32(row_idot_avx2<F, 0, 4, Fine>(w, wh, q, r),
                                              _mm256_set1_epi32(32 * is[0]));
          const __m256i hi = _mm256_sub_epi32(row_idot_avx2<F, 4, 8, Fine>(w, wh, q, r),
                                              _mm256_set1_epi32(32 * is[1]));
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo),
                                   _mm256_mul_ps(s0, _mm256_set1_ps(dxs)), acc[j]);
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi),
                                   _mm256_mul_ps(s1, _mm256_set1_ps(dxs)), acc[j]);
        } else if constexpr (F == kQ8_0) {
          const __m256i d = _mm256_sub_epi32(row_idot_avx2<F, 0, 8, Fine>(w, wh, q, r),
                                             _mm256_set1_epi32(128 * (is[0] + is[1])));
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                   _mm256_mul_ps(s0, _mm256_set1_ps(dxs)), acc[j]);
        } else {
          const __m256i d = row_idot_avx2<F, 0, 8, Fine>(w, wh, q, r);
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                   _mm256_mul_ps(s0, _mm256_set1_ps(dxs)), acc[j]);
          acc[j] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(a.xsum[mg]), acc[j]);
        }
      }
    }
    for (int j = 0; j < MR; ++j) {
      __m256 v = acc[j];
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + 8 * h));
      _mm256_storeu_ps(y + (m0 + j) * N + n0 + 8 * h, v);
    }
  }
}

// Rows 0 .. M of one tile, in register blocks of 8, 4, 2 and 1 rows (VNNI) or 4, 2, 1 (AVX2).
template <int64_t F, bool Fine>
void rows_of_tile(const Acts& a, const uint8_t* codes, const uint8_t* scales, const float* bias,
                  float* y, int64_t M, int64_t N, int64_t n0) {
  int64_t m = 0;
  if (use_vnni()) {
    for (; m + 8 <= M; m += 8) tile<F, 8, Fine>(a, codes, scales, bias, y, N, m, n0);
    if (m + 4 <= M) tile<F, 4, Fine>(a, codes, scales, bias, y, N, m, n0), m += 4;
    if (m + 2 <= M) tile<F, 2, Fine>(a, codes, scales, bias, y, N, m, n0), m += 2;
    if (m < M) tile<F, 1, Fine>(a, codes, scales, bias, y, N, m, n0);
    return;
  }
  for (; m + 4 <= M; m += 4) tile_avx2<F, 4, Fine>(a, codes, scales, bias, y, N, m, n0);
  if (m + 2 <= M) tile_avx2<F, 2, Fine>(a, codes, scales, bias, y, N, m, n0), m += 2;
  if (m < M) tile_avx2<F, 1, Fine>(a, codes, scales, bias, y, N, m, n0);
}

template <bool Fine>
void rows_of_any_tile(int64_t fmt, const Acts& a, const uint8_t* codes, const uint8_t* scales,
                      const float* bias, float* y, int64_t M, int64_t N, int64_t n0) {
  switch (fmt) {
    case kQ4_K: return rows_of_tile<kQ4_K, Fine>(a, codes, scales, bias, y, M, N, n0);
    case kQ5_K: return rows_of_tile<kQ5_K, Fine>(a, codes, scales, bias, y, M, N, n0);
    case kQ6_K: return rows_of_tile<kQ6_K, Fine>(a, codes, scales, bias, y, M, N, n0);
    default: return rows_of_tile<kQ8_0, Fine>(a, codes, scales, bias, y, M, N, n0);
  }
}

int64_t code_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ4_K: return Format<kQ4_K>::kCodeBytes;
    case kQ5_K: return Format<kQ5_K>::kCodeBytes;
    case kQ6_K: return Format<kQ6_K>::kCodeBytes;
    case kQ8_0: return Format<kQ8_0>::kCodeBytes;
    default: return -1;
  }
}

int64_t scale_bytes(int64_t fmt, int64_t G) {
  switch (fmt) {
    case kQ4_K: case kQ5_K: return G / 8 * Format<kQ4_K>::kRecordBytes;
    case kQ6_K: return G / 8 * Format<kQ6_K>::kRecordBytes;
    default: return G * Format<kQ8_0>::kRecordBytes;
  }
}

struct Scratch {
  std::vector<int8_t> qx, rx;
  std::vector<float> dx, xsum;
  std::vector<int32_t> isum;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& meta, const c10::optional<at::Tensor>& bias,
                         int64_t act_bits) {
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "kquant_linear: act_bits 8 or 16, not ",
              act_bits);
  const bool fine = act_bits == 16;
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 1 && scales.dim() == 1 && meta.dim() == 2 &&
                  meta.size(1) == 3,
              "kquant_linear: x [M, K], codes [bytes], scales [bytes], meta [N / 16, 3] "
              "expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kByte && meta.scalar_type() == at::kLong,
              "kquant_linear: x float32, codes and scales uint8, meta int64 expected");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() &&
                  meta.is_contiguous(),
              "kquant_linear: contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), T = meta.size(0), N = T * kTile, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "kquant_linear: K (", K, ") must be a multiple of 32");
  const int64_t* mp = meta.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // every tile's format and extent, before any read
    const int64_t fmt = mp[3 * t], cb = code_bytes(fmt);
    TORCH_CHECK(cb > 0, "kquant_linear: tile ", t, " has ggml type ", fmt,
                "; Q8_0 (8), Q4_K (12), Q5_K (13) and Q6_K (14) are served");
    TORCH_CHECK(fmt == kQ8_0 || K % 256 == 0, "kquant_linear: K-quant rows need K (", K,
                ") a multiple of 256");
    TORCH_CHECK(mp[3 * t + 1] >= 0 && mp[3 * t + 1] + G * cb <= codes.numel() &&
                    mp[3 * t + 2] >= 0 && mp[3 * t + 2] + scale_bytes(fmt, G) <= scales.numel(),
                "kquant_linear: tile ", t, "'s codes or scales lie outside the buffers");
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "kquant_linear: bias [N] float32 expected");
    bp = bias->data_ptr<float>();
  }
  Scratch& s = scratch();  // the caller's (a thread_local named in a lambda is the worker's)
  if (static_cast<int64_t>(s.qx.size()) < M * K) s.qx.resize(M * K), s.rx.resize(M * K);
  if (static_cast<int64_t>(s.dx.size()) < M * G)
    s.dx.resize(M * G), s.xsum.resize(M * G), s.isum.resize(2 * M * G);
  const float* xp = x.data_ptr<float>();
  for_rows(M, K, [&](int64_t m) {
    int8_t* q = s.qx.data() + m * K;
    int8_t* r = fine ? s.rx.data() + m * K : nullptr;
    (use_vnni() ? quantize_row : quantize_row_avx2)(xp + m * K, K, q, r, s.dx.data() + m * G,
                                                    s.xsum.data() + m * G);
    for (int64_t h = 0; h < 2 * G; ++h) {  // the offsets' integer sums, per 16 inputs
      int32_t sq = 0, sr = 0;
      for (int i = 0; i < 16; ++i) {
        sq += q[16 * h + i];
        if (fine) sr += r[16 * h + i];
      }
      s.isum[m * 2 * G + h] = fine ? 256 * sq + sr : sq;
    }
  });
  const Acts a{s.qx.data(), fine ? s.rx.data() : nullptr, s.dx.data(), s.xsum.data(),
               s.isum.data(), K};
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* tm = mp + 3 * t;
      if (fine)
        rows_of_any_tile<true>(tm[0], a, cp + tm[1], sp + tm[2], bp, yp, M, N, t * kTile);
      else
        rows_of_any_tile<false>(tm[0], a, cp + tm[1], sp + tm[2], bp, yp, M, N, t * kTile);
    }
  });
  return y;
}

}  // namespace saltserve_cpu
