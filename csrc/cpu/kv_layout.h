// Placement of one token's K/V head in one page of vLLM's paged KV cache, for
// every layout store_context_kv_layer and store_context_kv_fused understand. A page is
// the [block_size, 2*head_size] slab of one (block, KV head):
//   flash   : page[o, 0:d] = K, page[o, d:2d] = V (token stride `token_stride`)
//   cpu_vec : K part (first N*d elements) is [d, N] (column per token),
//             V part (next N*d) is [N, d]; vLLM's "vec" and "vec16" ISAs
//   cpu_amx : 16-bit pairs packed for AMX tiles, K part [N/16, d/2, 16, 2],
//             V part [d/16, N/2, 16, 2]; vLLM's "amx" ISA
// unit_t has the element's width; values are copied bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "../ops_common.h"

namespace vllm_dflash {

template <typename unit_t>
inline void store_kv_head(KVLayout layout, unit_t* page, int64_t o, int64_t N,
                          int64_t d, int64_t token_stride, const unit_t* k,
                          const unit_t* v) {
  if (layout == KVLayout::kFlash) {
    unit_t* dst = page + o * token_stride;
    std::memcpy(dst, k, d * sizeof(unit_t));
    std::memcpy(dst + d, v, d * sizeof(unit_t));
  } else if (layout == KVLayout::kCpuVec) {
    for (int64_t j = 0; j < d; ++j) page[j * N + o] = k[j];
    std::memcpy(page + N * d + o * d, v, d * sizeof(unit_t));
  } else {  // kCpuAmx, 16-bit elements: 2 per 32-bit lane
    constexpr int64_t p = 4 / sizeof(unit_t);
    unit_t* kblk = page + (o / 16) * 16 * d + (o % 16) * p;
    for (int64_t j = 0; j < d; ++j) kblk[(j / p) * 16 * p + j % p] = k[j];
    unit_t* vblk = page + N * d + (o / p) * 16 * p + o % p;
    for (int64_t j = 0; j < d; ++j) vblk[(j / 16) * 16 * N + (j % 16) * p] = v[j];
  }
}

}  // namespace vllm_dflash
