// Rotary embedding in place and the K/V cache write for the CPU decode step (vLLM's
// rotary_embedding and reshape_and_cache CPU ops), fp32.
//
// Why: in torch the neox rotation is six ops (two slices, neg, cat, two muls, add: ~35 us a
// layer at one token) and the cache write two index_copy_ (~16 us), for well under 1 us of
// arithmetic each.
//
// rotary_neox_: x [T, W] (rows may be strided, columns contiguous); the first num_heads heads of
// head_dim columns of each row are rotated in place by cos, sin [T, head_dim]:
//   out[i]        = x[i] * cos[i] + (-x[i + half]) * sin[i]            (i < half)
//   out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half]
// each product and the sum rounded separately (built with -ffp-contract=off): bit-identical to
// the torch formula x * cos + cat(-x[half:], x[:half]) * sin.
// reshape_and_cache: key, value [T, KVH, D] (rows may be strided) into
// key_cache, value_cache [num_blocks, block_size, KVH, D] at slot_mapping [T] int64 (every slot
// must be in the cache: unlike vLLM's, a -1 padding slot is refused, not skipped; the engine's
// slot mappings have no padding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

namespace saltserve_cpu {

void rotary_neox_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == head_dim,
              "rotary_neox_: x [T, W] and cos, sin [T, head_dim] expected");
  TORCH_CHECK(head_dim % 16 == 0 && num_heads > 0 && num_heads * head_dim <= x.size(1),
              "rotary_neox_: head_dim a multiple of 16 and num_heads * head_dim <= W");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary_neox_: float32 only");
  TORCH_CHECK(x.stride(1) == 1 && (x.size(0) < 2 || x.stride(0) >= x.size(1)) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary_neox_: contiguous, non-overlapping rows and contiguous cos/sin expected");
  const int64_t T = x.size(0), stride = x.stride(0), half = head_dim / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* v = xp + t * stride + h * head_dim;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
          const __m256 nb = _mm256_xor_ps(b, _mm256_set1_ps(-0.f));  // torch's neg: the sign bit
          _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(nb, _mm256_loadu_ps(s + i))));
          _mm256_storeu_ps(v + half + i,
                           _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                         _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
        }
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key_cache.dim() == 4 &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "reshape_and_cache: key, value [T, KVH, D] and caches [blocks, block_size, KVH, D]");
  const bool half = key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat &&
                  (key_cache.scalar_type() == at::kFloat || half) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache: float32 rows into float32 or bfloat16 caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "reshape_and_cache: slot_mapping [T] int64 expected");
  const int64_t KVH = key.size(1), D = key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == D && value.stride(2) == 1 &&
                  value.stride(1) == D && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "reshape_and_cache: each row's heads must be contiguous");
  const int64_t T = key.size(0), slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "reshape_and_cache: slot ", sm[t],
                " outside the cache (", slots, " slots)");
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  if (half) {  // rounded to nearest even, as torch's .to(torch.bfloat16)
    at::BFloat16* kh = key_cache.data_ptr<at::BFloat16>();
    at::BFloat16* vh = value_cache.data_ptr<at::BFloat16>();
    const int64_t n = KVH * D;
    for (int64_t t = 0; t < T; ++t) {
      const float* ks = kp + t * key.stride(0);
      const float* vs = vp + t * value.stride(0);
      at::BFloat16* kd = kh + sm[t] * n;
      at::BFloat16* vd = vh + sm[t] * n;
      for (int64_t i = 0; i < n; ++i) kd[i] = at::BFloat16(ks[i]), vd[i] = at::BFloat16(vs[i]);
    }
    return;
  }
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const size_t row = static_cast<size_t>(KVH * D) * sizeof(float);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + sm[t] * KVH * D, kp + t * key.stride(0), row);
    std::memcpy(vc + sm[t] * KVH * D, vp + t * value.stride(0), row);
  }
}

}  // namespace saltserve_cpu
