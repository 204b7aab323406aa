// Plain-CUDA launchers (no torch headers): raw pointers, byte sizes and a
// stream. csrc/cuda_bindings.cpp validates tensors and calls these.
//
// Bounds errors (an index or slot outside the source/cache) print the
// offending value and fail a device-side assert, like torch's own index
// kernels: checking on the host would need a device sync on every call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vllm_dflash::cuda {

// out[i, l*row_bytes:(l+1)*row_bytes] = srcs[l][indices[i]] for l < num_layers.
// srcs[l] rows are src_row_stride_bytes[l] apart; out is dense
// [n, num_layers*row_bytes]. srcs/strides are host arrays of num_layers items.
cudaError_t launch_gather_hidden_states(const void* const* srcs,
                                        const int64_t* src_row_stride_bytes,
                                        int64_t num_layers, const void* indices,
                                        bool indices_are_int64, int64_t n,
                                        int64_t num_rows, int64_t row_bytes,
                                        void* out, cudaStream_t stream);

// FlashAttention layout: cache[b, h, o, 0:d] = key[i, h], cache[b, h, o, d:2d]
// = value[i, h] with slot = b*block_size + o; negative slots are skipped.
// All strides are in bytes; head_bytes = head_size * element size.
struct WriteKVFlashArgs {
  const void* key;
  const void* value;
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  void* cache;
  int64_t cache_block_stride, cache_head_stride, cache_token_stride;
  const int64_t* slot_mapping;
  int64_t n;
  int64_t num_heads;
  int64_t head_bytes;
  int64_t num_blocks;
  int64_t block_size;
};

cudaError_t launch_write_kv_flash(const WriteKVFlashArgs& args,
                                  cudaStream_t stream);

}  // namespace vllm_dflash::cuda
