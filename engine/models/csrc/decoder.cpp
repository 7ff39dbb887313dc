// The decoder stack of a forward in one operator call:
//
//   decoder_stack(x, tensors, meta, eps, cos, sin, k_pool, v_pool, write, read, lens, start,
//                 block_mask, scale, counts) -> (x, delta)
//
// runs every layer of engine/models/llama.py's DecoderLayer.forward (norm, q/k/v, rotary, the paged
// cache's writes and attention, o_proj, norm, gate/up, SwiGLU, down) for weights in GGUF blocks, by
// calling the same operators in the same order with the same arguments.  The result is therefore
// bitwise the per-layer Python loop's (tested); what goes away is the interpreter between the
// operators.  Measured on a 2-core CPU, that glue (argument parsing, views, dispatch, the garbage
// collector's share) took about a fifth of a 1.5B model's one-token forward.
//
// The layers' weights travel as one flat list, described by `meta` (built once per model by
// engine/models/llama.py's FusedStack):
//
//   meta = [layers, heads, kv_heads, head_dim,
//           per layer: has_bias, then per linear (qkv, o, gate_up, down): parts, per part: type, K, rows]
//   tensors = per layer: input norm, post-attention norm, [qkv bias], then every linear's parts' blocks
//
// A linear of one part is a QuantWeight (engine/models/qweight.py: the bias goes into the kernel, a
// padded last group is cut off); of several, a StackedWeight (gguf_native.py: the parts side by side,
// then the bias added in the activations' dtype).  `type` is the kernel's (the GGML type, | 256 when
// packed).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kPackedFlag = 256;  // qweight._PACKED_FLAG
constexpr int64_t kPackRows = 8;      // qweight._PACK_ROWS

// The library's own operators, called through the dispatcher from here (as torch.ops does from
// Python), so that this file needs nothing of the others but their schemas.
template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      const std::optional<at::Tensor>&)>
      quant_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                   const std::optional<at::Tensor>&)>("mcsd_cpu::quant_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("mcsd_cpu::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, double)>
      add_rms_norm = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           double)>("mcsd_cpu::add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> rotary =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("mcsd_cpu::rotary");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      op<at::Tensor(const at::Tensor&)>("mcsd_cpu::silu_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double,
                                      const std::optional<at::Tensor>&)>
      paged_attention =
          op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const std::optional<at::Tensor>&, double,
                        const std::optional<at::Tensor>&)>("mcsd_cpu::paged_attention");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// Reads the flat description in order.
struct Reader {
  at::TensorList tensors;
  c10::IntArrayRef meta;
  size_t t = 0, m = 0;
  const at::Tensor& tensor() {
    TORCH_CHECK(t < tensors.size(), "decoder_stack: fewer tensors than meta describes");
    return tensors[t++];
  }
  int64_t next() {
    TORCH_CHECK(m < meta.size(), "decoder_stack: meta is too short");
    return meta[m++];
  }
};

struct Part {
  at::Tensor data;
  int64_t type, k, n;
};

// One linear's parts, from the reader.
std::vector<Part> read_linear(Reader& r) {
  const int64_t parts = r.next();
  TORCH_CHECK(parts >= 1, "decoder_stack: a linear needs at least one part");
  std::vector<Part> out;
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t type = r.next(), k = r.next(), n = r.next();
    out.push_back(Part{r.tensor(), type, k, n});
  }
  return out;
}

// QuantWeight.linear: the kernel's product (+ bias, padded like the packed rows), the padding cut off.
at::Tensor part_linear(const Part& p, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const Ops& o = ops();
  const int64_t pad = (p.type & kPackedFlag) ? (kPackRows - p.n % kPackRows) % kPackRows : 0;
  if (pad == 0) return o.quant_linear.call(x, p.data, p.type, p.k, bias);
  std::optional<at::Tensor> padded;
  if (bias.has_value()) padded = at::cat({*bias, at::zeros({pad}, bias->options())});
  return o.quant_linear.call(x, p.data, p.type, p.k, padded).narrow(-1, 0, p.n).contiguous();
}

// cpu_kernels.linear over a QuantWeight (one part) or a StackedWeight (several).
at::Tensor linear(const std::vector<Part>& parts, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  if (parts.size() == 1) return part_linear(parts[0], x, bias);
  std::vector<at::Tensor> ys;
  ys.reserve(parts.size());
  for (const Part& p : parts) ys.push_back(part_linear(p, x, std::nullopt));
  at::Tensor y = at::cat(ys, -1);
  return bias.has_value() ? at::add(y, *bias) : y;
}

std::tuple<at::Tensor, at::Tensor> decoder_stack(const at::Tensor& x_in, at::TensorList tensors,
                                                 c10::IntArrayRef meta, double eps, const at::Tensor& cos,
                                                 const at::Tensor& sin, const at::Tensor& k_pool,
                                                 const at::Tensor& v_pool, const at::Tensor& write,
                                                 const at::Tensor& read, const at::Tensor& lens,
                                                 const at::Tensor& start, const std::optional<at::Tensor>& block_mask,
                                                 double scale, const std::optional<at::Tensor>& counts) {
  TORCH_CHECK(x_in.dim() == 3, "decoder_stack: x must be [batch, block, hidden]");
  Reader r{tensors, meta};
  const int64_t layers = r.next(), hq = r.next(), hkv = r.next(), d = r.next();
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) >= layers && k_pool.sizes() == v_pool.sizes(),
              "decoder_stack: the pools must be [layers, rows, kv_heads, head_dim]");
  const Ops& o = ops();
  const int64_t b = x_in.size(0), t = x_in.size(1);
  const at::Tensor rows = write.reshape({-1});
  at::Tensor x = x_in, delta;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor& in_norm = r.tensor();
    const at::Tensor& post_norm = r.tensor();
    std::optional<at::Tensor> bias;
    if (r.next()) bias = r.tensor();
    const std::vector<Part> qkv_w = read_linear(r), o_w = read_linear(r), gate_up_w = read_linear(r),
                            down_w = read_linear(r);
    at::Tensor h;
    if (delta.defined())
      std::tie(x, h) = o.add_rms_norm.call(x, delta, in_norm, eps);
    else
      h = o.rms_norm.call(x, in_norm, eps);
    const at::Tensor qkv = linear(qkv_w, h, bias);
    // q and k heads rotate together; k and v go into the layer's pool rows, then the attention reads it
    const at::Tensor qk = o.rotary.call(qkv.narrow(-1, 0, (hq + hkv) * d).reshape({b, t, hq + hkv, d}), cos, sin);
    const at::Tensor q = qk.narrow(2, 0, hq), k = qk.narrow(2, hq, hkv);
    const at::Tensor v = qkv.narrow(-1, (hq + hkv) * d, hkv * d).view({b, t, hkv, d});
    const at::Tensor kp = k_pool.select(0, layer), vp = v_pool.select(0, layer);
    kp.index_copy_(0, rows, k.reshape({-1, hkv, d}));
    vp.index_copy_(0, rows, v.reshape({-1, hkv, d}));
    const at::Tensor attn = o.paged_attention.call(q.transpose(1, 2), kp, vp, read, lens, start, block_mask, scale,
                                                   counts);
    std::tie(x, h) = o.add_rms_norm.call(x, linear(o_w, attn.transpose(1, 2).reshape({b, t, hq * d}), std::nullopt),
                                         post_norm, eps);
    delta = linear(down_w, o.silu_mul.call(linear(gate_up_w, h, std::nullopt)), std::nullopt);
  }
  TORCH_CHECK(r.t == tensors.size() && r.m == meta.size(), "decoder_stack: tensors and meta do not match");
  return {x, delta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mcsd_cpu, m) {
  m.def("decoder_stack(Tensor x, Tensor[] tensors, int[] meta, float eps, Tensor cos, Tensor sin, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write, Tensor read, Tensor lens, Tensor start, "
        "Tensor? block_mask, float scale, Tensor? counts=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mcsd_cpu, CPU, m) { m.impl("decoder_stack", &decoder_stack); }
