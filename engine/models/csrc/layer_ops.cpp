// The row-wise operations between a decoder layer's linears, one operator each:
//
//   rms_norm(x, w, eps)            y = w * norm(x)
//   add_rms_norm(x, d, w, eps)     s = x + d, y = w * norm(s)      -> (s, y)  (residual add + next norm)
//   rotary(x, cos, sin)            x * cos + rotate_half(x) * sin   (q and k heads in one call)
//   silu_mul(gu)                   silu(g) * u for gu = [g | u] along the last dimension
//
// Built with the GEMM kernels into one library by engine/models/cpu_kernels.py; registers them under
// torch.ops.mcsd_cpu.
//
// Why.  Written with torch operators these take a large share of a small model's one-token forward on
// a CPU: RMSNorm alone is eight operators (upcast, pow, mean, add, rsqrt, mul, downcast, scale),
// each a dispatch and a pass over memory, 57 times a forward.  One pass per row here.
//
// Numerics.  Computed in fp32 and rounded to the tensor's dtype (bf16: to nearest even) exactly where
// the torch formulation rounds, so the only difference from it is the order of the sum of squares:
//   norm:    ss = sum x^2 (8 fp32 lanes in order, lanes.h's fixed reduction, then the tail);
//            y = round(w * round(x / sqrt(ss / n + eps)))
//   add:     s = round(x + d)
//   rotary:  round(round(x * cos) + round(rotate_half(x) * sin))
//   silu:    round(round(g / (1 + exp(-g))) * u)
// Every row is computed alone by the same operations, whatever the number of rows or threads: batch
// invariant, like the other kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "lanes.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float round_to(float v, float*) { return v; }
inline float round_to(float v, bf16*) { return static_cast<float>(static_cast<bf16>(v)); }
template <typename T>
inline float rnd(float v) { return round_to(v, static_cast<T*>(nullptr)); }

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;

using mcsd::load8;

inline __m256 round8(__m256 v, float*) { return v; }
inline __m256 round8(__m256 v, bf16*) { return mcsd::round_bf16(v); }
template <typename T>
inline __m256 rnd8(__m256 v) { return round8(v, static_cast<T*>(nullptr)); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) { mcsd::store_bf16(p, v); }  // v already rounded

#else
constexpr int64_t kLanes = 0;  // portable build: every element through the scalar tails
#endif

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// One norm row: y = round(w * round(x * inv)), inv = 1 / sqrt(mean(x^2) + eps).
template <typename T, typename W>
void norm_row(const T* x, const W* w, T* y, int64_t n, float eps) {
  int64_t i = 0;
  float ss = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = mcsd::reduce_lanes(acc);
#endif
  for (; i < n; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + kLanes <= n; i += kLanes)
    store8(y + i, rnd8<T>(_mm256_mul_ps(load8(w + i), rnd8<T>(_mm256_mul_ps(load8(x + i), iv)))));
#endif
  for (; i < n; ++i) y[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(x[i]) * inv));
}

// Rows of `rows` items, each `cost` elements, split over threads; calls under 8K elements run inline
// (a parallel region costs a few microseconds, about what splitting such a call saves).
template <typename F>
void for_rows(int64_t rows, int64_t cost, F f) {
  const int64_t grain = std::max<int64_t>(1, (1 << 13) / std::max<int64_t>(1, cost));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16 only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, what, ": needs a last dimension");
}

void check_weight(const at::Tensor& w, const at::Tensor& x, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous() && w.device().is_cpu() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              what, ": the weight must be a contiguous float32 or bfloat16 [", x.size(-1), "] on the CPU");
}

// f(T*, W*) with the data types of x (the activations) and w (the weight).
template <typename F>
void dispatch(const at::Tensor& x, const at::Tensor& w, F f) {
  const bool xf = x.scalar_type() == at::kFloat, wf = w.scalar_type() == at::kFloat;
  if (xf && wf) f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (xf) f(static_cast<float*>(nullptr), static_cast<bf16*>(nullptr));
  else if (wf) f(static_cast<bf16*>(nullptr), static_cast<float*>(nullptr));
  else f(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr));
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& weight, double eps) {
  check_rows(x_, "rms_norm");
  check_weight(weight, x_, "rms_norm");
  const at::Tensor x = x_.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  dispatch(x, weight, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    using W = std::remove_pointer_t<decltype(w)>;
    const int64_t n = x.size(-1);
    const T* xp = x.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    T* yp = y.data_ptr<T>();
    for_rows(x.numel() / n, n, [&](int64_t r) { norm_row(xp + r * n, wp, yp + r * n, n, static_cast<float>(eps)); });
  });
  return y;
}

template <typename T, typename W>
void add_norm_rows(const at::Tensor& x, const at::Tensor& d, const W* w, at::Tensor& s, at::Tensor& y, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T *xp = x.data_ptr<T>(), *dp = d.data_ptr<T>();
  T *sp = s.data_ptr<T>(), *yp = y.data_ptr<T>();
  for_rows(rows, n, [&](int64_t r) {
    const T *xr = xp + r * n, *dr = dp + r * n;
    T* sr = sp + r * n;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + kLanes <= n; i += kLanes) store8(sr + i, rnd8<T>(_mm256_add_ps(load8(xr + i), load8(dr + i))));
#endif
    for (; i < n; ++i) sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
    norm_row(sr, w, yp + r * n, n, static_cast<float>(eps));
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_, const at::Tensor& d_, const at::Tensor& weight,
                                                double eps) {
  check_rows(x_, "add_rms_norm");
  TORCH_CHECK(d_.sizes() == x_.sizes() && d_.scalar_type() == x_.scalar_type() && d_.device() == x_.device(),
              "add_rms_norm: x and the residual must have the same shape, dtype and device");
  check_weight(weight, x_, "add_rms_norm");
  const at::Tensor x = x_.contiguous(), d = d_.contiguous();
  at::Tensor s = at::empty(x.sizes(), x.options()), y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return {s, y};
  dispatch(x, weight, [&](auto* t, auto* w) {
    using T = std::remove_pointer_t<decltype(t)>;
    add_norm_rows<T>(x, d, weight.data_ptr<std::remove_pointer_t<decltype(w)>>(), s, y, eps);
  });
  return {s, y};
}

// x [B, T, H, D] (head dimension contiguous, any other strides), cos / sin [B, T, 1, D] -> [B, T, H, D]
template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& out) {
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const T *xp = x.data_ptr<T>(), *cp = c.data_ptr<T>(), *sp = s.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const auto xs = x.strides(), cs = c.strides(), ss = s.strides();
  for_rows(B * Tn * H, D, [&](int64_t r) {
    const int64_t b = r / (Tn * H), t = (r / H) % Tn, h = r % H;
    const T* xr = xp + b * xs[0] + t * xs[1] + h * xs[2];
    const T* cr = cp + b * cs[0] + t * cs[1];
    const T* sr = sp + b * ss[0] + t * ss[1];
    T* o = op + r * D;
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (half % kLanes == 0) {
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (; d < half; d += kLanes) {
        const __m256 rot = _mm256_xor_ps(load8(xr + d + half), sign);
        store8(o + d, rnd8<T>(_mm256_add_ps(rnd8<T>(_mm256_mul_ps(load8(xr + d), load8(cr + d))),
                                            rnd8<T>(_mm256_mul_ps(rot, load8(sr + d))))));
      }
      for (; d < D; d += kLanes) {
        const __m256 rot = load8(xr + d - half);
        store8(o + d, rnd8<T>(_mm256_add_ps(rnd8<T>(_mm256_mul_ps(load8(xr + d), load8(cr + d))),
                                            rnd8<T>(_mm256_mul_ps(rot, load8(sr + d))))));
      }
    }
#endif
    for (; d < D; ++d) {
      const float rot = d < half ? -static_cast<float>(xr[d + half]) : static_cast<float>(xr[d - half]);
      o[d] = static_cast<T>(rnd<T>(static_cast<float>(xr[d]) * static_cast<float>(cr[d])) +
                            rnd<T>(rot * static_cast<float>(sr[d])));
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rotary");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1,
              "rotary: x must be [B, T, H, D] with an even, contiguous head dimension");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device().is_cpu() && t->dim() == 4 &&
                    t->size(0) == x.size(0) && t->size(1) == x.size(1) && t->size(2) == 1 &&
                    t->size(3) == x.size(3) && t->stride(3) == 1,
                "rotary: cos and sin must be [B, T, 1, D] in x's dtype, head dimension contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat)
    rotary_rows<float>(x, cos, sin, out);
  else
    rotary_rows<bf16>(x, cos, sin, out);
  return out;
}

#if defined(MCSD_HAVE_512F)
MCSD_TARGET_512F inline __m512 round16(__m512 v, float*) { return v; }
MCSD_TARGET_512F inline __m512 round16(__m512 v, bf16*) { return mcsd::round_bf16_16(v); }
template <typename T>
MCSD_TARGET_512F inline __m512 rnd16(__m512 v) { return round16(v, static_cast<T*>(nullptr)); }
MCSD_TARGET_512F inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
MCSD_TARGET_512F inline void store16(bf16* p, __m512 v) { mcsd::store_bf16_16(p, v); }  // v already rounded

// silu(g) * u over lanes [0, n16), n16 a multiple of 16: the 8-lane loop's operations.
template <typename T>
MCSD_TARGET_512F void silu_mul_512(const T* g, const T* u, T* o, int64_t n16) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 gv = mcsd::load16(g + i);
    const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one, mcsd::exp16(_mm512_castsi512_ps(
                                             _mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(INT32_MIN))))));
    store16(o + i, rnd16<T>(_mm512_mul_ps(rnd16<T>(act), mcsd::load16(u + i))));
  }
}
#endif

template <typename T>
void silu_mul_rows(const at::Tensor& gu, at::Tensor& out) {
  const int64_t n = out.size(-1), rows = out.numel() / n;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for_rows(rows, n, [&](int64_t r) {
    const T *g = gp + r * 2 * n, *u = g + n;
    T* o = op + r * n;
    int64_t i = 0;
#if defined(MCSD_HAVE_512F)
    if (mcsd::wide_vectors().load(std::memory_order_relaxed)) {
      silu_mul_512(g, u, o, n / 16 * 16);
      i = n / 16 * 16;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + kLanes <= n; i += kLanes) {
      const __m256 gv = load8(g + i);
      const __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, mcsd::exp8(_mm256_xor_ps(gv, sign))));
      store8(o + i, rnd8<T>(_mm256_mul_ps(rnd8<T>(act), load8(u + i))));
    }
#endif
    for (; i < n; ++i) o[i] = static_cast<T>(rnd<T>(silu(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
  });
}

at::Tensor silu_mul(const at::Tensor& gu_) {
  check_rows(gu_, "silu_mul");
  TORCH_CHECK(gu_.size(-1) % 2 == 0, "silu_mul: the last dimension must hold [gate | up], an even size");
  const at::Tensor gu = gu_.contiguous();
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, gu.options());
  if (out.numel() == 0) return out;
  if (gu.scalar_type() == at::kFloat)
    silu_mul_rows<float>(gu, out);
  else
    silu_mul_rows<bf16>(gu, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcsd_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
}
