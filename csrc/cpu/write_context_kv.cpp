// CPU scatter of context K/V into one layer of vLLM's paged KV cache.
//
// Layouts (per block b and KV head h; the page is [block_size, 2*head_size]):
//   flash   : page[o, 0:d] = K[token], page[o, d:2d] = V[token]
//   cpu_vec : K part (first N*d elements) is [d, N] (column per token),
//             V part (next N*d) is [N, d]; vLLM's "vec" and "vec16" ISAs
//   cpu_amx : bf16 pairs packed for AMX tiles, K part [N/16, d/2, 16, 2],
//             V part [d/16, N/2, 16, 2]; vLLM's "amx" ISA
// Values are copied bit for bit; negative slots are skipped.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../ops_common.h"

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
        const unit_t* kp = k + i * ks0 + h * ks1;
        const unit_t* vp = v + i * vs0 + h * vs1;
        unit_t* page = cache + b * cs0 + h * cs1;
        if (layout == KVLayout::kFlash) {
          unit_t* dst = page + o * cs2;
          std::memcpy(dst, kp, d * sizeof(unit_t));
          std::memcpy(dst + d, vp, d * sizeof(unit_t));
        } else if (layout == KVLayout::kCpuVec) {
          for (int64_t j = 0; j < d; ++j) page[j * N + o] = kp[j];
          std::memcpy(page + N * d + o * d, vp, d * sizeof(unit_t));
        } else {  // kCpuAmx, 16-bit elements: 2 per 32-bit lane
          constexpr int64_t p = 4 / sizeof(unit_t);
          unit_t* kblk = page + (o / 16) * 16 * d + (o % 16) * p;
          for (int64_t j = 0; j < d; ++j) kblk[(j / p) * 16 * p + j % p] = kp[j];
          unit_t* vblk = page + N * d + (o / p) * 16 * p + o % p;
          for (int64_t j = 0; j < d; ++j)
            vblk[(j / 16) * 16 * N + (j % 16) * p] = vp[j];
        }
      }
    }
  });
}

void write_context_kv_cpu(const at::Tensor& key, const at::Tensor& value,
                          at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          c10::string_view layout) {
  const KVShape s =
      check_write_context_kv_inputs(key, value, kv_cache, slot_mapping, layout);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t capacity = s.num_blocks * s.block_size;
  for (int64_t i = 0; i < s.n; ++i) {
    TORCH_CHECK_VALUE(sp[i] < capacity, "write_context_kv: slot_mapping[", i,
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

}  // namespace
}  // namespace vllm_dflash

TORCH_LIBRARY_IMPL(vllm_dflash, CPU, m) {
  m.impl("write_context_kv", &vllm_dflash::write_context_kv_cpu);
}
