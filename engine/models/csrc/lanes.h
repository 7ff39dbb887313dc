// What the CPU kernels share: the one fixed reduction of 8 fp32 lanes.  Every kernel reduces its
// accumulators with it, so a result never depends on which kernel variant produced the lanes.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace mcsd {

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float reduce_lanes(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

}  // namespace mcsd
#endif
