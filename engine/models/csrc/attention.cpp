// Batch-invariant attention for CPUs:  out[b, h, t] = softmax(scale * q[b, h, t] . K[b, h / g]^T | mask) V
//
// Built with the GEMM kernels into one library by engine/models/cpu_kernels.py; registers
// torch.ops.mcsd_cpu.attention, paged_attention and vector_isa.
//
// Why.  torch's CPU scaled_dot_product_attention splits queries and keys into blocks whose sizes depend
// on the number of queries, so the same query gets last-bit different outputs in a decoding step (one
// query) and in a verification forward (a tree of them), or next to other sequences.  Quantized
// activations (int8 per block in the GGUF kernels) turn such last-bit differences into whole rounding
// steps, and greedy speculative output could then differ from plain decoding.  Here every query is
// computed alone, by the same sequence of float operations whatever else is in the call:
//
//   1. s_j = scale * (q . k_j) for every key j the mask allows: 8 fp32 lanes over the head dimension
//      in order, a fixed reduction;
//   2. m = max_j s_j, p_j = exp(s_j - m) (elementwise);
//   3. l = sum_j p_j and o = sum_j p_j v_j, both in increasing j over the allowed keys only, then o / l.
//
// Masked-out keys are skipped, never added as zeros, so padding (a longer kv_len for a batch) and the
// places a tree puts its tokens in the cache do not matter: only the allowed keys, in their order.
//
// Speed.  A work item is a block of one sequence's queries that share a kv head: the keys and values
// they all see are converted to fp32 once for the block, four or eight keys go through one pass, and
// the outputs stay in registers while a tile of values is added; with AVX-512F the same operations
// run 16 lanes at a time (torch.ops.mcsd_cpu.vector_isa switches).  Queries share converted rows,
// never arithmetic, so none of this changes a query's operations (attend_block).
//
// Layouts.  q [B, Hq, T, D], k and v [B, Hkv, L, D] (Hq a multiple of Hkv: grouped-query attention),
// any strides with the head dimension contiguous; mask bool [B, 1, T, L] or absent (attend to all);
// fp32 or bf16 (computed in fp32, rounded once at the end).  Output [B, Hq, T, D] contiguous.
// torch.ops.mcsd_cpu.paged_attention reads the keys and values straight from the paged cache's pool
// instead (see attend_paged), with the mask given over the new block only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>  // x86 only: the portable build elsewhere uses none of it
#endif

#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline void to_f32_row(const float* src, float* dst, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
inline void to_f32_row(const c10::BFloat16* src, float* dst, int64_t D) {  // bf16 -> fp32 is a 16-bit shift
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, mcsd::load8(src + d));
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

using mcsd::reduce_lanes;

inline float dot(const float* q, const float* k, int64_t D) {  // two chains (even / odd 8s), then lanes
  __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), acc2);
  }
  if (d + 8 <= D) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    d += 8;
  }
  float s = reduce_lanes(_mm256_add_ps(acc, acc2));
  for (; d < D; ++d) s += q[d] * k[d];
  return s;
}

inline void axpy(float a, const float* v, float* o, int64_t D) {  // o += a v
  const __m256 av = _mm256_set1_ps(a);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
  for (; d < D; ++d) o[d] += a * v[d];
}

inline void exp_shifted(float* s, int64_t n, float m) {  // s = exp(s - m), s <= m (or -inf)
  const __m256 mv = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, mcsd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
  if (j < n) {  // the tail through a padded vector: the same formula as the full ones
    alignas(32) float buf[8];
    std::fill(buf, buf + 8, -std::numeric_limits<float>::infinity());
    std::copy(s + j, s + n, buf);
    _mm256_store_ps(buf, mcsd::exp8(_mm256_sub_ps(_mm256_load_ps(buf), mv)));
    std::copy(buf, buf + (n - j), s + j);
  }
}
#else  // portable: the same steps, one lane
template <typename T>
inline void to_f32_row(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* q, const float* k, int64_t D) {
  float s = 0.0f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
  return s;
}

inline void axpy(float a, const float* v, float* o, int64_t D) {
  for (int64_t d = 0; d < D; ++d) o[d] += a * v[d];
}

inline void exp_shifted(float* s, int64_t n, float m) {
  for (int64_t j = 0; j < n; ++j) s[j] = std::exp(s[j] - m);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The tiled path (D a multiple of 16): four keys' scores at a time, and a tile of value rows added
// into outputs held in registers.  Each score gets exactly dot()'s operations (its even and odd
// 8-chunks' chains, their sum, then reduce_lanes' tree, here for four registers at once), and each
// output lane axpy()'s (p_r v_r added in r order), so the tiled path gives the bits of the one-key-
// at-a-time one.  A 512-bit register holds a key's two chains side by side, so the 512-bit variants
// (CPUs with AVX-512F) compute the same numbers as the 256-bit ones, with half the instructions.

// reduce_lanes of four registers: w = lo + hi (4 lanes), x = (w0 + w2, w1 + w3), then x0 + x1.  The
// first two steps: the low half's lanes 0-1 hold x of key 0, lanes 2-3 of key 2; the high half's keys
// 1 and 3.
inline __m256 reduce4_x(const __m256* a) {
  const __m256 w01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 w23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(w01, w23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(w01, w23, _MM_SHUFFLE(3, 2, 3, 2)));
}
// The last step, x0 + x1, for two such registers at once (hadd: [a0, a2, b0, b2 | a1, a3, b1, b3]),
// put in key order.
inline __m256 reduce_last(__m256 xa, __m256 xb) {
  return _mm256_permutevar8x32_ps(_mm256_hadd_ps(xa, xb), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline void reduce4(const __m256* a, float* out) {
  const __m256 x = reduce4_x(a);
  _mm_storeu_ps(out, _mm256_castps256_ps128(reduce_last(x, x)));
}
inline void reduce8(const __m256* a, float* out) { _mm256_storeu_ps(out, reduce_last(reduce4_x(a), reduce4_x(a + 4))); }

// Scores (before the scale) of query q against keys k[0 .. n) (rows D apart, n a multiple of 4); kD
// as for dots_512_k.
template <int kD>
void dots_256_d(const float* q, const float* k, int64_t n, int64_t D, float* out) {
  if (kD != 0) D = kD;
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    __m256 a[4], b[4];
    for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 qa = _mm256_loadu_ps(q + d), qb = _mm256_loadu_ps(q + d + 8);
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k + (i0 + i) * D + d), a[i]);
        b[i] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k + (i0 + i) * D + d + 8), b[i]);
      }
    }
    for (int i = 0; i < 4; ++i) a[i] = _mm256_add_ps(a[i], b[i]);
    reduce4(a, out + i0);
  }
}
void dots_256(const float* q, const float* k, int64_t n, int64_t D, float* out) {
  if (D == 128) return dots_256_d<128>(q, k, n, D, out);
  if (D == 64) return dots_256_d<64>(q, k, n, D, out);
  dots_256_d<0>(q, k, n, D, out);
}

// o[0 .. D) += p_r v_r for the rows r < n of v (D apart), in r order.
template <int V>  // registers of 8 lanes at a time
inline void axpy_rows_256(const float* p, const float* v, int64_t n, int64_t D, float* o) {
  __m256 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm256_loadu_ps(o + 8 * i);
  for (int64_t r = 0; r < n; ++r) {
    const __m256 pr = _mm256_set1_ps(p[r]);
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + r * D + 8 * i), acc[i]);
  }
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}
void values_256(const float* p, const float* v, int64_t n, int64_t D, float* o) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) axpy_rows_256<8>(p, v + d, n, D, o + d);
  for (; d < D; d += 16) axpy_rows_256<2>(p, v + d, n, D, o + d);
}

#if defined(MCSD_HAVE_512F)
// K keys from k: one 16-lane chain per key, kD the head dimension when known at compile time (the
// chains then stay in registers), else 0 (D at run time).
template <int K, int kD>
MCSD_TARGET_512F inline void dots_512_k(const float* q, const float* k, int64_t D, float* out) {
  if (kD != 0) D = kD;
  __m512 a[K];
  for (int i = 0; i < K; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int i = 0; i < K; ++i) a[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + i * D + d), a[i]);
  }
  __m256 h[K];  // lanes 0-7: the even chunks' chain, 8-15: the odd chunks'
  for (int i = 0; i < K; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
  if (K == 8)
    reduce8(h, out);
  else
    reduce4(h, out);
}
template <int kD>
MCSD_TARGET_512F void dots_512_d(const float* q, const float* k, int64_t n, int64_t D, float* out) {
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) dots_512_k<8, kD>(q, k + i0 * D, D, out + i0);
  if (i0 < n) dots_512_k<4, kD>(q, k + i0 * D, D, out + i0);
}
MCSD_TARGET_512F void dots_512(const float* q, const float* k, int64_t n, int64_t D, float* out) {
  if (D == 128) return dots_512_d<128>(q, k, n, D, out);
  if (D == 64) return dots_512_d<64>(q, k, n, D, out);
  dots_512_d<0>(q, k, n, D, out);
}
template <int V>  // registers of 16 lanes at a time
MCSD_TARGET_512F inline void axpy_rows_512(const float* p, const float* v, int64_t n, int64_t D, float* o) {
  __m512 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm512_loadu_ps(o + 16 * i);
  for (int64_t r = 0; r < n; ++r) {
    const __m512 pr = _mm512_set1_ps(p[r]);
    for (int i = 0; i < V; ++i) acc[i] = _mm512_fmadd_ps(pr, _mm512_loadu_ps(v + r * D + 16 * i), acc[i]);
  }
  for (int i = 0; i < V; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);
}
MCSD_TARGET_512F void values_512(const float* p, const float* v, int64_t n, int64_t D, float* o) {
  int64_t d = 0;
  for (; d + 128 <= D; d += 128) axpy_rows_512<8>(p, v + d, n, D, o + d);
  for (; d < D; d += 16) axpy_rows_512<1>(p, v + d, n, D, o + d);
}
#endif
constexpr bool kTiled = true;
#else
constexpr bool kTiled = false;
void dots_256(const float*, const float*, int64_t, int64_t, float*) {}
void values_256(const float*, const float*, int64_t, int64_t, float*) {}
#endif

inline void dots(const float* q, const float* k, int64_t n, int64_t D, float* out) {
#if defined(MCSD_HAVE_512F)
  if (mcsd::wide_vectors().load(std::memory_order_relaxed)) return dots_512(q, k, n, D, out);
#endif
  dots_256(q, k, n, D, out);
}
inline void values(const float* p, const float* v, int64_t n, int64_t D, float* o) {
#if defined(MCSD_HAVE_512F)
  if (mcsd::wide_vectors().load(std::memory_order_relaxed)) return values_512(p, v, n, D, o);
#endif
  values_256(p, v, n, D, o);
}

constexpr int64_t kTile = 16;  // key / value rows converted to fp32 at a time (tiled path)

// s[0 .. n) *= scale, returning the largest (a NaN passed over, as std::max(m, s) does).
inline float scale_max(float* s, int64_t n, float scale) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), sv);
    _mm256_storeu_ps(s + j, v);
    mv = _mm256_max_ps(v, mv);  // a NaN in v gives mv (the second operand)
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float x : lanes) m = std::max(m, x);
#endif
  for (; j < n; ++j) {
    s[j] *= scale;
    m = std::max(m, s[j]);
  }
  return m;
}

// One query's `group` heads, one key at a time (the recipe above as it reads): the path for head
// dimensions that are not a multiple of 16, or builds without AVX2.  `key(j)` / `value(j)` point at key
// j's rows; qf holds the group's queries in fp32, `row` room for one row.
template <typename T, typename KeyRow, typename ValueRow>
void attend_one(const float* qf, int64_t group, int64_t D, const int64_t* keys, int64_t n, KeyRow key, ValueRow value,
                float scale, float* s, int64_t s_stride, float* m, float* l, float* o, float* row, T* const* orows) {
  if (n == 0) {  // nothing to attend to: zeros (SDPA would give NaN)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < D; ++d) orows[g][d] = static_cast<T>(0.0f);
    return;
  }
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < n; ++r) {
    to_f32_row(key(keys[r]), row, D);
    for (int64_t g = 0; g < group; ++g) {
      const float sc = scale * dot(qf + g * D, row, D);
      s[g * s_stride + r] = sc;
      m[g] = std::max(m[g], sc);
    }
  }
  for (int64_t g = 0; g < group; ++g) exp_shifted(s + g * s_stride, n, m[g]);
  std::fill(o, o + group * D, 0.0f);
  std::fill(l, l + group, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    to_f32_row(value(keys[r]), row, D);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * s_stride + r];
      l[g] += p;
      axpy(p, row, o + g * D, D);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t d = 0; d < D; ++d) orows[g][d] = static_cast<T>(o[g * D + d] * inv);
  }
}

// A block of nq queries of one sequence that share kv head hk, all their heads (H = nq * group query
// vectors, vector h = query h / group, head h % group), tiled (D a multiple of 16, AVX2).  Query q's
// allowed keys are keys[q * L ..][0 .. n[q]), and the first `shared` of them are the same for every
// query (a sequence's committed cache entries): those keys and values are converted to fp32 a tile at
// a time once for the whole block, the rest per query.  Per query vector the operations are
// attend_one's, in its order: scores key by key (dots), max, exp, then p_r v_r added in r order into
// outputs (values) and the sum of p in r order (the vectors' chains side by side), so the outputs
// are the bits attend_one gives, whatever the block.  s holds H score rows L + kTile apart (room for
// a last tile's padding), rows kTile rows of D.
template <typename T, typename KeyRow, typename ValueRow>
void attend_block(int64_t nq, int64_t group, int64_t D, const int64_t* keys, const int64_t* n, int64_t L, int64_t shared,
                  KeyRow key, ValueRow value, float scale, const float* qf, float* s, float* m, float* l, float* o,
                  float* rows, T* const* orows) {
  const int64_t H = nq * group, ss = L + kTile;
  // Rows [r0, r1) of key list `list` converted a tile at a time; f(r0, nt, padded) then reads `rows`,
  // zero beyond nt up to the next multiple of 4 (extra scores land in s's padding and are overwritten
  // or never read).  The next tile's rows are asked for while this one is computed: a forward's keys
  // and values come from memory (a layer's do not stay in cache between steps), one scattered row at a
  // time.
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const auto tiles = [&](auto row_of, const int64_t* list, int64_t r0, int64_t r1, auto f) {
    for (; r0 < r1; r0 += kTile) {
      const int64_t nt = std::min(kTile, r1 - r0), padded = (nt + 3) / 4 * 4;
      for (int64_t i = r0 + kTile; i < std::min(r1, r0 + 2 * kTile); ++i)
        for (int64_t b = 0; b < row_bytes; b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(row_of(list[i])) + b, 0, 3);
      for (int64_t i = 0; i < nt; ++i) to_f32_row(row_of(list[r0 + i]), rows + i * D, D);
      std::fill(rows + nt * D, rows + padded * D, 0.0f);
      f(r0, nt, padded);
    }
  };
  tiles(key, keys, 0, shared, [&](int64_t r0, int64_t, int64_t padded) {
    for (int64_t h = 0; h < H; ++h) dots(qf + h * D, rows, padded, D, s + h * ss + r0);
  });
  for (int64_t q = 0; q < nq; ++q)
    tiles(key, keys + q * L, shared, n[q], [&](int64_t r0, int64_t, int64_t padded) {
      for (int64_t h = q * group; h < (q + 1) * group; ++h) dots(qf + h * D, rows, padded, D, s + h * ss + r0);
    });
  for (int64_t h = 0; h < H; ++h) {
    const int64_t nh = n[h / group];
    m[h] = scale_max(s + h * ss, nh, scale);
    if (nh > 0) exp_shifted(s + h * ss, nh, m[h]);
  }
  std::fill(o, o + H * D, 0.0f);
  std::fill(l, l + H, 0.0f);
  tiles(value, keys, 0, shared, [&](int64_t r0, int64_t nt, int64_t) {
    for (int64_t h = 0; h < H; ++h) values(s + h * ss + r0, rows, nt, D, o + h * D);
  });
  for (int64_t q = 0; q < nq; ++q) {
    tiles(value, keys + q * L, shared, n[q], [&](int64_t r0, int64_t nt, int64_t) {
      for (int64_t h = q * group; h < (q + 1) * group; ++h) values(s + h * ss + r0, rows, nt, D, o + h * D);
    });
    for (int64_t r = 0; r < n[q]; ++r)
      for (int64_t h = q * group; h < (q + 1) * group; ++h) l[h] += s[h * ss + r];
  }
  for (int64_t h = 0; h < H; ++h) {
    if (n[h / group] == 0) {  // nothing to attend to: zeros (SDPA would give NaN)
      std::fill(orows[h], orows[h] + D, static_cast<T>(0.0f));
      continue;
    }
    const float inv = 1.0f / l[h];
    for (int64_t d = 0; d < D; ++d) orows[h][d] = static_cast<T>(o[h * D + d] * inv);
  }
}

// n floats starting on a 64-byte boundary, so that a 16-lane load or store of a row (D a multiple of
// 16) never spans two cache lines (malloc aligns to 16 bytes).  Not copyable: p_ points into raw_.
class Floats {
 public:
  explicit Floats(int64_t n) : raw_(static_cast<size_t>(n) + 15) {
    p_ = raw_.data() + ((-reinterpret_cast<uintptr_t>(raw_.data()) & 63) / sizeof(float));
  }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  float* data() { return p_; }

 private:
  std::vector<float> raw_;
  float* p_;
};

// Scratch of one thread for blocks of up to nq queries: their heads' queries, scores (L + kTile apart),
// max / sum, outputs and key lists, and kTile rows in fp32.
struct Scratch {
  Floats qf, o, s, row, m, l;
  std::vector<int64_t> keys, n;
  Scratch(int64_t nq, int64_t group, int64_t L, int64_t D)
      : qf(nq * group * D), o(nq * group * D), s(nq * group * (L + kTile)), row(kTile * D), m(nq * group),
        l(nq * group), keys(nq * L), n(nq) {}
};

template <typename T>
void load_queries(const at::Tensor& q, int64_t b, int64_t hk, int64_t t, int64_t group, float* qf) {
  const auto qs = q.strides();
  const T* qp = q.data_ptr<T>();
  const int64_t D = q.size(3);
  for (int64_t g = 0; g < group; ++g)
    to_f32_row(qp + b * qs[0] + (hk * group + g) * qs[1] + t * qs[2], qf + g * D, D);
}

// Every query of a call, in work items of one sequence b, one kv head hk and a block of its queries:
// `keys_of(b, t, keys)` lists query t's allowed keys in increasing order and returns how many, of which
// the first `shared(b)` are the same for every query of sequence b; `key_row(b, hk, j)` /
// `value_row(b, hk, j)` point at key j's rows.  q and out are [B, Hq, T, D], or with `counts` (real
// queries per sequence, B of them) packed: [1, Hq, N, D] with N = sum(counts), sequence b's query t at
// row counts[0] + ... + counts[b - 1] + t.  Packed, a batch of blocks of different lengths costs only
// its real queries.  Blocks are sized so that every thread gets a couple of items; a query's result
// never depends on its block.
template <typename T, typename KeysOf, typename Shared, typename KeyRow, typename ValueRow>
void attend_all(const at::Tensor& q, int64_t Hkv, int64_t L, float scale, at::Tensor& out, const int64_t* counts,
                int64_t B, KeysOf keys_of, Shared shared, KeyRow key_row, ValueRow value_row) {
  const int64_t Hq = q.size(1), QT = q.size(2), D = q.size(3), group = Hq / Hkv;
  const bool tiled = kTiled && D % 16 == 0;
  int64_t queries = 0;  // real ones
  for (int64_t b = 0; b < B; ++b) queries += counts != nullptr ? counts[b] : QT;
  const int64_t threads = at::get_num_threads();
  const int64_t nq = !tiled ? 1
                            : std::max<int64_t>(1, std::min({int64_t{8}, (queries * Hkv) / (2 * threads),
                                                             (int64_t{1} << 16) / (group * (L + kTile))}));
  struct Block {
    int64_t b, t0, count, qb, qt0;  // sequence b's queries t0 .. t0 + count - 1, at q[qb, :, qt0 ..]
  };
  std::vector<Block> blocks;
  for (int64_t b = 0, row = 0; b < B; ++b) {
    const int64_t nb = counts != nullptr ? counts[b] : QT;
    for (int64_t t0 = 0; t0 < nb; t0 += nq)
      blocks.push_back(counts != nullptr ? Block{b, t0, std::min(nq, nb - t0), 0, row + t0}
                                         : Block{b, t0, std::min(nq, nb - t0), b, t0});
    row += nb;
  }
  const int64_t items = static_cast<int64_t>(blocks.size()) * Hkv;
  T* op = out.data_ptr<T>();
  // Small calls (tiny models, short contexts) run inline: a parallel region costs more than they do.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, nq * group * L * D));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    Scratch w(nq, group, L, D);
    std::vector<T*> orows(nq * group);
    for (int64_t i = i0; i < i1; ++i) {
      const Block& blk = blocks[i / Hkv];
      const int64_t hk = i % Hkv, b = blk.b;
      for (int64_t k = 0; k < blk.count; ++k) {
        load_queries<T>(q, blk.qb, hk, blk.qt0 + k, group, w.qf.data() + k * group * D);
        w.n[k] = keys_of(b, blk.t0 + k, w.keys.data() + k * L);
        for (int64_t g = 0; g < group; ++g)
          orows[k * group + g] = op + ((blk.qb * Hq + hk * group + g) * QT + blk.qt0 + k) * D;
      }
      const auto key = [&](int64_t j) { return key_row(b, hk, j); };
      const auto value = [&](int64_t j) { return value_row(b, hk, j); };
      if (tiled) {
        const int64_t common = std::min(shared(b), *std::min_element(w.n.begin(), w.n.begin() + blk.count));
        attend_block<T>(blk.count, group, D, w.keys.data(), w.n.data(), L, common, key, value, scale, w.qf.data(),
                        w.s.data(), w.m.data(), w.l.data(), w.o.data(), w.row.data(), orows.data());
      } else {
        for (int64_t k = 0; k < blk.count; ++k)
          attend_one<T>(w.qf.data() + k * group * D, group, D, w.keys.data() + k * L, w.n[k], key, value, scale,
                        w.s.data(), L + kTile, w.m.data(), w.l.data(), w.o.data(), w.row.data(),
                        orows.data() + k * group);
      }
    }
  });
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask, int64_t mask_sb,
            int64_t mask_st, float scale, at::Tensor& out) {
  const int64_t L = k.size(2);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const auto ks = k.strides(), vs = v.strides();
  attend_all<T>(
      q, k.size(1), L, scale, out, nullptr, q.size(0),
      [&](int64_t b, int64_t t, int64_t* keys) {
        const bool* allowed = mask != nullptr ? mask + b * mask_sb + t * mask_st : nullptr;
        int64_t n = 0;
        for (int64_t j = 0; j < L; ++j)
          if (allowed == nullptr || allowed[j]) keys[n++] = j;
        return n;
      },
      [&](int64_t) { return int64_t{0}; },  // any mask: no keys known to be shared
      [&](int64_t b, int64_t hk, int64_t j) { return kp + b * ks[0] + hk * ks[1] + j * ks[2]; },
      [&](int64_t b, int64_t hk, int64_t j) { return vp + b * vs[0] + hk * vs[1] + j * vs[2]; });
}

// The same attention read straight from a paged pool: key j of sequence b is pool row rows[b, j]
// (k_pool, v_pool [R, Hkv, D]), and the mask is never built over the keys: query t of sequence b (at
// cache position start[b] + t) sees every committed entry (j < lens[b]), then, in the pending entries
// and the block (lens[b] <= j < lens[b] + W), what block_mask[b, t, j - lens[b]] allows, or with no
// block mask every j <= start[b] + t (causal); and always itself.  Same allowed keys in the same order
// as `attend` over the gathered rows and the full mask: bitwise the same outputs.
// With `counts`, q and out are packed (see attend_all) and block_mask is [B, T, W] over each
// sequence's block.
template <typename T>
void attend_paged(const at::Tensor& q, const at::Tensor& kp_, const at::Tensor& vp_, const int64_t* rows,
                  const int64_t* lens, const int64_t* start, const bool* bm, int64_t T_, int64_t W, int64_t L,
                  const int64_t* counts, int64_t B, float scale, at::Tensor& out) {
  const T* kp = kp_.data_ptr<T>();
  const T* vp = vp_.data_ptr<T>();
  const auto ks = kp_.strides(), vs = vp_.strides();
  attend_all<T>(
      q, kp_.size(1), L, scale, out, counts, B,
      [&](int64_t b, int64_t t, int64_t* keys) {
        const int64_t committed = std::min(lens[b], L), self = start[b] + t;
        int64_t n = 0;
        for (int64_t j = 0; j < committed; ++j) keys[n++] = j;
        if (bm != nullptr) {
          const bool* allowed = bm + (b * T_ + t) * W;
          for (int64_t j = committed; j < L; ++j)
            if ((j - committed < W && allowed[j - committed]) || j == self) keys[n++] = j;
        } else {
          for (int64_t j = committed; j < L && j <= self; ++j) keys[n++] = j;
        }
        return n;
      },
      [&](int64_t b) { return std::min(lens[b], L); },  // every query sees the committed entries first
      [&](int64_t b, int64_t hk, int64_t j) { return kp + rows[b * L + j] * ks[0] + hk * ks[1]; },
      [&](int64_t b, int64_t hk, int64_t j) { return vp + rows[b * L + j] * vs[0] + hk * vs[1]; });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be [B, H, T, D]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "attention: q, k, v must all be float32 or all bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "attention: k and v must be [B, Hkv, L, D] matching q [B, Hq, T, D]");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attention: the head dimension must be contiguous");
  const bool* mp = nullptr;
  int64_t mask_sb = 0, mask_st = 0;
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1 && m.size(2) == q.size(2) &&
                    m.size(3) == k.size(2) && (m.size(0) == q.size(0) || m.size(0) == 1),
                "attention: the mask must be bool [B, 1, T, L]");
    m = m.contiguous();
    mp = m.data_ptr<bool>();
    mask_sb = m.size(0) == 1 ? 0 : m.stride(0);
    mask_st = m.stride(2);
  }
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat)
    attend<float>(q, k, v, mp, mask_sb, mask_st, s, out);
  else
    attend<c10::BFloat16>(q, k, v, mp, mask_sb, mask_st, s, out);
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& rows, const at::Tensor& lens, const at::Tensor& start,
                           const c10::optional<at::Tensor>& block_mask, double scale,
                           const c10::optional<at::Tensor>& counts) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes(),
              "paged_attention: q must be [B, Hq, T, D], the pools [R, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_attention: q and the pools must all be float32 or all bfloat16");
  TORCH_CHECK(k_pool.size(2) == q.size(3) && k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0,
              "paged_attention: head sizes do not match");
  TORCH_CHECK(q.stride(3) == 1 && k_pool.stride(2) == 1 && v_pool.stride(2) == 1,
              "paged_attention: the head dimension must be contiguous");
  const bool packed = counts.has_value() && counts->defined();
  const at::Tensor cn = packed ? counts->contiguous() : at::Tensor();
  const int64_t B = packed ? cn.numel() : q.size(0);
  int64_t T_ = q.size(2);  // queries per sequence (packed: the longest block)
  if (packed) {  // one pass over the counts (a handful of numbers, read every layer): no tensor reductions
    TORCH_CHECK(cn.scalar_type() == at::kLong && cn.device().is_cpu(), "paged_attention: counts [B] int64 on the CPU");
    const int64_t* c = cn.data_ptr<int64_t>();
    int64_t total = 0, lowest = 0;
    T_ = 0;
    for (int64_t b = 0; b < B; ++b) {
      total += c[b];
      lowest = std::min(lowest, c[b]);
      T_ = std::max(T_, c[b]);
    }
    TORCH_CHECK(q.size(0) == 1 && total == q.size(2) && lowest >= 0,
                "paged_attention: packed q must be [1, Hq, sum(counts), D]");
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == B, "paged_attention: rows [B, L] int64");
  TORCH_CHECK(lens.scalar_type() == at::kLong && start.scalar_type() == at::kLong && lens.numel() == B &&
                  start.numel() == B, "paged_attention: lens and start [B] int64");
  const at::Tensor r = rows.contiguous(), ln = lens.contiguous(), st = start.contiguous();
  const int64_t L = r.size(1), R = k_pool.size(0);
  TORCH_CHECK(r.numel() == 0 || (r.min().item<int64_t>() >= 0 && r.max().item<int64_t>() < R),
              "paged_attention: rows out of the pool");
  const bool* bm = nullptr;
  int64_t W = 0;
  at::Tensor m;
  if (block_mask.has_value() && block_mask->defined()) {
    m = block_mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3 && m.size(0) == B &&
                    (packed ? m.size(1) >= T_ : m.size(1) == T_),
                "paged_attention: the block mask must be bool [B, T, W]");
    bm = m.data_ptr<bool>();
    T_ = m.size(1);
    W = m.size(2);
  }
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat)
    attend_paged<float>(q, k_pool, v_pool, r.data_ptr<int64_t>(), ln.data_ptr<int64_t>(), st.data_ptr<int64_t>(), bm,
                        T_, W, L, packed ? cn.data_ptr<int64_t>() : nullptr, B, s, out);
  else
    attend_paged<c10::BFloat16>(q, k_pool, v_pool, r.data_ptr<int64_t>(), ln.data_ptr<int64_t>(),
                                st.data_ptr<int64_t>(), bm, T_, W, L, packed ? cn.data_ptr<int64_t>() : nullptr, B,
                                s, out);
  return out;
}

// "avx512" or "avx2" (or "portable"): the width the fp32 kernels (attention, layer operations) run at;
// `set` ("avx512" / "avx2", "" to only ask) switches it, and asking for 512-bit code the CPU lacks is an
// error.
std::string vector_isa(const std::string& set) {
  const std::string narrow = kTiled ? "avx2" : "portable";
  if (set == "avx512") {
    TORCH_CHECK(mcsd::cpu_has_avx512f(), "vector_isa: this CPU (or build) has no AVX-512F");
    mcsd::wide_vectors() = true;
  } else if (set == "avx2" || set == "portable") {
    mcsd::wide_vectors() = false;
  } else {
    TORCH_CHECK(set.empty(), "vector_isa: expected 'avx512', 'avx2' or '', got '", set, "'");
  }
  return mcsd::wide_vectors() ? "avx512" : narrow;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcsd_cpu, m) {
  m.def("vector_isa(str set='') -> str", &vector_isa);  // no tensors: a catch-all kernel
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor rows, Tensor lens, Tensor start, "
        "Tensor? block_mask, float scale, Tensor? counts=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) {
  m.impl("attention", &attention);
  m.impl("paged_attention", &paged_attention);
}
