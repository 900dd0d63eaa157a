// exp for 8 fp32 lanes, shared by our CPU ops (decode_attention.cpp, activation.cpp): Cephes'
// expf polynomial, about 1 ulp; inputs clamped to [-88.37, 88.37]. The coefficients are named
// once here: decode_attention.cpp's exp512 runs the same operations on 16 lanes with them, and
// must give exp256's result lane for lane (its AVX-512 tiles promise the AVX2 bits).
#pragma once

#include <immintrin.h>

namespace saltserve {

namespace exp_coef {
constexpr float kMax = 88.3762626647949f;  // clamp to [-kMax, kMax]
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace exp_coef

inline __m256 exp256(__m256 x) {
  using namespace exp_coef;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-kMax)), _mm256_set1_ps(kMax));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

}  // namespace saltserve
