// One decoder layer of a CPU decode step in one call (per-step overhead).
//
// Why: at one stream of --quantization gguf a step of the 135M model spends about as long in
// Python and in some 240 small ATen calls between the linears (bf16 conversions, views, splits,
// allocations: about 20 a layer, 3-10 us each from Python) as in the linears themselves. Here
// the layer's sequence of operations runs from C++: the same kernels, in the same order, on the
// same operands, so its output is bit-identical to the Python layer's (engine/models/llama.py,
// LlamaDecoderLayer.forward; a test compares them with torch.equal).
//
// The layer, for T rows that are each a sequence's one new token (query_len 1):
//   x = first ? rms_norm(hidden) : add_rms_norm(residual += hidden)
//   y = qkv(x); rotate q and k in place (neox); write k, v to the paged cache at slot_mapping
//   attn = decode_attention(q over each sequence's block table)
//   x = add_rms_norm(residual += o(attn));  gate, up = gate_up(x)
//   return down(silu_and_mul(gate_up))     (residual is updated in place; first: it is hidden)
//
// Each projection comes as a kind (kinds.h) and up to four tensors, chosen in Python by the
// layer's LinearMethod for this number of rows (engine/quantization.py, decode_spec):
//   kDense  (w)                        our linear_small_m (up to kernels.cpu_linear.MAX_ROWS)
//   kLinear (w)                        at::linear (F.linear: more rows)
//   kInt4   (packed, scales_and_zeros) torch's _weight_int4pack_mm_for_cpu in bf16
//   kQ4     (codes, scale, minimum)    our q4_linear
//   kQ4Vnni (codes, scale_min)         our q4_linear_vnni (VNNI or AVX2, q4_vnni.cpp); its
//                                      group slot carries the activation bits (8 or 16)
//   kQ8Vnni (codes, scale)             our q8_linear_vnni (int8 weights; the same)
//   kKQuant (codes, scales, meta)      our kquant_linear (GGUF K-quants and Q8_0; the same)
//   kInt8   (qweight, scales)          torch's _weight_int8pack_mm in bf16
//   kLinearBf16 (w bf16)               at::linear in bf16 (a quantized layer's bf16 dense copy)
//   kLinearOneDnn (w)                  mkldnn::_linear_pointwise (kernels.cpu_linear.linear's
//                                      fp32 GEMM above MAX_ROWS rows, KernelPolicy.onednn_large_m)
// plus an optional bias (added after the product, as QuantizedLinear does).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <tuple>

#include "kinds.h"
#include "ops.h"

namespace saltserve_cpu {
namespace {

constexpr int64_t kSlots = 4;  // tensors per projection: three operands and the bias

using OptTensor = c10::optional<at::Tensor>;

// A view of base's memory from element offset, with these sizes and strides, made without the
// dispatcher: at::narrow/select/view cost 0.4-0.5 us a call each (hot), about 8 us a layer of
// glue at one row, against about 0.1 us here. base must outlive the view (it does:
// every view here is of a tensor held for the whole layer or step).
at::Tensor view_of(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes,
                   at::IntArrayRef strides) {
  return at::from_blob(static_cast<char*>(base.data_ptr()) + offset * base.element_size(), sizes,
                       strides, base.options());
}

// Our other ops, through the dispatcher (about 1 us a call; the files stay independent).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor project(const c10::List<OptTensor>& w, int64_t p, int64_t kind, int64_t group,
                   const at::Tensor& x) {  // p: the projection's index in w (kSlots tensors each)
  static const auto linear_small_m =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
          "saltserve_cpu::linear_small_m");
  static const auto q4_linear =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const OptTensor&)>("saltserve_cpu::q4_linear");
  static const auto q4_linear_vnni =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                    int64_t)>("saltserve_cpu::q4_linear_vnni");
  static const auto q8_linear_vnni =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                    int64_t)>("saltserve_cpu::q8_linear_vnni");
  static const auto kquant_linear =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const OptTensor&, int64_t)>("saltserve_cpu::kquant_linear");
  auto slot = [&](int64_t i) -> at::Tensor {
    const OptTensor t = w.get(p * kSlots + i);
    TORCH_CHECK(t.has_value() && t->defined(), "decode_layer: projection ", p, " kind ", kind,
                " needs tensor ", i);
    return *t;
  };
  const OptTensor bias = w.get(p * kSlots + 3);
  const bool has_bias = bias.has_value() && bias->defined();
  switch (kind) {
    case kDense:
      return linear_small_m.call(x.contiguous(), slot(0), bias);
    case kLinear:
      return at::linear(x, slot(0), bias);
    case kLinearOneDnn: {  // boxed: the op belongs to torch's mkldnn library, not to ATen's API
      static const auto handle =
          c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
      torch::jit::Stack stack{x, slot(0), bias, std::string("none"),
                              c10::List<std::optional<c10::Scalar>>(),
                              std::optional<std::string>(std::string(""))};
      handle.callBoxed(&stack);
      return stack[0].toTensor();
    }
    case kQ4:
      return q4_linear.call(x.contiguous(), slot(0), slot(1), slot(2), bias);
    case kQ4Vnni:
      return q4_linear_vnni.call(x.contiguous(), slot(0), slot(1), bias, group);  // act bits
    case kQ8Vnni:
      return q8_linear_vnni.call(x.contiguous(), slot(0), slot(1), bias, group);
    case kKQuant:
      return kquant_linear.call(x.contiguous(), slot(0), slot(1), slot(2), bias, group);
    case kInt4:
    case kInt8:
    case kLinearBf16: {
      const at::Tensor xb = x.to(at::kBFloat16);
      at::Tensor y = kind == kInt4   ? at::_weight_int4pack_mm_for_cpu(xb, slot(0), group, slot(1))
                     : kind == kInt8 ? at::_weight_int8pack_mm(xb, slot(0), slot(1))
                                     : at::linear(xb, slot(0));
      y = y.to(x.scalar_type());
      return has_bias ? y + *bias : y;
    }
    default:
      TORCH_CHECK(false, "decode_layer: unknown projection kind ", kind);
  }
}

// One layer; its projections are weights[layer * 4 * kSlots ..], kinds[layer * 4 ..] and
// groups[layer * 4 ..]; cos and sin [T, head_dim] (rows_of_rotary).
at::Tensor layer_impl(const at::Tensor& hidden, at::Tensor& residual, bool first,
                      const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                      const c10::List<OptTensor>& weights, at::IntArrayRef kinds,
                      at::IntArrayRef groups, int64_t layer, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                      const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t intermediate_size, double scale) {
  static const auto rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("saltserve_cpu::rms_norm");
  static const auto add_rms_norm =
      op<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "saltserve_cpu::add_rms_norm");
  static const auto rotary_neox_ =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>(
          "saltserve_cpu::rotary_neox_");
  static const auto reshape_and_cache =
      op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
              const at::Tensor&)>("saltserve_cpu::reshape_and_cache");
  static const auto decode_attention =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "saltserve_cpu::decode_attention");
  static const auto silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("saltserve_cpu::silu_and_mul");
  const int64_t p0 = 4 * layer;  // the layer's first projection
  TORCH_CHECK(hidden.dim() == 2 && residual.sizes() == hidden.sizes(),
              "decode_layer: hidden and residual [T, hidden] expected");
  // The first layer's residual stream is its input: the caller passes hidden as residual
  // (read by rms_norm before add_rms_norm first writes it, as in the Python layer).
  TORCH_CHECK(!first || residual.is_same(hidden),
              "decode_layer: the first layer's residual must be hidden itself");
  const int64_t T = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;

  at::Tensor x = first ? rms_norm.call(hidden, ln1, eps)
                       : add_rms_norm.call(residual, hidden, ln1, eps);
  at::Tensor y = project(weights, p0, kinds[p0], groups[p0], x);  // [T, q | k | v]
  TORCH_CHECK(y.dim() == 2 && y.size(1) == q_size + 2 * kv_size && y.stride(1) == 1,
              "decode_layer: qkv gives ", y.sizes(), " with strides ", y.strides(),
              ", expected [T, ", q_size + 2 * kv_size, "] with unit column stride");
  rotary_neox_.call(y, cos, sin, num_heads + num_kv_heads, head_dim);
  const int64_t ld = y.stride(0);  // y is [T, q | k | v], contiguous (checked by the ops)
  const at::Tensor k = view_of(y, q_size, {T, num_kv_heads, head_dim}, {ld, head_dim, 1});
  const at::Tensor v = view_of(y, q_size + kv_size, {T, num_kv_heads, head_dim},
                               {ld, head_dim, 1});
  reshape_and_cache.call(k, v, key_cache, value_cache, slot_mapping);
  const at::Tensor q = view_of(y, 0, {T, num_heads, head_dim}, {ld, head_dim, 1});
  at::Tensor attn = at::empty({T, num_heads, head_dim}, y.options());
  decode_attention.call(attn, q.contiguous(), key_cache, value_cache, query_start_loc,
                        seq_lens, block_tables, scale);
  at::Tensor o = project(weights, p0 + 1, kinds[p0 + 1], groups[p0 + 1],
                         view_of(attn, 0, {T, q_size}, {q_size, 1}));
  x = add_rms_norm.call(residual, o, ln2, eps);
  const at::Tensor gate_up = project(weights, p0 + 2, kinds[p0 + 2], groups[p0 + 2], x);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) == 2 * intermediate_size,
              "decode_layer: gate_up gives ", gate_up.sizes(), ", expected [T, ",
              2 * intermediate_size, "]");
  const at::Tensor act = silu_and_mul.call(gate_up.contiguous());
  return project(weights, p0 + 3, kinds[p0 + 3], groups[p0 + 3], act);
}

// cos, sin [T, 1, head_dim] (the model's rotary lookup) as rotary_neox_ takes them.
at::Tensor rows_of_rotary(const at::Tensor& t, int64_t T, int64_t head_dim) {
  return t.view({T, head_dim});
}

}  // namespace

at::Tensor decode_layer(const at::Tensor& hidden, at::Tensor& residual, bool first,
                        const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        c10::List<OptTensor> weights, at::IntArrayRef kinds,
                        at::IntArrayRef groups, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, const at::Tensor& block_tables,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t intermediate_size, double scale) {
  TORCH_CHECK(kinds.size() == 4 && groups.size() == 4 &&
                  weights.size() == static_cast<size_t>(4 * kSlots),
              "decode_layer: 4 projections (qkv, o, gate_up, down) of ", kSlots,
              " tensors each expected");
  const int64_t T = hidden.size(0);
  return layer_impl(hidden, residual, first, ln1, ln2, eps, weights, kinds, groups, 0,
                    rows_of_rotary(cos, T, head_dim), rows_of_rotary(sin, T, head_dim),
                    key_cache, value_cache, slot_mapping, query_start_loc, seq_lens,
                    block_tables, num_heads, num_kv_heads, head_dim, intermediate_size, scale);
}

// Every layer of a decode step in one call (30 Python calls of decode_layer, each converting
// its 16 weight slots and 20 other arguments, would cost about 10 us a layer): layer i is
// decode_layer with norms[2 i], norms[2 i + 1], the projections [4 i, 4 i + 4) of weights,
// kinds and groups, and the caches kv_caches[i, 0] and kv_caches[i, 1]. The same calls in the
// same order, so the same bits. Returns (the last layer's MLP output, the residual stream:
// hidden itself, updated in place).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const c10::List<at::Tensor>& norms, double eps,
    c10::List<OptTensor> weights, at::IntArrayRef kinds, at::IntArrayRef groups,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale) {
  const int64_t L = kv_caches.dim() == 6 ? kv_caches.size(0) : -1;
  TORCH_CHECK(L > 0 && kv_caches.size(1) == 2,
              "decode_layers: kv_caches [layers, 2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * L) &&
                  kinds.size() == static_cast<size_t>(4 * L) &&
                  groups.size() == static_cast<size_t>(4 * L) &&
                  weights.size() == static_cast<size_t>(4 * kSlots * L),
              "decode_layers: per layer 2 norms and 4 projections (qkv, o, gate_up, down) of ",
              kSlots, " tensors each expected, for ", L, " layers");
  at::Tensor residual = hidden;  // the first layer's residual stream is its input
  at::Tensor h = hidden;
  const int64_t T = hidden.size(0);
  const at::Tensor cos_rows = rows_of_rotary(cos, T, head_dim);
  const at::Tensor sin_rows = rows_of_rotary(sin, T, head_dim);
  const at::IntArrayRef cache_sizes = kv_caches.sizes().slice(2);
  const at::IntArrayRef cache_strides = kv_caches.strides().slice(2);
  for (int64_t i = 0; i < L; ++i) {  // kv_caches[i, 0] and kv_caches[i, 1]
    at::Tensor key_cache = view_of(kv_caches, i * kv_caches.stride(0), cache_sizes,
                                   cache_strides);
    at::Tensor value_cache = view_of(kv_caches, i * kv_caches.stride(0) + kv_caches.stride(1),
                                     cache_sizes, cache_strides);
    h = layer_impl(h, residual, i == 0, norms.get(2 * i), norms.get(2 * i + 1), eps, weights,
                   kinds, groups, i, cos_rows, sin_rows, key_cache, value_cache, slot_mapping,
                   query_start_loc, seq_lens, block_tables, num_heads, num_kv_heads, head_dim,
                   intermediate_size, scale);
  }
  return {h, residual};
}

}  // namespace saltserve_cpu
