// CUDA scatter of context K/V into one layer of vLLM's FlashAttention KV
// cache: one thread block per token, copying K and V of every head.
// Bounds checks stay on in release builds (device-side assert).
#undef NDEBUG
#include <cassert>
#include <cstdio>

#include "copy_unit.cuh"
#include "launchers.h"

namespace vllm_dflash::cuda {
namespace {

template <typename unit_t>
__global__ void write_kv_flash_kernel(WriteKVFlashArgs a) {
  const int64_t i = blockIdx.x;
  const int64_t slot = a.slot_mapping[i];
  if (slot < 0) return;
  if (slot >= a.num_blocks * a.block_size) {
    if (threadIdx.x == 0) {
      printf("vllm_dflash.store_context_kv_layer: slot_mapping[%lld] = %lld is "
             "outside the cache (%lld slots)\n",
             static_cast<long long>(i), static_cast<long long>(slot),
             static_cast<long long>(a.num_blocks * a.block_size));
    }
    assert(slot < a.num_blocks * a.block_size && "vllm_dflash.store_context_kv_layer: slot outside the cache");
    return;
  }
  const int64_t b = slot / a.block_size, o = slot % a.block_size;
  const int64_t units_per_head = a.head_bytes / static_cast<int64_t>(sizeof(unit_t));
  const int64_t units_per_kv = a.num_heads * units_per_head;
  const char* key = static_cast<const char*>(a.key) + i * a.key_token_stride;
  const char* value = static_cast<const char*>(a.value) + i * a.value_token_stride;
  char* token = static_cast<char*>(a.cache) + b * a.cache_block_stride +
                o * a.cache_token_stride;
  for (int64_t u = threadIdx.x; u < 2 * units_per_kv; u += blockDim.x) {
    const bool is_value = u >= units_per_kv;
    const int64_t rem = is_value ? u - units_per_kv : u;
    const int64_t h = rem / units_per_head, c = rem % units_per_head;
    const unit_t* src = reinterpret_cast<const unit_t*>(
        is_value ? value + h * a.value_head_stride : key + h * a.key_head_stride);
    unit_t* dst = reinterpret_cast<unit_t*>(
        token + h * a.cache_head_stride + (is_value ? a.head_bytes : 0));
    dst[c] = src[c];
  }
}

}  // namespace

cudaError_t launch_write_kv_flash(const WriteKVFlashArgs& args,
                                  cudaStream_t stream) {
  if (args.n == 0 || args.num_heads == 0 || args.head_bytes == 0) return cudaSuccess;
  const uint64_t mask =
      reinterpret_cast<uintptr_t>(args.key) | reinterpret_cast<uintptr_t>(args.value) |
      reinterpret_cast<uintptr_t>(args.cache) |
      static_cast<uint64_t>(args.key_token_stride | args.key_head_stride |
                            args.value_token_stride | args.value_head_stride |
                            args.cache_block_stride | args.cache_head_stride |
                            args.cache_token_stride | args.head_bytes);
  const int unit = copy_unit_bytes(mask);
  return dispatch_copy_unit(unit, [&](auto unit_tag) -> cudaError_t {
    using unit_t = decltype(unit_tag);
    const int64_t units = 2 * args.num_heads * args.head_bytes /
                          static_cast<int64_t>(sizeof(unit_t));
    write_kv_flash_kernel<unit_t>
        <<<static_cast<unsigned int>(args.n), threads_for(units), 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace vllm_dflash::cuda
