// Paged decode attention for CPU (vLLM's paged_attention_v1 CPU op, for fp32): every sequence
// with one new token attends over its context straight through its block table.
//
// Why: the torch backend gathered each sequence's K and V rows into new tensors (aten::index,
// twice a layer) and then ran SDPA, about 70 us a layer at short contexts for ~10 us of
// arithmetic: 2 ms of a ~20 ms single-stream gguf decode step (issue 15).
//
// Layouts (engine/attention/metadata.py):
//   query, out:  [num_tokens, num_heads, head_dim] fp32
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32
//   query_start_loc [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, max_blocks]
//   int32. Sequences whose query_len is not 1 are skipped (their out rows are not written).
// Per (sequence, kv head): the scores of its num_heads / num_kv_heads query heads over all
// seq_len positions, a max-subtracted softmax in fp32 (exp: Cephes' polynomial, about 1 ulp;
// weights below exp(-88) count as 0), then the weighted sum of V. A sequence's result does not
// depend on its batch.
// Scores are taken four positions at a time (four independent FMA chains instead of one) and the
// weighted sum of V keeps 64 output columns in eight registers; both sum in the same order as the
// one-position loop, so the results are bit-identical to it. At a 1,550-token context a call
// takes 134 us a layer on 2 threads, against 245 us for the one-chain loop (1.8x, interleaved).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// exp(x) for 8 lanes (Cephes expf; x clamped to [-88.37, 88.37]).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum(acc);
}

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
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
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
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t G = H / KVH;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, S * KVH, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    std::vector<float> acc(D);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t s = w / KVH, kvh = w % KVH;
      if (qsl[s + 1] - qsl[s] != 1) continue;
      const int64_t L = lens[s], row = qsl[s];
      scores.resize(G * L);
      const int32_t* table = tables + s * MB;
      const float* qh = q + (row * H + kvh * G) * D;  // this kv head's G query heads
      // Position p's row of this kv head in a cache (K or V), through the block table.
      auto at = [&](const float* cache, int64_t p) {
        return cache + ((table[p / BS] * BS + p % BS) * KVH + kvh) * D;
      };
      int64_t pk = 0;
      for (; pk + 4 <= L; pk += 4) {  // four positions at once: four independent FMA chains
        const float *k0 = at(kc, pk), *k1 = at(kc, pk + 1), *k2 = at(kc, pk + 2),
                    *k3 = at(kc, pk + 3);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
          }
          float* sg = scores.data() + g * L + pk;
          sg[0] = hsum(a0) * sc, sg[1] = hsum(a1) * sc, sg[2] = hsum(a2) * sc;
          sg[3] = hsum(a3) * sc;
        }
      }
      for (; pk < L; ++pk)  // the same sum, in the same order, one position at a time
        for (int64_t g = 0; g < G; ++g) scores[g * L + pk] = dot(qh + g * D, at(kc, pk), D) * sc;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t p = 0; p < L; ++p) mx = std::fmax(mx, sg[p]);
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t p = 0;
        for (; p + 8 <= L; p += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + p), mv));
          _mm256_storeu_ps(sg + p, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        if (p < L) {  // the tail through the same exp, padded
          alignas(32) float tail[8];
          for (int64_t i = 0; i < 8; ++i) tail[i] = p + i < L ? sg[p + i] - mx : -INFINITY;
          _mm256_store_ps(tail, exp256(_mm256_load_ps(tail)));
          for (int64_t i = 0; p + i < L; ++i) {
            sg[p + i] = tail[i];
            sum += tail[i];
          }
        }
        const __m256 inv = _mm256_set1_ps(1.f / sum);
        float* og = o + (row * H + kvh * G + g) * D;
        // sum_p w[p] * v[p] in position order, per element: 64 columns at a time in eight
        // registers (the accumulators never round-trip through memory), the rest through acc.
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {
          __m256 a[8];
          for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
          for (int64_t pp = 0; pp < L; ++pp) {
            const float* v = at(vc, pp) + d0;
            const __m256 wv = _mm256_set1_ps(sg[pp]);
            for (int j = 0; j < 8; ++j)
              a[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8 * j), a[j]);
          }
          for (int j = 0; j < 8; ++j)
            _mm256_storeu_ps(og + d0 + 8 * j, _mm256_mul_ps(a[j], inv));
        }
        if (d0 < D) {
          std::fill(acc.begin() + d0, acc.end(), 0.f);
          for (int64_t pp = 0; pp < L; ++pp) {
            const float* v = at(vc, pp);
            const __m256 wv = _mm256_set1_ps(sg[pp]);
            for (int64_t d = d0; d < D; d += 8)
              _mm256_storeu_ps(acc.data() + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + d),
                                                              _mm256_loadu_ps(acc.data() + d)));
          }
          for (int64_t d = d0; d < D; d += 8)
            _mm256_storeu_ps(og + d, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + d), inv));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(saltserve_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(saltserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
