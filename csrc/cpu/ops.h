// The CPU implementations of the vllm_dflash ops, registered for the CPU
// dispatch key in csrc/cpu_bindings.cpp. Each validates its inputs with the
// checks in csrc/ops_common.h, which the CUDA implementations share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace vllm_dflash {

at::Tensor gather_hidden_states_cpu(at::TensorList hidden_states, const at::Tensor& indices);

void gather_hidden_states_out_cpu(at::TensorList hidden_states, const at::Tensor& indices, at::Tensor& out);

void store_context_kv_layer_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, c10::string_view layout);

void store_context_kv_fused_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_norm_weight,
                                double eps, const at::Tensor& cos_sin_cache, const at::Tensor& positions,
                                bool is_neox, at::TensorList kv_caches, const at::Tensor& slot_mapping,
                                c10::string_view layout);

at::Tensor rms_norm_cpu(const at::Tensor& input, const at::Tensor& weight, double eps);

// (argmax ids [rows] int64, top-1 minus top-2 logit [rows] float32)
std::tuple<at::Tensor, at::Tensor> logits_top2_cpu(const at::Tensor& logits);

// (context_rows, context_positions, context_slots, input_ids, positions, slots, seq_lens, query_start_loc)
using PrepareDFlashInputsOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                          at::Tensor, at::Tensor>;

PrepareDFlashInputsOut prepare_dflash_inputs_cpu(
    const at::Tensor& query_start_loc, const std::optional<at::Tensor>& num_rejected,
    const at::Tensor& target_positions, const at::Tensor& slot_mapping, const at::Tensor& next_token_ids,
    const at::Tensor& block_table, int64_t block_size, int64_t mask_token_id, int64_t num_speculative_tokens,
    int64_t num_rows, bool compact);

at::Tensor rejection_sample_cpu(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                                const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
                                const std::optional<at::Tensor>& bonus_token_ids,
                                const std::optional<at::Tensor>& is_greedy,
                                const std::optional<at::Tensor>& uniforms,
                                const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len);

}  // namespace vllm_dflash
