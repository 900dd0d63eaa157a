// 4-bit grouped linear for decode batches on AVX-512 VNNI CPUs: y[M, N] = x[M, K] @ w[N, K]^T
// with GGUF Q4_1 weights (w = code * scale + minimum per group of 32 inputs, code in [0, 15]).
//
// Why: at 16 decode rows torch's int4 kernel (_weight_int4pack_mm_for_cpu) costs about as much
// as our fp32 kernel on the dense weights, so through it --quantization gguf would serve 16
// streams barely faster than fp32, and q4_linear.cpp (pmaddubsw, one output row's group at a
// time) is slower still from 2 rows.
// Here one vpdpbusd multiplies 16 outputs x 4 inputs of unsigned codes by 4 int8 activations of
// one row broadcast to every lane (64 exact multiply-adds), so the int32 lanes are outputs and
// a group's scale is applied once per 16 outputs and row, not per multiply.
//
// Weight layout (kernels.cpu_linear.pack_q4_vnni): outputs in tiles of 16, per tile and group:
//   codes     [N / 16, K / 32, 256] uint8: sub-block s (inputs k0 = 32 g + 8 s .. k0 + 7) is 64
//             bytes, byte 4 l + b = code[16 t + l, k0 + b] | code[16 t + l, k0 + 4 + b] << 4;
//   scale_min [N / 16, K / 32, 32] float16: the tile's 16 scales, then its 16 minimums.
// 5 bits a weight, as in the GGUF.
// Activations: each row's groups of 32 inputs quantized to int8 (dx = max|x| / 127, round to
// nearest even; quantize_row in int8_dot.h, shared with kquant_vnni.cpp), with their fp32 sums
// for the minimum's term, as q4_linear.cpp and llama.cpp's Q4_1 x Q8_1 dot product do:
//   y[m, n] = sum_g (scale[n, g] * dx[m, g]) * idot(code[n, g], qx[m, g]) + minimum[n, g] * xsum[m, g]
// (+ bias[n] at the end); idot is exact int32. Each row's result takes the same operations in
// the same order whatever the other rows of the call, so a row has the same bits alone or in a
// batch (as our other decode kernels).
//
// Compiled for AVX-512 by function attributes (and the AMX part below by a target pragma), so the
// extension still loads on AVX2 CPUs;
// there (or with SALTSERVE_VNNI=0) the same layout runs through AVX2's vpmaddubsw + vpmaddwd
// (8 outputs a ymm, tile_avx2 below): the same exact integer dots and the same fp32 operations
// in the same order, so the two paths give the same bits (tests/kernels/test_cpu_linear.py
// compares them where both run).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx.h"
#include "int8_dot.h"
#include "ops.h"

namespace saltserve_cpu {
namespace {

using namespace int8dot;  // int8_dot.h: ISA switch, activation rounding, prefetch, row split

// Rows m0 .. m0 + MR of one tile of 16 outputs (n0 = 16 t). Fine: the activations are
// qx + rx / 256, and the group's integer dot is 256 idot(code, qx) + idot(code, rx): at most
// 256 * 32 * 15 * 127 + 32 * 15 * 127 < 2^24 in magnitude, so exact in int32 and in its fp32
// conversion.
template <int MR, bool Fine>
VNNI_TARGET void tile(const int8_t* qx, const int8_t* rx, const float* dx, const float* xsum,
                         const uint8_t* codes, const uint16_t* scale_min, const float* bias,
                         float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  const int64_t G = K / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = codes + g * kTileBytes;
    prefetch_ahead(c, kTileBytes, scale_min + g * 2 * kTile);
    __m512i w[8];
    for (int s = 0; s < 4; ++s) {
      const __m512i z = _mm512_loadu_si512(c + s * 64);
      w[2 * s] = _mm512_and_si512(z, low);
      w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
    }
    const uint16_t* sm = scale_min + g * 2 * kTile;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
    const __m512 mn =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + kTile)));
    for (int j = 0; j < MR; ++j) {
      const int8_t* q = qx + (m0 + j) * K + g * kGroup;
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      for (int s = 0; s < 4; ++s) {  // two chains: half the dependent vpdpbusd latency
        i0 = _mm512_dpbusd_epi32(i0, w[2 * s], _mm512_set1_epi32(load4(q + 8 * s)));
        i1 = _mm512_dpbusd_epi32(i1, w[2 * s + 1], _mm512_set1_epi32(load4(q + 8 * s + 4)));
      }
      __m512i idot = _mm512_add_epi32(i0, i1);
      const int64_t mg = (m0 + j) * G + g;
      float dxs = dx[mg];
      if (Fine) {
        const int8_t* r = rx + (m0 + j) * K + g * kGroup;
        __m512i i2 = _mm512_setzero_si512(), i3 = _mm512_setzero_si512();
        for (int s = 0; s < 4; ++s) {
          i2 = _mm512_dpbusd_epi32(i2, w[2 * s], _mm512_set1_epi32(load4(r + 8 * s)));
          i3 = _mm512_dpbusd_epi32(i3, w[2 * s + 1], _mm512_set1_epi32(load4(r + 8 * s + 4)));
        }
        idot = _mm512_add_epi32(_mm512_slli_epi32(idot, 8), _mm512_add_epi32(i2, i3));
        dxs *= 1.f / 256.f;  // exact: a power of two
      }
      const __m512 p = _mm512_cvtepi32_ps(idot);
      acc[j] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(dxs)), acc[j]);
      acc[j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[mg]), acc[j]);
    }
  }
  for (int j = 0; j < MR; ++j) {
    __m512 v = acc[j];
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    _mm512_storeu_ps(y + (m0 + j) * N + n0, v);
  }
}

// tile with AVX2, for CPUs without VNNI: the tile's 16 outputs as two halves of 8 (a ymm each,
// the half's codes are the first or last 32 bytes of each 64-byte sub-block). vpmaddubsw
// multiplies codes (u8, <= 15) by int8 activations (|a| <= 127) and adds pairs into int16
// (<= 3,810 in magnitude); the group's 8 products sum in int16 (<= 30,480: no saturation) and
// vpmaddwd by ones adds the last pairs into int32: the same integer as tile's vpdpbusd chains.
template <int MR, bool Fine>
void tile_avx2(const int8_t* qx, const int8_t* rx, const float* dx, const float* xsum,
               const uint8_t* codes, const uint16_t* scale_min, const float* bias, float* y,
               int64_t K, int64_t N, int64_t m0, int64_t n0) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* c = codes + g * kTileBytes + 32 * h;
      if (h == 0 && m0 == 0) prefetch_ahead(c, kTileBytes, scale_min + g * 2 * kTile);
      __m256i w[8];
      for (int s = 0; s < 4; ++s) {
        const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + s * 64));
        w[2 * s] = _mm256_and_si256(z, low);
        w[2 * s + 1] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
      }
      const uint16_t* sm = scale_min + g * 2 * kTile + 8 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm)));
      const __m256 mn =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kTile)));
      for (int j = 0; j < MR; ++j) {
        const int8_t* q = qx + (m0 + j) * K + g * kGroup;
        __m256i s0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load4(q)));
        __m256i s1 = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(load4(q + 4)));
        for (int s = 1; s < 4; ++s) {
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[2 * s],
                                                         _mm256_set1_epi32(load4(q + 8 * s))));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(
                                        w[2 * s + 1], _mm256_set1_epi32(load4(q + 8 * s + 4))));
        }
        __m256i idot = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
        const int64_t mg = (m0 + j) * G + g;
        float dxs = dx[mg];
        if (Fine) {
          const int8_t* r = rx + (m0 + j) * K + g * kGroup;
          __m256i s2 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load4(r)));
          __m256i s3 = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(load4(r + 4)));
          for (int s = 1; s < 4; ++s) {
            s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(
                                          w[2 * s], _mm256_set1_epi32(load4(r + 8 * s))));
            s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(
                                          w[2 * s + 1], _mm256_set1_epi32(load4(r + 8 * s + 4))));
          }
          idot = _mm256_add_epi32(_mm256_slli_epi32(idot, 8),
                                  _mm256_madd_epi16(_mm256_add_epi16(s2, s3), ones));
          dxs *= 1.f / 256.f;
        }
        const __m256 p = _mm256_cvtepi32_ps(idot);
        acc[j] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(dxs)), acc[j]);
        acc[j] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[mg]), acc[j]);
      }
    }
    for (int j = 0; j < MR; ++j) {
      __m256 v = acc[j];
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + 8 * h));
      _mm256_storeu_ps(y + (m0 + j) * N + n0 + 8 * h, v);
    }
  }
}

// tile_avx2 for one row (a decode step of one sequence), both halves of the tile in one pass
// over its groups: each group's 256 bytes of codes are loaded once and each activation quad
// broadcast once for the 16 outputs, where tile_avx2 walks the groups once per half. Per
// output the same integer dots and the same fp32 operations in the same order, so the same
// bits as tile_avx2<1, Fine>.
template <bool Fine>
void tile_avx2_one_row(const int8_t* qx, const int8_t* rx, const float* dx, const float* xsum,
                       const uint8_t* codes, const uint16_t* scale_min, const float* bias,
                       float* y, int64_t K, int64_t m0, int64_t n0, int64_t N) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const int8_t* q = qx + m0 * K;
  const int8_t* r = Fine ? rx + m0 * K : nullptr;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = codes + g * kTileBytes;
    prefetch_ahead(c, kTileBytes, scale_min + g * 2 * kTile);
    // int16 pair sums: [half][low or high nibbles] for qx, and for rx
    __m256i sq[2][2], sr[2][2];
    for (auto* acc : {&sq, &sr})
      for (auto& half : *acc) half[0] = half[1] = _mm256_setzero_si256();
    for (int s = 0; s < 4; ++s) {
      const __m256i z0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + s * 64));
      const __m256i z1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + s * 64 + 32));
      const __m256i w[2][2] = {
          {_mm256_and_si256(z0, low), _mm256_and_si256(_mm256_srli_epi16(z0, 4), low)},
          {_mm256_and_si256(z1, low), _mm256_and_si256(_mm256_srli_epi16(z1, 4), low)}};
      // inputs 8 s .. 8 s + 3 meet the low nibbles, 8 s + 4 .. 8 s + 7 the high ones
      const auto add_dots = [&](const int8_t* a, __m256i (&acc)[2][2]) {
        const __m256i b[2] = {_mm256_set1_epi32(load4(a)), _mm256_set1_epi32(load4(a + 4))};
        for (int h = 0; h < 2; ++h)
          for (int n = 0; n < 2; ++n)
            acc[h][n] = _mm256_add_epi16(acc[h][n], _mm256_maddubs_epi16(w[h][n], b[n]));
      };
      add_dots(q + g * kGroup + 8 * s, sq);
      if (Fine) add_dots(r + g * kGroup + 8 * s, sr);
    }
    const int64_t mg = m0 * G + g;
    const float dxs = Fine ? dx[mg] * (1.f / 256.f) : dx[mg];
    const uint16_t* sm = scale_min + g * 2 * kTile;
    for (int h = 0; h < 2; ++h) {
      __m256i idot = _mm256_madd_epi16(_mm256_add_epi16(sq[h][0], sq[h][1]), ones);
      if (Fine)
        idot = _mm256_add_epi32(_mm256_slli_epi32(idot, 8),
                                _mm256_madd_epi16(_mm256_add_epi16(sr[h][0], sr[h][1]), ones));
      const __m256 d =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + 8 * h)));
      const __m256 mn =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kTile + 8 * h)));
      __m256& acc = h ? acc1 : acc0;
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(d, _mm256_set1_ps(dxs)), acc);
      acc = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[mg]), acc);
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m256 v = h ? acc1 : acc0;
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + 8 * h));
    _mm256_storeu_ps(y + m0 * N + n0 + 8 * h, v);
  }
}

// ---- AMX-INT8: the same integer dots on the tile unit, from kAmxMinRowsQ4 / Q8 rows ----
// On CPUs with AMX (Sapphire Rapids and later Xeons), TDPBSUD multiplies a 16-row x 32-input
// tile of int8 activations (one group of every row) by an 8 x 64-byte tile of unsigned codes in
// exactly vpdpbusd's layout (row s: inputs 4 s .. 4 s + 3 of the 16 outputs): the group's 16 x 16
// int32 dots in one instruction, where vpdpbusd takes 8 (16 with 16-bit activations) per row.
// The dots are exact integers, so they equal the VNNI path's; the epilogue (the group's scale,
// minimum or correction, in fp32) is tile's and tile8's, operation for operation, so a row has
// the same bits on either path and alone or in a batch (tests/kernels/test_cpu_linear.py).
// Each group's 16 x 16 dots go through memory (a tile store, then vector loads for the fp32
// epilogue, about 25 cycles a group more than the tile work itself), so the gain is 1.2-1.7x,
// not the tile unit's 16x.

// Rows from which the AMX path runs. A 4-bit layer unpacks each output tile's codes first and
// pays for whole 8-row blocks: from 16 rows its whole blocks run on AMX and the rest (< 8 rows)
// on the VNNI tiles (at 8-13 rows the two tie, below 8 AMX is slower); the int8 layers read
// their codes as stored and run every row on AMX from 6, where the LM head starts to gain
// (docs/benchmarks.md).
constexpr int64_t kAmxMinRowsQ4 = 16;
constexpr int64_t kAmxMinRowsQ8 = 6;

// SALTSERVE_HAVE_AMX (amx.h): without it, the VNNI path alone.

// AMX-INT8 on this CPU and the tile registers granted to this process by Linux (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once per process).
bool amx_available() {
#if SALTSERVE_HAVE_AMX
  static const bool ok = [] {
    if (!use_vnni() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8"))
      return false;
    return saltserve::request_tile_data();
  }();
  return ok;
#else
  return false;
#endif
}

// Whether the AMX path runs: available, and not the environment's SALTSERVE_AMX=0 (read once
// per process) or switched off by int8_amx(0) (tests and benchmarks compare the two paths in
// one process).
std::atomic<int> amx_switch{-1};  // -1: not read yet, else 0 / 1
std::atomic<int64_t> amx_calls{0};  // calls that took the AMX path (int8_amx_calls, for tests)

bool use_amx() {
  int on = amx_switch.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* e = std::getenv("SALTSERVE_AMX");
    on = amx_available() && !(e && std::strcmp(e, "0") == 0);
    amx_switch.store(on, std::memory_order_relaxed);
  }
  return on;
}

}  // namespace

// int8_amx(-1) tells whether the AMX path runs; int8_amx(0 or 1) turns it off or on (on only
// where available) and returns the new state.
bool int8_amx(int64_t mode) {
  if (mode >= 0) amx_switch.store(mode && amx_available(), std::memory_order_relaxed);
  return use_amx();
}

int64_t int8_amx_calls() { return amx_calls.load(std::memory_order_relaxed); }

namespace {

// The activations of 8 rows as one A tile: rows 0-7 their int8 codes qx, rows 8-15 their
// residuals rx (16-bit activations; with 8-bit ones rows 8-15 are unused), so one TDPBSUD gives
// both dots of 8 rows (C rows 0-7 and 8-15). act_row() is where row m of each lives in the
// call's activation buffer [ceil(M / 8)][16][K].
inline int8_t* act_row(int8_t* buf, int64_t m, int64_t K, bool residual) {
  return buf + ((m / 8) * 16 + (residual ? 8 : 0) + m % 8) * K;
}

#if SALTSERVE_HAVE_AMX
// Compiled for AMX by a target pragma (every function down to pop_options, the inlined
// epilogues and the config's initializer included); called only where use_amx() holds.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")
#define AMX_TARGET

using saltserve::TileConfig;

// Two sets of tiles, so that one group's dots run while the previous group's are stored and
// scaled: set 0 is tmm0 (the activation tile), tmm2 (codes, 8 rows x 64 bytes) and tmm4 (the
// dots, 16 x 16 int32); set 1 is tmm1, tmm3 and tmm5. Loaded by each thread before its tiles
// (the config is per thread, and torch's own AMX kernels load theirs); GCC's _tile_loadconfig
// declares an 8-byte read, so the config lives in static memory.
AMX_TARGET void amx_begin() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = kGroup;
    for (int t : {2, 3}) c.rows[t] = kGroup / 4, c.colsb[t] = 64;
    for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

AMX_TARGET void amx_end() { _tile_release(); }

// Starts one group's dots on tile set `set`: the activation tile a [16 rows, stride K] against
// the codes tile b. The tile loads are asm with no memory operand: the caller's stores to b
// must be done (a compiler fence) before.
AMX_TARGET inline void amx_dots(int set, const int8_t* a, int64_t K, const void* b) {
  if (set == 0) {
    _tile_loadd(2, b, 64);
    _tile_loadd(0, a, K);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 2);
  } else {
    _tile_loadd(3, b, 64);
    _tile_loadd(1, a, K);
    _tile_zero(5);
    _tile_dpbsud(5, 1, 3);
  }
}

// The dots of set `set` into d [16][16] int32.
AMX_TARGET inline void amx_store(int set, int32_t* d) {
  if (set == 0)
    _tile_stored(4, d, 64);
  else
    _tile_stored(5, d, 64);
}

// Groups 0 .. G of one 8-row block, two in flight: group g's dots start two groups ahead (on
// tile set g & 1), are stored to buffer g & 1 once that set is needed again, and are scaled one
// group later, so neither the dots' latency nor the wait for the tile stores to reach L1 (they
// do not forward to loads) holds up every group. Written out in each kernel (no lambdas): the
// accumulators' address must not escape, or the tile stores' memory clobber keeps them in
// memory.
#define AMX_PIPELINE(G, DOTS, EPILOGUE)                      \
  do {                                                       \
    DOTS(0);                                                 \
    if ((G) > 1) DOTS(1);                                    \
    for (int64_t g_ = 0; g_ <= (G); ++g_) {                  \
      if (g_ < (G)) amx_store(g_ & 1, d[g_ & 1]);            \
      if (g_ > 0) EPILOGUE(g_ - 1);                          \
      if (g_ + 2 < (G)) DOTS(g_ + 2); /* the store has read the tile by now */ \
    }                                                        \
  } while (0)

// Row j's integer dot of one group from 8 rows' dots dg (rows 0-7 qx, 8-15 rx), and its
// activation step: with 16-bit activations 256 idot(qx) + idot(rx) and dx / 256, as tile<> and
// tile8<> combine them.
template <bool Fine>
AMX_TARGET __attribute__((always_inline)) inline __m512i row_dot(const int32_t* dg, int j,
                                                                 float& dxs) {
  __m512i idot = _mm512_load_si512(dg + 16 * j);
  if (Fine) {
    idot = _mm512_add_epi32(_mm512_slli_epi32(idot, 8), _mm512_load_si512(dg + 16 * (8 + j)));
    dxs *= 1.f / 256.f;  // exact: a power of two
  }
  return idot;
}

// One group's scaling of 8 rows' dots dg (rows 0-7 qx, 8-15 rx) into acc, tile<>'s operations
// in tile<>'s order. All 8 rows (rows past M are computed and never stored).
template <bool Fine>
AMX_TARGET __attribute__((always_inline)) inline void q4_epilogue(
    __m512* acc, const int32_t* dg, const uint16_t* smg, const float* dx, const float* xsum,
    int64_t m0, int64_t G, int64_t g) {
  const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(smg)));
  const __m512 mn =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(smg + kTile)));
  for (int j = 0; j < 8; ++j) {
    const int64_t mg = (m0 + j) * G + g;
    float dxs = dx[mg];
    const __m512 p = _mm512_cvtepi32_ps(row_dot<Fine>(dg, j, dxs));
    acc[j] = _mm512_fmadd_ps(p, _mm512_mul_ps(sc, _mm512_set1_ps(dxs)), acc[j]);
    acc[j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[mg]), acc[j]);
  }
}

// tile8<>'s scaling of one group, as q4_epilogue.
template <bool Fine>
AMX_TARGET __attribute__((always_inline)) inline void q8_epilogue(
    __m512* acc, const int32_t* dg, const float* dx, const int32_t* corr, int64_t m0, int64_t G,
    int64_t g) {
  for (int j = 0; j < 8; ++j) {
    const int64_t mg = (m0 + j) * G + g;
    float dxs = dx[mg];
    const __m512i idot =
        _mm512_sub_epi32(row_dot<Fine>(dg, j, dxs), _mm512_set1_epi32(corr[mg]));
    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_set1_ps(dxs), acc[j]);
  }
}

// rows_of_tile on AMX: all M rows of output tile t, 8 at a time (act: act_row's buffer). The
// codes of the tile's groups are unpacked once (the low and high nibbles of each 64-byte
// sub-block are tile rows 2 s and 2 s + 1, vpdpbusd's operands in tile<>).
template <bool Fine>
AMX_TARGET void rows_of_tile_amx(const int8_t* act, const float* dx, const float* xsum,
                                 const uint8_t* codes, const uint16_t* scale_min,
                                 const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                                 int64_t t) {
  const int64_t G = K / kGroup;
  const uint8_t* c = codes + t * G * kTileBytes;
  const uint16_t* sm = scale_min + t * G * 2 * kTile;
  const int64_t n0 = t * kTile;
  thread_local std::vector<uint8_t> unpacked;  // [G][8 rows][64] codes, one byte each
  if (static_cast<int64_t>(unpacked.size()) < G * 512) unpacked.resize(G * 512);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_ahead(c + g * kTileBytes, kTileBytes, sm + g * 2 * kTile);
    for (int s = 0; s < 4; ++s) {
      const __m512i z = _mm512_loadu_si512(c + g * kTileBytes + s * 64);
      uint8_t* u = unpacked.data() + g * 512 + s * 128;
      _mm512_storeu_si512(u, _mm512_and_si512(z, low));
      _mm512_storeu_si512(u + 64, _mm512_and_si512(_mm512_srli_epi16(z, 4), low));
    }
  }
  asm volatile("" ::: "memory");
  const uint8_t* up = unpacked.data();
  alignas(64) int32_t d[2][256];
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    const int8_t* a = act + (m0 / 8) * 16 * K;
#define Q4_DOTS(g) amx_dots((g) & 1, a + (g) * kGroup, K, up + (g) * 512)
#define Q4_EPILOGUE(g) q4_epilogue<Fine>(acc, d[(g) & 1], sm + (g) * 2 * kTile, dx, xsum, m0, G, g)
    AMX_PIPELINE(G, Q4_DOTS, Q4_EPILOGUE);
#undef Q4_DOTS
#undef Q4_EPILOGUE
    for (int j = 0; j < 8 && m0 + j < M; ++j) {
      __m512 v = acc[j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
      _mm512_storeu_ps(y + (m0 + j) * N + n0, v);
    }
  }
}

// rows_of_tile8 on AMX: the codes are vpdpbusd's operands as stored, each group's 8 x 64 bytes
// one tile.
template <bool Fine>
AMX_TARGET void rows_of_tile8_amx(const int8_t* act, const float* dx, const int32_t* corr,
                                  const uint8_t* codes, const float* scale, const float* bias,
                                  float* y, int64_t M, int64_t K, int64_t N, int64_t t) {
  const int64_t G = K / kGroup;
  const uint8_t* c = codes + t * G * 2 * kTileBytes;
  const int64_t n0 = t * kTile;
  alignas(64) int32_t d[2][256];
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    const int8_t* a = act + (m0 / 8) * 16 * K;
#define Q8_DOTS(g)                                                                 \
  do {                                                                             \
    if (m0 == 0) prefetch_ahead(c + (g) * 2 * kTileBytes, 2 * kTileBytes, nullptr); \
    amx_dots((g) & 1, a + (g) * kGroup, K, c + (g) * 2 * kTileBytes);              \
  } while (0)
#define Q8_EPILOGUE(g) q8_epilogue<Fine>(acc, d[(g) & 1], dx, corr, m0, G, g)
    AMX_PIPELINE(G, Q8_DOTS, Q8_EPILOGUE);
#undef Q8_DOTS
#undef Q8_EPILOGUE
    const __m512 sc = _mm512_loadu_ps(scale + n0);
    for (int j = 0; j < 8 && m0 + j < M; ++j) {
      __m512 v = _mm512_mul_ps(acc[j], sc);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
      _mm512_storeu_ps(y + (m0 + j) * N + n0, v);
    }
  }
}

#pragma GCC pop_options
#else  // no AMX intrinsics: never called (amx_available() is false)
inline void amx_begin() {}
inline void amx_end() {}
template <bool Fine>
void rows_of_tile_amx(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*,
                      const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
template <bool Fine>
void rows_of_tile8_amx(const int8_t*, const float*, const int32_t*, const uint8_t*,
                       const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

// ceil(M / max_rows) register tiles of balanced rows, each a call of kernel(rows, m0).

template <bool Fine>
void rows_of_tile(const int8_t* qx, const int8_t* rx, const float* dx,
                                 const float* xsum,
                                 const uint8_t* codes, const uint16_t* scale_min,
                                 const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                                 int64_t t, bool amx) {
  const int64_t G = K / kGroup;
  if (amx) {  // qx: act_row's buffer. Whole 8-row blocks on AMX, the rest (< 8 rows) below
    const int64_t full = M / 8 * 8;
    rows_of_tile_amx<Fine>(qx, dx, xsum, codes, scale_min, bias, y, full, K, N, t);
    if (full == M) return;
    const int8_t* last = qx + (full / 8) * 16 * K;  // the last block: its qx rows, then rx rows
    qx = last, rx = last + 8 * K, dx += full * G, xsum += full * G, y += full * N, M -= full;
  }
  const uint8_t* c = codes + t * G * kTileBytes;
  const uint16_t* sm = scale_min + t * G * 2 * kTile;
  const int64_t n0 = t * kTile;
  // The tile's codes stay in L1 between its register tiles of rows.
  if (use_vnni()) {
    balanced_rows(M, kMaxRows, [&](int64_t rows, int64_t m) {
      switch (rows) {
        case 8: tile<8, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        case 7: tile<7, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        case 6: tile<6, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        case 5: tile<5, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        case 4: tile<4, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        case 3: tile<3, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        case 2: tile<2, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
        default: tile<1, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
      }
    });
    return;
  }
  balanced_rows(M, kMaxRowsAvx2, [&](int64_t rows, int64_t m) {
    switch (rows) {
      case 4: tile_avx2<4, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
      case 3: tile_avx2<3, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
      case 2: tile_avx2<2, Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, N, m, n0); break;
      default: tile_avx2_one_row<Fine>(qx, rx, dx, xsum, c, sm, bias, y, K, m, n0, N); break;
    }
  });
}

// The quantized activations of a call (qx, rx [M, K] int8, or act: act_row's; dx, xsum, corr
// [M rounded up to 8, G]), kept by the calling thread across calls: a decode step makes about
// 120 of them, each of a few KB.
struct ActScratch {
  std::vector<int8_t> qx, rx, act;  // act: the AMX path's [ceil(M / 8)][16][K] (act_row)
  std::vector<int16_t> a16;          // tile8_avx2's [M, K]: 256 qx + rx, or qx
  std::vector<float> dx, xsum;
  std::vector<int32_t> corr;
};

ActScratch& act_scratch(int64_t M, int64_t K, int64_t G, bool amx) {
  thread_local ActScratch a;
  // Whole 8-row blocks: the AMX path reads rows past M (their results are never stored).
  const int64_t rows = (M + 7) / 8 * 8;
  if (amx) {
    if (static_cast<int64_t>(a.act.size()) < 2 * rows * K) a.act.resize(2 * rows * K);
  } else if (static_cast<int64_t>(a.qx.size()) < M * K) {
    a.qx.resize(M * K), a.rx.resize(M * K);
  }
  if (static_cast<int64_t>(a.dx.size()) < rows * G)
    a.dx.resize(rows * G), a.xsum.resize(rows * G), a.corr.resize(rows * G);
  return a;
}

// Row m's int8 activations and residuals (16-bit activations), where the kernel reads them.
inline int8_t* qx_row(ActScratch& a, int64_t m, int64_t K, bool amx) {
  return amx ? act_row(a.act.data(), m, K, false) : a.qx.data() + m * K;
}
inline int8_t* rx_row(ActScratch& a, int64_t m, int64_t K, bool amx) {
  return amx ? act_row(a.act.data(), m, K, true) : a.rx.data() + m * K;
}

// fn(m) for every row m of a call's activations (their rounding to int8), on torch's threads
// once there are enough elements to pay for waking them (rounded on one thread, the others
// would wait). The rows are independent, so the same bits whichever thread rounds a row. It
// saves 5-15% of a layer's projections at 16-330 rows on AMX, within the noise of a whole
// decode step (docs/benchmarks.md).

}  // namespace

at::Tensor q4_linear_vnni(const at::Tensor& x, const at::Tensor& codes,
                          const at::Tensor& scale_min, const c10::optional<at::Tensor>& bias,
                          int64_t act_bits) {
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "q4_linear_vnni: act_bits 8 or 16, not ",
              act_bits);
  const bool fine = act_bits == 16;
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scale_min.dim() == 3,
              "q4_linear_vnni: x [M, K], codes [N / 16, K / 32, 256], "
              "scale_min [N / 16, K / 32, 32] expected");
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), G = K / kGroup,
                N = T * kTile;
  TORCH_CHECK(K % kGroup == 0 && codes.size(1) == G && codes.size(2) == kTileBytes &&
                  scale_min.size(0) == T && scale_min.size(1) == G &&
                  scale_min.size(2) == 2 * kTile,
              "q4_linear_vnni: shapes do not match: x ", x.sizes(), ", codes ", codes.sizes(),
              ", scale_min ", scale_min.sizes(), " (K must be a multiple of 32)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  scale_min.scalar_type() == at::kHalf,
              "q4_linear_vnni: x float32, codes uint8, scale_min float16 expected");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scale_min.is_contiguous(),
              "q4_linear_vnni: contiguous inputs only");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "q4_linear_vnni: bias [N] float32 expected");
    bp = bias->data_ptr<float>();
  }
  const bool amx = G > 0 && M >= kAmxMinRowsQ4 && use_amx();
  if (amx) amx_calls.fetch_add(1, std::memory_order_relaxed);
  ActScratch& a = act_scratch(M, K, G, amx);
  std::vector<float>&dx = a.dx, &xsum = a.xsum;
  const float* xp = x.data_ptr<float>();
  for_rows(M, K, [&](int64_t m) {
    (use_vnni() ? quantize_row : quantize_row_avx2)(
        xp + m * K, K, qx_row(a, m, K, amx), fine ? rx_row(a, m, K, amx) : nullptr,
        dx.data() + m * G, xsum.data() + m * G);
  });
  const int8_t* qx = amx ? a.act.data() : a.qx.data();  // the AMX path: act_row's buffer
  const int8_t* rx = a.rx.data();
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    if (amx) amx_begin();
    for (int64_t t = t0; t < t1; ++t) {
      if (fine)
        rows_of_tile<true>(qx, rx, dx.data(), xsum.data(), cp, sp, bp, yp, M, K,
                           N, t, amx);
      else
        rows_of_tile<false>(qx, nullptr, dx.data(), xsum.data(), cp, sp, bp, yp, M, K,
                            N, t, amx);
    }
    if (amx) amx_end();
  });
  return y;
}

namespace {

// The int8 layers (--quantization int8, and gguf's Q8_0 LM head): per-channel int8 weights,
// w[n, k] = q[n, k] * scale[n], held as u = q + 128 (vpdpbusd multiplies unsigned by signed):
//   codes [N / 16, K / 32, 512] uint8: sub-block s (inputs 32 g + 4 s .. + 3) is 64 bytes, byte
//   4 l + b = q[16 t + l, 32 g + 4 s + b] + 128;  scale [N] fp32.
// idot(u, a) = idot(q, a) + 128 sum(a), so corr[m, g] = 128 * sum(qx) (16 bits:
// 128 * (256 sum(qx) + sum(rx))) is taken off each group's dot: at most 2^28 in magnitude with
// 16-bit activations, exact in int32 (its fp32 conversion rounds to fp32's 24 bits).
template <int MR, bool Fine>
VNNI_TARGET void tile8(const int8_t* qx, const int8_t* rx, const float* dx,
                          const int32_t* corr, const uint8_t* codes, const float* scale,
                          const float* bias, float* y, int64_t K, int64_t N, int64_t m0,
                          int64_t n0) {
  const int64_t G = K / kGroup;
  __m512 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = codes + g * 2 * kTileBytes;
    prefetch_ahead(c, 2 * kTileBytes, nullptr);
    __m512i w[8];
    for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(c + s * 64);
    for (int j = 0; j < MR; ++j) {
      const int8_t* q = qx + (m0 + j) * K + g * kGroup;
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      for (int s = 0; s < 8; s += 2) {
        i0 = _mm512_dpbusd_epi32(i0, w[s], _mm512_set1_epi32(load4(q + 4 * s)));
        i1 = _mm512_dpbusd_epi32(i1, w[s + 1], _mm512_set1_epi32(load4(q + 4 * s + 4)));
      }
      __m512i idot = _mm512_add_epi32(i0, i1);
      const int64_t mg = (m0 + j) * G + g;
      float dxs = dx[mg];
      if (Fine) {
        const int8_t* r = rx + (m0 + j) * K + g * kGroup;
        __m512i i2 = _mm512_setzero_si512(), i3 = _mm512_setzero_si512();
        for (int s = 0; s < 8; s += 2) {
          i2 = _mm512_dpbusd_epi32(i2, w[s], _mm512_set1_epi32(load4(r + 4 * s)));
          i3 = _mm512_dpbusd_epi32(i3, w[s + 1], _mm512_set1_epi32(load4(r + 4 * s + 4)));
        }
        idot = _mm512_add_epi32(_mm512_slli_epi32(idot, 8), _mm512_add_epi32(i2, i3));
        dxs *= 1.f / 256.f;
      }
      idot = _mm512_sub_epi32(idot, _mm512_set1_epi32(corr[mg]));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_set1_ps(dxs), acc[j]);
    }
  }
  const __m512 sc = _mm512_loadu_ps(scale + n0);
  for (int j = 0; j < MR; ++j) {
    __m512 v = _mm512_mul_ps(acc[j], sc);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    _mm512_storeu_ps(y + (m0 + j) * N + n0, v);
  }
}

// tile8 with AVX2: halves of 8 outputs as tile_avx2. The activations come as one int16 per
// input, a16 = 256 qx + rx with 16 bits (|a16| <= 32,639), qx with 8; the codes back to int8
// (u ^ 0x80 = q) widened to int16 (vpmovsxbw: 4 outputs x 4 inputs a ymm), and vpmaddwd adds
// q * a16 in pairs into int32 (the group's 32 products per output <= 2^27 in magnitude): the
// group's dot is idot(q, 256 qx + rx) = 256 idot(q, qx) + idot(q, rx) exactly, tile8's after its
// correction. One vpmaddwd + vpaddd per 16 products, where vpsignb + vpmaddubsw + vpmaddwd +
// vpaddd would take 32 (twice, for qx and rx, with 16 bits): at 16 rows the LM head in 16-bit
// activations runs about twice as fast this way. A group's two int32 accumulators of 4 outputs
// are summed by vphaddd into outputs 0 1 4 5 | 2 3 6 7; the fp32 accumulator keeps that lane
// order over the groups and is put back before the scale (a permutation: the lanes' bits are
// not touched).
template <int MR, bool Fine>
void tile8_avx2(const int16_t* a16, const float* dx, const uint8_t* codes, const float* scale,
                const float* bias, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  const int64_t G = K / kGroup;
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  const __m256i unpermute = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* c = codes + g * 2 * kTileBytes + 32 * h;
      if (h == 0 && m0 == 0) prefetch_ahead(codes + g * 2 * kTileBytes, 2 * kTileBytes, nullptr);
      __m256i lo[MR], hi[MR];  // outputs 0-3 and 4-7 of the half, int32 pairs
      for (int j = 0; j < MR; ++j) lo[j] = hi[j] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i w0 = _mm256_cvtepi8_epi16(
            _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + s * 64)), flip));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_xor_si128(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + s * 64 + 16)), flip));
        for (int j = 0; j < MR; ++j) {
          int64_t v;
          std::memcpy(&v, a16 + (m0 + j) * K + g * kGroup + 4 * s, sizeof v);
          const __m256i b = _mm256_set1_epi64x(v);
          lo[j] = _mm256_add_epi32(lo[j], _mm256_madd_epi16(w0, b));
          hi[j] = _mm256_add_epi32(hi[j], _mm256_madd_epi16(w1, b));
        }
      }
      for (int j = 0; j < MR; ++j) {
        const float dxs = Fine ? dx[(m0 + j) * G + g] * (1.f / 256.f) : dx[(m0 + j) * G + g];
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[j], hi[j])),
                                 _mm256_set1_ps(dxs), acc[j]);
      }
    }
    const __m256 sc = _mm256_loadu_ps(scale + n0 + 8 * h);
    for (int j = 0; j < MR; ++j) {
      __m256 v = _mm256_mul_ps(_mm256_permutevar8x32_ps(acc[j], unpermute), sc);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + 8 * h));
      _mm256_storeu_ps(y + (m0 + j) * N + n0 + 8 * h, v);
    }
  }
}

template <bool Fine>
void rows_of_tile8(const int8_t* qx, const int8_t* rx, const int16_t* a16, const float* dx,
                   const int32_t* corr, const uint8_t* codes, const float* scale,
                   const float* bias, float* y, int64_t M, int64_t K, int64_t N, int64_t t,
                   bool amx) {
  if (amx) {  // qx: act_row's buffer
    rows_of_tile8_amx<Fine>(qx, dx, corr, codes, scale, bias, y, M, K, N, t);
    return;
  }
  const uint8_t* c = codes + t * (K / kGroup) * 2 * kTileBytes;
  const int64_t n0 = t * kTile;
  if (use_vnni()) {
    balanced_rows(M, kMaxRows, [&](int64_t rows, int64_t m) {
      switch (rows) {
        case 8: tile8<8, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        case 7: tile8<7, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        case 6: tile8<6, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        case 5: tile8<5, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        case 4: tile8<4, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        case 3: tile8<3, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        case 2: tile8<2, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
        default: tile8<1, Fine>(qx, rx, dx, corr, c, scale, bias, y, K, N, m, n0); break;
      }
    });
    return;
  }
  balanced_rows(M, kMaxRowsAvx2, [&](int64_t rows, int64_t m) {
    switch (rows) {
      case 4: tile8_avx2<4, Fine>(a16, dx, c, scale, bias, y, K, N, m, n0); break;
      case 3: tile8_avx2<3, Fine>(a16, dx, c, scale, bias, y, K, N, m, n0); break;
      case 2: tile8_avx2<2, Fine>(a16, dx, c, scale, bias, y, K, N, m, n0); break;
      default: tile8_avx2<1, Fine>(a16, dx, c, scale, bias, y, K, N, m, n0); break;
    }
  });
}

}  // namespace

at::Tensor q8_linear_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t act_bits) {
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "q8_linear_vnni: act_bits 8 or 16, not ",
              act_bits);
  const bool fine = act_bits == 16;
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scale.dim() == 1,
              "q8_linear_vnni: x [M, K], codes [N / 16, K / 32, 512], scale [N] expected");
  const int64_t M = x.size(0), K = x.size(1), T = codes.size(0), G = K / kGroup,
                N = T * kTile;
  TORCH_CHECK(K % kGroup == 0 && codes.size(1) == G && codes.size(2) == 2 * kTileBytes &&
                  scale.size(0) == N,
              "q8_linear_vnni: shapes do not match: x ", x.sizes(), ", codes ", codes.sizes(),
              ", scale ", scale.sizes(), " (K must be a multiple of 32)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte &&
                  scale.scalar_type() == at::kFloat,
              "q8_linear_vnni: x float32, codes uint8, scale float32 expected");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scale.is_contiguous(),
              "q8_linear_vnni: contiguous inputs only");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "q8_linear_vnni: bias [N] float32 expected");
    bp = bias->data_ptr<float>();
  }
  const bool amx = G > 0 && M >= kAmxMinRowsQ8 && use_amx();
  if (amx) amx_calls.fetch_add(1, std::memory_order_relaxed);
  ActScratch& a = act_scratch(M, K, G, amx);
  std::vector<float>&dx = a.dx, &xsum = a.xsum;
  std::vector<int32_t>& corr = a.corr;
  const bool avx2 = !amx && !use_vnni();
  if (avx2 && static_cast<int64_t>(a.a16.size()) < M * K) a.a16.resize(M * K);
  const float* xp = x.data_ptr<float>();
  for_rows(M, K, [&](int64_t m) {
    int8_t* q = qx_row(a, m, K, amx);
    int8_t* r = fine ? rx_row(a, m, K, amx) : nullptr;
    (use_vnni() ? quantize_row : quantize_row_avx2)(xp + m * K, K, q, r, dx.data() + m * G,
                                                    xsum.data() + m * G);
    for (int64_t g = 0; g < G && !avx2; ++g) {  // tile8 and AMX: the correction of u = q + 128
      int32_t s1 = 0, s2 = 0;
      for (int i = 0; i < kGroup; ++i) {
        s1 += q[g * kGroup + i];
        if (fine) s2 += r[g * kGroup + i];
      }
      corr[m * G + g] = fine ? 128 * (256 * s1 + s2) : 128 * s1;
    }
    if (avx2) {
      int16_t* w = a.a16.data() + m * K;
      for (int64_t i = 0; i < K; ++i) w[i] = static_cast<int16_t>(fine ? 256 * q[i] + r[i] : q[i]);
    }
  });
  const int8_t* qx = amx ? a.act.data() : a.qx.data();  // the AMX path: act_row's buffer
  const int8_t* rx = a.rx.data();
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    if (amx) amx_begin();
    for (int64_t t = t0; t < t1; ++t) {
      if (fine)
        rows_of_tile8<true>(qx, rx, a.a16.data(), dx.data(), corr.data(), cp, sp, bp, yp, M,
                            K, N, t, amx);
      else
        rows_of_tile8<false>(qx, nullptr, a.a16.data(), dx.data(), corr.data(), cp, sp, bp,
                             yp, M, K, N, t, amx);
    }
    if (amx) amx_end();
  });
  return y;
}

}  // namespace saltserve_cpu
