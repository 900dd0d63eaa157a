// Paged decode attention for CPU (vLLM's paged_attention_v1 CPU op, for fp32): every sequence
// with one new token attends over its context straight through its block table.
//
// Why: through torch, each sequence's K and V rows are gathered into new tensors (aten::index,
// twice a layer) before SDPA runs: about 70 us a layer at short contexts for ~10 us of
// arithmetic, about a tenth of a single-stream gguf decode step.
//
// Layouts (engine/attention/metadata.py):
//   query, out:  [num_tokens, num_heads, head_dim] fp32
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32, or both bf16
//   (--kv-cache-dtype bfloat16: avx512_bf16 and a head_dim multiple of 32; namespace bf16 below)
//   query_start_loc [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, max_blocks]
//   int32. Sequences whose query_len is not 1 are skipped (their out rows are not written).
//
// Split-K over fixed chunks, shared chunks read once (cascade attention, in place):
// each sequence's context is cut into chunks of kChunk positions from position 0 (flash-decoding's
// split-K: a long context no longer leaves threads idle). A chunk is attended as a partial
// softmax per query row (its max m, its sum l and the unnormalised sum of exp(s - m) * v), and the
// partials of a row are merged in chunk order. Sequences whose chunk covers the same positions of
// the same physical blocks (a shared system prompt, a forked prompt: prefix-cache hits within one
// tenant, since salted hashes never share a block across tenants) read that chunk's K and V once,
// for all of their query heads together, as vLLM's cascade attention does for one common prefix;
// here any chunk, any number of groups. Every score, partial and merge is summed in an order fixed
// by the row's own positions, so a sequence's output is bit-identical whether or not another
// sequence shares its chunks, and does not depend on its batch.
// Per (chunk, kv head): scores of 3 query rows x 4 positions (one sequence's query heads of a
// KV head for SmolLM2's 9 / 3 heads; then 2 x 4, or 1 x 8) at a time in independent FMA chains
// over head_dim, each reduced by the same add tree; softmax in fp32 (the row max 8 lanes at a
// time; exp: Cephes' polynomial, about 1 ulp; weights below exp(-88) count as 0); then the
// weighted sum of V with 3 (or 2, or 1) rows x 32 columns held in registers. While a thread
// computes one work item it prefetches its next item's K and V lines, a few rows between each
// 3-row tile (1.2-1.6x a layer when walking a whole model's KV caches; docs/benchmarks.md).
// Working memory is kept per thread across calls (up to kKeepBytes of partials).
// On AVX-512 CPUs, chunks read for 6+ query rows run on zmm tiles with the same bits (f32x16).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include "amx.h"
#include "ops.h"
#include "vec_exp.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

namespace saltserve_cpu {
namespace {

using saltserve::exp256;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}


// Positions per partial softmax. 128 rather than 64: fewer partials to write and merge, up to
// ~1.1x a decode step where memory is contended and never slower; 256 gains nothing more.
constexpr int64_t kChunk = 128;
// Work items of at least this many query rows take the AVX-512 tiles where they are on (f32x16
// below); fewer rows (a sequence's own chunk: 3 rows for SmolLM2) are bound by reading K/V,
// and there the zmm tiles are slower than the AVX2 ones. From 6 rows (a chunk shared by two
// sequences) they are as fast or faster, up to ~1.2x at 48 rows
// (benchmarks/bench_decode_attention.py).
constexpr int64_t kWideRows = 6;
constexpr size_t kKeepBytes = 64u << 20;  // partial buffers kept across calls, at most
constexpr size_t kKeepGroups = 1u << 16;  // groups (chunk keys) kept across calls, at most


// Eight accumulators of 8 lanes each reduced to their eight sums, in lane k the sum of a[k]
// (((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))): the same order for every accumulator.
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of R query rows against NP positions (R * NP <= 12): s[r * ld + p] = (q_r . k_p) * sc.
// Each score is the same chain of FMAs over head_dim and the same reduce8 tree whatever the tile,
// so a row's scores do not depend on the rows it is tiled with.
template <int R, int NP>
inline void score_tile(const float* const* q, const float* const* k, int64_t D, float sc,
                       float* s, int64_t ld) {
  constexpr int A = R * NP;
  static_assert(A <= 12, "16 ymm registers: 12 accumulators, R query rows and one key row");
  __m256 a[A > 8 ? 16 : 8];
  for (int i = 0; i < A; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[R];
    for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q[r] + d);
    for (int p = 0; p < NP; ++p) {
      const __m256 kv = _mm256_loadu_ps(k[p] + d);
      for (int r = 0; r < R; ++r) a[r * NP + p] = _mm256_fmadd_ps(qv[r], kv, a[r * NP + p]);
    }
  }
  for (int i = A; i < (A > 8 ? 16 : 8); ++i) a[i] = a[i - A];  // padding, reduced and dropped
  alignas(32) float sums[16];
  const __m256 scv = _mm256_set1_ps(sc);
  _mm256_store_ps(sums, _mm256_mul_ps(reduce8(a), scv));
  if constexpr (A > 8) _mm256_store_ps(sums + 8, _mm256_mul_ps(reduce8(a + 8), scv));
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) s[r * ld + p] = sums[r * NP + p];
}

// acc[r][d0 .. d0 + 8 NV) = sum_j w[r * ld + j] * v_j[d0 ..], j in position order.
template <int R, int NV>
inline void pv_tile(const float* w, int64_t ld, const float* const* v, int64_t n, int64_t d0,
                    float* const* acc) {
  __m256 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_set1_ps(w[r * ld + j]);
    const float* vj = v[j] + d0;
    for (int i = 0; i < NV; ++i) {
      const __m256 x = _mm256_loadu_ps(vj + 8 * i);
      for (int r = 0; r < R; ++r) a[r][i] = _mm256_fmadd_ps(wv[r], x, a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc[r] + d0 + 8 * i, a[r][i]);
}

// Asks for rows[0 .. n)'s bytes bytes (their cache lines) to be brought into L1.
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[j]) + b, _MM_HINT_T0);
}

// The next work item's K then V rows, prefetched a few at a time between this item's register
// tiles: a burst of hundreds of prefetches stalls on the core's fill buffers, spread out they
// overlap the arithmetic.
template <typename T>
struct Prefetcher {
  const T* const* k;
  const T* const* v;
  int64_t n, done = 0, per = 0;
  Prefetcher(const T* const* k_, const T* const* v_, int64_t n_, int64_t steps)
      : k(k_), v(v_), n(n_), per((2 * n_ + steps - 1) / std::max<int64_t>(steps, 1)) {}
  void step(int64_t bytes, bool all = false) {
    for (int64_t e = all ? 2 * n : std::min(done + per, 2 * n); done < e; ++done)
      prefetch_rows((done < n ? k + done : v + done - n), 1, bytes);
  }
};

// A row's numerators from position j on, in place: whole 8-lane blocks through exp256, added to
// sum8 in position order, then the last n % 8 (exp256 padded with -inf) added one by one to the
// blocks' hsum. Returns the row's sum. Both softmax paths end here, so they sum in one order.
inline float softmax_rest(float* si, int64_t j, int64_t n, float mx, __m256 sum8) {
  const __m256 mv = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(si + j), mv));
    _mm256_storeu_ps(si + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  if (j >= n) return sum;
  alignas(32) float tail[8];
  for (int64_t t = 0; t < 8; ++t) tail[t] = j + t < n ? si[j + t] - mx : -INFINITY;
  _mm256_store_ps(tail, exp256(_mm256_load_ps(tail)));
  for (int64_t t = 0; j + t < n; ++t) {
    si[j + t] = tail[t];
    sum += tail[t];
  }
  return sum;
}

// Softmax numerators of rows s[i * ld + 0 .. n), i < nq, in place: s = exp(s - m_i), with the
// row max in *m[i] and the sum of the numerators in *l[i].
void softmax_rows(float* s, int64_t ld, int64_t nq, int64_t n, float* const* m,
                  float* const* l) {
  for (int64_t i = 0; i < nq; ++i) {  // softmax numerators and sums per row
    float* si = s + i * ld;
    // The row's max, 8 lanes at a time (std::fmax is a libm call per element: 16% of the
    // kernel at 16 shared rows); max is exact in any order, and scores are finite.
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    int64_t j0 = 0;
    for (; j0 + 8 <= n; j0 += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(si + j0));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    float mx = -INFINITY;
    for (int t = 0; t < 8; ++t) mx = lanes[t] > mx ? lanes[t] : mx;
    for (; j0 < n; ++j0) mx = si[j0] > mx ? si[j0] : mx;
    *m[i] = mx;
    *l[i] = softmax_rest(si, 0, n, mx, _mm256_setzero_ps());
  }
}

// One partial softmax: nq query rows over n <= kChunk positions (row pointers k[j], v[j]).
// Writes m[i], l[i] and acc[i][0 .. D) = sum_j exp(s_ij - m_i) v_j; s is scratch [nq, kChunk].
// next_k, next_v: the next work item's rows (next_n of each; 0: none), prefetched while this
// one computes (Prefetcher).
void partial(const float* const* q, int64_t nq, const float* const* k, const float* const* v,
             int64_t n, int64_t D, float sc, float* s, float* const* m, float* const* l,
             float* const* acc, const float* const* next_k, const float* const* next_v,
             int64_t next_n) {
  constexpr int64_t ld = kChunk;
  Prefetcher<float> ahead(next_k, next_v, next_n, 2 * ((nq + 2) / 3));  // a step a 3-row tile
  int64_t i = 0;
  for (; i + 3 <= nq; i += 3) {  // 3 rows: one sequence's query heads of a KV head (SmolLM2)
    ahead.step(D * 4);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) score_tile<3, 4>(q + i, k + j, D, sc, s + i * ld + j, ld);
    for (; j < n; ++j) score_tile<3, 1>(q + i, k + j, D, sc, s + i * ld + j, ld);
  }
  for (; i + 2 <= nq; i += 2) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) score_tile<2, 4>(q + i, k + j, D, sc, s + i * ld + j, ld);
    for (; j < n; ++j) score_tile<2, 1>(q + i, k + j, D, sc, s + i * ld + j, ld);
  }
  for (; i < nq; ++i) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) score_tile<1, 8>(q + i, k + j, D, sc, s + i * ld + j, ld);
    for (; j < n; ++j) score_tile<1, 1>(q + i, k + j, D, sc, s + i * ld + j, ld);
  }
  ahead.step(D * 4);  // rows left over from tiles of 2 and 1 rows
  softmax_rows(s, ld, nq, n, m, l);
  for (i = 0; i + 3 <= nq; i += 3) {
    ahead.step(D * 4);
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) pv_tile<3, 4>(s + i * ld, ld, v, n, d0, acc + i);
    for (; d0 < D; d0 += 8) pv_tile<3, 1>(s + i * ld, ld, v, n, d0, acc + i);
  }
  ahead.step(D * 4, true);  // what tiles of 2 and 1 rows left
  for (; i + 2 <= nq; i += 2) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) pv_tile<2, 4>(s + i * ld, ld, v, n, d0, acc + i);
    for (; d0 < D; d0 += 8) pv_tile<2, 1>(s + i * ld, ld, v, n, d0, acc + i);
  }
  for (; i < nq; ++i) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) pv_tile<1, 4>(s + i * ld, ld, v, n, d0, acc + i);
    for (; d0 < D; d0 += 8) pv_tile<1, 1>(s + i * ld, ld, v, n, d0, acc + i);
  }
}

// fp32 caches on AVX-512 (avx512f/bw/vl/dq, where the CPU has them and attention_avx512 is on):
// the AVX2 path's arithmetic, two of its 8-lane registers in each zmm, so the same bits.
// - Scores: a zmm holds two query rows' 8 columns ([row 2p | row 2p + 1], packed once an item)
//   against one key row's 8 columns broadcast to both halves: each half is score_tile's FMA
//   chain for its row, and reduce8x2 is reduce8's tree on both halves at once (half its
//   shuffles a score, and half the FMA instructions).
// - P.V: each column's sum over positions is one FMA chain in position order whatever the
//   register width, so 16-column tiles give pv_tile's bits.
// - Softmax: exp over 16 lanes (lane for lane exp256's operations), the sum added in 8-lane
//   halves in softmax_rows's order.
// A query row left over from the pairs is scored by the AVX2 tile (the same bits again). Since
// both paths give the same bits, each work item may take either: items of kWideRows rows or more
// come here. The next item's K/V rows are prefetched at every 8-position score tile (at 48 rows,
// 2 rows a tile): the AVX2 path's spread (a step a 3-row tile) would ask for 30 rows at once and
// stall on the core's fill buffers. Prefetches still wait for fill buffers where the caches do
// not fit L3. On CPUs with two AVX-512 FMA units, 16 sequences on a shared prefix run about
// 1.1-1.3x the AVX2 path a layer (benchmarks/bench_decode_attention.py; docs/benchmarks.md).
#ifndef SALTSERVE_HAVE_AVX512
#if defined(__x86_64__) && !defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8
#define SALTSERVE_HAVE_AVX512 1
#else
#define SALTSERVE_HAVE_AVX512 0
#endif
#endif
#if SALTSERVE_HAVE_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace f32x16 {

// _mm256_hadd_ps on each 256-bit half: per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
inline __m512 hadd(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// reduce8 on both halves of eight accumulators a[i] = [x_i | y_i]: lanes [x0..x3, y0..y3,
// x4..x7, y4..y7] hold their sums, each in reduce8's order (lo + hi as its permutes add them).
__attribute__((always_inline)) inline __m512 reduce8x2(const __m512* a) {
  const __m512 t0 = hadd(a[0], a[1]), t1 = hadd(a[2], a[3]);
  const __m512 t2 = hadd(a[4], a[5]), t3 = hadd(a[6], a[7]);
  const __m512 u0 = hadd(t0, t1), u1 = hadd(t2, t3);
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// Where reduce8x2 puts accumulator a (0..7 of its group)'s first half; the second is 4 lanes on.
constexpr int lane_of(int a) { return a < 4 ? a : a + 4; }

// Scores of RP row pairs against NP positions: q2[p] is pair p's packed rows (D / 8 blocks of
// [8 columns of row 2p | the same 8 of row 2p + 1]); s[r * ld + j] = (q_r . k_j) * sc for rows
// r = 2p, 2p + 1, with score_tile's chains and tree.
template <int RP, int NP>
inline void score_pairs(const float* const* q2, const float* const* k, int64_t D, float sc,
                        float* s, int64_t ld) {
  constexpr int A = RP * NP, AP = (A + 7) / 8 * 8;  // accumulators; whole groups of 8
  static_assert(A + RP + 1 <= 32, "32 zmm registers: accumulators, pairs and one key row");
  __m512 a[AP];
#pragma GCC unroll 32
  for (int i = 0; i < AP; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 qv[RP];
#pragma GCC unroll 4
    for (int p = 0; p < RP; ++p) qv[p] = _mm512_loadu_ps(q2[p] + 2 * d);
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(k[j] + d));
#pragma GCC unroll 4
      for (int p = 0; p < RP; ++p) a[p * NP + j] = _mm512_fmadd_ps(qv[p], kv, a[p * NP + j]);
    }
  }
  const __m512 scv = _mm512_set1_ps(sc);
  if constexpr (NP == 8) {  // a pair's group: [row 2p 0..3, row 2p+1 0..3, 2p 4..7, 2p+1 4..7]
    const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
#pragma GCC unroll 4
    for (int p = 0; p < RP; ++p) {
      const __m512 v = _mm512_permutexvar_ps(rows, _mm512_mul_ps(reduce8x2(a + 8 * p), scv));
      _mm256_storeu_ps(s + 2 * p * ld, _mm512_castps512_ps256(v));
      _mm256_storeu_ps(s + (2 * p + 1) * ld, _mm512_extractf32x8_ps(v, 1));
    }
  } else {
    alignas(64) float sums[AP * 2];
#pragma GCC unroll 4
    for (int g = 0; g < AP / 8; ++g)
      _mm512_store_ps(sums + 16 * g, _mm512_mul_ps(reduce8x2(a + 8 * g), scv));
    for (int p = 0; p < RP; ++p)
      for (int j = 0; j < NP; ++j) {
        const int i = p * NP + j, at = 16 * (i / 8) + lane_of(i % 8);
        s[2 * p * ld + j] = sums[at];
        s[(2 * p + 1) * ld + j] = sums[at + 4];
      }
  }
}

// pv_tile on 16-column registers: acc[r][d0 .. d0 + 16 NV) = sum_j w[r * ld + j] * v_j[d0 ..],
// j in position order. Half: 8 columns (D % 16 == 8), NV = 1. (The loops are unrolled so that
// GCC keeps a[] in registers; rolled, it stores all 24 accumulators every position.)
template <int R, int NV, bool Half = false>
inline void pv_tile(const float* w, int64_t ld, const float* const* v, int64_t n, int64_t d0,
                    float* const* acc) {
  static_assert(R * NV + NV <= 32 && (!Half || NV == 1), "32 zmm registers");
  constexpr __mmask16 mask = Half ? 0x00FF : 0xFFFF;
  __m512 a[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v[j] + d0;
    __m512 x[NV];
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i)
      x[i] = Half ? _mm512_maskz_loadu_ps(mask, vj + 16 * i) : _mm512_loadu_ps(vj + 16 * i);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r * ld + j]);
#pragma GCC unroll 4
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(wv, x[i], a[r][i]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) _mm512_mask_storeu_ps(acc[r] + d0 + 16 * i, mask, a[r][i]);
}

// R rows of P.V over every column: 64-column tiles, then 16, then a half register.
template <int R>
inline void pv_rows(const float* w, int64_t ld, const float* const* v, int64_t n, int64_t D,
                    float* const* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_tile<R, 4>(w, ld, v, n, d0, acc);
  for (; d0 + 16 <= D; d0 += 16) pv_tile<R, 1>(w, ld, v, n, d0, acc);
  if (d0 < D) pv_tile<R, 1, true>(w, ld, v, n, d0, acc);
}

// exp256's operations and coefficients on 16 lanes (the same result lane for lane).
inline __m512 exp512(__m512 x) {
  using namespace saltserve::exp_coef;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-kMax)), _mm512_set1_ps(kMax));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// softmax_rows with 16-lane max and exp; the sum in its 8-lane order, so the same bits.
void softmax_rows(float* s, int64_t ld, int64_t nq, int64_t n, float* const* m,
                  float* const* l) {
  for (int64_t i = 0; i < nq; ++i) {
    float* si = s + i * ld;
    __m512 mx16 = _mm512_set1_ps(-INFINITY);  // max is exact in any order
    int64_t j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) mx16 = _mm512_max_ps(mx16, _mm512_loadu_ps(si + j0));
    if (j0 < n) {
      const __mmask16 rest = static_cast<__mmask16>((1u << (n - j0)) - 1);
      mx16 = _mm512_max_ps(mx16, _mm512_mask_loadu_ps(mx16, rest, si + j0));
    }
    const float mx = _mm512_reduce_max_ps(mx16);
    const __m512 mv = _mm512_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(si + j), mv));
      _mm512_storeu_ps(si + j, e);
      sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
      sum8 = _mm256_add_ps(sum8, _mm512_extractf32x8_ps(e, 1));
    }
    *m[i] = mx;
    *l[i] = softmax_rest(si, j, n, mx, sum8);  // the 8-lane block and tail left, AVX2's way
  }
}

// partial() on AVX-512: the same outputs, bit for bit. q2: scratch for nq / 2 packed pairs.
void partial(const float* const* q, int64_t nq, const float* const* k, const float* const* v,
             int64_t n, int64_t D, float sc, float* s, float* q2, float* const* m,
             float* const* l, float* const* acc, const float* const* next_k,
             const float* const* next_v, int64_t next_n) {
  constexpr int64_t ld = kChunk;
  const int64_t pairs = nq / 2;
  for (int64_t p = 0; p < pairs; ++p)  // [8 of row 2p | 8 of row 2p + 1] for each 8 columns
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_storeu_ps(q2 + 2 * (p * D + d), _mm256_loadu_ps(q[2 * p] + d));
      _mm256_storeu_ps(q2 + 2 * (p * D + d) + 8, _mm256_loadu_ps(q[2 * p + 1] + d));
    }
  // The next item's rows are asked for a few at a time, at every tile of 8 positions (at 48
  // rows, 2 rows a tile: a burst of more fills the core's line fill buffers and stalls on them).
  const int64_t steps = (pairs / 3 + pairs % 3 + nq % 2) * (n / 8) + nq / 6;  // step() calls
  Prefetcher<float> ahead(next_k, next_v, next_n, steps);
  const float* qp[3];
  int64_t p = 0;
  for (; p + 3 <= pairs; p += 3) {  // 6 rows: 24 accumulators
    for (int t = 0; t < 3; ++t) qp[t] = q2 + 2 * (p + t) * D;
    int64_t j = 0;
    float* sp = s + 2 * p * ld;
    for (; j + 8 <= n; j += 8) {
      ahead.step(D * 4);
      score_pairs<3, 8>(qp, k + j, D, sc, sp + j, ld);
    }
    for (; j < n; ++j) score_pairs<3, 1>(qp, k + j, D, sc, sp + j, ld);
  }
  for (; p < pairs; ++p) {
    qp[0] = q2 + 2 * p * D;
    int64_t j = 0;
    float* sp = s + 2 * p * ld;
    for (; j + 8 <= n; j += 8) {
      ahead.step(D * 4);
      score_pairs<1, 8>(qp, k + j, D, sc, sp + j, ld);
    }
    for (; j + 4 <= n; j += 4) score_pairs<1, 4>(qp, k + j, D, sc, sp + j, ld);
    for (; j < n; ++j) score_pairs<1, 1>(qp, k + j, D, sc, sp + j, ld);
  }
  if (nq % 2) {  // the row left over: AVX2's tile, the same chains and tree
    const int64_t i = nq - 1;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      ahead.step(D * 4);
      score_tile<1, 8>(q + i, k + j, D, sc, s + i * ld + j, ld);
    }
    for (; j < n; ++j) score_tile<1, 1>(q + i, k + j, D, sc, s + i * ld + j, ld);
  }
  softmax_rows(s, ld, nq, n, m, l);
  int64_t i = 0;
  for (; i + 6 <= nq; i += 6) {
    ahead.step(D * 4);
    pv_rows<6>(s + i * ld, ld, v, n, D, acc + i);
  }
  ahead.step(D * 4, true);
  for (; i + 3 <= nq; i += 3) pv_rows<3>(s + i * ld, ld, v, n, D, acc + i);
  for (; i + 2 <= nq; i += 2) pv_rows<2>(s + i * ld, ld, v, n, D, acc + i);
  for (; i < nq; ++i) pv_rows<1>(s + i * ld, ld, v, n, D, acc + i);
}

}  // namespace f32x16
#pragma GCC pop_options
#endif  // SALTSERVE_HAVE_AVX512

// Whether fp32 caches take the AVX-512 path (f32x16): built, a CPU with avx512f/bw/vl/dq, and
// not switched off by attention_avx512(0). Both paths give the same bits.
bool avx512_supported() {
#if SALTSERVE_HAVE_AVX512
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
#else
  return false;
#endif
}
// A path's switch (tests and benchmarks compare the paths in one process): state -1 until
// first asked or set; enabled -1 asks, 0 / 1 turn the path off / on (on only where
// supported). Returns whether it is on.
bool path_switch(std::atomic<int>& state, int64_t enabled, bool supported) {
  if (enabled >= 0) state = enabled && supported;
  int on = state.load();
  if (on < 0) {  // first ask: the default, unless a switch came in between
    state.compare_exchange_strong(on, supported ? 1 : 0);
    on = state.load();
  }
  return on;
}

std::atomic<int> avx512_on{-1};

}  // namespace

// The AVX-512 path's switch (path_switch).
bool attention_avx512(int64_t enabled) {
  return path_switch(avx512_on, enabled, avx512_supported());
}

namespace {

// bf16 caches (--kv-cache-dtype bfloat16): the same plan, chunks and merge, with the products
// on avx512_bf16's VDPBF16PS (pairs of bf16 products summed into fp32 lanes). K and V are bf16
// already; Q (once a call) and P (a chunk's softmax numerators) are each split into a bf16 high
// part and a bf16 low part (x - hi, rounded), and both parts are multiplied: each product of a
// bf16 pair is exact in fp32, so the result is fp32 attention over the cache's bf16 values to
// about 3e-6 relative (one bf16 part each would give 2e-3, the error FlashAttention's bf16 Q and
// P give on GPUs, and a prefix-cache hit could then change the bundled model's greedy tokens).
// The split costs a second VDPBF16PS per product; reading half the bytes, the path still runs
// about 1.1x the fp32 one (docs/benchmarks.md). Scores and softmax stay fp32. Every row runs
// the same arithmetic whatever its tile or group, so a row's bits still do not depend on its
// batch.
// The bf16 path as written needs GCC 11's target pragma (clang ignores it) and an assembler that
// knows avx512_bf16; kernels/cpu/build.py's load() builds again with -DSALTSERVE_HAVE_BF16=0
// where the build fails, and bf16 caches are then refused (bf16_kv_cache() says so; the torch
// path reads them).
#ifndef SALTSERVE_HAVE_BF16
#if defined(__x86_64__) && !defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11
#define SALTSERVE_HAVE_BF16 1
#else
#define SALTSERVE_HAVE_BF16 0
#endif
#endif
#if SALTSERVE_HAVE_BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
namespace bf16 {

// Scores of R query rows against the chunk's positions 0 .. 16 NB, K packed by pack_k:
// s[r * ld + p] = (q_r . k_p) * sc, each score one chain of VDPBF16PS over the D / 2 element
// pairs in order, the high part's then the low part's (a lane of one accumulator): no
// reduction, and the same for every tile. (Not the fp32 tiles' dot-product form: reducing a
// zmm per score costs more than two VDPBF16PS at D = 64.)
template <int R, int NB>
inline void score_tile(const uint16_t* const* q, const __m512i* kt, int64_t D, float sc, float* s,
                       int64_t ld) {
  __m512 a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) a[r][b] = _mm512_setzero_ps();
  const int32_t* q32[R];  // each row: D bf16 of Q's high part, then D of its low part
  for (int r = 0; r < R; ++r) q32[r] = reinterpret_cast<const int32_t*>(q[r]);
  for (int64_t t = 0; t < D / 2; ++t) {
    __m512bh kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = (__m512bh)_mm512_loadu_si512(kt + t * (kChunk / 16) + b);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(q32[r][t]);
      for (int b = 0; b < NB; ++b) a[r][b] = _mm512_dpbf16_ps(a[r][b], w, kv[b]);
      const __m512bh wl = (__m512bh)_mm512_set1_epi32(q32[r][t + D / 2]);
      for (int b = 0; b < NB; ++b) a[r][b] = _mm512_dpbf16_ps(a[r][b], wl, kv[b]);
    }
  }
  const __m512 scv = _mm512_set1_ps(sc);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + r * ld + 16 * b, _mm512_mul_ps(a[r][b], scv));
}

template <int R>
inline void score_rows(const uint16_t* const* q, const __m512i* kt, int64_t nb, int64_t D, float sc,
                       float* s, int64_t ld) {
  for (int64_t b0 = 0; b0 < nb; b0 += 4, kt += 4, s += 64) switch (nb - b0) {  // 64 positions
    case 1: score_tile<R, 1>(q, kt, D, sc, s, ld); break;  // at a time (4 x 16)
    case 2: score_tile<R, 2>(q, kt, D, sc, s, ld); break;
    case 3: score_tile<R, 3>(q, kt, D, sc, s, ld); break;
    default: score_tile<R, 4>(q, kt, D, sc, s, ld); break;
  }
}

// 16 x 16 dwords transposed in registers.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// K rows k[0 .. n) (D bf16 each) as element pairs by position: kt[t][p] = (k_p[2t], k_p[2t + 1])
// as one dword, [D / 2][kChunk] dwords ([D / 2][kChunk / 16] zmm); positions n .. 16 ceil(n / 16)
// are zero.
inline void pack_k(const uint16_t* const* k, int64_t n, int64_t D, __m512i* kt) {
  for (int64_t p0 = 0; p0 < n; p0 += 16)
    for (int64_t c0 = 0; c0 < D / 2; c0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = p0 + i < n ? _mm512_loadu_si512(reinterpret_cast<const int32_t*>(k[p0 + i]) + c0)
                          : _mm512_setzero_si512();
      transpose16(r);  // r[c] = column c0 + c over positions p0 .. p0 + 16
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kt + (c0 + c) * (kChunk / 16) + p0 / 16, r[c]);
    }
}

// x[0 .. n) fp32 to bf16 (round to nearest even), n a multiple of 32.
inline void round_row(const float* x, int64_t n, uint16_t* out) {
  for (int64_t d = 0; d < n; d += 32)
    _mm512_storeu_si512(out + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + d + 16),
                                                              _mm512_loadu_ps(x + d)));
}

// x[0 .. n) (n a multiple of 32) as a bf16 high part out[0 .. n) (round_row) and a bf16 low
// part out[lo .. lo + n) = x - hi, rounded: hi + lo is x to about 2^-17 relative.
inline void split_row(const float* x, int64_t n, uint16_t* out, int64_t lo) {
  round_row(x, n, out);
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 hi = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(out + d)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + lo + d),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(_mm512_loadu_ps(x + d), hi)));
  }
}

// acc[r][32 cb .. + 32) = sum over position pairs t of P[r][2t] v_2t + P[r][2t + 1] v_2t+1.
// pb: P rows as bf16 pairs (pld a row: kChunk / 2 pairs of the high part, then the low
// part's; high then low per pair t); vp: V of the chunk interleaved by position pairs
// (pack_v), whose lanes hold columns 8L + i (lo) and 8L + 4 + i (hi) of 128-bit lane L; the two
// accumulators are put back in column order on the way out.
template <int R>
inline void pv_tile(const uint32_t* pb, int64_t pld, const __m512i* vp, int64_t npairs,
                    int64_t cb, float* const* acc) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  const __m512i* vt = vp + cb * npairs * 2;
  for (int64_t t = 0; t < npairs; ++t) {
    const __m512bh lo = (__m512bh)_mm512_loadu_si512(vt + 2 * t);
    const __m512bh hi = (__m512bh)_mm512_loadu_si512(vt + 2 * t + 1);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r * pld + t]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], w, lo);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], w, hi);
      const __m512bh wl =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r * pld + kChunk / 2 + t]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], wl, lo);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], wl, hi);
    }
  }
  // column c of the 32: lane L = c / 8, i = c % 8: lo[4L + i] for i < 4, else hi[4L + i - 4]
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30,
                                       31);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc[r] + 32 * cb, _mm512_permutex2var_ps(a[r][0], i0, a[r][1]));
    _mm512_storeu_ps(acc[r] + 32 * cb + 16, _mm512_permutex2var_ps(a[r][0], i1, a[r][1]));
  }
}

// V rows v[0 .. n) (D bf16 each) interleaved by position pairs into vp [D / 32][npairs][2] zmm;
// an odd n's last pair takes a zero row.
inline void pack_v(const uint16_t* const* v, int64_t n, int64_t D, __m512i* vp) {
  const int64_t npairs = (n + 1) / 2;
  for (int64_t cb = 0; cb < D / 32; ++cb)
    for (int64_t t = 0; t < npairs; ++t) {
      const __m512i a = _mm512_loadu_si512(v[2 * t] + 32 * cb);
      const __m512i b = 2 * t + 1 < n ? _mm512_loadu_si512(v[2 * t + 1] + 32 * cb)
                                      : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (cb * npairs + t) * 2, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vp + (cb * npairs + t) * 2 + 1, _mm512_unpackhi_epi16(a, b));
    }
}

// partial() for bf16 rows: q [nq] rows of 2 D bf16 (Q's high part, then its low part), k and v
// cache rows; pb scratch [nq, kChunk] pairs, kt [D / 2, kChunk / 16] zmm, vp [D / 32,
// kChunk / 2, 2] zmm.
void partial(const uint16_t* const* q, int64_t nq, const uint16_t* const* k,
             const uint16_t* const* v, int64_t n, int64_t D, float sc, float* s, uint32_t* pb,
             __m512i* kt, __m512i* vp, float* const* m, float* const* l, float* const* acc,
             const uint16_t* const* next_k, const uint16_t* const* next_v, int64_t next_n) {
  constexpr int64_t ld = kChunk, pld = kChunk;  // P rows: kChunk / 2 high pairs, then low
  Prefetcher<uint16_t> ahead(next_k, next_v, next_n, 2 * ((nq + 5) / 6));
  pack_k(k, n, D, kt);
  const int64_t nb = (n + 15) / 16;
  int64_t i = 0;
  for (; i + 6 <= nq; i += 6) {
    ahead.step(D * 2);
    score_rows<6>(q + i, kt, nb, D, sc, s + i * ld, ld);
  }
  for (; i + 3 <= nq; i += 3) score_rows<3>(q + i, kt, nb, D, sc, s + i * ld, ld);
  for (; i < nq; ++i) score_rows<1>(q + i, kt, nb, D, sc, s + i * ld, ld);
  ahead.step(D * 2);
  softmax_rows(s, ld, nq, n, m, l);
  const int64_t npairs = (n + 1) / 2, padded = (n + 31) / 32 * 32;
  for (i = 0; i < nq; ++i) {  // P rows to bf16 pairs, high and low parts, zero past n
    float* si = s + i * ld;
    for (int64_t j = n; j < padded; ++j) si[j] = 0.f;
    split_row(si, padded, reinterpret_cast<uint16_t*>(pb + i * pld), kChunk);
  }
  pack_v(v, n, D, vp);
  for (i = 0; i + 6 <= nq; i += 6) {
    ahead.step(D * 2);
    for (int64_t cb = 0; cb < D / 32; ++cb) pv_tile<6>(pb + i * pld, pld, vp, npairs, cb, acc + i);
  }
  ahead.step(D * 2, true);
  for (; i + 3 <= nq; i += 3)
    for (int64_t cb = 0; cb < D / 32; ++cb) pv_tile<3>(pb + i * pld, pld, vp, npairs, cb, acc + i);
  for (; i < nq; ++i)
    for (int64_t cb = 0; cb < D / 32; ++cb) pv_tile<1>(pb + i * pld, pld, vp, npairs, cb, acc + i);
}

// rows [rows, D] fp32 to [rows, 2 D] bf16: each row's high part, then its low part (split_row);
// not inlined into callers built without avx512_bf16.
void round_rows(const float* x, int64_t rows, int64_t D, uint16_t* out) {
  for (int64_t i = 0; i < rows; ++i, x += D, out += 2 * D) split_row(x, D, out, D);
}

}  // namespace bf16
#pragma GCC pop_options
#endif  // SALTSERVE_HAVE_BF16

// bf16 caches on AMX (Sapphire Rapids and later Xeons, where Linux grants the tile registers
// and SALTSERVE_AMX=0 is not set): the same operands (Q and P split into bf16 high and low
// parts, K and V bf16) multiplied on AMX-BF16 tiles, TDPBF16PS with fp32 accumulation, 16 query
// rows a tile. Why: at 16 sequences on a shared prompt, attention on VDPBF16PS takes over half of
// a gguf decode step; a tile multiplies 16 rows x 16 positions x 32 elements in one instruction,
// about 2x VDPBF16PS a layer (docs/benchmarks.md). What is left is mostly not the tiles' dots:
// the softmax and P's split to bf16 cost the most, then the P.V tiles, the score tiles, and
// packing K, Q and V.
// Every row's arithmetic is its own (a C tile row depends only on its A row), in an order
// fixed by positions and columns, so a row's bits still do not depend on its batch or tile.
// Its bits differ from VDPBF16PS's (the order of the two products of a pair, and the sum over
// 16 pairs, are the hardware's), so where AMX runs it runs every bf16 item; the two paths agree
// to fp32 rounding (a test checks both).
// Built where SALTSERVE_HAVE_AMX (amx.h) holds, like q4_vnni.cpp's AMX path.
// bf16amx uses the bf16 path's packing and f32x16::exp512: it needs both built.
#define SALTSERVE_AMX_ATTENTION \
  (SALTSERVE_HAVE_AMX && SALTSERVE_HAVE_BF16 && SALTSERVE_HAVE_AVX512)
#if SALTSERVE_AMX_ATTENTION
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
namespace bf16amx {

constexpr int64_t kTileRows = 16;
using saltserve::TileConfig;

// tmm0, 1, 6, 7: C (16 rows x 16 fp32), four blocks of positions or columns; tmm4 / tmm5: A,
// Q's or P's high / low part (16 rows x 32 bf16); tmm2, 3: B (16 element pairs x 16
// positions or columns). Loaded by each thread before its items (the config is per thread;
// q4_vnni.cpp's kernels load their own); static memory, since GCC's _tile_loadconfig declares
// an 8-byte read.
void begin() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = kTileRows, c.colsb[t] = 64;
    return c;
  }();
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}
void end() { _tile_release(); }

// V rows v[0 .. n) as AMX B tiles for P.V: vb[cb][t][c] = (v_2t[16 cb + c], v_2t+1[16 cb + c])
// as one dword, [ceil(D / 64) 4][kChunk / 2][16]; pairs from n on are zero up to npad / 2, and
// so are the column blocks past D / 16.
inline void pack_v(const uint16_t* const* v, int64_t n, int64_t npad, int64_t D, uint32_t* vb) {
  alignas(64) static constexpr uint16_t kIdx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5,
                                                     37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42,
                                                     11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx = _mm512_load_si512(kIdx);  // word 2c: a's column c, 2c + 1: b's
  for (int64_t cb = 0; cb < (D / 16 + 3) / 4 * 4; ++cb)
    for (int64_t t = 0; 2 * t < npad; ++t) {
      if (cb >= D / 16) {
        _mm512_storeu_si512(vb + (cb * (kChunk / 2) + t) * 16, _mm512_setzero_si512());
        continue;
      }
      const __m512i a = 2 * t < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(v[2 * t] + 16 * cb)))
                                  : _mm512_setzero_si512();
      const __m512i b = 2 * t + 1 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(v[2 * t + 1] + 16 * cb)))
                                      : _mm512_setzero_si512();
      _mm512_storeu_si512(vb + (cb * (kChunk / 2) + t) * 16, _mm512_permutex2var_epi16(a, idx, b));
    }
}

// Each row's softmax numerators over its n scores (s * sc, the row max in *m[i], their sum
// in *l[i]), written as P's bf16 high and low parts (hi = bf16(e), lo = bf16(e - hi)) to p16
// row i: [0, npad) high, [kChunk, kChunk + npad) low; positions n .. npad are 0. Spare rows
// nq .. rows are zero. One pass a row, 16 positions a register: exp512 (exp256's polynomial),
// the sum in four accumulators (16-position blocks j with j % 4 = a, then ((a0 + a1) + (a2 +
// a3)) and the lanes' tree), so no serial chain of adds through the row.
inline void softmax_split(const float* s, int64_t nq, int64_t rows, int64_t n, int64_t npad,
                          float sc, uint16_t* p16, float* const* m, float* const* l) {
  const __m512 scv = _mm512_set1_ps(sc), ninf = _mm512_set1_ps(-INFINITY);
  const int64_t nv = npad / 16;  // registers a row (npad <= kChunk: at most 8)
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* hi = p16 + i * 2 * kChunk;
    uint16_t* lo = hi + kChunk;
    if (i >= nq) {
      std::memset(hi, 0, 2 * kChunk * sizeof(uint16_t));
      continue;
    }
    const float* si = s + i * kChunk;
    __m512 x[kChunk / 16];
    __mmask16 live[kChunk / 16];
    __m512 mx = ninf;
    for (int64_t j = 0; j < nv; ++j) {
      const int64_t left = n - 16 * j;
      live[j] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      x[j] = _mm512_mask_mul_ps(ninf, live[j], _mm512_maskz_loadu_ps(live[j], si + 16 * j), scv);
      mx = _mm512_max_ps(mx, x[j]);
    }
    const float rmax = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(rmax);
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int64_t j = 0; j < nv; ++j) {
      // exp512 clamps at -88.4 (a denormal, not 0): padding is set to 0 outright
      const __m512 e = _mm512_maskz_mov_ps(live[j], f32x16::exp512(_mm512_sub_ps(x[j], mv)));
      sum[j % 4] = _mm512_add_ps(sum[j % 4], e);
      const __m256bh h = _mm512_cvtneps_pbh(e);
      const __m512 rest = _mm512_sub_ps(e, _mm512_cvtpbh_ps(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + 16 * j), (__m256i)h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(rest));
    }
    *m[i] = rmax;
    *l[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]),
                                               _mm512_add_ps(sum[2], sum[3])));
  }
}

// bf16::partial's outputs on AMX tiles. q: nq rows of 2 D bf16 (high part, then low); qa
// scratch [ceil(nq / 16) 16, 2 D] bf16; s scratch [ceil(nq / 16) 16, kChunk] fp32; pb scratch
// as many rows of kChunk dwords (P's high part, then its low part, as bf16); kt [D / 2,
// kChunk / 16] zmm (bf16::pack_k); vb [ceil(D / 64) 4, kChunk / 2, 16] dwords; cbuf [16, 64]
// fp32.
void partial(const uint16_t* const* q, int64_t nq, const uint16_t* const* k,
             const uint16_t* const* v, int64_t n, int64_t D, float sc, float* s, uint16_t* qa,
             uint32_t* pb, __m512i* kt, uint32_t* vb, float* cbuf, float* const* m,
             float* const* l, float* const* acc, const uint16_t* const* next_k,
             const uint16_t* const* next_v, int64_t next_n) {
  constexpr int64_t ld = kChunk;
  const int64_t tiles = (nq + kTileRows - 1) / kTileRows, rows = tiles * kTileRows;
  Prefetcher<uint16_t> ahead(next_k, next_v, next_n, 2 * tiles);
  for (int64_t i = 0; i < rows; ++i) {  // Q rows packed, the last tile's spare rows zero
    uint16_t* dst = qa + i * 2 * D;
    if (i < nq) std::memcpy(dst, q[i], 2 * D * sizeof(uint16_t));
    else std::memset(dst, 0, 2 * D * sizeof(uint16_t));
  }
  bf16::pack_k(k, n, D, kt);
  // The tile loads below are asm without a memory operand: this keeps the stores to qa and kt
  // above them (as q4_vnni.cpp does before its tile loads).
  asm volatile("" ::: "memory");
  const int64_t nb = (n + 15) / 16, npad = (n + 31) / 32 * 32;
  // Scores: C = sum over 32-element blocks e of Q_hi K + Q_lo K (* sc in softmax_split); four
  // blocks of 16 positions at a time (C in tmm0, 1, 6, 7: four independent chains; past nb they score the
  // zero or stale rows of kt into s's own spare columns, never read).
  for (int64_t t0 = 0; t0 < tiles; ++t0) {
    ahead.step(D * 2);
    const uint16_t* qt = qa + t0 * kTileRows * 2 * D;
    float* st = s + t0 * kTileRows * ld;
    for (int64_t b = 0; b < nb; b += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t e = 0; e < D / 32; ++e) {
        const __m512i* kb = kt + 16 * e * (kChunk / 16) + b;
        _tile_loadd(4, qt + 32 * e, 2 * D * 2);
        _tile_loadd(5, qt + D + 32 * e, 2 * D * 2);
        _tile_loadd(2, kb, kChunk * 4);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(0, 5, 2);
        _tile_loadd(3, kb + 1, kChunk * 4);
        _tile_dpbf16ps(1, 4, 3);
        _tile_dpbf16ps(1, 5, 3);
        _tile_loadd(2, kb + 2, kChunk * 4);
        _tile_dpbf16ps(6, 4, 2);
        _tile_dpbf16ps(6, 5, 2);
        _tile_loadd(3, kb + 3, kChunk * 4);
        _tile_dpbf16ps(7, 4, 3);
        _tile_dpbf16ps(7, 5, 3);
      }
      _tile_stored(0, st + 16 * b, ld * 4);
      _tile_stored(1, st + 16 * (b + 1), ld * 4);
      _tile_stored(6, st + 16 * (b + 2), ld * 4);
      _tile_stored(7, st + 16 * (b + 3), ld * 4);
    }
  }
  uint16_t* p16 = reinterpret_cast<uint16_t*>(pb);  // row i: kChunk high, then kChunk low
  softmax_split(s, nq, rows, n, npad, sc, p16, m, l);
  pack_v(v, n, npad, D, vb);
  asm volatile("" ::: "memory");  // the stores to p16 and vb stay above the tile loads
  // P.V: four blocks of 16 columns at a time (C in tmm0, 1, 6, 7), sum over 32-position
  // blocks e of P_hi V + P_lo V; vb has zero columns up to a multiple of 64 (pack_v).
  for (int64_t t0 = 0; t0 < tiles; ++t0) {
    ahead.step(D * 2, t0 + 1 == tiles);
    const uint16_t* pt = p16 + t0 * kTileRows * 2 * kChunk;
    const int64_t live = std::min(kTileRows, nq - t0 * kTileRows);
    for (int64_t cb = 0; cb < D / 16; cb += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t e = 0; e < npad / 32; ++e) {
        const uint32_t* vt = vb + (cb * (kChunk / 2) + 16 * e) * 16;
        constexpr int64_t next = kChunk / 2 * 16;  // dwords from one column block to the next
        _tile_loadd(4, pt + 32 * e, 2 * kChunk * 2);
        _tile_loadd(5, pt + kChunk + 32 * e, 2 * kChunk * 2);
        _tile_loadd(2, vt, 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(0, 5, 2);
        _tile_loadd(3, vt + next, 64);
        _tile_dpbf16ps(1, 4, 3);
        _tile_dpbf16ps(1, 5, 3);
        _tile_loadd(2, vt + 2 * next, 64);
        _tile_dpbf16ps(6, 4, 2);
        _tile_dpbf16ps(6, 5, 2);
        _tile_loadd(3, vt + 3 * next, 64);
        _tile_dpbf16ps(7, 4, 3);
        _tile_dpbf16ps(7, 5, 3);
      }
      _tile_stored(0, cbuf, 256);
      _tile_stored(1, cbuf + 16, 256);
      _tile_stored(6, cbuf + 32, 256);
      _tile_stored(7, cbuf + 48, 256);
      const int64_t cols = std::min<int64_t>(64, D - 16 * cb);
      for (int64_t r = 0; r < live; ++r)
        std::memcpy(acc[t0 * kTileRows + r] + 16 * cb, cbuf + 64 * r, cols * sizeof(float));
    }
  }
}

}  // namespace bf16amx
#pragma GCC pop_options
#endif  // SALTSERVE_AMX_ATTENTION

// Whether bf16 caches run on AMX tiles here (bf16amx): built, a CPU with amx-tile and amx-bf16,
// the tile registers granted by Linux (arch_prctl ARCH_REQ_XCOMP_PERM, asked once), and
// SALTSERVE_AMX=0 not set (read once, as the int8 kernels do).
bool amx_bf16_supported() {
#if SALTSERVE_AMX_ATTENTION
  static const bool ok = [] {
    const char* e = std::getenv("SALTSERVE_AMX");
    if (e && std::strcmp(e, "0") == 0) return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16"))
      return false;
    return saltserve::request_tile_data();
  }();
  return ok;
#else
  return false;
#endif
}
std::atomic<int> amx_bf16_on{-1};

}  // namespace

// bf16 caches' AMX path's switch (path_switch).
bool attention_amx(int64_t enabled) {
  return path_switch(amx_bf16_on, enabled, amx_bf16_supported());
}

// Whether bf16 caches run here: the bf16 path built, and a CPU with avx512_bf16.
bool bf16_kv_cache() {
#if SALTSERVE_HAVE_BF16
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

namespace {

struct Group {
  int64_t seq, chunk, n;           // the table and chunk it is read through, its length
  std::vector<int64_t> members;    // index into seqs of each sequence that shares it
};
struct Scratch {
  std::vector<int64_t> seqs, first;  // decode sequences; index of each one's first chunk slot
  std::vector<Group> groups;         // the plan's first groups (kept across calls); items name them
  std::vector<int32_t> keys;         // each group's key, flat: keys[key_at[u] ..]
  std::vector<int64_t> key_at, table;  // table: open addressing over key hashes, -1 empty
  std::vector<float> pm, pl, pacc;
  std::vector<std::pair<int64_t, int64_t>> items;
  // The plan above (seqs .. items, slots) was made for these inputs: a decode step
  // calls this once a layer with the same rows and tables, so layers 2 .. L reuse layer 1's
  // (its grouping costs about 24 us a layer at 16 sequences on a 1,750-token prefix).
  std::vector<int32_t> made_for;  // S, MB, BS, KVH, then qsl, lens and tables
  int64_t slots = 0;  // partial slots: every decode sequence's chunks
};

// The plan of a call, stored in w with the inputs it was made for (decode_attention's, checked
// there): the chunks of every decode sequence, and which of them read the same cache rows (a
// chunk's key is its index, its length, its offset in its first block and the block ids under
// it: positions c * kChunk .. + n of that table; the index keeps each member's partial in its
// own slot first[i] + c even for tables that hold one block at two logical places); then the
// work items (group, kv head), the largest first.
void make_plan(Scratch& w, const int32_t* qsl, const int32_t* lens, const int32_t* tables,
               int64_t S, int64_t MB, int64_t BS, int64_t KVH, const int32_t* shape) {
  std::vector<int64_t>& seqs = w.seqs;
  std::vector<int64_t>& first = w.first;
  std::vector<Group>& groups = w.groups;
  std::vector<std::pair<int64_t, int64_t>>& items = w.items;
  w.made_for.clear();  // no plan until this one is whole (an allocation may throw)
  seqs.clear(), first.clear(), items.clear();
  int64_t slots = 0, ngroups = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (qsl[s + 1] - qsl[s] != 1) continue;
    seqs.push_back(s);
    first.push_back(slots);
    slots += (lens[s] + kChunk - 1) / kChunk;
  }
  int64_t cap = 16;
  while (cap < 2 * slots) cap *= 2;
  w.table.assign(cap, -1);
  w.keys.clear(), w.key_at.clear();
  int32_t key[4 + kChunk];  // chunk, length, offset in the first block, then its blocks
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    const int64_t s = seqs[i], L = lens[s];
    for (int64_t c = 0; c * kChunk < L; ++c) {
      const int64_t p0 = c * kChunk, n = std::min(kChunk, L - p0);
      const int64_t b0 = p0 / BS, b1 = (p0 + n - 1) / BS;
      const int64_t klen = 3 + b1 - b0 + 1;  // a chunk spans at most kChunk blocks
      key[0] = static_cast<int32_t>(c), key[1] = static_cast<int32_t>(n);
      key[2] = static_cast<int32_t>(p0 % BS);
      std::memcpy(key + 3, tables + s * MB + b0, (b1 - b0 + 1) * sizeof(int32_t));
      uint64_t h = 1469598103934665603ull;  // FNV-1a over the key's ints
      for (int64_t x = 0; x < klen; ++x) h = (h ^ static_cast<uint32_t>(key[x])) * 1099511628211ull;
      int64_t at = static_cast<int64_t>(h & static_cast<uint64_t>(cap - 1)), u;
      for (;; at = (at + 1) & (cap - 1)) {
        u = w.table[at];
        if (u < 0) break;
        const int32_t* k = w.keys.data() + w.key_at[u];
        if (k[0] == klen && std::memcmp(k + 1, key, klen * sizeof(int32_t)) == 0) break;
      }
      if (u < 0) {  // a chunk not seen yet: a new group
        u = ngroups++;
        w.table[at] = u;
        w.key_at.push_back(static_cast<int64_t>(w.keys.size()));
        w.keys.push_back(static_cast<int32_t>(klen));
        w.keys.insert(w.keys.end(), key, key + klen);
        if (static_cast<int64_t>(groups.size()) < ngroups) groups.emplace_back();
        groups[u].seq = s, groups[u].chunk = c, groups[u].n = n;
        groups[u].members.clear();
      }
      groups[u].members.push_back(i);
    }
  }
  // Work items (group, kv head), the largest first, taken in turn by each thread.
  items.clear();
  for (int64_t u = 0; u < ngroups; ++u)
    for (int64_t h = 0; h < KVH; ++h) items.emplace_back(u, h);
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
    return groups[a.first].members.size() * groups[a.first].n >
           groups[b.first].members.size() * groups[b.first].n;
  });
  w.slots = slots;
  w.made_for.assign(shape, shape + 4);
  w.made_for.insert(w.made_for.end(), qsl, qsl + S + 1);
  w.made_for.insert(w.made_for.end(), lens, lens + S);
  w.made_for.insert(w.made_for.end(), tables, tables + S * MB);
}

}  // namespace

void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes()
                  && out.sizes() == query.sizes(),
              "decode_attention: query/out [T, H, D] and caches [blocks, block_size, KVH, D]");
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && D % 8 == 0 && KVH > 0 && H % KVH == 0,
              "decode_attention: head_dim a multiple of 8, num_heads a multiple of num_kv_heads");
  const bool half = key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  (key_cache.scalar_type() == at::kFloat || half) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "decode_attention: float32 query and out, float32 or bfloat16 caches");
  TORCH_CHECK(!half || (bf16_kv_cache() && D % 32 == 0),
              "decode_attention: bfloat16 caches need avx512_bf16 and a head_dim multiple of 32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "decode_attention: int32 query_start_loc, seq_lens and block_tables expected");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous()
                  && out.is_contiguous() && block_tables.is_contiguous() &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "decode_attention: contiguous inputs only");
  const int64_t S = seq_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(query_start_loc.size(0) == S + 1 && block_tables.size(0) == S,
              "decode_attention: query_start_loc [S + 1] and block_tables [S, max_blocks]");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t NB = key_cache.size(0);
  for (int64_t s = 0; s < S; ++s) {
    if (qsl[s + 1] - qsl[s] != 1) continue;
    TORCH_CHECK(lens[s] > 0 && lens[s] <= MB * BS && qsl[s] >= 0 && qsl[s] < query.size(0),
                "decode_attention: a seq_len outside its block table or a row outside query");
    for (int64_t b = 0; b < (lens[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tables[s * MB + b] >= 0 && tables[s * MB + b] < NB,
                  "decode_attention: block id out of range");
  }
  const float* q = query.data_ptr<float>();
  const float* kc = half ? nullptr : key_cache.data_ptr<float>();
  const float* vc = half ? nullptr : value_cache.data_ptr<float>();
  const uint16_t* kb = half ? reinterpret_cast<const uint16_t*>(key_cache.data_ptr()) : nullptr;
  const uint16_t* vb = half ? reinterpret_cast<const uint16_t*>(value_cache.data_ptr()) : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t G = H / KVH;
  const float sc = static_cast<float>(scale);

  // Working memory and the plan (make_plan), kept by the calling thread across calls (a decode
  // step calls this once a layer): no allocation per call once it has seen the step's size,
  // and the plan made again only for other rows or tables.
  thread_local Scratch w;
  std::vector<int64_t>& seqs = w.seqs;
  std::vector<int64_t>& first = w.first;
  std::vector<Group>& groups = w.groups;
  std::vector<std::pair<int64_t, int64_t>>& items = w.items;
  const int32_t shape[4] = {static_cast<int32_t>(S), static_cast<int32_t>(MB),
                            static_cast<int32_t>(BS), static_cast<int32_t>(KVH)};
  const auto same_inputs = [&] {
    const int32_t* f = w.made_for.data();
    return static_cast<int64_t>(w.made_for.size()) == 4 + (S + 1) + S + S * MB &&
           std::memcmp(f, shape, sizeof shape) == 0 &&
           std::memcmp(f + 4, qsl, (S + 1) * sizeof(int32_t)) == 0 &&
           std::memcmp(f + 5 + S, lens, S * sizeof(int32_t)) == 0 &&
           std::memcmp(f + 5 + 2 * S, tables, S * MB * sizeof(int32_t)) == 0;
  };
  if (!same_inputs()) make_plan(w, qsl, lens, tables, S, MB, BS, KVH, shape);
  if (seqs.empty()) return;
  const int64_t slots = w.slots;
  // Partials [slot, kvh, g]: m, l and acc[D]; slot = first[i] + chunk. Not cleared: each
  // (slot, kvh, g) is written by exactly one work item before the merge reads it.
  if (static_cast<int64_t>(w.pm.size()) < slots * KVH * G)
    w.pm.resize(slots * KVH * G), w.pl.resize(slots * KVH * G);
  if (static_cast<int64_t>(w.pacc.size()) < slots * KVH * G * D) w.pacc.resize(slots * KVH * G * D);
  float* const pm = w.pm.data();
  float* const pl = w.pl.data();
  float* const pacc = w.pacc.data();
  // bf16 caches: the query rows split into bf16 high and low parts once, for every work item
  // that reads them.
  // Row i of seqs (a decode row) at qh + 2 i H D: H heads of D high then D low parts.
  thread_local std::vector<uint16_t> qround;
  const uint16_t* qh = nullptr;
#if SALTSERVE_HAVE_BF16
  if (half) {
    qround.resize(2 * seqs.size() * H * D);
    for (size_t i = 0; i < seqs.size(); ++i)
      bf16::round_rows(q + qsl[seqs[i]] * H * D, H, D, qround.data() + 2 * i * H * D);
    qh = qround.data();
  }
#endif
  // Items [0, nthreads) are the threads' first (each thread's own indices of parallel_for, so a
  // thread that starts early cannot also take a late one's first item); then they are taken in
  // turn from next.
  // fp32 caches on the AVX-512 tiles (items of kWideRows rows or more)
  [[maybe_unused]] const bool wide = !half && attention_avx512(-1);
  // bf16 caches on AMX tiles (bf16amx), every item of the call
  [[maybe_unused]] const bool amx = half && attention_amx(-1);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{nthreads};
  at::parallel_for(0, nthreads, 1, [&](int64_t own, int64_t own_end) {
    auto claim = [&]() -> int64_t { return own < own_end ? own++ : next.fetch_add(1); };
    struct Rows {  // each thread's own, kept across calls
      std::vector<const float*> qr, kr, vr, next_kr, next_vr;             // float32 caches
      std::vector<const uint16_t*> qh, kh, vh, next_kh, next_vh;          // bfloat16 caches
      std::vector<float*> mr, lr, ar;
      std::vector<float> sbuf, q2, cbuf;
      std::vector<uint16_t> qa;
      std::vector<uint32_t> pb, vb;
      std::vector<__m512i> kt, vp;
    };
    thread_local Rows r;
    r.kr.resize(kChunk), r.vr.resize(kChunk), r.next_kr.resize(kChunk), r.next_vr.resize(kChunk);
    r.kh.resize(kChunk), r.vh.resize(kChunk), r.next_kh.resize(kChunk), r.next_vh.resize(kChunk);
    // Item it's K and V row pointers (positions chunk * kChunk + j of its table, kv head kvh).
    auto rows_of = [&](int64_t it, auto* k0, auto* v0, auto& kr, auto& vr) {
      const Group& grp = groups[items[it].first];
      const int64_t kvh = items[it].second;
      const int32_t* table = tables + grp.seq * MB;
      for (int64_t j = 0; j < grp.n; ++j) {
        const int64_t p = grp.chunk * kChunk + j;
        const int64_t off = ((table[p / BS] * BS + p % BS) * KVH + kvh) * D;
        kr[j] = k0 + off;
        vr[j] = v0 + off;
      }
      return grp.n;
    };
    // Each item's K and V lines are asked for while the item before it computes (its rows sit
    // kvh * D apart in the cache, a row a position: demand misses one at a time would leave
    // the score tiles waiting). The thread claims its next item before computing this one.
    const int64_t row_bytes = D * key_cache.element_size();
    int64_t it = claim();
    if (it < num_items) {
      const int64_t n = half ? rows_of(it, kb, vb, r.kh, r.vh) : rows_of(it, kc, vc, r.kr, r.vr);
      if (half) prefetch_rows(r.kh.data(), n, row_bytes), prefetch_rows(r.vh.data(), n, row_bytes);
      else prefetch_rows(r.kr.data(), n, row_bytes), prefetch_rows(r.vr.data(), n, row_bytes);
    }
#if SALTSERVE_AMX_ATTENTION
    struct Tiles {  // configured for this thread's items, released however the loop ends
      bool on;
      ~Tiles() {
        if (on) bf16amx::end();
      }
    } tiles{amx && it < num_items};
    if (tiles.on) bf16amx::begin();
#endif
    while (it < num_items) {
      const int64_t nx = claim();
      const int64_t next_n = nx >= num_items ? 0
                             : half ? rows_of(nx, kb, vb, r.next_kh, r.next_vh)
                                    : rows_of(nx, kc, vc, r.next_kr, r.next_vr);
      const Group& grp = groups[items[it].first];
      const int64_t kvh = items[it].second;
      r.qr.clear(), r.qh.clear(), r.mr.clear(), r.lr.clear(), r.ar.clear();
      for (const int64_t i : grp.members) {
        const int64_t row = qsl[seqs[i]];
        const int64_t slot = ((first[i] + grp.chunk) * KVH + kvh) * G;
        for (int64_t g = 0; g < G; ++g) {
          if (half) r.qh.push_back(qh + 2 * (i * H + kvh * G + g) * D);
          else r.qr.push_back(q + (row * H + kvh * G + g) * D);
          r.mr.push_back(pm + slot + g);
          r.lr.push_back(pl + slot + g);
          r.ar.push_back(pacc + (slot + g) * D);
        }
      }
      const int64_t nq = static_cast<int64_t>(r.mr.size());
      r.sbuf.resize(nq * kChunk);
      if (half) {
#if SALTSERVE_AMX_ATTENTION
        if (amx) {
          const int64_t rows = (nq + 15) / 16 * 16;
          r.sbuf.resize(rows * kChunk), r.pb.resize(rows * kChunk), r.qa.resize(rows * 2 * D);
          r.kt.resize(D / 2 * kChunk / 16), r.vb.resize((D + 63) / 64 * 64 * kChunk / 2);
          r.cbuf.resize(16 * 64);
          bf16amx::partial(r.qh.data(), nq, r.kh.data(), r.vh.data(), grp.n, D, sc,
                           r.sbuf.data(), r.qa.data(), r.pb.data(), r.kt.data(), r.vb.data(),
                           r.cbuf.data(), r.mr.data(), r.lr.data(), r.ar.data(),
                           r.next_kh.data(), r.next_vh.data(), next_n);
          std::swap(r.kh, r.next_kh), std::swap(r.vh, r.next_vh);
          it = nx;
          continue;
        }
#endif
#if SALTSERVE_HAVE_BF16
        r.pb.resize(nq * kChunk);
        r.kt.resize(D / 2 * kChunk / 16), r.vp.resize(D / 32 * kChunk);
        bf16::partial(r.qh.data(), nq, r.kh.data(), r.vh.data(), grp.n, D, sc, r.sbuf.data(),
                      r.pb.data(), r.kt.data(), r.vp.data(), r.mr.data(), r.lr.data(), r.ar.data(),
                      r.next_kh.data(), r.next_vh.data(), next_n);
#endif
        std::swap(r.kh, r.next_kh), std::swap(r.vh, r.next_vh);
      } else {
#if SALTSERVE_HAVE_AVX512
        if (wide && nq >= kWideRows) {
          r.q2.resize(nq * D);
          f32x16::partial(r.qr.data(), nq, r.kr.data(), r.vr.data(), grp.n, D, sc,
                          r.sbuf.data(), r.q2.data(), r.mr.data(), r.lr.data(), r.ar.data(),
                          r.next_kr.data(), r.next_vr.data(), next_n);
        } else
#endif
          partial(r.qr.data(), nq, r.kr.data(), r.vr.data(), grp.n, D, sc, r.sbuf.data(),
                  r.mr.data(), r.lr.data(), r.ar.data(), r.next_kr.data(), r.next_vr.data(),
                  next_n);
        std::swap(r.kr, r.next_kr), std::swap(r.vr, r.next_vr);
      }
      it = nx;
    }
  });
  // Merge each row's partials in chunk order: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
  const int64_t ns = static_cast<int64_t>(seqs.size());
  at::parallel_for(0, ns * KVH, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> num;
    num.resize(D);
    for (int64_t wi = w0; wi < w1; ++wi) {
      const int64_t i = wi / KVH, kvh = wi % KVH, s = seqs[i];
      const int64_t nc = (lens[s] + kChunk - 1) / kChunk;
      for (int64_t g = 0; g < G; ++g) {
        auto at = [&](int64_t c) { return ((first[i] + c) * KVH + kvh) * G + g; };
        float mx = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) mx = pm[at(c)] > mx ? pm[at(c)] : mx;
        float den = 0.f;
        std::fill(num.begin(), num.end(), 0.f);
        for (int64_t c = 0; c < nc; ++c) {
          const float f = std::exp(pm[at(c)] - mx);
          den += f * pl[at(c)];
          const __m256 fv = _mm256_set1_ps(f);
          const float* a = pacc + at(c) * D;
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(num.data() + d, _mm256_fmadd_ps(fv, _mm256_loadu_ps(a + d),
                                                             _mm256_loadu_ps(num.data() + d)));
        }
        const __m256 inv = _mm256_set1_ps(1.f / den);
        float* og = o + (qsl[s] * H + kvh * G + g) * D;
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(og + d, _mm256_mul_ps(_mm256_loadu_ps(num.data() + d), inv));
      }
    }
  });
  // A step of many long rows (2,048 prefill rows over 8 K positions: 600 MB of partials, 260 K
  // groups) must not stay on the thread's heap for good: only an ordinary step's is kept.
  if (w.pacc.capacity() * sizeof(float) > kKeepBytes || w.groups.size() > kKeepGroups)
    w = Scratch(), qround = std::vector<uint16_t>();
}

}  // namespace saltserve_cpu
