// What the CPU kernels share: the one fixed reduction of 8 fp32 lanes (every kernel reduces its
// accumulators with it, so a result never depends on which kernel variant produced the lanes), 8
// lanes loaded from fp32 or bf16 and rounded to bf16, and one vector exp.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string>

// The fp32 kernels' 512-bit variants (attention, layer operations) are compiled in every build with
// AVX2 + FMA, as functions targeting AVX-512F whatever the build's flags, and chosen at run time.
#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__)
#define MCSD_HAVE_512F 1
#define MCSD_TARGET_512F __attribute__((target("avx512f")))
#endif

namespace mcsd {

// Whether this build has the fp32 kernels' 512-bit variants and the CPU can run them (AVX-512F).
inline bool cpu_has_avx512f() {
#if defined(MCSD_HAVE_512F)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// Whether the fp32 kernels (attention, layer operations) run 16 lanes at a time: where the CPU has
// AVX-512F, unless MCSD_CPU_ISA is avx2 or avxvnni (read once) or torch.ops.mcsd_cpu.vector_isa
// switches them.  Every such variant computes each lane by the 8-lane code's operations, so both widths give the same bits;
// the switch is for timing and tests.  One flag for the whole library (an inline function's static).
inline std::atomic<bool>& wide_vectors() {
  static std::atomic<bool> wide{[] {
    const char* set = std::getenv("MCSD_CPU_ISA");
    const std::string env = set != nullptr ? set : "";
    return cpu_has_avx512f() && env != "avx2" && env != "avxvnni";
  }()};
  return wide;
}

}  // namespace mcsd

#if defined(__AVX2__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace mcsd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 -> the nearest bf16 (ties to even, as c10::BFloat16 rounds), kept in fp32: the bits below the
// top 16 rounded away.  NaN stays NaN (the quiet NaN c10 gives).
inline __m256 round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}
// 8 values already rounded by round_bf16 stored as bf16 (their top halves).
inline void store_bf16(c10::BFloat16* p, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float reduce_lanes(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// exp(x): 0 below -87, +inf above 88; else x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial (relative error under 2e-7), times 2^n through the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 hi = _mm256_set1_ps(88.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), over);
}

#if defined(MCSD_HAVE_512F)
// The 16-lane twins of load8, exp8, round_bf16 and store_bf16: the same operations per lane.
MCSD_TARGET_512F inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MCSD_TARGET_512F inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
MCSD_TARGET_512F inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(e));  // andnot
  return _mm512_mask_blend_ps(over, y, _mm512_set1_ps(__builtin_inff()));
}
MCSD_TARGET_512F inline __m512 round_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r),
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}
MCSD_TARGET_512F inline void store_bf16_16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif

}  // namespace mcsd
#endif
