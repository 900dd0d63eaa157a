// The kernel functions of the saltserve_cpu extension, one per op (torch.ops.saltserve_cpu.*):
// defined in the .cpp named above each group, registered with their schemas in bindings.cpp.
// What each computes is described in its .cpp; the Python APIs are kernels/cpu_linear.py and
// kernels/cpu_ops.py.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace saltserve_cpu {

// linear.cpp
at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias);

// q4_linear.cpp
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& minimum, const c10::optional<at::Tensor>& bias);

// q4_vnni.cpp
at::Tensor q4_linear_vnni(const at::Tensor& x, const at::Tensor& codes,
                          const at::Tensor& scale_min, const c10::optional<at::Tensor>& bias,
                          int64_t act_bits);
at::Tensor q8_linear_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias, int64_t act_bits);
bool int8_amx(int64_t mode);
int64_t int8_amx_calls();

// kquant_vnni.cpp
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& meta, const c10::optional<at::Tensor>& bias,
                         int64_t act_bits);

// norm.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps);

// decode_attention.cpp
void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                      const at::Tensor& seq_lens, const at::Tensor& block_tables,
                      double scale);
bool bf16_kv_cache();
bool attention_avx512(int64_t enabled);
bool attention_amx(int64_t enabled);

// rotary_cache.cpp
void rotary_neox_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t num_heads, int64_t head_dim);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// decode_layer.cpp
at::Tensor decode_layer(const at::Tensor& hidden, at::Tensor& residual, bool first,
                        const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        c10::List<c10::optional<at::Tensor>> weights, at::IntArrayRef kinds,
                        at::IntArrayRef groups, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, const at::Tensor& block_tables,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t intermediate_size, double scale);
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const c10::List<at::Tensor>& norms, double eps,
    c10::List<c10::optional<at::Tensor>> weights, at::IntArrayRef kinds, at::IntArrayRef groups,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale);

// activation.cpp
at::Tensor silu_and_mul(const at::Tensor& x);

// sampling.cpp
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace saltserve_cpu
