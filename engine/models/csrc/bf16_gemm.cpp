// Small-M bf16 GEMM for CPUs without native bf16 (AVX2 + FMA on x86; the same eight lanes in plain C++
// elsewhere, see V8):  y = round_bf16(x @ W^T + b),
// and the same kernel over fp32 weights and activations (f32_linear), for batch-invariant fp32.
//
// Built once per machine at first use by engine/models/cpu_kernels.py and registered as the
// operator torch.ops.mcsd_cpu.bf16_linear (a plain shared library without Python binding code,
// which keeps the one-off compilation short).
//
// The problem.  Speculative decoding runs forwards of M = 1..64 rows against weight matrices of
// megabytes to hundreds of megabytes.  torch's bf16 matmul on CPUs without avx512_bf16 / AMX is a
// decent GEMV for M = 1 but falls back to a slow kernel for M >= 2 (time linear in M).  Here every
// weight is read from DRAM exactly once per call and the few activation rows stay in cache, so the
// cost is max(weight bytes / bandwidth, M * N * K / FMA throughput).
//
// Numerics (batch invariance).  Every output element y[m, n] is computed by exactly the same
// sequence of floating-point operations whatever M is, whatever the other rows contain, whatever
// the tiling and whatever the number of threads:
//   * one 8-lane fp32 accumulator per (m, n), one FMA per 8 k's, in increasing k order (per lane),
//     never split over K (no K-blocking, no split-K across threads);
//   * then one fixed horizontal reduction of the 8 lanes (hsum8), + bias in fp32, and
//     round-to-nearest-even to bf16.
// The register tiling (how many weight rows x activation rows one micro-kernel computes) and the
// split of N across threads only decide *which* accumulators live in registers together, never the
// order of the operations inside one accumulator.  So the result for a row is bitwise identical for
// M = 1 and M = 16 (what speculative verification relies on) and for 1 or 16 threads.  Compiled
// with -ffp-contract=off and without -ffast-math so that the compiler cannot re-associate or fuse.
//
// bf16 -> fp32 in registers.  A 256-bit load of 16 consecutive bf16 weights gives eight 32-bit
// lanes, lane j = (w[2j+1] << 16) | w[2j].  Shifting each lane left by 16 yields the fp32 values
// of the even elements w[2j]; masking the low half away yields the odd elements w[2j+1]: one
// integer op per 8 weights and no cross-lane shuffle (the classic zero-extend + shift would need
// two).  The activations are converted once per call into an fp32 scratch buffer laid out to
// match: per chunk of 16 k's, the 8 even elements, then the 8 odd ones (zero padded to a multiple
// of 16).  Accumulator lane j thus sees, in chunk c, k = 16c + 2j and then k = 16c + 2j + 1.  The
// tail of K (K % 16 != 0) is handled by copying the weight tail into a zero-padded 16-element
// buffer and running the same step on it, identically for every M.
//
// Work split.  Threads (at::parallel_for, so torch.get_num_threads() is respected) take contiguous
// ranges of R-row weight blocks.  For one block, the m-tiles of C activation rows run one after
// the other: the block (R * K * 2 bytes) comes from DRAM during the first tile and from L1/L2 for
// the others, while the next block is software-prefetched a cache line per step.  Inputs with
// more than 96 rows (prefill) are processed in panels of 96 rows, one pass over the weights each.
//
// fp32.  f32_linear runs the same tiles with fp32 weights: a chunk of 16 k's is two plain 8-float
// loads (lane j sees k = 16c + j, then 16c + 8 + j), the scratch is a zero-padded copy of the
// activations, and the result is stored without rounding.  Same numerics argument: torch's fp32
// GEMM (MKL / oneDNN) picks different kernels for 1 row and for many, so its rows differ in the
// last bits with the batch; this one's do not.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kChunk = 16;  // k's per step: one 256-bit load of 16 bf16 weights
constexpr int kMaxR = 8;        // weight rows per micro-kernel (8 only for C = 1, else <= 4)
constexpr int kMaxC = 3;        // activation rows per micro-kernel
constexpr int64_t kPanel = 96;  // activation rows per pass over the weights
constexpr int64_t kShortRow = 4096;  // K up to which a single m-tile prefetches the next block

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as c10::BFloat16 does
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Eight fp32 lanes and what the tiles do with them.  With AVX2 + FMA a 256-bit register; the portable
// build (other CPUs) holds the same eight lanes in an array and does the same operations on each (a
// fused multiply-add per lane, the same reduction tree), so both builds give the same bits.
#if defined(__AVX2__) && defined(__FMA__)
using V8 = __m256;
inline V8 v_zero() { return _mm256_setzero_ps(); }
inline V8 v_load(const float* p) { return _mm256_loadu_ps(p); }
inline void v_store(float* p, V8 v) { _mm256_storeu_ps(p, v); }
inline V8 v_fma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
// A 256-bit load of 16 bf16 weights gives lane j = (w[2j+1] << 16) | w[2j]: the even elements'
// fp32 values are that shifted left by 16, the odd ones' that with the low half masked away.
inline V8 v_even_bf16(const uint16_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline V8 v_odd_bf16(const uint16_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
// The one horizontal reduction used for every output element (lanes.h).
inline float hsum8(V8 v) { return mcsd::reduce_lanes(v); }
inline void prefetch_l1(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
inline void prefetch_l2(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
#else
struct V8 {
  float l[8];
};
inline V8 v_zero() { return V8{}; }
inline V8 v_load(const float* p) {
  V8 v;
  std::memcpy(v.l, p, sizeof(v.l));
  return v;
}
inline void v_store(float* p, const V8& v) { std::memcpy(p, v.l, sizeof(v.l)); }
inline V8 v_fma(V8 a, V8 b, V8 c) {
  for (int j = 0; j < 8; ++j) c.l[j] = std::fma(a.l[j], b.l[j], c.l[j]);
  return c;
}
inline V8 v_even_bf16(const uint16_t* w) {
  V8 v;
  for (int j = 0; j < 8; ++j) v.l[j] = bf16_bits_to_f32(w[2 * j]);
  return v;
}
inline V8 v_odd_bf16(const uint16_t* w) {
  V8 v;
  for (int j = 0; j < 8; ++j) v.l[j] = bf16_bits_to_f32(w[2 * j + 1]);
  return v;
}
// lanes.h's reduce_lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float hsum8(const V8& v) {
  const float* l = v.l;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
inline void prefetch_l1(const char* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }
#endif

// One activation row (K bf16) -> fp32 scratch row (nchunks * 16 floats, even/odd layout).
void convert_row(const uint16_t* src, int64_t K, float* dst, int64_t nchunks);

// How one weight type is read: a chunk of 16 k's as two 8-lane halves (the scratch activations use
// the matching layout), the activation row's conversion, and the output's rounding.
struct Bf16 {
  using T = uint16_t;
  static V8 first(const T* w) { return v_even_bf16(w); }
  static V8 second(const T* w) { return v_odd_bf16(w); }
  static void convert(const T* src, int64_t K, float* dst, int64_t nchunks) { convert_row(src, K, dst, nchunks); }
  static float to_f32(T v) { return bf16_bits_to_f32(v); }
  static T store(float v) { return f32_to_bf16_rne(v); }
};

struct F32 {
  using T = float;
  static V8 first(const T* w) { return v_load(w); }
  static V8 second(const T* w) { return v_load(w + 8); }
  static void convert(const T* src, int64_t K, float* dst, int64_t nchunks) {
    std::memcpy(dst, src, K * sizeof(float));
    for (int64_t k = K; k < nchunks * kChunk; ++k) dst[k] = 0.0f;
  }
  static float to_f32(T v) { return v; }
  static T store(float v) { return v; }
};

void convert_row(const uint16_t* src, int64_t K, float* dst, int64_t nchunks) {
  const int64_t nfull = K / kChunk;
  for (int64_t c = 0; c < nfull; ++c) {
    v_store(dst + c * kChunk, v_even_bf16(src + c * kChunk));
    v_store(dst + c * kChunk + 8, v_odd_bf16(src + c * kChunk));
  }
  if (nfull < nchunks) {  // tail chunk, zero padded
    float* d = dst + nfull * kChunk;
    for (int j = 0; j < kChunk; ++j) d[j] = 0.0f;
    for (int64_t k = nfull * kChunk; k < K; ++k) {
      const int64_t j = k - nfull * kChunk;
      d[(j & 1) * 8 + (j >> 1)] = bf16_bits_to_f32(src[k]);
    }
  }
}

// One step (16 k's) of an R x C tile: R weight rows (row stride ldw, in bf16 elements) against C
// scratch activation rows (row stride ldx, in floats).  Per accumulator: FMA(even), FMA(odd).
// The C activation vectors of each half-chunk are held in registers and reused over the R weight
// rows; the weight vector is re-loaded (from L1) for the odd half rather than kept, so that R*C
// accumulators + C activations + 1 temporary fit the 16 ymm registers (R=4, C=3: 12 + 3 + 1).
template <typename W, int R, int C>
__attribute__((always_inline)) inline void step(const typename W::T* w, int64_t ldw, const float* x,
                                                int64_t ldx, V8 (&acc)[R][C]) {
  V8 xv[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) xv[c] = v_load(x + c * ldx);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const V8 we = W::first(w + r * ldw);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = v_fma(we, xv[c], acc[r][c]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) xv[c] = v_load(x + c * ldx + 8);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const V8 wo = W::second(w + r * ldw);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = v_fma(wo, xv[c], acc[r][c]);
  }
}

// Full-K R x C tile.  w: first weight row (row stride ldw); nfull: whole 16-chunks of K; wtail:
// [R][16] zero-padded K tail or nullptr; x: first scratch row (row stride ldx); out[r * kMaxC + c]
// receives the reduced dot products; pf / pf_lines: cache lines to prefetch, spread over the steps.
template <typename W, int R, int C>
void tile(const typename W::T* w, int64_t ldw, int64_t nfull, const typename W::T* wtail, const float* x,
          int64_t ldx, float* out, const char* pf, int64_t pf_lines) {
  V8 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = v_zero();
  int64_t ch = 0;
  if (pf_lines <= nfull) {  // several m-tiles share the prefetch: one line per step, into L1
    for (; ch < pf_lines; ++ch) {
      prefetch_l1(pf + ch * 64);
      step<W, R, C>(w + ch * kChunk, ldw, x + ch * kChunk, ldx, acc);
    }
  } else if (nfull > 0) {  // a single m-tile prefetches the whole next block, into L2
    const int64_t per_step = (pf_lines + nfull - 1) / nfull;
    for (; ch < nfull; ++ch) {
      const char* p = pf + ch * per_step * 64;
      for (int64_t j = 0; j < per_step; ++j) prefetch_l2(p + j * 64);
      step<W, R, C>(w + ch * kChunk, ldw, x + ch * kChunk, ldx, acc);
    }
  }
  for (; ch < nfull; ++ch) step<W, R, C>(w + ch * kChunk, ldw, x + ch * kChunk, ldx, acc);
  if (wtail != nullptr) step<W, R, C>(wtail, kChunk, x + nfull * kChunk, ldx, acc);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) out[r * kMaxC + c] = hsum8(acc[r][c]);
}

template <typename W>
using TileFn = void (*)(const typename W::T*, int64_t, int64_t, const typename W::T*, const float*, int64_t,
                        float*, const char*, int64_t);

template <typename W, int R>
TileFn<W> tile_small_r(int c) {
  return c == 1 ? &tile<W, R, 1> : c == 2 ? &tile<W, R, 2> : &tile<W, R, 3>;
}

// r: 1..8 rows (5..8 only with c == 1), c: 1..3 activation rows.
template <typename W>
TileFn<W> tile_fn(int r, int c) {
  switch (r) {
    case 1: return tile_small_r<W, 1>(c);
    case 2: return tile_small_r<W, 2>(c);
    case 3: return tile_small_r<W, 3>(c);
    case 4: return tile_small_r<W, 4>(c);
    case 5: return &tile<W, 5, 1>;
    case 6: return &tile<W, 6, 1>;
    case 7: return &tile<W, 7, 1>;
    default: return &tile<W, 8, 1>;
  }
}

// Register blocking for a given M; numerically irrelevant (see the header comment).
// M = 1 is a GEMV bound by memory bandwidth: 8 rows at once for enough independent FMA chains.
// Otherwise 4 weight rows x up to 3 activation rows (the best fit of the 16 ymm registers).
void blocking(int64_t M, int* rb, int* cb) {
  if (M == 1) {
    *rb = 8, *cb = 1;
  } else {
    *rb = 4, *cb = 3;
  }
}

template <typename W>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       at::ScalarType dtype, const char* name) {
  using T = typename W::T;
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, name, ": x and weight must be ",
              dtype, ", got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), name, ": weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.dim() >= 1, name, ": x must have at least one dimension");
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, name, ": x has ", x.size(-1), " features, weight expects ", K);
  const T* bptr = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == dtype && b.dim() == 1 && b.size(0) == N,
                name, ": bias must be a ", dtype, " [", N, "] tensor");
    b = b.contiguous();
    bptr = reinterpret_cast<const T*>(b.data_ptr());
  }

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x.options());
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  if (out.numel() == 0) return out;
  T* y = reinterpret_cast<T*>(out.data_ptr());

  const int64_t nchunks = (K + kChunk - 1) / kChunk;
  const int64_t nfull = K / kChunk;
  const int64_t ktail = K - nfull * kChunk;
  const int64_t Kp = nchunks * kChunk;

  // Activations -> fp32 scratch (even/odd layout, zero padded).
  at::Tensor x2 = x.reshape({M, K});
  if (K > 0 && x2.stride(1) != 1) x2 = x2.contiguous();
  const T* xb = reinterpret_cast<const T*>(x2.data_ptr());
  const int64_t ldxb = M > 1 ? x2.stride(0) : K;
  at::Tensor scratch = at::empty({std::max<int64_t>(M * Kp, 1)}, x.options().dtype(at::kFloat));
  float* xs = scratch.data_ptr<float>();
  // Serial unless large (prefill): a fork/join costs more than converting a few rows.
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) {
                     for (int64_t m = m0; m < m1; ++m)
                       W::convert(xb + m * ldxb, K, xs + m * Kp, nchunks);
                   });

  const T* wb = reinterpret_cast<const T*>(weight.data_ptr());
  int rb, cb;
  blocking(M, &rb, &cb);
  const int64_t nblocks = (N + rb - 1) / rb;
  // At least ~256 KiB of weights per task, to amortise waking the thread pool.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, rb * K * int64_t{sizeof(T)}));

  // Rows are processed in panels of at most kPanel (one pass over the weights per panel), so that
  // a long prefill keeps its activation panel in L2/L3 instead of re-reading all of x for every
  // weight block.  Up to kPanel rows (every decoding / verification shape) is a single pass.
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t P = std::min<int64_t>(kPanel, M - p0);
    const int64_t ntiles = (P + cb - 1) / cb;
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
      alignas(32) T wtail[kMaxR * kChunk];
      alignas(32) float res[kMaxR * kMaxC];
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n0 = blk * rb;
        const int r = static_cast<int>(std::min<int64_t>(rb, N - n0));
        const T* w = wb + n0 * K;
        const T* tailp = nullptr;
        if (ktail > 0) {
          std::memset(wtail, 0, sizeof(wtail));
          for (int i = 0; i < r; ++i)
            std::memcpy(wtail + i * kChunk, w + i * K + nfull * kChunk, ktail * sizeof(T));
          tailp = wtail;
        }
        // The next block of this thread (the rows right after this one) is prefetched during the
        // m-tiles of this block, spread evenly over them.  Not for M = 1, nor for a single m-tile
        // (M <= 3) over long rows: there the hardware stream prefetchers do as well on their own
        // and the extra instructions cost.  (Tuned on Zen 3.)
        const char* next = reinterpret_cast<const char*>(w + r * K);
        const bool prefetch = M > 1 && (ntiles > 1 || K <= kShortRow) && blk + 1 < b1;
        const int64_t next_lines = prefetch
                                       ? (std::min<int64_t>(rb, N - n0 - r) * K * int64_t{sizeof(T)} + 63) / 64
                                       : 0;
        const int64_t pf_quota = (next_lines + ntiles - 1) / ntiles;
        for (int64_t t = 0, m0 = p0; t < ntiles; ++t) {
          // balanced tiles: the first P % ntiles tiles get one row more
          const int c = static_cast<int>(P / ntiles + (t < P % ntiles ? 1 : 0));
          const int64_t pf_start = t * pf_quota;
          int64_t pf_lines = std::max<int64_t>(0, std::min(pf_quota, next_lines - pf_start));
          if (ntiles > 1) pf_lines = std::min(pf_lines, nfull);  // at most one line per step
          tile_fn<W>(r, c)(w, K, nfull, tailp, xs + m0 * Kp, Kp, res, next + pf_start * 64, pf_lines);
          for (int j = 0; j < c; ++j) {
            T* yrow = y + (m0 + j) * N + n0;
            for (int i = 0; i < r; ++i) {
              float v = res[i * kMaxC + j];
              if (bptr != nullptr) v += W::to_f32(bptr[n0 + i]);
              yrow[i] = W::store(v);
            }
          }
          m0 += c;
        }
      }
    });
  }
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_impl<Bf16>(x, weight, bias, at::kBFloat16, "bf16_linear");
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_impl<F32>(x, weight, bias, at::kFloat, "f32_linear");
}

}  // namespace

TORCH_LIBRARY(mcsd_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("f32_linear", &f32_linear);
}
