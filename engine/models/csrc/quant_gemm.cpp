// GGUF block-quantized weights, multiplied in place:  y[M, N] = x[M, K] @ dequant(W)[N, K]^T  (fp32).
//
// Built with bf16_gemm.cpp into one library by engine/models/cpu_kernels.py; registers
// torch.ops.mcsd_cpu.quant_linear (x, packed weight, type | 256, K, bias?: fp32 math, the result in
// x's dtype), quant_pack / quant_unpack (GGUF rows to packed groups and back), quant_dequantize and
// quant_isa.
//
// Weights.  A GGUF tensor's rows, uint8 [N, row_bytes]: each row is K / B blocks of the type's layout
// (B = 32 for Q4_0, Q4_1, Q5_0, Q8_0; B = 256 for the k-quants Q4_K, Q5_K, Q6_K), exactly as llama.cpp
// writes them.  quant_pack permutes them once, at load time, into groups of 8 rows ("the product"
// below): no conversion of the values, no second copy.
//
// How.  Integer dot products on activations quantized to int8 per 32 or, for the k-quants, per 256
// (see "the product" below); the dequantizers here serve quant_dequantize (embedding rows, tests).
// Dequantized values follow the `gguf` package's formulas (fp32 d * scale * q - dmin * m).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>  // x86 only: the portable build elsewhere uses none of it
#endif

#include "lanes.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ------------------------------------------------------------------------------------ block layouts
// Each dequantizes one block at `b` into `y` (B floats).

void deq_q8_0(const uint8_t* b, float* y) {  // d, int8 qs[32]
  const float d = fp16_to_f32(rd16(b));
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void deq_q4_0(const uint8_t* b, float* y) {  // d, qs[16]: low nibbles are 0..15, high 16..31; (q - 8) d
  const float d = fp16_to_f32(rd16(b));
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(static_cast<int>(qs[j] & 0x0f) - 8) * d;
    y[j + 16] = static_cast<float>(static_cast<int>(qs[j] >> 4) - 8) * d;
  }
}

void deq_q4_1(const uint8_t* b, float* y) {  // d, m, qs[16]; q d + m
  const float d = fp16_to_f32(rd16(b));
  const float m = fp16_to_f32(rd16(b + 2));
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void deq_q5_0(const uint8_t* b, float* y) {  // d, qh (32 fifth bits), qs[16]; (q - 16) d
  const float d = fp16_to_f32(rd16(b));
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10u);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10u);
    y[j] = static_cast<float>(((qs[j] & 0x0f) | h0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | h1) - 16) * d;
  }
}

// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes), as four 32-bit words:
// scales 0-3, scales 4-7, mins 0-3, mins 4-7, one byte each.  Sub-blocks 0-3 keep theirs in the low 6
// bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 have their low 4 bits in bytes 8-11
// (scale: low nibble, min: high nibble) and their top 2 bits in the top 2 bits of bytes 0-3 (scales)
// and 4-7 (mins).
struct KScaleWords {
  uint32_t w[4];
};

inline KScaleWords kscale_words(const uint8_t* q) {
  uint32_t a, b, c;
  std::memcpy(&a, q, 4);
  std::memcpy(&b, q + 4, 4);
  std::memcpy(&c, q + 8, 4);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
  return {{a & low6, (c & low4) | (((a >> 6) & top2) << 4), b & low6, ((c >> 4) & low4) | (((b >> 6) & top2) << 4)}};
}

// The same as bytes sc[8], m[8].
inline void kscale_bytes(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  const KScaleWords k = kscale_words(q);
  std::memcpy(sc, k.w, 8);
  std::memcpy(m, k.w + 2, 8);
}

struct KScales {
  float d1, m1, d2, m2;
};

// The scales and mins of sub-blocks is and is + 1 of a Q4_K / Q5_K super-block, times d and dmin.
inline KScales kscales(float d, float dmin, const uint8_t* scales, int is) {
  uint8_t sc[8], m[8];
  kscale_bytes(scales, sc, m);
  return {d * static_cast<float>(sc[is]), dmin * static_cast<float>(m[is]), d * static_cast<float>(sc[is + 1]),
          dmin * static_cast<float>(m[is + 1])};
}

void deq_q4_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qs[128]
  const float d = fp16_to_f32(rd16(b));
  const float dmin = fp16_to_f32(rd16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    const auto [d1, m1, d2, m2] = kscales(d, dmin, scales, is);
    for (int l = 0; l < 32; ++l) y[j + l] = d1 * static_cast<float>(q[l] & 0x0f) - m1;
    for (int l = 0; l < 32; ++l) y[j + 32 + l] = d2 * static_cast<float>(q[l] >> 4) - m2;
  }
}

void deq_q5_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qh[32], qs[128]
  const float d = fp16_to_f32(rd16(b));
  const float dmin = fp16_to_f32(rd16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
    const auto [d1, m1, d2, m2] = kscales(d, dmin, scales, is);
    for (int l = 0; l < 32; ++l)
      y[j + l] = d1 * static_cast<float>((ql[l] & 0x0f) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l)
      y[j + 32 + l] = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

void deq_q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], int8 scales[16], d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16_to_f32(rd16(b + 208));
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
    // four runs of 32 outputs; within a run of 16 the scale is fixed (plain loops vectorize)
    for (int part = 0; part < 4; ++part) {
      const uint8_t* lo = ql + (part & 1) * 32;
      const int shift_lo = (part >> 1) * 4, shift_hi = part * 2;
      for (int half = 0; half < 2; ++half) {
        const float ds = d * static_cast<float>(sc[half + 2 * part]);
        float* out = y + n + 32 * part + 16 * half;
        for (int l = 0; l < 16; ++l) {
          const int i = 16 * half + l;
          const int q = static_cast<int>(((lo[i] >> shift_lo) & 0x0f) | (((qh[i] >> shift_hi) & 3) << 4)) - 32;
          out[l] = ds * static_cast<float>(q);
        }
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 dequantizers: the same formulas, 8 weights per instruction.  (The scalar ones above are the
// portable build's; within one build every path uses the same one, so results stay batch-invariant.)
inline __m256 u8x8(const uint8_t* p) {  // 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i u8x8i(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i nib_lo(const uint8_t* p) { return _mm256_and_si256(u8x8i(p), _mm256_set1_epi32(0x0f)); }
inline __m256i nib_hi(const uint8_t* p) { return _mm256_srli_epi32(u8x8i(p), 4); }

void vdeq_q8_0(const uint8_t* b, float* y) {
  const __m256 d = _mm256_set1_ps(fp16_to_f32(rd16(b)));
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; j += 8) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j)));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
  }
}

void vdeq_q4_0(const uint8_t* b, float* y) {
  const __m256 d = _mm256_set1_ps(fp16_to_f32(rd16(b)));
  const __m256i eight = _mm256_set1_epi32(8);
  for (int j = 0; j < 16; j += 8) {
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib_lo(b + 2 + j), eight)), d));
    _mm256_storeu_ps(y + 16 + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib_hi(b + 2 + j), eight)), d));
  }
}

void vdeq_q4_1(const uint8_t* b, float* y) {  // q d + m, as two roundings like the scalar one
  const __m256 d = _mm256_set1_ps(fp16_to_f32(rd16(b)));
  const __m256 m = _mm256_set1_ps(fp16_to_f32(rd16(b + 2)));
  for (int j = 0; j < 16; j += 8) {
    _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(nib_lo(b + 4 + j)), d), m));
    _mm256_storeu_ps(y + 16 + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(nib_hi(b + 4 + j)), d), m));
  }
}

inline __m256i bits8(uint32_t word, int first) {  // bits first..first+7 of word, one per lane (0 or 1)
  const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word >> first)), shifts),
                          _mm256_set1_epi32(1));
}

void vdeq_q5_0(const uint8_t* b, float* y) {  // weight i's fifth bit is bit i of qh
  const __m256 d = _mm256_set1_ps(fp16_to_f32(rd16(b)));
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const __m256i sixteen = _mm256_set1_epi32(16);
  for (int j = 0; j < 16; j += 8) {
    const __m256i lo = _mm256_or_si256(nib_lo(b + 6 + j), _mm256_slli_epi32(bits8(qh, j), 4));
    const __m256i hi = _mm256_or_si256(nib_hi(b + 6 + j), _mm256_slli_epi32(bits8(qh, j + 16), 4));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo, sixteen)), d));
    _mm256_storeu_ps(y + 16 + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi, sixteen)), d));
  }
}

// d * sc * q - dmin * m, with d * sc and dmin * m rounded first (as the scalar one)
inline void kquant_run(const __m256i q, float ds, float dm, float* y) {
  _mm256_storeu_ps(y, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(ds), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(dm)));
}

void vdeq_q4_k(const uint8_t* b, float* y) {
  const float d = fp16_to_f32(rd16(b));
  const float dmin = fp16_to_f32(rd16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    const auto [d1, m1, d2, m2] = kscales(d, dmin, scales, is);
    for (int l = 0; l < 32; l += 8) kquant_run(nib_lo(q + l), d1, m1, y + j + l);
    for (int l = 0; l < 32; l += 8) kquant_run(nib_hi(q + l), d2, m2, y + j + 32 + l);
  }
}

void vdeq_q5_k(const uint8_t* b, float* y) {
  const float d = fp16_to_f32(rd16(b));
  const float dmin = fp16_to_f32(rd16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  const __m256i zero = _mm256_setzero_si256(), sixteen = _mm256_set1_epi32(16);
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
    const auto [d1, m1, d2, m2] = kscales(d, dmin, scales, is);
    const __m256i u1 = _mm256_set1_epi32(1 << is), u2 = _mm256_set1_epi32(2 << is);
    for (int l = 0; l < 32; l += 8) {
      const __m256i h = u8x8i(qh + l);
      const __m256i h1 = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h, u1), zero), sixteen);
      const __m256i h2 = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h, u2), zero), sixteen);
      kquant_run(_mm256_add_epi32(nib_lo(ql + l), h1), d1, m1, y + j + l);
      kquant_run(_mm256_add_epi32(nib_hi(ql + l), h2), d2, m2, y + j + 32 + l);
    }
  }
}

void vdeq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16_to_f32(rd16(b + 208));
  const __m256i low4 = _mm256_set1_epi32(0x0f), low2 = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
    for (int part = 0; part < 4; ++part) {
      const uint8_t* lo = ql + (part & 1) * 32;
      const __m128i shift_lo = _mm_cvtsi32_si128((part >> 1) * 4), shift_hi = _mm_cvtsi32_si128(part * 2);
      for (int half = 0; half < 2; ++half) {
        const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[half + 2 * part]));
        for (int l = 0; l < 16; l += 8) {
          const int i = 16 * half + l;
          const __m256i ql4 = _mm256_and_si256(_mm256_srl_epi32(u8x8i(lo + i), shift_lo), low4);
          const __m256i qh2 = _mm256_and_si256(_mm256_srl_epi32(u8x8i(qh + i), shift_hi), low2);
          const __m256i q = _mm256_sub_epi32(_mm256_or_si256(ql4, _mm256_slli_epi32(qh2, 4)), bias);
          _mm256_storeu_ps(y + n + 32 * part + i, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q)));
        }
      }
    }
  }
}
#define DEQ(name) v##name
#else
#define DEQ(name) name
#endif

struct BlockType {
  int64_t id;  // GGMLQuantizationType
  const char* name;
  int block;  // weights per block
  int bytes;  // bytes per block
  void (*deq)(const uint8_t*, float*);
};

constexpr BlockType kTypes[] = {
    {2, "Q4_0", 32, 18, DEQ(deq_q4_0)},    {3, "Q4_1", 32, 20, DEQ(deq_q4_1)},
    {6, "Q5_0", 32, 22, DEQ(deq_q5_0)},    {8, "Q8_0", 32, 34, DEQ(deq_q8_0)},
    {12, "Q4_K", 256, 144, DEQ(deq_q4_k)}, {13, "Q5_K", 256, 176, DEQ(deq_q5_k)},
    {14, "Q6_K", 256, 210, DEQ(deq_q6_k)},
};

const BlockType& block_type(int64_t id) {
  for (const auto& t : kTypes)
    if (t.id == id) return t;
  TORCH_CHECK(false, "quant_linear: unsupported GGML block type ", id,
              " (supported: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)");
}

const BlockType& check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  const BlockType& t = block_type(type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quant_linear: the weight must be a contiguous 2-D uint8 CPU tensor of GGUF blocks");
  TORCH_CHECK(K > 0 && K % t.block == 0, "quant_linear: K = ", K, " is not a multiple of the ", t.name,
              " block size ", t.block);
  TORCH_CHECK(w.size(1) == K / t.block * t.bytes, "quant_linear: ", t.name, " rows of K = ", K, " take ",
              K / t.block * t.bytes, " bytes, the weight has ", w.size(1));
  return t;
}

// ------------------------------------------------------------------------------------ the product
// Integer dot products, the way llama.cpp's ggml-cpu does them (our own code), on weights packed in
// groups of 8 rows (quant_pack, once at load time; quant_unpack gives back the GGUF bytes exactly):
// one register then holds a few quant bytes of each of the 8 rows, the activation's bytes are broadcast
// to all of them, and the float work after each block's exact integer sums is one multiply-add per 8
// rows.  Two families: the k-quants ("k-quants, packed") and the 32-weight blocks ("32-weight blocks,
// packed"); "the driver" runs either over a call.
//
// Numerics (batch invariance).  The integer sums are exact; every float operation of y[m, n] is the
// same whatever M is, whatever the other rows hold, however many threads run and whichever kernel
// variant (512-bit, 256-bit, portable) runs, so greedy speculative decoding sees exactly the logits of
// single-row decoding steps.  Against fp32 math the error is the activation rounding: at most
// sum_k |w_k| * dx_{g(k)} / 2, g a block of 32 or a super-block of 256 (tests/engine/models/
// test_qweight.py checks that bound).

constexpr int kPackRows = 8;
constexpr int64_t kPackedFlag = 256;  // quant_linear's type for a packed weight: the GGML type | kPackedFlag

// Rounds one group of n activations (n a multiple of 16) to int8: q = round(x / dx), nearest, ties to
// even, with dx = max|x| / 127.  Writes q and the exact integer sum of each 16; returns dx.
template <typename T>  // float or bf16 (read exactly as fp32)
inline float round_group(const T* x, int n, int8_t* q, int* sums16) {
#if defined(__AVX2__)
  // The same operations 8 lanes at a time (max is exact in any order; a NaN is passed over as
  // std::max does; _mm256_round_ps to nearest is nearbyint in the default rounding mode).
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m8 = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m8 = _mm256_max_ps(_mm256_and_ps(mcsd::load8(x + i), abs_mask), m8);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const float d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  const __m256 id8 = _mm256_set1_ps(id);
  for (int h = 0; h < n / 16; ++h) {
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(mcsd::load8(x + 16 * h), id8),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(mcsd::load8(x + 16 * h + 8), id8),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h),
                     _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)));
    __m256i s8 = _mm256_add_epi32(i0, i1);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    sums16[h] = _mm_cvtsi128_si32(s4) + _mm_extract_epi32(s4, 1);
  }
  return d;
#else
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int h = 0; h < n / 16; ++h) {
    int sum = 0;
    for (int i = 16 * h; i < 16 * h + 16; ++i) {
      const int v = static_cast<int>(std::nearbyint(static_cast<float>(x[i]) * id));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    sums16[h] = sum;
  }
  return d;
#endif
}

// Every kernel reads its weights once per call, front to back within a thread's range.  The hardware
// prefetcher alone left the one-row products waiting on memory, at about half the read bandwidth they
// reach when the kernel asks for the bytes kPrefetchBytes ahead of the row it reads (8 to 64 weight
// rows ahead into L2 do about equally well; into L1 is slower, its fill buffers are few).  Prefetches never pass `end`, the end of the thread's range.
constexpr int64_t kPrefetchBytes = 16 << 10;

inline void prefetch(const uint8_t* p, const uint8_t* end) {
  if (p < end) __builtin_prefetch(p, 0, 2);  // into L2
}

inline void prefetch_lines(const uint8_t* p, int64_t bytes, const uint8_t* end) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch(p + off, end);
}

// Where a kernel prefetches its group from: `p` is the group's bytes kPrefetchBytes further on (null: the
// group is read from L2, nothing to prefetch), never past `end`.  A kernel asks for one unit's lines
// (a super-block or block, all 8 rows) per unit it computes, so that the requests spread over its
// work: asked all at once per group, the products wait on them.
struct Ahead {
  const uint8_t* p;
  const uint8_t* end;
  void unit(int64_t u, int64_t bytes) const {
    if (p != nullptr) prefetch_lines(p + u * bytes, bytes, end);
  }
};

#if defined(__AVX2__)
// 32 bytes, 0x10 where bit i of `bits` is set, else 0.
inline __m256i bits_to_16s(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}
#endif

// ------------------------------------------------------------------------------------ k-quants, packed
// Q4_K, Q5_K and Q6_K are multiplied from a packed form of their blocks (quant_pack, once at load time;
// quant_unpack gives back the GGUF bytes exactly).  The integer work is llama.cpp's pairing of k-quant
// weights with "Q8_K" activations (our own code); the packing lets one instruction serve 8 weight rows,
// so the float work per super-block is one multiply-add per 8 rows, not per row.
//
// Packing.  Weight rows go in groups of 8 (the last one padded with zero rows); a group's super-block s
// holds the 8 rows' super-blocks s, interleaved so that one 64-byte load holds 8 bytes of every row (row
// r in 64-bit lane r), and the sub-block scales come as bytes, per pair of sub-blocks [row][2]:
//   Q4_K (1184 bytes = 8 x 148): d[8], dmin[8] (fp16); scales and mins, [pair p][row][2] each (64 + 64);
//        qs[chunk j][l-block b][row][8] (1024): bytes 32 j + 8 b .. +7 of the row's qs, whose low nibbles
//        are weights 64 j + 8 b .. +7 (sub-block 2j) and the high ones the same + 32 (sub-block 2j + 1).
//   Q5_K (1440 = 8 x 180): the same, then qh[l-block b][row][8] (256): bits 2j, 2j + 1 are chunk j's.
//   Q6_K (1680 = 8 x 210): d[8]; the 16 int8 scales as [pair][row][2] (128); then per half h and
//        l-block b, three [row][8] runs (192 bytes): ql bytes 64 h + 8 b.., ql 64 h + 32 + 8 b.., qh 32 h
//        + 8 b..; together they hold weights 128 h + 32 p + 8 b .. +7 for p = 0..3.
// The 6-bit scales and mins are stored a byte each: 32 bytes more per 8 rows' Q4_K / Q5_K super-block
// (under 3%); Q6_K keeps its size.
//
// The product.
//  1. Activations are rounded to int8 per 256 (one super-block): dx = max|x| / 127 (fp32), q =
//     round(x / dx), ties to even, with the exact sums of q per sub-block (16 or 32 values).
//  2. Per activation row c, group and super-block, one register's int32 lanes gather every row's exact
//        isum_r = sum_sub sc_sub(r) * sum_{i in sub} u_i(r) q_i     (maddubs, then madd or vpdpwssd)
//     where u are the unsigned quants; Q6_K's zero point comes off in integers, isum_r -= 32 sum_sub
//     sc_sub(r) S_sub (S the sub-block sums of q), and for Q4_K / Q5_K's mins msum_r = sum_sub m_sub(r) S_sub.
//  3. Then, the only float arithmetic, for the 8 rows' lanes at once (k_scaled):
//        acc += (d * dx) * isum,  acc_m += (dmin * dx) * msum,  and at the end y = acc - acc_m.
// Every kernel variant (512-bit, 256-bit, portable) computes the same integers and then exactly these
// float operations, per row in super-block order: all give the same bits, and a row's result does
// not depend on M, on the other rows or on the threads (batch-invariant).  Error against fp32 math: at
// most sum_k |w_k| dx_{sb(k)} / 2.
//
// Sums stay in range: Q4_K / Q5_K 8 sub-blocks x 63 x 32 x 31 x 127 < 2^31; Q6_K 16 x 128 x 16 x 63 x
// 127 < 2^31; a maddubs pair at most 2 x 63 x 127 < 2^15; a sub-block's sum of q at most 32 x 127.

constexpr int kSuper = 256;

// Bytes of one packed super-block (8 rows), and where its parts are.
constexpr int kK4Bytes = 1184, kK5Bytes = 1440, kK6Bytes = 1680;
constexpr int k_packed_bytes(int64_t id) { return id == 12 ? kK4Bytes : id == 13 ? kK5Bytes : kK6Bytes; }
constexpr int kK4Scales = 32, kK4Mins = 96, kK4Qs = 160, kK5Qh = 1184;  // d at 0, dmin at 16
constexpr int kK6Scales = 16, kK6Runs = 144;                            // d at 0

bool is_k_quant(int64_t id) { return id == 12 || id == 13 || id == 14; }

// Inverse of kscale_bytes: 8 scales and 8 mins (6 bits each) into the 12 bytes of the GGUF layout.
void kscale_encode(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>((sc[j] & 0x3f) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>((m[j] & 0x3f) | ((m[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4));
  }
}

// Moves row r's super-block between its GGUF bytes g and its place in a packed super-block p: packing
// (kPack) or unpacking; every GGUF byte is covered, so the two are exact inverses.
template <bool kPack>
inline void mv(uint8_t* g, uint8_t* p, int n) {
  if (kPack)
    std::memcpy(p, g, n);
  else
    std::memcpy(g, p, n);
}

template <bool kPack>
void move_k4(uint8_t* g, uint8_t* p, int r, bool fifth) {
  mv<kPack>(g, p + 2 * r, 2);
  mv<kPack>(g + 2, p + 16 + 2 * r, 2);
  uint8_t sc[8], m[8];
  if (kPack) kscale_bytes(g + 4, sc, m);
  for (int j = 0; j < 8; ++j) {
    const int at = 16 * (j / 2) + 2 * r + j % 2;  // [pair][row][2]
    if (kPack) {
      p[kK4Scales + at] = sc[j];
      p[kK4Mins + at] = m[j];
    } else {
      sc[j] = p[kK4Scales + at];
      m[j] = p[kK4Mins + at];
    }
  }
  if (!kPack) kscale_encode(sc, m, g + 4);
  const int qs = fifth ? 48 : 16;
  for (int j = 0; j < 4; ++j)
    for (int b = 0; b < 4; ++b) mv<kPack>(g + qs + 32 * j + 8 * b, p + kK4Qs + 256 * j + 64 * b + 8 * r, 8);
  if (fifth)
    for (int b = 0; b < 4; ++b) mv<kPack>(g + 16 + 8 * b, p + kK5Qh + 64 * b + 8 * r, 8);
}

template <bool kPack>
void move_q6k(uint8_t* g, uint8_t* p, int r) {
  mv<kPack>(g + 208, p + 2 * r, 2);
  for (int k = 0; k < 16; ++k) mv<kPack>(g + 192 + k, p + kK6Scales + 16 * (k / 2) + 2 * r + k % 2, 1);
  for (int h = 0; h < 2; ++h)
    for (int b = 0; b < 4; ++b) {
      uint8_t* unit = p + kK6Runs + 192 * (4 * h + b) + 8 * r;
      mv<kPack>(g + 64 * h + 8 * b, unit, 8);
      mv<kPack>(g + 64 * h + 32 + 8 * b, unit + 64, 8);
      mv<kPack>(g + 128 + 32 * h + 8 * b, unit + 128, 8);
    }
}

template <bool kPack>
void move_super(int64_t id, uint8_t* g, uint8_t* p, int r) {
  if (id == 14)
    move_q6k<kPack>(g, p, r);
  else
    move_k4<kPack>(g, p, r, id == 13);
}

// Activations for the k-quants: q [M, K], dx [M, K/256], and per super-block the exact sums of q per
// sub-block (32 values for Q4_K / Q5_K, 16 for Q6_K), laid out for a madd against 8 rows' scales:
// per pair of sub-blocks (2p, 2p + 1) the two sums, repeated 8 times (16 int16, one int32 lane per
// weight row).
struct QActsK {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int16_t> sums;  // [M, supers, pairs, 16]
  int64_t K, supers, pairs;
  const int8_t* x(int64_t m, int64_t s) const { return q.data() + m * K + s * kSuper; }
  const int16_t* pair_sums(int64_t m, int64_t s) const { return sums.data() + (m * supers + s) * pairs * 16; }
  float scale(int64_t m, int64_t s) const { return dx[m * supers + s]; }
};

template <typename T>
QActsK quantize_acts_k(const T* x, int64_t M, int64_t K, int sub) {
  QActsK a;
  a.K = K;
  a.supers = K / kSuper;
  a.pairs = kSuper / sub / 2;
  a.q.resize(static_cast<size_t>(M * K));
  a.dx.resize(static_cast<size_t>(M * a.supers));
  a.sums.resize(static_cast<size_t>(M * a.supers * a.pairs * 16));
  at::parallel_for(0, M, std::max<int64_t>(8, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t s = 0; s < a.supers; ++s) {
        int s16[kSuper / 16];
        a.dx[m * a.supers + s] = round_group(x + m * K + s * kSuper, kSuper, a.q.data() + m * K + s * kSuper, s16);
        int16_t* out = a.sums.data() + (m * a.supers + s) * a.pairs * 16;
        for (int64_t p = 0; p < a.pairs; ++p) {  // the pair's two sums, [row][2] for the 8 rows
          const int v0 = sub == 16 ? s16[2 * p] : s16[4 * p] + s16[4 * p + 1];
          const int v1 = sub == 16 ? s16[2 * p + 1] : s16[4 * p + 2] + s16[4 * p + 3];
          const uint32_t both = static_cast<uint16_t>(v0) | static_cast<uint32_t>(static_cast<uint16_t>(v1)) << 16;
          for (int r = 0; r < kPackRows; ++r) std::memcpy(out + 16 * p + 2 * r, &both, 4);
        }
      }
  });
  return a;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m128i load16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32b(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline int64_t load64(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// pshufb controls that spread one sub-block's scales of 8 rows (byte 2 r + t of a [row][2] pair of
// scales, the 16 bytes broadcast to every 128-bit lane) over each row's 64-bit lane, in one of three
// layouts: kU16, the four int16 lanes zero-extended; kS16, the four int16 lanes with the scale in the
// high byte, which a shift right by 8 then sign-extends; kU32, the low int16 of both int32 lanes
// (zero-extended, 0 in the high int16), so that vpdpwssd multiplies an int32 lane holding an int16
// value by it.  A 512-bit register holds rows 0-7 (128-bit lane L: rows 2 L, 2 L + 1); a 256-bit one
// rows 4 h .. 4 h + 3, the table's bytes 32 h ...
constexpr int kU16 = 0, kS16 = 1, kU32 = 2;
struct ScaleCtl {
  int8_t b[3][2][64];  // [layout][t]
};
constexpr ScaleCtl make_scale_ctl() {
  ScaleCtl c{};
  for (int layout = kU16; layout <= kU32; ++layout)
    for (int t = 0; t < 2; ++t)
      for (int k = 0; k < 64; ++k) {
        const int row = 2 * (k / 16) + (k % 16) / 8;
        const bool take = layout == kU32 ? k % 4 == 0 : k % 2 == layout;
        c.b[layout][t][k] = take ? static_cast<int8_t>(2 * row + t) : static_cast<int8_t>(-128);
      }
  return c;
}
alignas(64) constexpr ScaleCtl kScaleCtl = make_scale_ctl();

// Rows 4 h .. 4 h + 3's scales of sub-block t of `pair`, in their 64-bit lanes (kU16 or kS16).
template <int kLayout>
inline __m256i scales_256(__m256i pair_x2, int t, int h) {
  const __m256i v = _mm256_shuffle_epi8(pair_x2, load32b(kScaleCtl.b[kLayout][t] + 32 * h));
  return kLayout == kS16 ? _mm256_srai_epi16(v, 8) : v;
}

// The only float arithmetic of the k-quant kernels, per super-block and activation row: 8 weight rows'
// exact integer sums scaled into their fp32 lanes, acc + isum * (d * dx).  Every kernel variant does
// these operations, and the portable one the same per lane (k_scaled_lane).
inline __m256 k_scaled(__m256 acc, __m256i isum, __m256 d8, float dx) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(dx)), acc);
}
inline __m256 fp16x8(const uint8_t* p) { return _mm256_cvtph_ps(load16(p)); }

// Rows 0-3 (lane pairs 2 r, 2 r + 1 of `a`) and 4-7 (of `b`) -> one int32 lane per row, in order.
inline __m256i pair_sums_256(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), _MM_SHUFFLE(3, 1, 2, 0));
}

// sum_pair madd(8 rows' [row][2] bytes of the pair as int16, the activation's pair sums): one int32 lane
// per row.  Q4_K / Q5_K's mins (4 pairs, unsigned) and Q6_K's scales (8 pairs, signed).
template <int kPairs, bool kSigned>
inline __m256i scale_dot(const uint8_t* pairs, const int16_t* sums) {
  __m256i t = _mm256_setzero_si256();
  for (int p = 0; p < kPairs; ++p) {
    const __m128i b = load16(pairs + 16 * p);
    const __m256i s = kSigned ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
    t = _mm256_add_epi32(t, _mm256_madd_epi16(s, load32b(sums + 16 * p)));
  }
  return t;
}

// Bit `bit` of every byte, moved to bit 4 (Q5_K's fifth bits).
inline __m256i fifth_256(__m256i h, int bit) {
  const __m256i b = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(bit)), _mm256_set1_epi8(1));
  return _mm256_slli_epi16(b, 4);
}

// Sub-block pair j's weights of rows 4 h .. 4 h + 3 as bytes, per l-block: lo (sub-block 2 j) and hi
// (2 j + 1), with Q5_K's fifth bits.
template <bool kFifth>
inline void k4_unpack_256(const uint8_t* b, int j, int h, __m256i* lo, __m256i* hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int lb = 0; lb < 4; ++lb) {
    const __m256i v = load32b(b + kK4Qs + 256 * j + 64 * lb + 32 * h);
    lo[lb] = _mm256_and_si256(v, low4);
    hi[lb] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (kFifth) {
      const __m256i qh = load32b(b + kK5Qh + 64 * lb + 32 * h);
      lo[lb] = _mm256_or_si256(lo[lb], fifth_256(qh, 2 * j));
      hi[lb] = _mm256_or_si256(hi[lb], fifth_256(qh, 2 * j + 1));
    }
  }
}

// A Q4_K / Q5_K super-block's float work for activation rows m .. m + C - 1 (256-bit kernels): the
// 8 rows' sums (rows 0-3 in isum[0], 4-7 in isum[1]) and mins scaled into acc and accm.
template <int C>
inline void k4_scale_256(const uint8_t* b, const QActsK& a, int64_t m, int64_t s, const __m256i (*isum)[C],
                         __m256* acc, __m256* accm) {
  const __m256 d8 = fp16x8(b), dm8 = fp16x8(b + 16);
  for (int c = 0; c < C; ++c) {
    const float dx = a.scale(m + c, s);
    acc[c] = k_scaled(acc[c], pair_sums_256(isum[0][c], isum[1][c]), d8, dx);
    accm[c] = k_scaled(accm[c], scale_dot<4, false>(b + kK4Mins, a.pair_sums(m + c, s)), dm8, dx);
  }
}

// The dword layout (256-bit kernels).  The packed form holds 8 bytes of each row in a 64-bit lane, so
// a 256-bit register of it has 4 rows.  The Q4_K / Q5_K kernels, and Q6_K's for 5-8 rows, rearrange
// two such registers (rows 0-3, 4-7) into 4 bytes of all 8 rows per register (one shuffle each, shared
// by every activation row of the pass).  One register of int16 sums then holds a sub-block's products
// for all 8 rows, so an activation row needs one accumulator where it needed two, and a pass of 8
// activation rows fits the 16 registers.  Lane i of such a register holds row kDwRows[i]; the integer
// sums go back to row order once per super-block, before the float work.
constexpr int kDwRows[8] = {0, 1, 4, 5, 2, 3, 6, 7};

// Rows 0-3 (a) and 4-7 (b), 8 bytes each -> bytes 0-3 (*d0) and 4-7 (*d1) of the 8 rows, dword layout.
inline void dw_split(__m256i a, __m256i b, __m256i* d0, __m256i* d1) {
  const __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
  *d0 = _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88));
  *d1 = _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xdd));
}

// pshufb controls that spread sub-block t's scales of a [row][2] pair of scales (16 bytes, broadcast
// to both 128-bit lanes) over both int16 of each row's dword lane, in layout kU16 or kS16 (as
// ScaleCtl does for 64-bit lanes).
struct DwScaleCtl {
  int8_t b[2][2][32];  // [layout][t]
};
constexpr DwScaleCtl make_dw_scale_ctl() {
  DwScaleCtl c{};
  for (int layout = kU16; layout <= kS16; ++layout)
    for (int t = 0; t < 2; ++t)
      for (int k = 0; k < 32; ++k)
        c.b[layout][t][k] = k % 2 == layout ? static_cast<int8_t>(2 * kDwRows[k / 4] + t) : static_cast<int8_t>(-128);
  return c;
}
alignas(32) constexpr DwScaleCtl kDwScaleCtl = make_dw_scale_ctl();

// Sub-block t's scales of `pair` (a [row][2] pair, 16 bytes broadcast to both 128-bit lanes), one
// value in both int16 of each row's dword lane.
template <int kLayout>
inline __m256i dw_scales(__m256i pair, int t) {
  const __m256i v = _mm256_shuffle_epi8(pair, load32b(kDwScaleCtl.b[kLayout][t]));
  return kLayout == kS16 ? _mm256_srai_epi16(v, 8) : v;
}

// Dword-layout lanes back in row order (the permutation is its own inverse).
inline __m256i dw_row_order(__m256i v) {
  return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(kDwRows[0], kDwRows[1], kDwRows[2], kDwRows[3],
                                                          kDwRows[4], kDwRows[5], kDwRows[6], kDwRows[7]));
}

// An empty asm that takes v and gives it back: the compiler must have v in a register here, so it
// cannot regroup a chain of integer adds into a tree that holds every product at once (GCC does, and
// then spills them).
inline void keep_in_register(__m256i& v) {
#if defined(__GNUC__)
  __asm__("" : "+x"(v));
#endif
}

inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Q4_K (kFifth = false) and Q5_K, 256-bit: packed group `w` times activation rows m .. m + C - 1
// (C = 1..8); y[c * ldy + r] for the group's 8 rows r.  A sub-block at a time: its 8 registers of
// weights (dword layout) are made once and meet every activation row's 4-byte broadcasts.  An int16
// lane of a sub-block's sums gathers 4 products per l-block: Q4_K's 4 l-blocks at most 16 * 15 * 127
// = 30480; Q5_K's quants reach 31, so its sums go to int32 every 2 l-blocks (8 * 31 * 127 = 31496).
// It takes fewer cycles per packed super-block and row at every row count than the kernel before it
// (rows 0-3 and 4-7 in turn, 4 activation rows a pass): docs/quantized.md.
template <int C, bool kFifth>
void k4_group(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  constexpr int kBytes = kFifth ? kK5Bytes : kK4Bytes;
  constexpr int kRun = kFifth ? 2 : 4;  // l-blocks summed as int16 before the madd
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = accm[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kBytes;
    ahead.unit(s, kBytes);
    const int8_t* xs[C];
    for (int c = 0; c < C; ++c) xs[c] = a.x(m + c, s);
    __m256i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm256_setzero_si256();
    const auto sub_block = [&](int j, auto nib_c) {
      constexpr int nib = decltype(nib_c)::value;
      const int t = 2 * j + nib;
      const __m256i sc = dw_scales<kU16>(_mm256_broadcastsi128_si256(load16(b + kK4Scales + 16 * j)), nib);
      for (int r0 = 0; r0 < 4; r0 += kRun) {
        __m256i t16[C];
        for (int c = 0; c < C; ++c) t16[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int lb = r0; lb < r0 + kRun; ++lb) {
          const uint8_t* q = b + kK4Qs + 256 * j + 64 * lb;
          __m256i d[2], h[2];
          dw_split(load32b(q), load32b(q + 32), &d[0], &d[1]);
          if (kFifth) dw_split(load32b(b + kK5Qh + 64 * lb), load32b(b + kK5Qh + 64 * lb + 32), &h[0], &h[1]);
          for (int e = 0; e < 2; ++e) {
            __m256i u = _mm256_and_si256(nib == 0 ? d[e] : _mm256_srli_epi16(d[e], 4), low4);
            if (kFifth) u = _mm256_or_si256(u, fifth_256(h[e], t));
            for (int c = 0; c < C; ++c) {
              __m256i v = _mm256_add_epi16(t16[c], _mm256_maddubs_epi16(u, bcast32(xs[c] + 32 * t + 8 * lb + 4 * e)));
              keep_in_register(v);
              t16[c] = v;
            }
          }
        }
        for (int c = 0; c < C; ++c) isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(t16[c], sc));
      }
    };
    for (int j = 0; j < 4; ++j) {
      sub_block(j, std::integral_constant<int, 0>{});
      sub_block(j, std::integral_constant<int, 1>{});
    }
    const __m256 d8 = fp16x8(b), dm8 = fp16x8(b + 16);
    for (int c = 0; c < C; ++c) {
      const float dx = a.scale(m + c, s);
      acc[c] = k_scaled(acc[c], dw_row_order(isum[c]), d8, dx);
      accm[c] = k_scaled(accm[c], scale_dot<4, false>(b + kK4Mins, a.pair_sums(m + c, s)), dm8, dx);
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, _mm256_sub_ps(acc[c], accm[c]));
}

// Run p's 6-bit Q6_K quants (0..63), a byte each: the low 4 bits from `ql` (the low nibbles for runs 0
// and 1, the high ones for 2 and 3: runs 0 / 2 and 1 / 3 share their ql bytes) and the high 2 bits from
// `qh` (bits 2 p, 2 p + 1 of each byte).
inline __m256i q6k_quants(__m256i ql, __m256i qh, int p) {
  const __m256i lo = p < 2 ? ql : _mm256_srli_epi16(ql, 4);
  const __m256i hi = p == 0 ? _mm256_slli_epi16(qh, 4) : p == 1 ? _mm256_slli_epi16(qh, 2)
                                                      : p == 2 ? qh : _mm256_srli_epi16(qh, 2);
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0f)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

// Q6_K in the dword layout, for passes of 5-8 activation rows: the same integers as q6k_group, so the
// same bits.  Per half hf and run p, 32 weights of the 8 rows under two scales (l-blocks 0-1, 2-3); an
// l-block's two maddubs go to int16 (4 products of at most 63 * 127: 32004), then to int32 by one madd
// against its scale.

template <int C>
void q6k_group_dw(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kK6Bytes;
    ahead.unit(s, kK6Bytes);
    const int8_t* xs[C];
    for (int c = 0; c < C; ++c) xs[c] = a.x(m + c, s);
    __m256i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm256_setzero_si256();
    const auto run = [&](int hf, auto p_c) {
      constexpr int p = decltype(p_c)::value;
      const __m256i pair = _mm256_broadcastsi128_si256(load16(b + kK6Scales + 16 * (4 * hf + p)));
      for (int t = 0; t < 2; ++t) {
        const __m256i sc = dw_scales<kS16>(pair, t);
        __m256i u[2][2];
        for (int i = 0; i < 2; ++i) {
          const uint8_t* unit = b + kK6Runs + 192 * (4 * hf + 2 * t + i);
          __m256i d[2], h[2];
          dw_split(load32b(unit + 64 * (p % 2)), load32b(unit + 64 * (p % 2) + 32), &d[0], &d[1]);
          dw_split(load32b(unit + 128), load32b(unit + 160), &h[0], &h[1]);
          for (int e = 0; e < 2; ++e) u[i][e] = q6k_quants(d[e], h[e], p);
        }
        for (int c = 0; c < C; ++c) {
          const int8_t* xq = xs[c] + 128 * hf + 32 * p + 16 * t;
          __m256i d = isum[c];
          for (int i = 0; i < 2; ++i) {
            __m256i t16 = _mm256_maddubs_epi16(u[i][0], bcast32(xq + 8 * i));
            t16 = _mm256_add_epi16(t16, _mm256_maddubs_epi16(u[i][1], bcast32(xq + 8 * i + 4)));
            d = _mm256_add_epi32(d, _mm256_madd_epi16(t16, sc));
            keep_in_register(d);
          }
          isum[c] = d;
        }
      }
    };
    for (int hf = 0; hf < 2; ++hf) {
      run(hf, std::integral_constant<int, 0>{});
      run(hf, std::integral_constant<int, 1>{});
      run(hf, std::integral_constant<int, 2>{});
      run(hf, std::integral_constant<int, 3>{});
    }
    const __m256 d8 = fp16x8(b);
    for (int c = 0; c < C; ++c) {
      const __m256i zero_point = _mm256_slli_epi32(scale_dot<8, true>(b + kK6Scales, a.pair_sums(m + c, s)), 5);
      const __m256i isum8 = _mm256_sub_epi32(dw_row_order(isum[c]), zero_point);
      acc[c] = k_scaled(acc[c], isum8, d8, a.scale(m + c, s));
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}

// Q6_K, 256-bit.  Unit (half hf, l-block lb) has run p's weights under scale 8 hf + 2 p + lb / 2.
template <int C>
void q6k_group(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kK6Bytes;
    ahead.unit(s, kK6Bytes);
    __m256i isum[2][C];
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < C; ++c) isum[h][c] = _mm256_setzero_si256();
      for (int hf = 0; hf < 2; ++hf)
        for (int t = 0; t < 2; ++t)      // l-blocks 2 t, 2 t + 1: the same scales
          for (int p = 0; p < 4; ++p) {  // run p: one at a time, which keeps the registers in hand
            __m256i u[2];
            for (int i = 0; i < 2; ++i) {
              const uint8_t* unit = b + kK6Runs + 192 * (4 * hf + 2 * t + i) + 32 * h;
              const __m256i q = load32b(unit + 64 * (p % 2)), qh = load32b(unit + 128);
              u[i] = q6k_quants(q, qh, p);
            }
            const __m256i sp = scales_256<kS16>(_mm256_broadcastsi128_si256(load16(b + kK6Scales + 16 * (4 * hf + p))), t, h);
            // The two l-blocks' maddubs pairs added as int16 (at most 4 * 63 * 127 = 32004), then one madd.
            for (int c = 0; c < C; ++c) {
              const int8_t* xq = a.x(m + c, s) + 128 * hf + 32 * p + 16 * t;
              const __m256i t16 = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], _mm256_set1_epi64x(load64(xq))),
                                                   _mm256_maddubs_epi16(u[1], _mm256_set1_epi64x(load64(xq + 8))));
              isum[h][c] = _mm256_add_epi32(isum[h][c], _mm256_madd_epi16(t16, sp));
            }
          }
    }
    const __m256 d8 = fp16x8(b);
    for (int c = 0; c < C; ++c) {
      const __m256i zero_point = _mm256_slli_epi32(scale_dot<8, true>(b + kK6Scales, a.pair_sums(m + c, s)), 5);
      const __m256i isum8 = _mm256_sub_epi32(pair_sums_256(isum[0][c], isum[1][c]), zero_point);
      acc[c] = k_scaled(acc[c], isum8, d8, a.scale(m + c, s));
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}
#else  // portable: the same integer sums, then the same float operations per row
inline float k_scaled_lane(float acc, int32_t isum, float d, float dx) {
  return std::fma(static_cast<float>(isum), d * dx, acc);
}

// A group's 8 rows at once: an l-block's 64 bytes hold row r's 8 weights at 8 r .. 8 r + 7, so each
// row's products are 8 adjacent lanes of a 64-lane loop (which compilers vectorize), summed per row
// after kBlocks l-blocks; x: their 8 kBlocks activations.  Acc: int16 where kBlocks products fit it
// (4 of at most 31 * 127), int32 for Q8_0's signed weights.  Exact integers: the vector kernels' sums.
#if defined(__GNUC__)
#define MCSD_INLINE __attribute__((always_inline)) inline
#else
#define MCSD_INLINE inline
#endif
template <int kBlocks, typename Acc = int16_t, typename U = uint8_t>
MCSD_INLINE void dot_rows_8(const U (*u)[64], const int8_t* x, int32_t* dot) {
  Acc t[64] = {};
  for (int lb = 0; lb < kBlocks; ++lb)
    for (int r = 0; r < kPackRows; ++r)
      for (int l = 0; l < 8; ++l) t[8 * r + l] = static_cast<Acc>(t[8 * r + l] + u[lb][8 * r + l] * x[8 * lb + l]);
  for (int r = 0; r < kPackRows; ++r) {
    int32_t d = 0;
    for (int l = 0; l < 8; ++l) d += t[8 * r + l];
    dot[r] = d;
  }
}

template <int C, bool kFifth>
void k4_group(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  constexpr int kBytes = kFifth ? kK5Bytes : kK4Bytes;
  float acc[C][kPackRows] = {}, accm[C][kPackRows] = {};
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kBytes;
    uint8_t u[8][4][64];  // the super-block's weights as bytes: [sub-block][l-block][8 r + l]
    for (int j = 0; j < 4; ++j)
      for (int lb = 0; lb < 4; ++lb) {
        const uint8_t* q = b + kK4Qs + 256 * j + 64 * lb;
        const uint8_t* qh = b + kK5Qh + 64 * lb;
        for (int i = 0; i < 64; ++i) {
          u[2 * j][lb][i] = static_cast<uint8_t>((q[i] & 0x0f) | (kFifth ? ((qh[i] >> (2 * j)) & 1) << 4 : 0));
          u[2 * j + 1][lb][i] = static_cast<uint8_t>((q[i] >> 4) | (kFifth ? ((qh[i] >> (2 * j + 1)) & 1) << 4 : 0));
        }
      }
    for (int c = 0; c < C; ++c) {
      const int8_t* x = a.x(m + c, s);
      const int16_t* sums = a.pair_sums(m + c, s);
      int32_t isum[kPackRows] = {}, msum[kPackRows] = {};
      for (int sub = 0; sub < 8; ++sub) {
        const int j = sub / 2, hi = sub % 2;
        int32_t dot[kPackRows];
        dot_rows_8<4>(u[sub], x + 64 * j + 32 * hi, dot);
        for (int r = 0; r < kPackRows; ++r) {
          isum[r] += b[kK4Scales + 16 * j + 2 * r + hi] * dot[r];
          msum[r] += b[kK4Mins + 16 * j + 2 * r + hi] * sums[16 * j + hi];
        }
      }
      const float dx = a.scale(m + c, s);
      for (int r = 0; r < kPackRows; ++r) {
        acc[c][r] = k_scaled_lane(acc[c][r], isum[r], fp16_to_f32(rd16(b + 2 * r)), dx);
        accm[c][r] = k_scaled_lane(accm[c][r], msum[r], fp16_to_f32(rd16(b + 16 + 2 * r)), dx);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < kPackRows; ++r) y[c * ldy + r] = acc[c][r] - accm[c][r];
}

template <int C>
void q6k_group(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  float acc[C][kPackRows] = {};
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kK6Bytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + kK6Scales);
    uint8_t u[2][4][4][64];  // the super-block's weights (0..63) as bytes: [half][run][l-block][8 r + l]
    for (int hf = 0; hf < 2; ++hf)
      for (int lb = 0; lb < 4; ++lb) {
        const uint8_t* unit = b + kK6Runs + 192 * (4 * hf + lb);
        for (int p = 0; p < 4; ++p)
          for (int i = 0; i < 64; ++i)
            u[hf][p][lb][i] = static_cast<uint8_t>((((p % 2 ? unit[64 + i] : unit[i]) >> (p < 2 ? 0 : 4)) & 0x0f) |
                                                   (((unit[128 + i] >> (2 * p)) & 3) << 4));
      }
    for (int c = 0; c < C; ++c) {
      const int8_t* x = a.x(m + c, s);
      const int16_t* sums = a.pair_sums(m + c, s);
      int32_t isum[kPackRows] = {};
      for (int hf = 0; hf < 2; ++hf)
        for (int p = 0; p < 4; ++p)
          for (int t = 0; t < 2; ++t) {  // sub-block 8 hf + 2 p + t: l-blocks 2 t, 2 t + 1 of run p
            const int sub = 8 * hf + 2 * p + t;
            int32_t dot[kPackRows];
            dot_rows_8<2>(u[hf][p] + 2 * t, x + 128 * hf + 32 * p + 16 * t, dot);
            for (int r = 0; r < kPackRows; ++r) isum[r] += sc[16 * (sub / 2) + 2 * r + sub % 2] * dot[r];
          }
      for (int r = 0; r < kPackRows; ++r) {
        for (int sub = 0; sub < 16; ++sub) isum[r] -= 32 * sc[16 * (sub / 2) + 2 * r + sub % 2] * sums[16 * (sub / 2) + sub % 2];
        acc[c][r] = k_scaled_lane(acc[c][r], isum[r], fp16_to_f32(rd16(b + 2 * r)), a.scale(m + c, s));
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < kPackRows; ++r) y[c * ldy + r] = acc[c][r];
}
#endif

// ------------------------------------------------------------------------------------ k-quants, 512-bit
// On CPUs with AVX-512 (F, BW, VL) and VNNI the same products run on 512-bit vectors (the 32-weight
// blocks' 512-bit kernels follow theirs below): one register holds
// all 8 rows, and vpdpwssd adds the scales' products to the int32 sums in one instruction (madd, then
// add, above).  The integers are the same, and the float work is k_scaled: the results are bitwise the
// 256-bit kernels' (tested), so which one a CPU runs changes its time only.  Compiled for those
// instructions whatever the build's flags (a target attribute) and chosen at run time (quant_isa).
#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__)
#define MCSD_HAVE_512 1
#define MCSD_TARGET_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// Rows 0-7's scales of sub-block t of `pair`, in the layout kLayout (kU16, kS16 or kU32).
template <int kLayout>
MCSD_TARGET_512 inline __m512i scales_512(const uint8_t* pair, int t) {
  const __m512i v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(load16(pair)), _mm512_load_si512(kScaleCtl.b[kLayout][t]));
  return kLayout == kS16 ? _mm512_srai_epi16(v, 8) : v;
}
// Lanes 2 r + 2 r + 1 -> lane r (rows 0-7).
MCSD_TARGET_512 inline __m256i pair_sums_512(__m512i v) {
  return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32)));
}
MCSD_TARGET_512 inline __m256i halves_sum(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// scale_dot on 512 bits: two pairs per madd, the halves added at the end (the same integers).
template <int kPairs, bool kSigned>
MCSD_TARGET_512 inline __m256i scale_dot_512(const uint8_t* pairs, const int16_t* sums) {
  __m512i t = _mm512_setzero_si512();
  for (int p = 0; p < kPairs; p += 2) {
    const __m256i b = load32b(pairs + 16 * p);
    const __m512i s = kSigned ? _mm512_cvtepi8_epi16(b) : _mm512_cvtepu8_epi16(b);
    t = _mm512_dpwssd_epi32(t, s, _mm512_loadu_si512(sums + 16 * p));
  }
  return halves_sum(t);
}
MCSD_TARGET_512 inline __m512i fifth_512(__m512i h, int bit) {
  const __m512i b = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(bit)), _mm512_set1_epi8(1));
  return _mm512_slli_epi16(b, 4);
}

// Q4_K / Q5_K, 512-bit.  A sub-block's products are first summed without its scale, then multiplied by it
// once: Q4_K by vpdpbusd (4 products per int32 lane, 16 over the sub-block's 4 registers, at most
// 16 * 15 * 127 = 30480, an int16), Q5_K by maddubs and 16-bit adds (8 per lane, at most 8 * 31 * 127 =
// 31496).  Either is then one vpdpwssd against the scales, where madd-per-register took one per register:
// 10 multiplies per sub-block pair and activation row instead of 16.  The integers are the same.
template <int C, bool kFifth>
MCSD_TARGET_512 void k4_group_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  constexpr int kBytes = kFifth ? kK5Bytes : kK4Bytes;
  __m256 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = accm[c] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kBytes;
    ahead.unit(s, kBytes);
    __m512i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const uint8_t* pair = b + kK4Scales + 16 * j;
      constexpr int kLayout = kFifth ? kU16 : kU32;  // int16 sums (Q5_K) or int32 lanes holding int16 (Q4_K)
      const __m512i slo = scales_512<kLayout>(pair, 0), shi = scales_512<kLayout>(pair, 1);
      __m512i lo[4], hi[4];
      for (int lb = 0; lb < 4; ++lb) {
        const __m512i v = _mm512_loadu_si512(b + kK4Qs + 256 * j + 64 * lb);
        lo[lb] = _mm512_and_si512(v, low4);
        hi[lb] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (kFifth) {
          const __m512i qh = _mm512_loadu_si512(b + kK5Qh + 64 * lb);
          lo[lb] = _mm512_or_si512(lo[lb], fifth_512(qh, 2 * j));
          hi[lb] = _mm512_or_si512(hi[lb], fifth_512(qh, 2 * j + 1));
        }
      }
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = a.x(m + c, s) + 64 * j;
        __m512i tlo, thi;
        if (kFifth) {
          tlo = _mm512_maddubs_epi16(lo[0], _mm512_set1_epi64(load64(xq)));
          thi = _mm512_maddubs_epi16(hi[0], _mm512_set1_epi64(load64(xq + 32)));
          for (int lb = 1; lb < 4; ++lb) {
            tlo = _mm512_add_epi16(tlo, _mm512_maddubs_epi16(lo[lb], _mm512_set1_epi64(load64(xq + 8 * lb))));
            thi = _mm512_add_epi16(thi, _mm512_maddubs_epi16(hi[lb], _mm512_set1_epi64(load64(xq + 32 + 8 * lb))));
          }
        } else {
          tlo = thi = _mm512_setzero_si512();
          for (int lb = 0; lb < 4; ++lb) {
            tlo = _mm512_dpbusd_epi32(tlo, lo[lb], _mm512_set1_epi64(load64(xq + 8 * lb)));
            thi = _mm512_dpbusd_epi32(thi, hi[lb], _mm512_set1_epi64(load64(xq + 32 + 8 * lb)));
          }
        }
        isum[c] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[c], tlo, slo), thi, shi);
      }
    }
    const __m256 d8 = fp16x8(b), dm8 = fp16x8(b + 16);
    for (int c = 0; c < C; ++c) {
      const float dx = a.scale(m + c, s);
      acc[c] = k_scaled(acc[c], pair_sums_512(isum[c]), d8, dx);
      accm[c] = k_scaled(accm[c], scale_dot_512<4, false>(b + kK4Mins, a.pair_sums(m + c, s)), dm8, dx);
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, _mm256_sub_ps(acc[c], accm[c]));
}

template <int C>
MCSD_TARGET_512 void q6k_group_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f), x30 = _mm512_set1_epi8(0x30);
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kK6Bytes;
    ahead.unit(s, kK6Bytes);
    __m512i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm512_setzero_si512();
    for (int hf = 0; hf < 2; ++hf)
      for (int t = 0; t < 2; ++t) {  // l-blocks 2 t, 2 t + 1: the same scales
        __m512i sp[4], u[2][4];
        for (int p = 0; p < 4; ++p) sp[p] = scales_512<kS16>(b + kK6Scales + 16 * (4 * hf + p), t);
        for (int i = 0; i < 2; ++i) {
          const uint8_t* unit = b + kK6Runs + 192 * (4 * hf + 2 * t + i);
          const __m512i qa = _mm512_loadu_si512(unit), qb = _mm512_loadu_si512(unit + 64),
                        qh = _mm512_loadu_si512(unit + 128);
          u[i][0] = _mm512_or_si512(_mm512_and_si512(qa, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), x30));
          u[i][1] = _mm512_or_si512(_mm512_and_si512(qb, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), x30));
          u[i][2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qa, 4), low4), _mm512_and_si512(qh, x30));
          u[i][3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qb, 4), low4),
                                    _mm512_and_si512(_mm512_srli_epi16(qh, 2), x30));
        }
        // The two l-blocks' maddubs sums share a scale: added as int16 (at most 4 * 63 * 127 = 32004),
        // then one vpdpwssd, where there were two.
        for (int c = 0; c < C; ++c) {
          const int8_t* xq = a.x(m + c, s) + 128 * hf + 16 * t;
          for (int p = 0; p < 4; ++p) {
            const __m512i t16 = _mm512_add_epi16(_mm512_maddubs_epi16(u[0][p], _mm512_set1_epi64(load64(xq + 32 * p))),
                                                 _mm512_maddubs_epi16(u[1][p], _mm512_set1_epi64(load64(xq + 32 * p + 8))));
            isum[c] = _mm512_dpwssd_epi32(isum[c], t16, sp[p]);
          }
        }
      }
    const __m256 d8 = fp16x8(b);
    for (int c = 0; c < C; ++c) {
      const __m256i zero_point = _mm256_slli_epi32(scale_dot_512<8, true>(b + kK6Scales, a.pair_sums(m + c, s)), 5);
      acc[c] = k_scaled(acc[c], _mm256_sub_epi32(pair_sums_512(isum[c]), zero_point), d8, a.scale(m + c, s));
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}

template <int C>
void q4k_group_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { k4_group_512<C, false>(w, a, m, y, ldy, ahead); }
template <int C>
void q5k_group_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { k4_group_512<C, true>(w, a, m, y, ldy, ahead); }

bool cpu_has_512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#else
bool cpu_has_512() { return false; }
#endif

// ------------------------------------------------------------------------------------ Q4_K, AVX-VNNI
// CPUs with AVX-VNNI but no AVX-512 (Intel's client cores since Alder Lake) run Q4_K's 256-bit kernel
// (and the 32-weight blocks', b32_group_vnni below) with the 512-bit one's integer steps: vpdpbusd sums a sub-block's products without its scale (16
// per int32 lane, at most 16 * 15 * 127 = 30480), then one vpdpwssd multiplies them by the scales
// (kU32 layout), where the AVX2 kernel takes maddubs, 16-bit adds and a madd.  The same integers, then
// k_scaled: bitwise the other kernels' results (tested), so it changes the time only.  Compiled for
// those instructions whatever the build's flags, chosen at run time (quant_isa).
#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__)
#define MCSD_HAVE_VNNI256 1
#define MCSD_TARGET_VNNI256 __attribute__((target("avx2,fma,f16c,avxvnni")))

template <int C>
MCSD_TARGET_VNNI256 void q4k_group_vnni(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy,
                                        Ahead ahead) {
  __m256 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = accm[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kK4Bytes;
    ahead.unit(s, kK4Bytes);
    __m256i isum[2][C];
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < C; ++c) isum[h][c] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i pair = _mm256_broadcastsi128_si256(load16(b + kK4Scales + 16 * j));
        const __m256i slo = scales_256<kU32>(pair, 0, h), shi = scales_256<kU32>(pair, 1, h);
        __m256i lo[4], hi[4];
        k4_unpack_256<false>(b, j, h, lo, hi);
        for (int c = 0; c < C; ++c) {
          const int8_t* xq = a.x(m + c, s) + 64 * j;
          __m256i tlo = _mm256_setzero_si256(), thi = _mm256_setzero_si256();
          for (int lb = 0; lb < 4; ++lb) {
            tlo = _mm256_dpbusd_avx_epi32(tlo, lo[lb], _mm256_set1_epi64x(load64(xq + 8 * lb)));
            thi = _mm256_dpbusd_avx_epi32(thi, hi[lb], _mm256_set1_epi64x(load64(xq + 32 + 8 * lb)));
          }
          isum[h][c] = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(isum[h][c], tlo, slo), thi, shi);
        }
      }
    }
    k4_scale_256<C>(b, a, m, s, isum, acc, accm);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, _mm256_sub_ps(acc[c], accm[c]));
}

// AVX-VNNI is CPUID leaf 7, sub-leaf 1, EAX bit 4 (GCC 12's __builtin_cpu_supports does not know it).
// (This build loads only on CPUs with AVX2 + FMA + F16C: cpu_kernels.build_kind.)
bool cpu_has_vnni256() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax >> 4) & 1u;
}
#else
bool cpu_has_vnni256() { return false; }
#endif

// ------------------------------------------------------------------------------------ 32-weight blocks, packed
// Q4_0, Q4_1, Q5_0 and Q8_0 are packed like the k-quants, in groups of 8 rows, block by block (a
// packed block holds the 8 rows' blocks of 32 weights; the same bytes as the GGUF rows):
//   Q8_0 (272 = 8 x 34): d[8] (fp16); qs[l-block b][row][8] (256): the row's quants 8 b .. 8 b + 7.
//   Q4_0 (144 = 8 x 18): d[8]; qs[half h][row][8] (128): the row's qs bytes 8 h .. +7, whose low nibbles
//        are weights 8 h .. +7 and high ones 16 + 8 h .. +7.
//   Q4_1 (160 = 8 x 20): d[8], m[8]; qs as Q4_0.
//   Q5_0 (176 = 8 x 22): d[8]; qh[l-block b][row] (32): byte b of the row's qh (the fifth bits of
//        weights 8 b .. +7); qs as Q4_0.
// Activations are rounded to int8 per 32 (dx; S the exact sum of the block's q).  Per activation row
// and block, one register's int32 lanes gather the 8 rows' exact
//     isum_r = sum_i u_i(r) q_i - z S
// (u the unsigned quants: maddubs then madd on AVX2, vpdpbusd on AVX-512; z the zero point, Q4_0 8,
// Q5_0 16, Q8_0 128 where its quants are read as w + 128, or none where AVX2 multiplies them signed),
// then the float work of the 8 rows at once, k_scaled:  acc += (d * dx) * isum, and for Q4_1 also
// acc += m * (dx * S).  So per 32 weights one multiply-add per 8 rows, where a row-at-a-time kernel
// pays one per row.  Sums: a maddubs pair at most 2 x 31 x 127 (4-5 bits; four of them still fit in
// int16) or 2 x 127 x 127 (Q8_0, signed); a block's sum at most 32 x 255 x 127 < 2^31.

// Where a packed block keeps its parts.
constexpr int b32_bytes(int64_t id) { return id == 8 ? 272 : id == 2 ? 144 : id == 3 ? 160 : 176; }
constexpr int b32_qs(int64_t id) { return id == 8 ? 16 : id == 2 ? 16 : id == 3 ? 32 : 48; }
constexpr int b32_zero_point(int64_t id) { return id == 2 ? 8 : id == 6 ? 16 : 0; }  // Q8_0's: see above

template <bool kPack>
void move_b32(int64_t id, uint8_t* g, uint8_t* p, int r) {
  mv<kPack>(g, p + 2 * r, 2);  // d
  if (id == 8) {
    for (int b = 0; b < 4; ++b) mv<kPack>(g + 2 + 8 * b, p + 16 + 64 * b + 8 * r, 8);
    return;
  }
  const int qs_in = id == 3 ? 4 : id == 6 ? 6 : 2;  // where the GGUF block keeps qs
  if (id == 3) mv<kPack>(g + 2, p + 16 + 2 * r, 2);  // m
  if (id == 6)
    for (int b = 0; b < 4; ++b) mv<kPack>(g + 2 + b, p + 16 + 8 * b + r, 1);  // qh, byte b
  for (int h = 0; h < 2; ++h) mv<kPack>(g + qs_in + 8 * h, p + b32_qs(id) + 64 * h + 8 * r, 8);
}

// Activations for the 32-weight blocks: q [M, K], dx and S [M, K/32].
struct QActs32 {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> sums;
  int64_t K, blocks;
  const int8_t* x(int64_t m, int64_t blk) const { return q.data() + m * K + blk * 32; }
  float scale(int64_t m, int64_t blk) const { return dx[m * blocks + blk]; }
  int32_t sum(int64_t m, int64_t blk) const { return sums[m * blocks + blk]; }
};

template <typename T>
QActs32 quantize_acts_32(const T* x, int64_t M, int64_t K) {
  QActs32 a;
  a.K = K;
  a.blocks = K / 32;
  a.q.resize(static_cast<size_t>(M * K));
  a.dx.resize(static_cast<size_t>(M * a.blocks));
  a.sums.resize(static_cast<size_t>(M * a.blocks));
  at::parallel_for(0, M, std::max<int64_t>(8, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t blk = 0; blk < a.blocks; ++blk) {
        int s16[2];
        a.dx[m * a.blocks + blk] = round_group(x + m * K + blk * 32, 32, a.q.data() + m * K + blk * 32, s16);
        a.sums[m * a.blocks + blk] = s16[0] + s16[1];
      }
  });
  return a;
}

#if defined(__AVX2__) && defined(__FMA__)
// L-block lb's unsigned quants of rows 4 h .. 4 h + 3 (Q4_0, Q4_1, Q5_0: nibbles, with Q5_0's fifth
// bits).
template <int64_t kType>
inline __m256i b32_nibbles_256(const uint8_t* b, int lb, int h) {
  const __m256i nib = load32b(b + b32_qs(kType) + 64 * (lb & 1) + 32 * h);
  __m256i u = _mm256_and_si256(lb < 2 ? nib : _mm256_srli_epi16(nib, 4), _mm256_set1_epi8(0x0f));
  if (kType == 6) {
    uint32_t bits;
    std::memcpy(&bits, b + 16 + 8 * lb + 4 * h, 4);  // rows 4 h .. 4 h + 3: bit 8 r' + l, weight 8 lb + l
    u = _mm256_or_si256(u, bits_to_16s(bits));
  }
  return u;
}

// A block's float work for activation rows m .. m + C - 1 (256-bit kernels): the 8 rows' sums (rows
// 0-3 in isum[0], 4-7 in isum[1]) less kZero times the activation's block sum, scaled into acc; Q4_1
// also adds its m term.
template <int C, int64_t kType, int kZero>
inline void b32_scale_256(const uint8_t* b, const QActs32& a, int64_t m, int64_t blk, const __m256i (*isum)[C],
                          __m256* acc) {
  const __m256 d8 = fp16x8(b);
  for (int c = 0; c < C; ++c) {
    __m256i i8 = pair_sums_256(isum[0][c], isum[1][c]);
    if (kZero != 0) i8 = _mm256_sub_epi32(i8, _mm256_set1_epi32(kZero * a.sum(m + c, blk)));
    const float dx = a.scale(m + c, blk);
    acc[c] = k_scaled(acc[c], i8, d8, dx);
    if (kType == 3) acc[c] = _mm256_fmadd_ps(fp16x8(b + 16), _mm256_set1_ps(dx * static_cast<float>(a.sum(m + c, blk))), acc[c]);
  }
}

// Packed group `w` (K / 32 blocks) times activation rows m .. m + C - 1: y[c * ldy + r], rows 0-3 and
// 4-7 in turn (h).
template <int C, int64_t kType>
void b32_group(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  constexpr int kBytes = b32_bytes(kType);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t blk = 0; blk < a.blocks; ++blk) {
    const uint8_t* b = w + blk * kBytes;
    ahead.unit(blk, kBytes);
    __m256i isum[2][C];
    for (int h = 0; h < 2; ++h) {
      if (kType == 8) {  // signed quants: |w| times q with w's sign, pair sums up to 2 x 127 x 127
        for (int c = 0; c < C; ++c) isum[h][c] = _mm256_setzero_si256();
        for (int lb = 0; lb < 4; ++lb) {
          const __m256i v = load32b(b + 16 + 64 * lb + 32 * h), av = _mm256_abs_epi8(v);
          for (int c = 0; c < C; ++c) {
            const __m256i xq = _mm256_set1_epi64x(load64(a.x(m + c, blk) + 8 * lb));
            isum[h][c] = _mm256_add_epi32(isum[h][c], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xq, v)), ones));
          }
        }
        continue;
      }
      __m256i s16[C];  // int16 pair sums of the 4 l-blocks: at most 4 x 2 x 31 x 127
      for (int c = 0; c < C; ++c) s16[c] = _mm256_setzero_si256();
      for (int lb = 0; lb < 4; ++lb) {
        const __m256i u = b32_nibbles_256<kType>(b, lb, h);
        for (int c = 0; c < C; ++c)
          s16[c] = _mm256_add_epi16(s16[c], _mm256_maddubs_epi16(u, _mm256_set1_epi64x(load64(a.x(m + c, blk) + 8 * lb))));
      }
      for (int c = 0; c < C; ++c) isum[h][c] = _mm256_madd_epi16(s16[c], ones);
    }
    b32_scale_256<C, kType, b32_zero_point(kType)>(b, a, m, blk, isum, acc);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}
#else  // portable: the same integer sums, then the same float operations per row
template <int C, int64_t kType>
void b32_group(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  constexpr int kBytes = b32_bytes(kType), kQs = b32_qs(kType);
  using U = std::conditional_t<kType == 8, int8_t, uint8_t>;
  using Acc = std::conditional_t<kType == 8, int32_t, int16_t>;  // Q8_0: 4 * 8 products of up to 128 * 127
  float acc[C][kPackRows] = {};
  for (int64_t blk = 0; blk < a.blocks; ++blk) {
    const uint8_t* b = w + blk * kBytes;
    U u[4][64];  // the block's weights: [l-block][8 r + l]
    for (int lb = 0; lb < 4; ++lb)
      for (int r = 0; r < kPackRows; ++r)
        for (int l = 0; l < 8; ++l) {
          const int i = 8 * r + l;
          if constexpr (kType == 8) {
            u[lb][i] = static_cast<int8_t>(b[16 + 64 * lb + i]);
          } else {
            const uint8_t byte = b[kQs + 64 * (lb & 1) + i];
            int v = lb < 2 ? byte & 0x0f : byte >> 4;
            if (kType == 6) v |= ((b[16 + 8 * lb + r] >> l) & 1) << 4;  // row r's fifth bits: a byte
            u[lb][i] = static_cast<uint8_t>(v);
          }
        }
    for (int c = 0; c < C; ++c) {
      int32_t dot[kPackRows];
      dot_rows_8<4, Acc>(u, a.x(m + c, blk), dot);
      const float dx = a.scale(m + c, blk);
      for (int r = 0; r < kPackRows; ++r) {
        const int32_t isum = dot[r] - b32_zero_point(kType) * a.sum(m + c, blk);
        acc[c][r] = k_scaled_lane(acc[c][r], isum, fp16_to_f32(rd16(b + 2 * r)), dx);
        if (kType == 3) acc[c][r] = std::fma(fp16_to_f32(rd16(b + 16 + 2 * r)), dx * static_cast<float>(a.sum(m + c, blk)), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < kPackRows; ++r) y[c * ldy + r] = acc[c][r];
}
#endif

#if defined(MCSD_HAVE_512)
// 512-bit: a register holds all 8 rows and vpdpbusd takes the products to int32 in one instruction;
// Q8_0's quants are read as w + 128 (unsigned), so z = 128.  The same integers as the 256-bit kernel.
template <int C, int64_t kType>
MCSD_TARGET_512 void b32_group_512(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
  constexpr int kBytes = b32_bytes(kType), kQs = b32_qs(kType), kZero = kType == 8 ? 128 : b32_zero_point(kType);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t blk = 0; blk < a.blocks; ++blk) {
    const uint8_t* b = w + blk * kBytes;
    ahead.unit(blk, kBytes);
    __m512i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm512_setzero_si512();
    for (int lb = 0; lb < 4; ++lb) {
      __m512i u;
      if (kType == 8) {
        u = _mm512_xor_si512(_mm512_loadu_si512(b + 16 + 64 * lb), _mm512_set1_epi8(static_cast<char>(0x80)));
      } else {
        const __m512i nib = _mm512_loadu_si512(b + kQs + 64 * (lb & 1));
        u = _mm512_and_si512(lb < 2 ? nib : _mm512_srli_epi16(nib, 4), low4);
        if (kType == 6) {
          uint64_t bits;
          std::memcpy(&bits, b + 16 + 8 * lb, 8);  // bit 8 r + l: row r, weight 8 lb + l
          u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
        }
      }
      for (int c = 0; c < C; ++c)
        isum[c] = _mm512_dpbusd_epi32(isum[c], u, _mm512_set1_epi64(load64(a.x(m + c, blk) + 8 * lb)));
    }
    const __m256 d8 = fp16x8(b);
    for (int c = 0; c < C; ++c) {
      __m256i i8 = pair_sums_512(isum[c]);
      if (kZero != 0) i8 = _mm256_sub_epi32(i8, _mm256_set1_epi32(kZero * a.sum(m + c, blk)));
      const float dx = a.scale(m + c, blk);
      acc[c] = k_scaled(acc[c], i8, d8, dx);
      if (kType == 3) acc[c] = _mm256_fmadd_ps(fp16x8(b + 16), _mm256_set1_ps(dx * static_cast<float>(a.sum(m + c, blk))), acc[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}
#endif

#if defined(MCSD_HAVE_VNNI256)
// AVX-VNNI, 256-bit: b32_group_512's integer steps on rows 0-3 and 4-7 in turn (h), vpdpbusd taking
// every l-block's products to int32 where the AVX2 kernel takes maddubs, 16-bit adds and a madd.  The
// same integers (Q8_0 read as w + 128, z = 128), then the same float work: bitwise b32_group's results.
template <int C, int64_t kType>
MCSD_TARGET_VNNI256 void b32_group_vnni(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy,
                                        Ahead ahead) {
  constexpr int kBytes = b32_bytes(kType);
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < a.blocks; ++blk) {
    const uint8_t* b = w + blk * kBytes;
    ahead.unit(blk, kBytes);
    __m256i isum[2][C];
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < C; ++c) isum[h][c] = _mm256_setzero_si256();
      for (int lb = 0; lb < 4; ++lb) {
        const __m256i u = kType == 8 ? _mm256_xor_si256(load32b(b + 16 + 64 * lb + 32 * h), _mm256_set1_epi8(static_cast<char>(0x80)))
                                     : b32_nibbles_256<kType>(b, lb, h);
        for (int c = 0; c < C; ++c)
          isum[h][c] = _mm256_dpbusd_avx_epi32(isum[h][c], u, _mm256_set1_epi64x(load64(a.x(m + c, blk) + 8 * lb)));
      }
    }
    b32_scale_256<C, kType, kType == 8 ? 128 : b32_zero_point(kType)>(b, a, m, blk, isum, acc);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}
#endif

// ------------------------------------------------------------------------------------ the driver
template <typename Acts>
using GroupFn = void (*)(const uint8_t*, const Acts&, int64_t, float*, int64_t, Ahead);

// A type's kernels by activation rows per call, indexed by that count: the 256-bit (or portable) ones
// for 1-4 rows (1-8 for the k-quants on AVX2, whose dword-layout kernels fit 8 rows' accumulators in
// the registers) and the 512-bit ones for 1-16 (null: none in this build).  A call runs its rows in
// passes over each group (packed_linear): all in one pass if they are at most `single`, else passes
// of `most` rows and one for the rest.  A pass unpacks the weights once for all its rows, so fewer passes cost less,
// up to the row count where a kernel's accumulators no longer fit in the registers.  The 512-bit
// kernels take up to 16 rows in one pass (14 for the 32-weight blocks, whose 15 and 16 spilled), longer
// calls in passes of 8 (wider ones were slower for Q4_K at many rows); 9-14 rows in one pass beat 8 and
// the rest in two.
constexpr int kWideMost = 16;
template <typename Acts>
struct GroupKernels {
  GroupFn<Acts> rows[9];  // 1-narrow_most rows
  GroupFn<Acts> wide[kWideMost + 1];
  GroupFn<Acts> vnni[5] = {};  // 256-bit with AVX-VNNI, 1-4 rows (null: none for this type or build)
  int wide_single = kWideMost;  // the most rows of one 512-bit pass
  int narrow_most = 4;          // the most rows of one 256-bit (or portable) pass
};

#if defined(MCSD_HAVE_512)
#define WIDE(f) {nullptr, f<1>, f<2>, f<3>, f<4>, f<5>, f<6>, f<7>, f<8>, f<9>, f<10>, f<11>, f<12>, f<13>, f<14>, f<15>, f<16>}
#else
#define WIDE(f) {}
#endif
#define NARROW(f) {nullptr, f<1>, f<2>, f<3>, f<4>}
#if defined(__AVX2__) && defined(__FMA__)
#define NARROW8(f) {nullptr, f<1>, f<2>, f<3>, f<4>, f<5>, f<6>, f<7>, f<8>}
constexpr int kNarrowK4 = 8;
#else
#define NARROW8(f) NARROW(f)
constexpr int kNarrowK4 = 4;
#endif
#if defined(MCSD_HAVE_VNNI256)
#define VNNI(f) NARROW(f)
#else
#define VNNI(f) {}
#endif
template <int C>
void q4k_group(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { k4_group<C, false>(w, a, m, y, ldy, ahead); }
template <int C>
void q5k_group(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { k4_group<C, true>(w, a, m, y, ldy, ahead); }
// Q6_K on AVX2: passes of up to 4 rows by q6k_group, of 5-8 by q6k_group_dw, whose rearranging of the
// weights costs more than it saves below 5 rows (gate_up in L2, one thread: 4 rows 144 against 136
// cycles a packed super-block and row, 8 rows 115 against 123 for two passes of 4).
template <int C>
void q6k_group_sel(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy, Ahead ahead) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (C > 4) {
    q6k_group_dw<C>(w, a, m, y, ldy, ahead);
    return;
  }
#endif
  q6k_group<C>(w, a, m, y, ldy, ahead);
}
#define B32(f, id)                                                                                     \
  template <int C>                                                                                     \
  void f(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { b32_group<C, id>(w, a, m, y, ldy, ahead); }
B32(q4_0_group, 2)
B32(q4_1_group, 3)
B32(q5_0_group, 6)
B32(q8_0_group, 8)
#undef B32
#if defined(MCSD_HAVE_512)
#define B32(f, id)                                                                                     \
  template <int C>                                                                                     \
  void f(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { b32_group_512<C, id>(w, a, m, y, ldy, ahead); }
B32(q4_0_group_512, 2)
B32(q4_1_group_512, 3)
B32(q5_0_group_512, 6)
B32(q8_0_group_512, 8)
#undef B32
#endif
#if defined(MCSD_HAVE_VNNI256)
#define B32(f, id)                                                                                     \
  template <int C>                                                                                     \
  void f(const uint8_t* w, const QActs32& a, int64_t m, float* y, int64_t ldy, Ahead ahead) { b32_group_vnni<C, id>(w, a, m, y, ldy, ahead); }
B32(q4_0_group_vnni, 2)
B32(q4_1_group_vnni, 3)
B32(q5_0_group_vnni, 6)
B32(q8_0_group_vnni, 8)
#undef B32
#endif

const GroupKernels<QActsK>& k_kernels(int64_t id) {
  static const GroupKernels<QActsK> q4k{NARROW8(q4k_group), WIDE(q4k_group_512), VNNI(q4k_group_vnni), kWideMost, kNarrowK4};
  static const GroupKernels<QActsK> q5k{NARROW8(q5k_group), WIDE(q5k_group_512), {}, kWideMost, kNarrowK4};
  static const GroupKernels<QActsK> q6k{NARROW8(q6k_group_sel), WIDE(q6k_group_512), {}, kWideMost, kNarrowK4};
  return id == 12 ? q4k : id == 13 ? q5k : q6k;
}

const GroupKernels<QActs32>& b32_kernels(int64_t id) {
  static const GroupKernels<QActs32> q4_0{NARROW(q4_0_group), WIDE(q4_0_group_512), VNNI(q4_0_group_vnni), 14};
  static const GroupKernels<QActs32> q4_1{NARROW(q4_1_group), WIDE(q4_1_group_512), VNNI(q4_1_group_vnni), 14};
  static const GroupKernels<QActs32> q5_0{NARROW(q5_0_group), WIDE(q5_0_group_512), VNNI(q5_0_group_vnni), 14};
  static const GroupKernels<QActs32> q8_0{NARROW(q8_0_group), WIDE(q8_0_group_512), VNNI(q8_0_group_vnni), 14};
  return id == 2 ? q4_0 : id == 3 ? q4_1 : id == 6 ? q5_0 : q8_0;
}
#undef VNNI
#undef WIDE
#undef NARROW
#undef NARROW8

// Which kernels run: the 512-bit ones where the CPU has them, else the AVX-VNNI ones where it has
// those, unless MCSD_CPU_ISA (read once: avx2, or avxvnni to stand in for a CPU without AVX-512) or
// quant_isa() says otherwise.  All give the same bits; this is for timing and tests.
enum class Isa { kNarrow, kVnni256, kWide };
std::atomic<Isa> g_isa{[] {
  const char* env = std::getenv("MCSD_CPU_ISA");
  const std::string want = env != nullptr ? env : "";
  if (want == "avx2") return Isa::kNarrow;
  if (want != "avxvnni" && cpu_has_512()) return Isa::kWide;
  return cpu_has_vnni256() ? Isa::kVnni256 : Isa::kNarrow;
}()};

// Where packed_linear's outputs go: y [M, N] in fp32 or bf16, plus an optional fp32 bias of N.
struct Out {
  float* f32 = nullptr;          // one of these two
  c10::BFloat16* bf16 = nullptr;
  const float* bias = nullptr;
  bool direct() const { return bf16 == nullptr && bias == nullptr; }  // the kernels write y themselves
};

// Outputs [rows, cols] of a chunk, in fp32 (ld apart), finished into `out` at column n0: + bias in fp32,
// then rounded to bf16 (ties to even, as c10 rounds) where y is bf16.  The same operations as adding
// the bias and converting the fp32 result afterwards, done while the chunk is in cache.
void finish(const float* buf, int64_t ld, int64_t rows, int64_t cols, const Out& out, int64_t N, int64_t n0) {
  const float* bias = out.bias != nullptr ? out.bias + n0 : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = buf + r * ld;
    int64_t j = 0;
#if defined(__AVX2__)
    for (; j + 8 <= cols; j += 8) {
      __m256 v = _mm256_loadu_ps(src + j);
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
      if (out.bf16 != nullptr)
        mcsd::store_bf16(out.bf16 + r * N + n0 + j, mcsd::round_bf16(v));
      else
        _mm256_storeu_ps(out.f32 + r * N + n0 + j, v);
    }
#endif
    for (; j < cols; ++j) {
      const float v = bias != nullptr ? src[j] + bias[j] : src[j];
      if (out.bf16 != nullptr)
        out.bf16[r * N + n0 + j] = static_cast<c10::BFloat16>(v);
      else
        out.f32[r * N + n0 + j] = v;
    }
  }
}

// y [M, 8 G] for a packed weight of G groups (group_bytes each): threads split the groups; each group
// meets the activation rows in passes (up to 16 rows in one on 512 bits, else 8 at a time; 4 on 256
// bits: GroupKernels), so its bytes are read from memory once and from L1 after.  Unless y is fp32 without a bias (the kernels then write it), a chunk's
// outputs go to a per-thread fp32 buffer and are finished into y chunk by chunk.
template <typename Acts>
void packed_linear(const GroupKernels<Acts>& k, const uint8_t* wp, int64_t G, int64_t group_bytes, const Acts& a,
                   int64_t M, int64_t K, const Out& out) {
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  const bool wide = isa == Isa::kWide && k.wide[kWideMost] != nullptr;
  const GroupFn<Acts>* rows = wide ? k.wide : isa == Isa::kVnni256 && k.vnni[4] != nullptr ? k.vnni : k.rows;
  const int64_t narrow = rows == k.rows ? k.narrow_most : 4;
  const int64_t most = wide ? 8 : narrow;  // activation rows per pass, while more than `single` are left
  const int64_t single = wide ? k.wide_single : narrow;
  const int64_t N = kPackRows * G;
  // Groups go in chunks of about kChunkBytes, which stay in the core's L2 while every panel of
  // activation rows (in L1) passes over them: each activation byte is then read from L2 once per
  // chunk, not once per group.  The chunking only orders the work: every output is computed by the
  // same operations.
  constexpr int64_t kChunkBytes = 160 << 10;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, std::min(kChunkBytes / group_bytes, (G + 4 * threads - 1) / (4 * threads)));
  const int64_t chunks = (G + chunk - 1) / chunk;
  // Small calls run inline (a parallel region costs more than they do).
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, kPackRows * chunk * K * M));
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    const uint8_t* end = wp + std::min(G, c1 * chunk) * group_bytes;  // this thread's last group
    std::vector<float> buf(out.direct() ? 0 : M * kPackRows * chunk);
    const int64_t ldy = out.direct() ? N : kPackRows * chunk;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * chunk, g1 = std::min(G, g0 + chunk);
      float* yp = out.direct() ? out.f32 + kPackRows * g0 : buf.data();  // where group g0's outputs go
      bool first = true;  // the chunk's first pass reads it from memory (prefetching ahead), the others from L2
      const auto pass = [&](GroupFn<Acts> rows, int64_t m) {
        for (int64_t g = g0; g < g1; ++g) {
          const Ahead ahead{first ? wp + g * group_bytes + kPrefetchBytes : nullptr, end};
          rows(wp + g * group_bytes, a, m, yp + m * ldy + kPackRows * (g - g0), ldy, ahead);
        }
        first = false;
      };
      // A call of up to `single` rows in one pass, a longer one in passes of `most` and one for the
      // rest: a pass unpacks the group's weights once for all its rows, so 7 rows in one pass cost less
      // than 4 + 2 + 1 in three (more than 8 rows in one), and 12 in one less than 8 + 4.
      int64_t m = 0;
      if (M > single)
        for (; m + most <= M; m += most) pass(rows[most], m);
      if (m < M) pass(rows[M - m], m);
      if (!out.direct()) finish(buf.data(), ldy, M, kPackRows * (g1 - g0), out, N, kPackRows * g0);
    }
  });
}

// Bytes of one packed unit (8 rows' super-block or block), and moving one row's unit in or out.
int packed_bytes(int64_t id) { return is_k_quant(id) ? k_packed_bytes(id) : b32_bytes(id); }

template <bool kPack>
void move_unit(int64_t id, uint8_t* g, uint8_t* p, int r) {
  if (is_k_quant(id))
    move_super<kPack>(id, g, p, r);
  else
    move_b32<kPack>(id, g, p, r);
}

// A packed weight: uint8 [G, K / B * packed bytes].
void check_packed(const at::Tensor& w, int64_t type, int64_t K) {
  const BlockType& t = block_type(type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quant_linear: a packed weight must be a contiguous 2-D uint8 CPU tensor (quant_pack's)");
  TORCH_CHECK(K > 0 && K % t.block == 0, "quant_linear: K = ", K, " is not a multiple of the ", t.name,
              " block size ", t.block);
  TORCH_CHECK(w.size(1) == K / t.block * packed_bytes(type), "quant_linear: packed ", t.name, " groups of K = ", K,
              " take ", K / t.block * packed_bytes(type), " bytes, the weight has ", w.size(1));
}

// A weight's GGUF rows [N, row_bytes] packed in groups of 8 rows: [ceil(N / 8), K / B * packed bytes],
// the last group padded with zero rows (whose products are 0).
at::Tensor quant_pack(const at::Tensor& w, int64_t type, int64_t K) {
  const BlockType& t = check_weight(w, type, K);
  const int64_t N = w.size(0), G = (N + kPackRows - 1) / kPackRows, units = K / t.block, pb = packed_bytes(type);
  at::Tensor out = at::zeros({G, units * pb}, w.options());
  uint8_t* src = w.data_ptr<uint8_t>();  // only read: move_unit<true> copies from it
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int r = 0; r < kPackRows && g * kPackRows + r < N; ++r)
        for (int64_t u = 0; u < units; ++u)
          move_unit<true>(type, src + (g * kPackRows + r) * w.size(1) + u * t.bytes, dst + (g * units + u) * pb, r);
  });
  return out;
}

// Rows `rows` of a packed weight as GGUF bytes, uint8 [len(rows), row_bytes].
at::Tensor quant_unpack(const at::Tensor& w, int64_t type, int64_t K, const at::Tensor& rows) {
  check_packed(w, type, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.device().is_cpu(),
              "quant_unpack: rows must be a 1-D int64 CPU tensor");
  const BlockType& t = block_type(type);
  const int64_t units = K / t.block, pb = packed_bytes(type), N = kPackRows * w.size(0), R = rows.size(0);
  const at::Tensor idx = rows.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "quant_unpack: row ", ip[i], " is outside the weight's ", N, " rows");
  at::Tensor out = at::empty({R, units * t.bytes}, w.options());
  uint8_t* src = w.data_ptr<uint8_t>();  // only read: move_unit<false> copies from it
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, R, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = ip[i] / kPackRows;
      const int r = static_cast<int>(ip[i] % kPackRows);
      for (int64_t u = 0; u < units; ++u)
        move_unit<false>(type, dst + (i * units + u) * t.bytes, src + (g * units + u) * pb, r);
    }
  });
  return out;
}

// x @ W^T (+ bias) in fp32 for a packed weight (type | kPackedFlag), returned in x's dtype, in one
// operator call per linear: fp32 or bf16 activations are read as they are, and the bias and the
// rounding to bf16 are done chunk by chunk while the outputs are in cache (the same fp32 operations and
// rounding as doing them apart).  Other dtypes go through fp32.
at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K,
                        const std::optional<at::Tensor>& bias) {
  if ((type & kPackedFlag) == 0) {
    check_weight(w, type, K);
    TORCH_CHECK(false, "quant_linear: ", block_type(type).name, " weights run packed: quant_pack them and pass type ",
                type | kPackedFlag);
  }
  type &= ~kPackedFlag;
  check_packed(w, type, K);
  TORCH_CHECK(x_in.size(-1) == K, "quant_linear: x has ", x_in.size(-1), " columns, the weight K = ", K);
  const at::ScalarType dtype = x_in.scalar_type();
  const bool native = dtype == at::kFloat || dtype == at::kBFloat16;
  const at::Tensor x = native ? x_in.reshape({-1, K}).contiguous() : x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), G = w.size(0), N = kPackRows * G, group_bytes = w.size(1);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "quant_linear: the bias needs one value per output (", N,
                "), got shape ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.reshape(out_shape).to(dtype);
  Out out;
  out.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto run = [&](const auto* xp) {
    if (is_k_quant(type))
      packed_linear(k_kernels(type), wp, G, group_bytes, quantize_acts_k(xp, M, K, type == 14 ? 16 : 32), M, K, out);
    else
      packed_linear(b32_kernels(type), wp, G, group_bytes, quantize_acts_32(xp, M, K), M, K, out);
  };
  if (x.scalar_type() == at::kBFloat16) {  // y has x's dtype
    out.bf16 = y.data_ptr<c10::BFloat16>();
    run(x.data_ptr<c10::BFloat16>());
  } else {
    out.f32 = y.data_ptr<float>();
    run(x.data_ptr<float>());
  }
  y = y.reshape(out_shape);
  return native ? y : y.to(dtype);
}

at::Tensor quant_dequantize(const at::Tensor& w, int64_t type, int64_t K) {
  const BlockType& t = check_weight(w, type, K);
  const int64_t N = w.size(0), nblocks = K / t.block, row_bytes = w.size(1);
  at::Tensor y = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t blk = 0; blk < nblocks; ++blk) t.deq(wp + n * row_bytes + blk * t.bytes, yp + n * K + blk * t.block);
  });
  return y;
}

// "avx512", "avxvnni" or "avx2" (or "portable"): the quantized kernels in use ("avxvnni": the 256-bit
// ones, with AVX-VNNI where a type has such a kernel: Q4_K and the 32-weight types); `set` (one of
// those, "" to only ask) switches them, and asking for kernels the CPU lacks is an error.
std::string quant_isa(const std::string& set) {
#if defined(__AVX2__)
  const std::string narrow = "avx2";
#else
  const std::string narrow = "portable";
#endif
  if (set == "avx512") {
    TORCH_CHECK(cpu_has_512(), "quant_isa: this CPU (or build) has no AVX-512 with VNNI");
    g_isa = Isa::kWide;
  } else if (set == "avxvnni") {
    TORCH_CHECK(cpu_has_vnni256(), "quant_isa: this CPU (or build) has no AVX-VNNI");
    g_isa = Isa::kVnni256;
  } else if (set == "avx2" || set == "portable") {
    g_isa = Isa::kNarrow;
  } else {
    TORCH_CHECK(set.empty(), "quant_isa: expected 'avx512', 'avxvnni', 'avx2' or '', got '", set, "'");
  }
  const Isa isa = g_isa.load();
  return isa == Isa::kWide ? "avx512" : isa == Isa::kVnni256 ? "avxvnni" : narrow;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcsd_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int type, int K, Tensor? bias=None) -> Tensor");
  m.def("quant_dequantize(Tensor weight, int type, int K) -> Tensor");
  m.def("quant_pack(Tensor weight, int type, int K) -> Tensor");
  m.def("quant_unpack(Tensor weight, int type, int K, Tensor rows) -> Tensor");
  m.def("quant_isa(str set='') -> str", &quant_isa);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_unpack", &quant_unpack);
}
