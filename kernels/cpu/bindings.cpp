// Every op of the saltserve_cpu library (torch.ops.saltserve_cpu.*): its schema (m.def) and the
// kernel function that runs it (m.impl; declared in ops.h, defined in the .cpp named there).
// Tensor ops run for CPU tensors; the switches and queries without a tensor argument
// (int8_amx, attention_avx512, ...) for any (CatchAll). A new op is declared in ops.h, defined
// in its .cpp, registered here and named in build.py's OPS (load() checks them).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(saltserve_cpu, m) {
  // linear.cpp
  m.def("linear_small_m(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  // q4_linear.cpp
  m.def("q4_linear(Tensor x, Tensor codes, Tensor scale, Tensor minimum, Tensor? bias) -> Tensor");
  // q4_vnni.cpp
  m.def("q8_linear_vnni(Tensor x, Tensor codes, Tensor scale, Tensor? bias, "
        "int act_bits) -> Tensor");
  m.def("q4_linear_vnni(Tensor x, Tensor codes, Tensor scale_min, Tensor? bias, "
        "int act_bits) -> Tensor");
  m.def("int8_amx(int mode) -> bool");
  m.def("int8_amx_calls() -> int");
  // kquant_vnni.cpp
  m.def("kquant_linear(Tensor x, Tensor codes, Tensor scales, Tensor meta, Tensor? bias, "
        "int act_bits) -> Tensor");
  // norm.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  // decode_attention.cpp
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, float scale) -> ()");
  m.def("bf16_kv_cache() -> bool");
  m.def("attention_avx512(int enabled) -> bool");
  m.def("attention_amx(int enabled) -> bool");
  // rotary_cache.cpp
  m.def("rotary_neox_(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  // decode_layer.cpp
  // residual (a!): updated in place; on the first layer it is hidden itself (decode_layer.cpp).
  m.def("decode_layer(Tensor hidden, Tensor(a!) residual, bool first, Tensor ln1, Tensor ln2, "
        "float eps, Tensor?[] weights, int[] kinds, int[] groups, Tensor cos, Tensor sin, "
        "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, int num_heads, "
        "int num_kv_heads, int head_dim, int intermediate_size, float scale) -> Tensor");
  // hidden (a!): the residual stream, updated in place and returned second.
  m.def("decode_layers(Tensor(a!) hidden, Tensor[] norms, float eps, Tensor?[] weights, "
        "int[] kinds, int[] groups, Tensor cos, Tensor sin, Tensor(b!) kv_caches, "
        "Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
        "int num_heads, int num_kv_heads, int head_dim, int intermediate_size, float scale) "
        "-> (Tensor, Tensor(a!))");
  // activation.cpp
  m.def("silu_and_mul(Tensor x) -> Tensor");
  // sampling.cpp
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(saltserve_cpu, CPU, m) {
  m.impl("linear_small_m", &saltserve_cpu::linear_small_m);
  m.impl("q4_linear", &saltserve_cpu::q4_linear);
  m.impl("q4_linear_vnni", &saltserve_cpu::q4_linear_vnni);
  m.impl("q8_linear_vnni", &saltserve_cpu::q8_linear_vnni);
  m.impl("kquant_linear", &saltserve_cpu::kquant_linear);
  m.impl("rms_norm", &saltserve_cpu::rms_norm);
  m.impl("add_rms_norm", &saltserve_cpu::add_rms_norm);
  m.impl("decode_attention", &saltserve_cpu::decode_attention);
  m.impl("rotary_neox_", &saltserve_cpu::rotary_neox_);
  m.impl("reshape_and_cache", &saltserve_cpu::reshape_and_cache);
  m.impl("decode_layer", &saltserve_cpu::decode_layer);
  m.impl("decode_layers", &saltserve_cpu::decode_layers);
  m.impl("silu_and_mul", &saltserve_cpu::silu_and_mul);
  m.impl("argmax_rows", &saltserve_cpu::argmax_rows);
}

TORCH_LIBRARY_IMPL(saltserve_cpu, CatchAll, m) {
  m.impl("int8_amx", &saltserve_cpu::int8_amx);
  m.impl("int8_amx_calls", &saltserve_cpu::int8_amx_calls);
  m.impl("bf16_kv_cache", &saltserve_cpu::bf16_kv_cache);
  m.impl("attention_avx512", &saltserve_cpu::attention_avx512);
  m.impl("attention_amx", &saltserve_cpu::attention_amx);
}
