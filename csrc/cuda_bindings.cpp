// CUDA implementations of the vllm_dflash ops: validate tensors, then call the
// plain-CUDA launchers on the current stream. Built only when torch has CUDA.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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

void write_context_kv_cuda(const at::Tensor& key, const at::Tensor& value,
                           at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                           c10::string_view layout) {
  const KVShape s =
      check_write_context_kv_inputs(key, value, kv_cache, slot_mapping, layout);
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
               "write_context_kv");
}

}  // namespace
}  // namespace vllm_dflash

TORCH_LIBRARY_IMPL(vllm_dflash, CUDA, m) {
  m.impl("gather_hidden_states", &vllm_dflash::gather_hidden_states_cuda);
  m.impl("gather_hidden_states_out", &vllm_dflash::gather_hidden_states_out_cuda);
  m.impl("write_context_kv", &vllm_dflash::write_context_kv_cuda);
}
