// GGUF block-quantized weights, multiplied in place:  y[M, N] = x[M, K] @ dequant(W)[N, K]^T  (fp32).
//
// Built with bf16_gemm.cpp into one library by engine/models/cpu_kernels.py; registers
// torch.ops.mcsd_cpu.quant_linear and torch.ops.mcsd_cpu.quant_dequantize.
//
// Weights.  W is the GGUF tensor's own bytes, uint8 [N, row_bytes]: each row is K / B blocks of
// the type's layout (B = 32 for Q4_0, Q4_1, Q5_0, Q8_0; B = 256 for the k-quants Q4_K, Q5_K, Q6_K),
// exactly as llama.cpp writes them, so a GGUF file is used as it is: no conversion, no copy.
//
// How.  A thread owns a range of weight rows and takes them 4 at a time: the 4 rows are dequantized
// into an fp32 scratch (4 * K floats, in L2), then a register-tiled micro-kernel multiplies them by
// the activation rows, 3 at a time, over all K (12 accumulators in registers), in panels of 48 rows.
// The weights are read from memory once per call whatever M is.
//
// Numerics (batch invariance).  Every output y[m, n] is the same sequence of float operations
// whatever M is, whatever the other rows hold and however many threads run: the dequantized value
// of a weight does not depend on m, accumulator lane l sums k = l, l + 8, ... in increasing order
// (one FMA each on AVX2; a multiply and an add in the portable build) and the final reduction of the
// 8 lanes is fixed; the tiling only decides which accumulators share registers.  So greedy
// speculative decoding (a verification forward of many rows) sees exactly the logits that
// single-row decoding steps would.  -ffp-contract=off keeps the compiler from fusing elsewhere.
//
// The dequantization loops are plain C++ for the vectorizer; the product has an AVX2 + FMA path and
// a portable one.  Dequantized values follow the `gguf` package's formulas (fp32 d * scale * q - dmin * m).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 8;
constexpr int kTileRows = 4;  // weight rows dequantized together (RT)

inline float fp16_to_f32(uint16_t h) {
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

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct KScales {
  float d1, m1, d2, m2;
};

// The scales and mins of sub-blocks is and is + 1 of a Q4_K / Q5_K super-block, times d and dmin.
inline KScales kscales(float d, float dmin, const uint8_t* scales, int is) {
  int sc1, m1, sc2, m2;
  scale_min_k4(is, scales, &sc1, &m1);
  scale_min_k4(is + 1, scales, &sc2, &m2);
  return {d * static_cast<float>(sc1), dmin * static_cast<float>(m1), d * static_cast<float>(sc2),
          dmin * static_cast<float>(m2)};
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
// A micro-kernel multiplies R dequantized weight rows (fp32, row stride ldw) by C activation rows
// (fp32, row stride ldx) over all K, with one 8-lane accumulator per (r, c) held in registers:
// lane l sums k = l, l + 8, l + 16, ... in increasing order (one fused multiply-add each), then the
// fixed reduce_lanes.  The same sequence for every (R, C) variant, hence batch invariance.
#if defined(__AVX2__) && defined(__FMA__)
inline float reduce_lanes(__m256 v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
  __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

template <int R, int C>
void micro(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + r * ldw + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c * ldy + r] = reduce_lanes(acc[r][c]);
}
#else  // portable: the same lanes and order, a multiply and an add
inline float reduce_lanes(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

template <int R, int C>
void micro(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  float acc[R][C][kLanes] = {};
  for (int64_t k = 0; k < K; k += kLanes)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < kLanes; ++l) acc[r][c][l] += w[r * ldw + k + l] * x[c * ldx + k + l];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c * ldy + r] = reduce_lanes(acc[r][c]);
}
#endif

constexpr int kC = 3;          // activation rows per micro-kernel (4 x 3 accumulators + 3 + 1 registers)
constexpr int64_t kPanel = 48;  // activation rows per pass over a tile (keeps the panel in L2 for K ~ 1.5k)

template <int R>
void tile_rows(const float* w, int64_t K, const float* x, int64_t m0, int64_t m1, float* y, int64_t N) {
  int64_t m = m0;
  for (; m + kC <= m1; m += kC) micro<R, kC>(w, K, x + m * K, K, K, y + m * N, N);
  if (m1 - m == 2) micro<R, 2>(w, K, x + m * K, K, K, y + m * N, N);
  if (m1 - m == 1) micro<R, 1>(w, K, x + m * K, K, K, y + m * N, N);
}

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t K) {
  const BlockType& t = check_weight(w, type, K);
  TORCH_CHECK(x_in.size(-1) == K, "quant_linear: x has ", x_in.size(-1), " columns, the weight K = ", K);
  const at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0), nblocks = K / t.block, row_bytes = w.size(1);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.reshape(out_shape);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> deq(static_cast<size_t>(kTileRows) * K);  // the tile's rows, dequantized
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t n0 = tile * kTileRows;
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
      const uint8_t* wt = wp + n0 * row_bytes;
      for (int r = 0; r < rows; ++r)
        for (int64_t blk = 0; blk < nblocks; ++blk)
          t.deq(wt + r * row_bytes + blk * t.bytes, deq.data() + r * K + blk * t.block);
      for (int64_t m0 = 0; m0 < M; m0 += kPanel) {
        const int64_t m1 = std::min(M, m0 + kPanel);
        switch (rows) {
          case 4: tile_rows<4>(deq.data(), K, xp, m0, m1, yp + n0, N); break;
          case 3: tile_rows<3>(deq.data(), K, xp, m0, m1, yp + n0, N); break;
          case 2: tile_rows<2>(deq.data(), K, xp, m0, m1, yp + n0, N); break;
          default: tile_rows<1>(deq.data(), K, xp, m0, m1, yp + n0, N); break;
        }
      }
    }
  });
  return y.reshape(out_shape);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcsd_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor weight, int type, int K) -> Tensor");
  m.def("quant_dequantize(Tensor weight, int type, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
