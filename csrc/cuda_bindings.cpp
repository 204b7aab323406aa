// CUDA implementations of the vllm_dflash ops, all registered here: validate
// tensors (csrc/ops_common.h, shared with the CPU implementations), then call
// the plain-CUDA launchers (csrc/cuda/launchers.h) on the current stream.
// Built only when torch has CUDA.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "cuda/launchers.h"
#include "ops_common.h"

namespace vllm_dflash {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ",
              cudaGetErrorString(err));
}

void gather_into_cuda(at::TensorList hidden_states, const at::Tensor& indices,
                      const at::Tensor& out, const GatherShape& s) {
  const c10::cuda::CUDAGuard guard(indices.device());
  std::vector<at::Tensor> keep_alive;
  std::vector<const void*> srcs;
  std::vector<int64_t> strides;
  for (const at::Tensor& h : hidden_states) {
    keep_alive.push_back(dense_rows(h));
    srcs.push_back(keep_alive.back().const_data_ptr());
    strides.push_back(keep_alive.back().stride(0) * h.element_size());
  }
  const at::Tensor idx = indices.contiguous();
  check_launch(
      cuda::launch_gather_hidden_states(
          srcs.data(), strides.data(), s.num_layers, idx.const_data_ptr(),
          idx.scalar_type() == at::kLong, s.n, s.num_rows,
          s.hidden * hidden_states[0].element_size(), out.data_ptr(),
          c10::cuda::getCurrentCUDAStream(indices.device().index()).stream()),
      "gather_hidden_states");
}

at::Tensor gather_hidden_states_cuda(at::TensorList hidden_states,
                                     const at::Tensor& indices) {
  const GatherShape s = check_gather_inputs(hidden_states, indices);
  at::Tensor out =
      at::empty({s.n, s.num_layers * s.hidden}, hidden_states[0].options());
  gather_into_cuda(hidden_states, indices, out, s);
  return out;
}

void gather_hidden_states_out_cuda(at::TensorList hidden_states,
                                   const at::Tensor& indices, at::Tensor& out) {
  const GatherShape s = check_gather_inputs(hidden_states, indices);
  check_gather_out(out, s, hidden_states[0]);
  gather_into_cuda(hidden_states, indices, out, s);
}

void store_context_kv_layer_cuda(const at::Tensor& key, const at::Tensor& value,
                           at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                           c10::string_view layout) {
  const KVShape s =
      check_store_context_kv_layer_inputs(key, value, kv_cache, slot_mapping, layout);
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t es = kv_cache.element_size();
  cuda::WriteKVFlashArgs a{};
  a.key = k.const_data_ptr();
  a.value = v.const_data_ptr();
  a.key_token_stride = k.stride(0) * es;
  a.key_head_stride = k.stride(1) * es;
  a.value_token_stride = v.stride(0) * es;
  a.value_head_stride = v.stride(1) * es;
  a.cache = kv_cache.data_ptr();
  a.cache_block_stride = kv_cache.stride(0) * es;
  a.cache_head_stride = kv_cache.stride(1) * es;
  a.cache_token_stride = kv_cache.stride(2) * es;
  a.slot_mapping = slots.const_data_ptr<int64_t>();
  a.n = s.n;
  a.num_heads = s.num_heads;
  a.head_bytes = s.head_size * es;
  a.num_blocks = s.num_blocks;
  a.block_size = s.block_size;
  check_launch(cuda::launch_write_kv_flash(
                   a, c10::cuda::getCurrentCUDAStream(key.device().index()).stream()),
               "store_context_kv_layer");
}


int dtype_code(at::ScalarType t) {
  return t == at::kFloat ? 0 : (t == at::kHalf ? 1 : 2);
}

void store_context_kv_fused_cuda(const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& k_norm_weight, double eps,
                           const at::Tensor& cos_sin_cache,
                           const at::Tensor& positions, bool is_neox,
                           at::TensorList kv_caches, const at::Tensor& slot_mapping,
                           c10::string_view layout) {
  const ContextKVShape s = check_store_context_kv_fused_inputs(
      key, value, k_norm_weight, cos_sin_cache, positions, kv_caches,
      slot_mapping, layout);
  TORCH_CHECK_VALUE(s.kv.layout == KVLayout::kFlash, "store_context_kv_fused: CUDA "
                    "caches use layout='flash'");
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const at::Tensor pos = positions.contiguous();
  std::vector<void*> caches;
  for (const at::Tensor& c : kv_caches) caches.push_back(c.data_ptr());
  cuda::StoreContextKVFusedArgs a{};
  a.key = k.const_data_ptr();
  a.value = v.const_data_ptr();
  for (int dim = 0; dim < 3; ++dim) {
    a.key_stride[dim] = k.stride(dim);
    a.value_stride[dim] = v.stride(dim);
  }
  a.k_norm_weight = k_norm_weight.const_data_ptr();
  a.weight_stride[0] = k_norm_weight.stride(0);
  a.weight_stride[1] = k_norm_weight.stride(1);
  a.cos_sin_cache = cos_sin_cache.const_data_ptr();
  a.cos_sin_stride[0] = cos_sin_cache.stride(0);
  a.cos_sin_stride[1] = cos_sin_cache.stride(1);
  a.positions = pos.const_data_ptr<int64_t>();
  a.slot_mapping = slots.const_data_ptr<int64_t>();
  a.caches = caches.data();
  a.cache_block_stride = kv_caches[0].stride(0);
  a.cache_head_stride = kv_caches[0].stride(1);
  a.cache_token_stride = kv_caches[0].stride(2);
  a.n = s.kv.n;
  a.num_layers = s.num_layers;
  a.num_heads = s.kv.num_heads;
  a.head_size = s.kv.head_size;
  a.rot_dim = s.rot_dim;
  a.num_blocks = s.kv.num_blocks;
  a.block_size = s.kv.block_size;
  a.max_pos = s.max_pos;
  a.eps = static_cast<float>(eps);
  a.is_neox = is_neox;
  a.dtype = dtype_code(key.scalar_type());
  a.cos_sin_dtype = dtype_code(cos_sin_cache.scalar_type());
  check_launch(cuda::launch_store_context_kv_fused(
                   a, c10::cuda::getCurrentCUDAStream(key.device().index()).stream()),
               "store_context_kv_fused");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor, at::Tensor>
prepare_dflash_inputs_cuda(const at::Tensor& query_start_loc,
                           const std::optional<at::Tensor>& num_rejected,
                           const at::Tensor& target_positions,
                           const at::Tensor& slot_mapping,
                           const at::Tensor& next_token_ids,
                           const at::Tensor& block_table, int64_t block_size,
                           int64_t mask_token_id, int64_t num_speculative_tokens,
                           int64_t num_rows, bool compact) {
  const PrepareShape s = check_prepare_dflash_inputs(
      query_start_loc, num_rejected, target_positions, slot_mapping,
      next_token_ids, block_table, block_size, num_speculative_tokens, num_rows);
  TORCH_CHECK_VALUE(!compact || !num_rejected, "prepare_dflash_inputs: "
                    "compact=True needs a host-side count of the verified rows; "
                    "use compact=False on CUDA (rejected rows get slot -1)");
  const c10::cuda::CUDAGuard guard(next_token_ids.device());
  const auto i64 = next_token_ids.options().dtype(at::kLong);
  const auto i32 = next_token_ids.options().dtype(at::kInt);
  const int64_t B = s.batch, T = s.num_rows, q = s.q_len;
  at::Tensor rows = at::empty({T}, i64), pos = at::empty({T}, i64),
             ctx_slots = at::empty({T}, i64);
  at::Tensor ids = at::empty({B * q}, i32), qpos = at::empty({B * q}, i64),
             qslots = at::empty({B * q}, i64);
  at::Tensor seq_lens = at::empty({B}, i32), qsl_out = at::empty({B + 1}, i32);
  const at::Tensor qsl = query_start_loc.contiguous();
  const at::Tensor tpos = target_positions.contiguous();
  const at::Tensor tslot = slot_mapping.contiguous();
  const at::Tensor next = next_token_ids.contiguous();
  const at::Tensor rej = num_rejected ? num_rejected->contiguous() : at::Tensor();
  cuda::PrepareInputsArgs a{};
  a.query_start_loc = qsl.const_data_ptr<int32_t>();
  a.num_rejected = rej.defined() ? rej.const_data_ptr() : nullptr;
  a.num_rejected_int64 = rej.defined() && rej.scalar_type() == at::kLong;
  a.target_positions = tpos.const_data_ptr<int64_t>();
  a.slot_mapping = tslot.const_data_ptr<int64_t>();
  a.next_token_ids = next.const_data_ptr();
  a.next_token_ids_int64 = next.scalar_type() == at::kLong;
  a.block_table = block_table.const_data_ptr<int32_t>();
  a.block_table_stride = block_table.stride(0);
  a.max_blocks = s.max_blocks;
  a.block_size = block_size;
  a.mask_token_id = mask_token_id;
  a.q_len = q;
  a.batch = B;
  a.num_rows = T;
  a.context_rows = rows.data_ptr<int64_t>();
  a.context_positions = pos.data_ptr<int64_t>();
  a.context_slots = ctx_slots.data_ptr<int64_t>();
  a.input_ids = ids.data_ptr<int32_t>();
  a.positions = qpos.data_ptr<int64_t>();
  a.slots = qslots.data_ptr<int64_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start_loc_out = qsl_out.data_ptr<int32_t>();
  check_launch(cuda::launch_prepare_dflash_inputs(
                   a, c10::cuda::getCurrentCUDAStream(next_token_ids.device().index()).stream()),
               "prepare_dflash_inputs");
  return {rows, pos, ctx_slots, ids, qpos, qslots, seq_lens, qsl_out};
}


at::Tensor rms_norm_cuda(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(input, weight);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  check_launch(cuda::launch_rms_norm(x.const_data_ptr(), w.const_data_ptr(), out.data_ptr(), rows, d,
                                     static_cast<float>(eps), dtype_code(x.scalar_type()),
                                     c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "rms_norm");
  return out;
}

template <typename T>
const T* optional_ptr(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

at::Tensor rejection_sample_cuda(
    const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& bonus_token_ids,
    const std::optional<at::Tensor>& is_greedy,
    const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len) {
  const c10::cuda::OptionalCUDAGuard guard(target_probs.device());
  at::Tensor out = check_rejection_sample_args(
      draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs,
      bonus_token_ids, is_greedy, uniforms, exp_noise, max_spec_len);
  check_launch(cuda::launch_rejection_sample(
                   out.data_ptr<int32_t>(), draft_token_ids.data_ptr<int32_t>(),
                   cu_num_draft_tokens.data_ptr<int32_t>(), target_probs.data_ptr<float>(),
                   optional_ptr<float>(draft_probs), optional_ptr<int32_t>(bonus_token_ids),
                   optional_ptr<bool>(is_greedy), optional_ptr<double>(uniforms),
                   optional_ptr<float>(exp_noise), cu_num_draft_tokens.size(0),
                   target_probs.size(1), max_spec_len,
                   c10::cuda::getCurrentCUDAStream().stream()),
               "rejection_sample");
  return out;
}

}  // namespace
}  // namespace vllm_dflash

TORCH_LIBRARY_IMPL(vllm_dflash, CUDA, m) {
  m.impl("gather_hidden_states", &vllm_dflash::gather_hidden_states_cuda);
  m.impl("gather_hidden_states_out", &vllm_dflash::gather_hidden_states_out_cuda);
  m.impl("store_context_kv_layer", &vllm_dflash::store_context_kv_layer_cuda);
  m.impl("store_context_kv_fused", &vllm_dflash::store_context_kv_fused_cuda);
  m.impl("prepare_dflash_inputs", &vllm_dflash::prepare_dflash_inputs_cuda);
  m.impl("rms_norm", &vllm_dflash::rms_norm_cuda);
  m.impl("rejection_sample", &vllm_dflash::rejection_sample_cuda);
}
