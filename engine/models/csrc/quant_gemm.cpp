// GGUF block-quantized weights, multiplied in place:  y[M, N] = x[M, K] @ dequant(W)[N, K]^T  (fp32).
//
// Built with bf16_gemm.cpp into one library by engine/models/cpu_kernels.py; registers
// torch.ops.mcsd_cpu.quant_linear (x, weight, type, K, bias?: fp32 math, the result in x's dtype) and
// torch.ops.mcsd_cpu.quant_dequantize.
//
// Weights.  W is the GGUF tensor's own bytes, uint8 [N, row_bytes]: each row is K / B blocks of
// the type's layout (B = 32 for Q4_0, Q4_1, Q5_0, Q8_0; B = 256 for the k-quants Q4_K, Q5_K, Q6_K),
// exactly as llama.cpp writes them, so a GGUF file is used as it is: no conversion, no copy.
//
// How.  Integer dot products on activations quantized to int8 per 32 or, for the k-quants, per 256
// (see "the product" below); the
// dequantizers here serve quant_dequantize (embedding rows, tests).  Dequantized values follow the
// `gguf` package's formulas (fp32 d * scale * q - dmin * m).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

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
// Integer dot products, as llama.cpp's ggml-cpu does them (our own code).  Two kernels, one per
// family of layouts; a type always takes the same one, so each is batch-invariant on its own.
//
// The 32-weight types (Q4_0, Q4_1, Q5_0, Q8_0).  Per call:
//  1. Activations.  Each row of x is quantized per group of 32: scale dx = max|x| / 127 (fp32) and
//     int8 q = round(x / dx) (nearest, ties to even), plus, per 16, the scaled sum dx * sum(q).
//  2. Weights.  A thread takes 4 weight rows at a time and unpacks their blocks into a small scratch
//     (in L1/L2): per weight one byte, unsigned 0..31 (Q8_0: signed -128..127), per group of 32 an
//     fp32 scale dg, and per 16 an fp32 "offset" coefficient mn (Q4_1's mins, and the -8 / -16 zero
//     points of Q4_0 / Q5_0, which keep the bytes unsigned).  So a weight is dg * u + mn.
//  3. The product of weight row r and activation row c is
//         sum_g (dg * dx_g) * int32(sum_{i in g} u_i * q_i)  +  sum_{h of 16} mn_h * (dx * sum q)_h,
//     the first with maddubs / madd (32 products per instruction pair) into 8 fp32 lanes, the second a
//     short fp32 dot over K / 16 terms.
// Folding 4 weight rows into one vector (hadd) shares each activation load and each float
// multiply-add among 4 rows, which pays from a few activation rows on.  (Unpacking in registers with
// one multiply-add per block and row, as the k-quants below do, was 10-20% faster at one row and up
// to 1.6x slower at 8 to 64 rows, measured.)
//
// The k-quants (Q4_K, Q5_K, Q6_K) are multiplied straight from their blocks: see "k-quants, direct".
//
// Numerics (batch invariance).  The integer sums are exact; every float operation of y[m, n] is the
// same whatever M is, whatever the other rows hold and however many threads run (lane l of the
// accumulator takes the groups in increasing order, then a fixed reduction), so greedy speculative
// decoding sees exactly the logits of single-row decoding steps.  Against fp32 math the error is the
// activation rounding: at most sum_k |w_k| * dx_{g(k)} / 2 (tests/engine/models/test_qweight.py
// checks that bound).

constexpr int kGroup = 32;
constexpr int kTileRows = 4;   // weight rows unpacked together
constexpr int64_t kPanel = 64;  // activation rows per pass over a tile

inline int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

// Rounds one group of n activations (n a multiple of 16) to int8: q = round(x / dx), nearest, ties to
// even, with dx = max|x| / 127.  Writes q and the exact integer sum of each 16; returns dx.
inline float round_group(const float* x, int n, int8_t* q, int* sums16) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int h = 0; h < n / 16; ++h) {
    int sum = 0;
    for (int i = 16 * h; i < 16 * h + 16; ++i) {
      const int v = static_cast<int>(std::nearbyint(x[i] * id));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    sums16[h] = sum;
  }
  return d;
}

// The quantized activations of M rows, row-major: q [M, K], dx [M, K/32], s16 [M, pad8(K/16)].
struct QActs {
  std::vector<int8_t> q;
  std::vector<float> dx, s16;
  int64_t K, groups, halves;  // halves = pad8(K / 16), the row stride of s16 (zero tail)
};

QActs quantize_acts(const float* x, int64_t M, int64_t K) {
  QActs a;
  a.K = K;
  a.groups = K / kGroup;
  a.halves = pad8(K / 16);
  a.q.resize(static_cast<size_t>(M * K));
  a.dx.resize(static_cast<size_t>(M * a.groups));
  a.s16.assign(static_cast<size_t>(M * a.halves), 0.0f);
  at::parallel_for(0, M, std::max<int64_t>(8, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < a.groups; ++g) {
        int sum[2];
        const float d = round_group(x + m * K + g * kGroup, kGroup, a.q.data() + m * K + g * kGroup, sum);
        a.dx[m * a.groups + g] = d;
        a.s16[m * a.halves + 2 * g] = d * static_cast<float>(sum[0]);
        a.s16[m * a.halves + 2 * g + 1] = d * static_cast<float>(sum[1]);
      }
    }
  });
  return a;
}

// One weight row, unpacked: u [K] bytes, dg [K/32], mn [pad8(K/16)] (zero tail).
struct WRow {
  uint8_t* u;
  float* dg;
  float* mn;
};

// Byte work of the unpackers, AVX2 and portable.
#if defined(__AVX2__)
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i nib_lo32(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline __m256i nib_hi32(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }

// 32 bytes, 0x10 where bit i of `bits` is set (weight i), else 0.
inline __m256i bits_to_16s(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

// Q4_0 / Q4_1 / Q5_0 layout: 16 bytes hold weights j (low nibble) and j + 16 (high nibble).
inline void nibbles16(const uint8_t* qs, uint8_t* u, uint32_t fifth_bits) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0f);
  const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
  store32(u, _mm256_or_si256(q, bits_to_16s(fifth_bits)));
}

#else
inline void nibbles16(const uint8_t* qs, uint8_t* u, uint32_t fifth_bits) {
  for (int j = 0; j < 16; ++j) {
    u[j] = static_cast<uint8_t>((qs[j] & 0x0f) | (((fifth_bits >> j) & 1u) << 4));
    u[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((fifth_bits >> (j + 16)) & 1u) << 4));
  }
}

#endif

// Unpackers: block `b` into weights [0, 32) of u, group 0 of dg and halves 0, 1 of mn.
inline void unpack_q4_0(const uint8_t* b, uint8_t* u, float* dg, float* mn) {
  const float d = fp16_to_f32(rd16(b));
  nibbles16(b + 2, u, 0);
  dg[0] = d;
  mn[0] = mn[1] = -8.0f * d;
}

inline void unpack_q4_1(const uint8_t* b, uint8_t* u, float* dg, float* mn) {
  nibbles16(b + 4, u, 0);
  dg[0] = fp16_to_f32(rd16(b));
  mn[0] = mn[1] = fp16_to_f32(rd16(b + 2));
}

inline void unpack_q5_0(const uint8_t* b, uint8_t* u, float* dg, float* mn) {
  const float d = fp16_to_f32(rd16(b));
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  nibbles16(b + 6, u, qh);
  dg[0] = d;
  mn[0] = mn[1] = -16.0f * d;
}

inline void unpack_q8_0(const uint8_t* b, uint8_t* u, float* dg, float* mn) {
  std::memcpy(u, b + 2, 32);  // signed bytes, taken as such by the Q8_0 product
  dg[0] = fp16_to_f32(rd16(b));
  mn[0] = mn[1] = 0.0f;
}

using UnpackFn = void (*)(const uint8_t*, uint8_t*, float*, float*);

// Every kernel reads its weights once per call, front to back within a thread's range.  The hardware
// prefetcher alone left the one-row products waiting on memory: on a 2-core Xeon, Q4_K at one row read
// 8 GB/s, and 17-18 GB/s when the kernel asks for the bytes kPrefetchBytes ahead of the row it reads
// (8 to 64 weight rows ahead into L2 did about equally well; into L1 was slower, its fill buffers are
// few).  Prefetches never pass `end`, the end of the thread's range.
constexpr int64_t kPrefetchBytes = 16 << 10;

inline void prefetch(const uint8_t* p, const uint8_t* end) {
  if (p < end) __builtin_prefetch(p, 0, 2);  // into L2
}

inline void prefetch_lines(const uint8_t* p, int64_t bytes, const uint8_t* end) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch(p + off, end);
}

// A row of nblocks blocks of B weights (kBytes each, at most a cache line), prefetching ahead.
template <UnpackFn F, int B, int kBytes>
void unpack_row(const uint8_t* wr, int64_t nblocks, const uint8_t* end, const WRow& row) {
  static_assert(kBytes <= 64, "one prefetch per block must reach every cache line");
  constexpr int kGroups = B / kGroup;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* b = wr + blk * kBytes;
    prefetch(b + kPrefetchBytes, end);
    F(b, row.u + blk * B, row.dg + blk * kGroups, row.mn + blk * 2 * kGroups);
  }
}

struct Unpacker {
  int64_t id;
  void (*row)(const uint8_t*, int64_t, const uint8_t*, const WRow&);
  bool is_signed;  // Q8_0's bytes are signed and it has no offsets; the others' bytes are unsigned
};

constexpr Unpacker kUnpackers[] = {
    {2, unpack_row<unpack_q4_0, 32, 18>, false},
    {3, unpack_row<unpack_q4_1, 32, 20>, false},
    {6, unpack_row<unpack_q5_0, 32, 22>, false},
    {8, unpack_row<unpack_q8_0, 32, 34>, true},
};

const Unpacker& unpacker(int64_t id) {
  for (const auto& t : kUnpackers)
    if (t.id == id) return t;
  TORCH_CHECK(false, "quant_linear: no unpacker for type ", id);
}

// A tile: 4 unpacked weight rows (a short tile is padded with zero rows) and their group scales
// interleaved, dg4[4 g + r], so that one load gives the 4 rows' scales of group g.
struct WTile {
  WRow row[kTileRows];
  const float* dg4;
};

// The offset term of one (weight row, activation row) pair: a fixed-order dot over pad8(K / 16).
#if defined(__AVX2__) && defined(__FMA__)
using mcsd::reduce_lanes;

inline float offset_dot(const float* mn, const float* s16, int64_t halves) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t h = 0; h < halves; h += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mn + h), _mm256_loadu_ps(s16 + h), acc);
  return reduce_lanes(acc);
}

// The tile's 4 weight rows times C quantized activation rows: y[c * ldy + r], r < nrows.
// Per group g and activation row c, the 4 rows' sums are folded by three hadds into one vector of
// int32 (lanes r and 4 + r: row r; for the unsigned 4-5 bit weights the hadds run on int16, exact),
// converted, scaled by dg4[g] * dx[c, g] and added to one accumulator per c; at the end
// y[r] = lane r + lane 4 + r.  The same operations for every C.
template <int C, bool kSigned>
void micro(const WTile& w, int nrows, const QActs& a, int64_t m, float* y, int64_t ldy) {
  constexpr bool kOffsets = !kSigned;  // Q4_0 / Q4_1 / Q5_0 zero points and mins
  const int64_t groups = a.groups, K = a.K;
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i wv[kTileRows];
    for (int r = 0; r < kTileRows; ++r) wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.row[r].u + g * kGroup));
    const __m256 dg = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(w.dg4 + 4 * g));
    for (int c = 0; c < C; ++c) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (m + c) * K + g * kGroup));
      __m256i p[kTileRows], s;
      if (!kSigned) {  // weights < 32: a lane of 8 products fits int16 (8 * 31 * 127 < 2^15)
        for (int r = 0; r < kTileRows; ++r) p[r] = _mm256_maddubs_epi16(wv[r], xv);
        const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
        s = _mm256_madd_epi16(h, ones);
      } else {
        for (int r = 0; r < kTileRows; ++r)
          p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv[r], wv[r]), _mm256_sign_epi8(xv, wv[r])), ones);
        s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
      }
      const __m256 scale = _mm256_mul_ps(dg, _mm256_broadcast_ss(a.dx.data() + (m + c) * groups + g));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[c]);
    for (int r = 0; r < nrows; ++r) {
      float v = lanes[r] + lanes[4 + r];
      if (kOffsets) v += offset_dot(w.row[r].mn, a.s16.data() + (m + c) * a.halves, a.halves);
      y[c * ldy + r] = v;
    }
  }
}
#else  // portable: the same sums, one group at a time
inline float offset_dot(const float* mn, const float* s16, int64_t halves) {
  float acc = 0.0f;
  for (int64_t h = 0; h < halves; ++h) acc += mn[h] * s16[h];
  return acc;
}

template <int C, bool kSigned>
void micro(const WTile& w, int nrows, const QActs& a, int64_t m, float* y, int64_t ldy) {
  constexpr bool kOffsets = !kSigned;
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < nrows; ++r) {
      const int8_t* x = a.q.data() + (m + c) * a.K;
      const float* dx = a.dx.data() + (m + c) * a.groups;
      const WRow& row = w.row[r];
      float acc = 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        int32_t sum = 0;
        for (int i = 0; i < kGroup; ++i) {
          const int wi = kSigned ? static_cast<int8_t>(row.u[g * kGroup + i]) : row.u[g * kGroup + i];
          sum += wi * x[g * kGroup + i];
        }
        acc += static_cast<float>(sum) * (w.dg4[4 * g + r] * dx[g]);
      }
      if (kOffsets) acc += offset_dot(row.mn, a.s16.data() + (m + c) * a.halves, a.halves);
      y[c * ldy + r] = acc;
    }
}
#endif

template <bool kSigned>
void tile_times_panel(const WTile& w, int nrows, const QActs& a, int64_t m0, int64_t m1, float* y, int64_t N) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) micro<4, kSigned>(w, nrows, a, m, y + m * N, N);
  if (m1 - m >= 2) {
    micro<2, kSigned>(w, nrows, a, m, y + m * N, N);
    m += 2;
  }
  if (m < m1) micro<1, kSigned>(w, nrows, a, m, y + m * N, N);
}

// ------------------------------------------------------------------------------------ k-quants, direct
// Q4_K, Q5_K and Q6_K are multiplied straight from their blocks, the way llama.cpp's ggml-cpu
// pairs them with "Q8_K" activations (our own code):
//
//  1. Activations are rounded to int8 per 256 (one super-block): dx = max|x| / 127 (fp32), q =
//     round(x / dx), ties to even, and per 16 the exact sum of q (int16).
//  2. A weight row's super-block is unpacked in registers, never stored: nibbles (and fifth / high
//     bits) become unsigned bytes u, the 6-bit (Q4_K, Q5_K) or int8 (Q6_K) sub-block scales int16
//     lanes.  For every activation row c of the call (up to 4 at a time, sharing the unpacked bytes)
//        isum = sum_sub sc_sub * sum_{i in sub} u_i q_i          (maddubs, madd: int32, exact)
//     Q6_K's zero point -32 is subtracted in integers: isum -= 32 * sum_sub sc_sub * bsum_sub.
//     Q4_K / Q5_K's mins:  msum = sum_sub m_sub * bsum_sub (int32, exact).
//  3. Then once per super-block, in fp32 lanes:  acc += (d * dx) * isum,  acc_m += (dmin * dx) * msum,
//     and y = reduce(acc) - reduce(acc_m) with the fixed reduction of lanes.h.
//
// So one multiply-add in floats per 256 weights, and every float operation of y[m, n] is the same
// whatever M is and whichever rows share the call (batch-invariant).  Error against fp32 math: at
// most sum_k |w_k| dx_{sb(k)} / 2, dx now per 256.
//
// Sums stay in range: Q4_K / Q5_K 8 sub-blocks x 63 x 32 x 31 x 127 < 2^31; Q6_K 16 x 127 x 16 x 63
// x 127 < 2^31; a maddubs pair at most 2 x 63 x 127 < 2^15.

constexpr int kSuper = 256;

// Activations for the k-quants: q [M, K], dx [M, K/256], bsum [M, K/16] (int16, in weight order).
// `paired` (the Q4_K / Q5_K kernels): within every 128 values q holds the four 32-value pieces in the
// order 0, 2, 1, 3, so that the 64 bytes at 128 i pair the low nibbles of a 64-byte run of weight bytes
// (weights 128 i .. +31 and 128 i + 64 .. +95) and the 64 bytes after them the high nibbles: one load
// each in the 512-bit kernels.  The 256-bit ones read a piece wherever it is (xoff4).
struct QActsK {
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int16_t> bsum;
  int64_t K, supers;
};

// Where the paired layout keeps the 32 activations of Q4_K / Q5_K chunk j's low (half 0) or high
// (half 1) nibbles, i.e. weights 64 j + 32 half .. +31 of the super-block.
constexpr int xoff4(int j, int half) { return (j / 2) * 128 + half * 64 + (j % 2) * 32; }

QActsK quantize_acts_k(const float* x, int64_t M, int64_t K, bool paired) {
  QActsK a;
  a.K = K;
  a.supers = K / kSuper;
  a.q.resize(static_cast<size_t>(M * K));
  a.dx.resize(static_cast<size_t>(M * a.supers));
  a.bsum.resize(static_cast<size_t>(M * K / 16));
  at::parallel_for(0, M, std::max<int64_t>(8, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    int8_t q[kSuper];
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t s = 0; s < a.supers; ++s) {
        int sums[kSuper / 16];
        int8_t* out = a.q.data() + m * K + s * kSuper;
        a.dx[m * a.supers + s] = round_group(x + m * K + s * kSuper, kSuper, paired ? q : out, sums);
        if (paired)
          for (int j = 0; j < 4; ++j)
            for (int half = 0; half < 2; ++half) std::memcpy(out + xoff4(j, half), q + 64 * j + 32 * half, 32);
        int16_t* bs = a.bsum.data() + (m * K + s * kSuper) / 16;
        for (int h = 0; h < kSuper / 16; ++h) bs[h] = static_cast<int16_t>(sums[h]);
      }
    }
  });
  return a;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256i load_x(const QActsK& a, int64_t m, int64_t s, int off) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + m * a.K + s * kSuper + off));
}
inline __m256i load_bsum(const QActsK& a, int64_t m, int64_t s) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum.data() + (m * a.K + s * kSuper) / 16));
}
// 16 int16 lanes holding lane j of the 8 int16 in `v8` (j = 0..7, a compile-time constant).
template <int J>
inline __m256i lane16(__m256i v8x2) {
  const __m256i pick = _mm256_set1_epi16(static_cast<int16_t>((2 * J) | ((2 * J + 1) << 8)));
  return _mm256_shuffle_epi8(v8x2, pick);
}

// A Q4_K / Q5_K super-block's scales (bytes 0-7) and mins (8-15), built in a register: through memory,
// the 8-byte reload of two 4-byte stores missed store forwarding, in every super-block.
inline __m128i kscale_vec(const uint8_t* q) {
  const KScaleWords k = kscale_words(q);
  return _mm_set_epi32(static_cast<int>(k.w[3]), static_cast<int>(k.w[2]), static_cast<int>(k.w[1]),
                       static_cast<int>(k.w[0]));
}

// The only float arithmetic of the k-quant kernels, once per super-block s and activation row `row`:
// the exact integer sums scaled into the fp32 lanes (Q4_K / Q5_K: isum by d dx, the mins' sum by
// dmin dx).  The 256- and 512-bit kernels both call these, which is why their results are bitwise equal.
inline void k4_accumulate(__m256& acc, __m256& accm, __m256i isum, __m256i mins, const QActsK& a, int64_t row,
                          int64_t s, float d, float dmin) {
  const float dx = a.dx[row * a.supers + s];
  const __m256i msum = _mm256_madd_epi16(mins, load_bsum(a, row, s));
  acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(isum), acc);
  accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(msum), accm);
}

inline void q6k_accumulate(__m256& acc, __m256i isum, const QActsK& a, int64_t row, int64_t s, float d) {
  acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a.dx[row * a.supers + s]), _mm256_cvtepi32_ps(isum), acc);
}

// Q4_K (kFifth = false) and Q5_K: d, dmin, scales[12], [qh[32],] qs[128].  Weight row `w` (nsb
// super-blocks) times activation rows m .. m + C - 1: y[c * ldy].
template <int C, bool kFifth>
void k4_rows(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) {
  constexpr int kBytes = kFifth ? 176 : 144;
  __m256 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = accm[c] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kBytes;
    const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
    const __m128i sm = kscale_vec(b + 4);
    const __m256i sc2 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // the 8 scales as int16, in both halves
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  // m_j for bsums 2j, 2j+1
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    __m256i hbits = kFifth ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    __m256i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm256_setzero_si256();
    const auto chunk = [&](auto jc) {
      constexpr int j = decltype(jc)::value;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if (kFifth) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), one), 4));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
      const __m256i s0 = lane16<2 * j>(sc2), s1 = lane16<2 * j + 1>(sc2);
      for (int c = 0; c < C; ++c) {
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load_x(a, m + c, s, xoff4(j, 0))), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load_x(a, m + c, s, xoff4(j, 1))), s1);
        isum[c] = _mm256_add_epi32(isum[c], _mm256_add_epi32(p0, p1));
      }
    };
    chunk(std::integral_constant<int, 0>{});
    chunk(std::integral_constant<int, 1>{});
    chunk(std::integral_constant<int, 2>{});
    chunk(std::integral_constant<int, 3>{});
    for (int c = 0; c < C; ++c) {
      k4_accumulate(acc[c], accm[c], isum[c], mins, a, m + c, s, d, dmin);
    }
  }
  for (int c = 0; c < C; ++c) y[c * ldy] = mcsd::reduce_lanes(acc[c]) - mcsd::reduce_lanes(accm[c]);
}

// Q6_K: ql[128], qh[64], int8 scales[16], d.  Per half (128 weights) four runs of 32: run p takes
// the low (p < 2) or high nibbles of ql[32 (p % 2) ...] and bits 2p, 2p + 1 of qh; its two 16s have
// scales 2p and 2p + 1 of the half.
template <int C>
void q6k_rows(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), x30 = _mm256_set1_epi8(0x30);
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * 210;
    const float d = fp16_to_f32(rd16(b + 208));
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  // all 16 scales, int16
    __m256i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                                          _mm256_slli_epi32(_mm256_madd_epi16(sc16, load_bsum(a, m + c, s)), 5));
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = b + 64 * half;
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      // the half's 8 scales as int16, in both 128-bit halves: run p's pair is lanes 2p, 2p + 1
      const __m256i s8 = _mm256_broadcastsi128_si256(half == 0 ? _mm256_castsi256_si128(sc16)
                                                               : _mm256_extracti128_si256(sc16, 1));
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), x30)),
          _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), x30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, x30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(h, 2), x30))};
      const __m256i pick0 = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  //
                                             2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
      for (int p = 0; p < 4; ++p) {
        const __m256i sp = _mm256_shuffle_epi8(s8, _mm256_add_epi8(pick0, _mm256_set1_epi8(static_cast<char>(4 * p))));
        for (int c = 0; c < C; ++c) {
          const __m256i prod = _mm256_maddubs_epi16(u[p], load_x(a, m + c, s, 128 * half + 32 * p));
          isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(prod, sp));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      q6k_accumulate(acc[c], isum[c], a, m + c, s, d);
    }
  }
  for (int c = 0; c < C; ++c) y[c * ldy] = mcsd::reduce_lanes(acc[c]);
}
#else  // portable: the same integer sums per super-block, one float multiply-add each
template <int C, bool kFifth>
void k4_rows(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) {
  constexpr int kBytes = kFifth ? 176 : 144;
  for (int c = 0; c < C; ++c) {
    float acc = 0.0f, accm = 0.0f;
    for (int64_t s = 0; s < a.supers; ++s) {
      const uint8_t* b = w + s * kBytes;
      const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
      uint8_t sc8[8], m8[8];
      kscale_bytes(b + 4, sc8, m8);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (kFifth ? 48 : 16);
      const int8_t* x = a.q.data() + (m + c) * a.K + s * kSuper;
      const int16_t* bs = a.bsum.data() + ((m + c) * a.K + s * kSuper) / 16;
      int32_t isum = 0, msum = 0;
      for (int j = 0; j < 4; ++j) {
        int32_t lo = 0, hi = 0;
        for (int l = 0; l < 32; ++l) {
          const int h = kFifth ? qh[l] >> (2 * j) : 0;
          lo += ((qs[32 * j + l] & 0x0f) | ((h & 1) << 4)) * x[xoff4(j, 0) + l];
          hi += ((qs[32 * j + l] >> 4) | (((h >> 1) & 1) << 4)) * x[xoff4(j, 1) + l];
        }
        isum += sc8[2 * j] * lo + sc8[2 * j + 1] * hi;
      }
      for (int j = 0; j < 8; ++j) msum += m8[j] * (bs[2 * j] + bs[2 * j + 1]);
      const float dx = a.dx[(m + c) * a.supers + s];
      acc += (d * dx) * static_cast<float>(isum);
      accm += (dmin * dx) * static_cast<float>(msum);
    }
    y[c * ldy] = acc - accm;
  }
}

template <int C>
void q6k_rows(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) {
  for (int c = 0; c < C; ++c) {
    float acc = 0.0f;
    for (int64_t s = 0; s < a.supers; ++s) {
      const uint8_t* b = w + s * 210;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const int8_t* x = (a.q.data() + (m + c) * a.K + s * kSuper);
      int32_t isum = 0;
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = b + 64 * half;
        const uint8_t* qh = b + 128 + 32 * half;
        for (int p = 0; p < 4; ++p)
          for (int sub = 0; sub < 2; ++sub) {
            int32_t part = 0;
            for (int l = 16 * sub; l < 16 * sub + 16; ++l) {
              const int low = (p < 2 ? ql[32 * (p & 1) + l] : ql[32 * (p & 1) + l] >> 4) & 0x0f;
              const int u = low | (((qh[l] >> (2 * p)) & 3) << 4);
              part += (u - 32) * x[128 * half + 32 * p + l];
            }
            isum += sc[8 * half + 2 * p + sub] * part;
          }
      }
      acc += (fp16_to_f32(rd16(b + 208)) * a.dx[(m + c) * a.supers + s]) * static_cast<float>(isum);
    }
    y[c * ldy] = acc;
  }
}
#endif

// ------------------------------------------------------------------------------------ k-quants, 512-bit
// On CPUs with AVX-512 (F, BW, VL) and VNNI the same products run on 512-bit vectors: two 32-byte
// pieces of weight bytes per instruction, and vpdpwssd adds the sub-block scales' products to the int32
// sums in one instruction (madd, then add, above).  The 512-bit sum's two halves are added at the end,
// so lane l of the 256-bit sum holds exactly the integer products lane l holds in the 256-bit kernel:
// the same integers, then the 256-bit kernel's float operations.  Both kernels give bitwise the same
// results (tested), so which one a CPU runs changes its time only.  Compiled for those instructions
// whatever the build's flags (a target attribute) and chosen at run time (kquant_isa).
#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__)
#define MCSD_HAVE_512 1
#define MCSD_TARGET_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// Scale picks for vpermw: 32 int16 lanes, 8 per entry.  Q4_K / Q5_K: per pair of chunks P, low nibbles
// (sub-blocks 4P and 4P + 2, 16 lanes each) and high (4P + 1, 4P + 3).  Q6_K: per half h, runs 0-1
// (scales 8h + 0..3) and runs 2-3 (8h + 4..7).
struct ScalePicks {
  int16_t v[8][32];
};
constexpr ScalePicks make_scale_picks() {
  ScalePicks p{};
  const int q[8][4] = {{0, 0, 2, 2}, {1, 1, 3, 3}, {4, 4, 6, 6}, {5, 5, 7, 7},
                       {0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}};
  for (int t = 0; t < 8; ++t)
    for (int i = 0; i < 32; ++i) p.v[t][i] = static_cast<int16_t>(q[t][i / 8]);
  return p;
}
alignas(64) constexpr ScalePicks kScalePicks = make_scale_picks();

MCSD_TARGET_512 inline __m512i pick16(const __m512i& sc, int table) {
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(kScalePicks.v[table]), sc);
}
// 32 int16 shift counts: a in the low 256 bits, b in the high
MCSD_TARGET_512 inline __m512i halves16(int a, int b) {
  return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<int16_t>(a)),
                                 _mm512_set1_epi16(static_cast<int16_t>(b)));
}

template <int C, bool kFifth>
MCSD_TARGET_512 void k4_rows_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) {
  constexpr int kBytes = kFifth ? 176 : 144;
  __m256 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = accm[c] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * kBytes;
    const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
    const __m128i sm = kscale_vec(b + 4);
    const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));  // lanes 0-7 the scales
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    const __m512i hb = kFifth ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)))
                              : _mm512_setzero_si512();
    __m512i isum[C];
    for (int c = 0; c < C; ++c) isum[c] = _mm512_setzero_si512();
    for (int P = 0; P < 2; ++P) {  // chunks 2P (low 256 bits) and 2P + 1 (high)
      const __m512i v = _mm512_loadu_si512(qs + 64 * P);
      __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if (kFifth) {  // chunk j's fifth bits are bits 2j (low nibbles) and 2j + 1 (high) of the qh bytes
        const __m512i h = _mm512_srlv_epi16(hb, halves16(4 * P, 4 * P + 2));
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(h, one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 1), one), 4));
      }
      const __m512i s_lo = pick16(sc, 2 * P), s_hi = pick16(sc, 2 * P + 1);
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = a.q.data() + (m + c) * a.K + s * kSuper + 128 * P;  // the paired layout
        isum[c] = _mm512_dpwssd_epi32(isum[c], _mm512_maddubs_epi16(lo, _mm512_loadu_si512(xq)), s_lo);
        isum[c] = _mm512_dpwssd_epi32(isum[c], _mm512_maddubs_epi16(hi, _mm512_loadu_si512(xq + 64)), s_hi);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m256i is = _mm256_add_epi32(_mm512_castsi512_si256(isum[c]), _mm512_extracti64x4_epi64(isum[c], 1));
      k4_accumulate(acc[c], accm[c], is, mins, a, m + c, s, d, dmin);
    }
  }
  for (int c = 0; c < C; ++c) y[c * ldy] = mcsd::reduce_lanes(acc[c]) - mcsd::reduce_lanes(accm[c]);
}

template <int C>
MCSD_TARGET_512 void q6k_rows_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f), x30 = _mm512_set1_epi8(0x30);
  const __m512i shl01 = halves16(4, 2), shr23 = halves16(0, 2);  // runs 0, 1: h << 4, h << 2; runs 2, 3: h, h >> 2
  for (int64_t s = 0; s < a.supers; ++s) {
    const uint8_t* b = w + s * 210;
    const float d = fp16_to_f32(rd16(b + 208));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    __m256i isum0[C];
    __m512i isum[C];
    for (int c = 0; c < C; ++c) {
      isum0[c] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, load_bsum(a, m + c, s)), 5));
      isum[c] = _mm512_setzero_si512();
    }
    for (int half = 0; half < 2; ++half) {
      const __m512i l = _mm512_loadu_si512(b + 64 * half);  // ql of runs 0 | 1 (low nibbles), 2 | 3 (high)
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half)));
      const __m512i u01 = _mm512_or_si512(_mm512_and_si512(l, low4), _mm512_and_si512(_mm512_sllv_epi16(h, shl01), x30));
      const __m512i u23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                          _mm512_and_si512(_mm512_srlv_epi16(h, shr23), x30));
      const __m512i s01 = pick16(sc, 4 + 2 * half), s23 = pick16(sc, 5 + 2 * half);
      for (int c = 0; c < C; ++c) {
        const int8_t* xq = a.q.data() + (m + c) * a.K + s * kSuper + 128 * half;
        isum[c] = _mm512_dpwssd_epi32(isum[c], _mm512_maddubs_epi16(u01, _mm512_loadu_si512(xq)), s01);
        isum[c] = _mm512_dpwssd_epi32(isum[c], _mm512_maddubs_epi16(u23, _mm512_loadu_si512(xq + 64)), s23);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m256i is = _mm256_add_epi32(
          isum0[c], _mm256_add_epi32(_mm512_castsi512_si256(isum[c]), _mm512_extracti64x4_epi64(isum[c], 1)));
      q6k_accumulate(acc[c], is, a, m + c, s, d);
    }
  }
  for (int c = 0; c < C; ++c) y[c * ldy] = mcsd::reduce_lanes(acc[c]);
}

template <int C>
void q4k_rows_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) { k4_rows_512<C, false>(w, a, m, y, ldy); }
template <int C>
void q5k_rows_512(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) { k4_rows_512<C, true>(w, a, m, y, ldy); }

bool cpu_has_512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#else
bool cpu_has_512() { return false; }
#endif

using KRowsFn = void (*)(const uint8_t*, const QActsK&, int64_t, float*, int64_t);

template <int C>
void q4k_rows(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) { k4_rows<C, false>(w, a, m, y, ldy); }
template <int C>
void q5k_rows(const uint8_t* w, const QActsK& a, int64_t m, float* y, int64_t ldy) { k4_rows<C, true>(w, a, m, y, ldy); }

struct KKernel {
  int64_t id;
  bool paired;  // reads its activations in the paired layout (QActsK)
  KRowsFn rows4, rows2, rows1;  // the 256-bit (or portable) kernels
  KRowsFn wide4, wide2, wide1;  // the 512-bit ones (null: none)
};
#if defined(MCSD_HAVE_512)
#define WIDE(f) f<4>, f<2>, f<1>
#else
#define WIDE(f) nullptr, nullptr, nullptr
#endif
constexpr KKernel kKKernels[] = {
    {12, true, q4k_rows<4>, q4k_rows<2>, q4k_rows<1>, WIDE(q4k_rows_512)},
    {13, true, q5k_rows<4>, q5k_rows<2>, q5k_rows<1>, WIDE(q5k_rows_512)},
    {14, false, q6k_rows<4>, q6k_rows<2>, q6k_rows<1>, WIDE(q6k_rows_512)},
};
#undef WIDE

const KKernel* k_kernel(int64_t id) {
  for (const auto& k : kKKernels)
    if (k.id == id) return &k;
  return nullptr;
}

// Which k-quant kernels run: the 512-bit ones where the CPU has them, unless MCSD_CPU_ISA=avx2 (read
// once) or quant_isa() says otherwise.  Both give the same bits; this is for timing and tests.
std::atomic<bool> g_wide{[] {
  const char* env = std::getenv("MCSD_CPU_ISA");
  return cpu_has_512() && !(env != nullptr && std::string(env) == "avx2");
}()};

// y [M, N] for a k-quant weight: threads split the weight rows; each row meets the activation rows
// 4 at a time (then 2, 1), so its bytes are read from memory once and from L1 after.
void k_linear(const KKernel& k, const uint8_t* wp, int64_t row_bytes, int64_t N, const float* x, int64_t M,
              int64_t K, float* yp) {
  const QActsK a = quantize_acts_k(x, M, K, k.paired);
  const bool wide = g_wide.load(std::memory_order_relaxed);
  const KRowsFn rows4 = wide ? k.wide4 : k.rows4, rows2 = wide ? k.wide2 : k.rows2, rows1 = wide ? k.wide1 : k.rows1;
  // Weight rows go in chunks of about kChunkBytes, which stay in the core's L2 while every panel of
  // 4 activation rows (4K bytes, in L1) passes over them: each activation byte is then read from L2
  // once per chunk, not once per weight row (at 256 rows that was 100 KB of activations per 1 KB of
  // weights).  The chunking only orders the work: every output is computed by the same operations.
  constexpr int64_t kChunkBytes = 160 << 10;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, std::min(kChunkBytes / row_bytes, (N + 4 * threads - 1) / (4 * threads)));
  const int64_t chunks = (N + chunk - 1) / chunk;
  // Small calls run inline (a parallel region costs more than they do).
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, chunk * K * M));
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    const uint8_t* end = wp + std::min(N, c1 * chunk) * row_bytes;  // this thread's last weight row
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      bool first = true;  // the chunk's first pass reads it from memory (prefetching ahead), the others from L2
      const auto pass = [&](KRowsFn rows, int64_t m) {
        for (int64_t n = n0; n < n1; ++n) {
          if (first) prefetch_lines(wp + n * row_bytes + kPrefetchBytes, row_bytes, end);
          rows(wp + n * row_bytes, a, m, yp + m * N + n, N);
        }
        first = false;
      };
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) pass(rows4, m);
      if (M - m >= 2) {
        pass(rows2, m);
        m += 2;
      }
      if (m < M) pass(rows1, m);
    }
  });
}

at::Tensor quant_linear_f32(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K) {
  const BlockType& t = check_weight(w, type, K);
  TORCH_CHECK(x_in.size(-1) == K, "quant_linear: x has ", x_in.size(-1), " columns, the weight K = ", K);
  const at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0), nblocks = K / t.block, row_bytes = w.size(1);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.reshape(out_shape);
  if (const KKernel* kk = k_kernel(type)) {
    k_linear(*kk, w.data_ptr<uint8_t>(), row_bytes, N, x.data_ptr<float>(), M, K, y.data_ptr<float>());
    return y.reshape(out_shape);
  }
  const Unpacker& up = unpacker(type);
  const QActs a = quantize_acts(x.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t groups = K / kGroup, halves = pad8(K / 16);
  // Small calls run inline (a parallel region costs more than they do); results do not depend on it.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kTileRows * K * M));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> u(static_cast<size_t>(kTileRows * K), 0);
    std::vector<float> dg(static_cast<size_t>(kTileRows * groups), 0.0f), dg4(dg.size(), 0.0f);
    std::vector<float> mn(static_cast<size_t>(kTileRows * halves), 0.0f);
    WTile tile{{}, dg4.data()};
    for (int r = 0; r < kTileRows; ++r)
      tile.row[r] = {u.data() + r * K, dg.data() + r * groups, mn.data() + r * halves};
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * kTileRows;
      const int nrows = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
      const uint8_t* end = wp + std::min(N, t1 * kTileRows) * row_bytes;  // this thread's last weight row
      for (int r = 0; r < nrows; ++r) up.row(wp + (n0 + r) * row_bytes, nblocks, end, tile.row[r]);
      for (int r = nrows; r < kTileRows; ++r) std::fill(tile.row[r].dg, tile.row[r].dg + groups, 0.0f);  // zero rows
      for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < kTileRows; ++r) dg4[4 * g + r] = tile.row[r].dg[g];
      for (int64_t m0 = 0; m0 < M; m0 += kPanel) {
        const int64_t m1 = std::min(M, m0 + kPanel);
        float* yt = yp + n0;
        if (up.is_signed)
          tile_times_panel<true>(tile, nrows, a, m0, m1, yt, N);
        else
          tile_times_panel<false>(tile, nrows, a, m0, m1, yt, N);
      }
    }
  });
  return y.reshape(out_shape);
}

// x @ W^T (+ bias) in fp32, returned in x's dtype: one operator call per linear, so a forward does not
// pay for separate conversions and a bias add (the same fp32 operations as doing them apart).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K,
                       const std::optional<at::Tensor>& bias) {
  at::Tensor y = quant_linear_f32(x, w, type, K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "quant_linear: the bias needs one value per output (",
                w.size(0), "), got shape ", bias->sizes());
    y.add_(bias->to(at::kFloat));
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
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

// "avx512" or "avx2" (or "portable"): the k-quant kernels in use; `set` ("avx512" / "avx2", "" to only
// ask) switches them, and asking for 512-bit kernels the CPU lacks is an error.
std::string quant_isa(const std::string& set) {
#if defined(__AVX2__)
  const std::string narrow = "avx2";
#else
  const std::string narrow = "portable";
#endif
  if (set == "avx512") {
    TORCH_CHECK(cpu_has_512(), "quant_isa: this CPU (or build) has no AVX-512 with VNNI");
    g_wide = true;
  } else if (set == "avx2" || set == "portable") {
    g_wide = false;
  } else {
    TORCH_CHECK(set.empty(), "quant_isa: expected 'avx512', 'avx2' or '', got '", set, "'");
  }
  return g_wide ? "avx512" : narrow;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcsd_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int type, int K, Tensor? bias=None) -> Tensor");
  m.def("quant_dequantize(Tensor weight, int type, int K) -> Tensor");
  m.def("quant_isa(str set='') -> str", &quant_isa);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
