// CPU scatter of context K/V into one layer of vLLM's paged KV cache.
//
// Layouts: see kv_layout.h. Values are copied bit for bit; negative slots are
// skipped.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "../ops_common.h"
#include "ops.h"
#include "kv_layout.h"

namespace vllm_dflash {
namespace {

// unit_t has the element's width; copies never convert values.
template <typename unit_t>
void write_kv(const KVShape& s, const at::Tensor& key, const at::Tensor& value,
              at::Tensor& kv_cache, const int64_t* slots) {
  const unit_t* k = static_cast<const unit_t*>(key.const_data_ptr());
  const unit_t* v = static_cast<const unit_t*>(value.const_data_ptr());
  unit_t* cache = static_cast<unit_t*>(kv_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t cs0 = kv_cache.stride(0), cs1 = kv_cache.stride(1),
                cs2 = kv_cache.stride(2);
  const int64_t H = s.num_heads, d = s.head_size, N = s.block_size;
  const KVLayout layout = s.layout;

  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(H * d, 1));
  at::parallel_for(0, s.n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t b = slot / N, o = slot % N;
      for (int64_t h = 0; h < H; ++h) {
        store_kv_head(layout, cache + b * cs0 + h * cs1, o, N, d, cs2,
                      k + i * ks0 + h * ks1, v + i * vs0 + h * vs1);
      }
    }
  });
}

}  // namespace

void store_context_kv_layer_cpu(const at::Tensor& key, const at::Tensor& value,
                          at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          c10::string_view layout) {
  const KVShape s =
      check_store_context_kv_layer_inputs(key, value, kv_cache, slot_mapping, layout);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t capacity = s.num_blocks * s.block_size;
  for (int64_t i = 0; i < s.n; ++i) {
    TORCH_CHECK_VALUE(sp[i] < capacity, "store_context_kv_layer: slot_mapping[", i,
                      "] = ", sp[i], " is outside the cache (", s.num_blocks,
                      " blocks x ", s.block_size, " = ", capacity, " slots)");
  }
  if (s.n == 0 || s.head_size == 0) return;
  // Only the head dim has to be dense; token and head strides are free.
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  if (kv_cache.element_size() == 2) {
    write_kv<uint16_t>(s, k, v, kv_cache, sp);
  } else {
    write_kv<uint32_t>(s, k, v, kv_cache, sp);
  }
}

}  // namespace vllm_dflash
