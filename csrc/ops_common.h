// Input validation and KV-layout resolution shared by the CPU and CUDA
// implementations, so both devices reject the same inputs with the same
// ValueError text (TORCH_CHECK_VALUE raises ValueError in Python).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <string_view>

#if defined(__x86_64__) || defined(_M_X64)
  #include <cpuid.h>
#endif

namespace vllm_dflash {

// ---------------------------------------------------------------------------
// gather_hidden_states
// ---------------------------------------------------------------------------

struct GatherShape {
  int64_t num_layers;  // L
  int64_t num_rows;    // T, rows of every hidden-state tensor
  int64_t hidden;      // D
  int64_t n;           // number of gathered rows
};

inline GatherShape check_gather_inputs(at::TensorList hidden_states,
                                       const at::Tensor& indices) {
  TORCH_CHECK_VALUE(!hidden_states.empty(),
                    "gather_hidden_states: hidden_states is empty; pass one "
                    "[T, D] tensor per captured target layer");
  const at::Tensor& h0 = hidden_states[0];
  TORCH_CHECK_VALUE(h0.dim() == 2,
                    "gather_hidden_states: hidden_states[0] must be 2-D [T, D], "
                    "got shape ",
                    h0.sizes());
  for (size_t l = 0; l < hidden_states.size(); ++l) {
    const at::Tensor& h = hidden_states[l];
    TORCH_CHECK_VALUE(h.sizes() == h0.sizes(), "gather_hidden_states: "
                      "hidden_states[", l, "] has shape ", h.sizes(),
                      " but hidden_states[0] has ", h0.sizes(),
                      "; all layers must share [T, D]");
    TORCH_CHECK_VALUE(h.scalar_type() == h0.scalar_type(),
                      "gather_hidden_states: hidden_states[", l, "] is ",
                      h.scalar_type(), " but hidden_states[0] is ",
                      h0.scalar_type(), "; cast them to one dtype");
    TORCH_CHECK_VALUE(h.device() == h0.device(), "gather_hidden_states: "
                      "hidden_states[", l, "] is on ", h.device(),
                      " but hidden_states[0] is on ", h0.device());
  }
  TORCH_CHECK_VALUE(indices.dim() == 1,
                    "gather_hidden_states: indices must be 1-D [n], got shape ",
                    indices.sizes());
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kLong ||
                        indices.scalar_type() == at::kInt,
                    "gather_hidden_states: indices must be int64 or int32, got ",
                    indices.scalar_type());
  TORCH_CHECK_VALUE(indices.device() == h0.device(),
                    "gather_hidden_states: indices are on ", indices.device(),
                    " but hidden_states are on ", h0.device(),
                    "; move them to the same device");
  return {static_cast<int64_t>(hidden_states.size()), h0.size(0), h0.size(1),
          indices.size(0)};
}

inline void check_gather_out(const at::Tensor& out, const GatherShape& s,
                             const at::Tensor& h0) {
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == s.n &&
                        out.size(1) == s.num_layers * s.hidden,
                    "gather_hidden_states: out must have shape [", s.n, ", ",
                    s.num_layers * s.hidden, "], got ", out.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == h0.scalar_type(),
                    "gather_hidden_states: out is ", out.scalar_type(),
                    " but hidden_states are ", h0.scalar_type());
  TORCH_CHECK_VALUE(out.device() == h0.device(), "gather_hidden_states: out is "
                    "on ", out.device(), " but hidden_states are on ",
                    h0.device());
  TORCH_CHECK_VALUE(out.is_contiguous(),
                    "gather_hidden_states: out must be contiguous");
}

// Rows must be dense (stride(1) == 1) for the row copies; row-strided views
// such as a slice of a wider buffer are fine.
inline at::Tensor dense_rows(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) ? t : t.contiguous();
}

// ---------------------------------------------------------------------------
// write_context_kv
// ---------------------------------------------------------------------------

enum class KVLayout {
  kFlash,   // FlashAttention: K then V along the last (2d) axis of each token
  kCpuVec,  // vLLM CPU "vec"/"vec16": K block stored [d, N], V block [N, d]
  kCpuAmx,  // vLLM CPU "amx": K/V blocks packed in 32-bit pairs for AMX tiles
};

// Mirrors the tile-permission check torch.cpu._is_amx_tile_supported() relies
// on (cpuinfo): CPUID.(7,0):EDX[24] and the OS enabling XTILECFG/XTILEDATA in
// XCR0 (bits 17, 18).
inline bool cpu_has_amx_tile() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool has_amx = [] {
    unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const bool osxsave = (ecx >> 27) & 1u;
    if (!osxsave) return false;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const bool amx_tile = (edx >> 24) & 1u;
    unsigned int xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    const bool os_tiles = (xcr0_lo & 0x60000u) == 0x60000u;
    return amx_tile && os_tiles;
  }();
  return has_amx;
#else
  return false;
#endif
}

// vLLM 0.32 `_get_attn_isa` (v1/attention/backends/cpu_attn.py), restricted
// to x86: the ISA fixes how cpu_attn_reshape_and_cache packs a block.
inline KVLayout resolve_cpu_layout(at::ScalarType dtype, int64_t block_size,
                                   int64_t head_size) {
#if defined(__x86_64__) || defined(_M_X64)
  if (head_size % 32 != 0 && head_size % 16 == 0) return KVLayout::kCpuVec;
  if (cpu_has_amx_tile() && dtype == at::kBFloat16 && block_size % 32 == 0)
    return KVLayout::kCpuAmx;
  return KVLayout::kCpuVec;  // "vec" (block_size % 32 == 0) or "vec16"
#else
  TORCH_CHECK_VALUE(false,
                    "write_context_kv: layout='cpu' is only implemented for "
                    "x86 (vLLM's vec/vec16/amx packings); vLLM uses another "
                    "packing (neon/vsx/vxe/rvv) on this architecture");
  return KVLayout::kCpuVec;
#endif
}

struct KVShape {
  int64_t n;           // tokens to write = slot_mapping.size(0)
  int64_t num_heads;   // H
  int64_t head_size;   // d
  int64_t num_blocks;  // B
  int64_t block_size;  // N
  KVLayout layout;
};

inline KVShape check_write_context_kv_inputs(const at::Tensor& key,
                                             const at::Tensor& value,
                                             const at::Tensor& kv_cache,
                                             const at::Tensor& slot_mapping,
                                             std::string_view layout) {
  TORCH_CHECK_VALUE(key.dim() == 3, "write_context_kv: key must be 3-D "
                    "[n, num_kv_heads, head_size], got shape ", key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "write_context_kv: value "
                    "shape ", value.sizes(), " differs from key shape ",
                    key.sizes());
  TORCH_CHECK_VALUE(value.scalar_type() == key.scalar_type(),
                    "write_context_kv: value is ", value.scalar_type(),
                    " but key is ", key.scalar_type());
  TORCH_CHECK_VALUE(kv_cache.element_size() != 1,
                    "write_context_kv: kv_cache is ", kv_cache.scalar_type(),
                    " (an fp8/quantized KV cache); only unquantized caches are "
                    "supported, start vLLM with kv_cache_dtype='auto'");
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == key.scalar_type(),
                    "write_context_kv: kv_cache is ", kv_cache.scalar_type(),
                    " but key is ", key.scalar_type(),
                    "; cast key/value to the cache dtype");
  TORCH_CHECK_VALUE(kv_cache.element_size() == 2 || kv_cache.element_size() == 4,
                    "write_context_kv: unsupported dtype ",
                    kv_cache.scalar_type(), "; use float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(kv_cache.dim() == 4, "write_context_kv: kv_cache must be "
                    "one layer's cache [num_blocks, num_kv_heads, block_size, "
                    "2 * head_size], got shape ", kv_cache.sizes());
  const int64_t H = key.size(1), d = key.size(2);
  TORCH_CHECK_VALUE(kv_cache.size(1) == H && kv_cache.size(3) == 2 * d,
                    "write_context_kv: kv_cache shape ", kv_cache.sizes(),
                    " does not fit key [n, ", H, ", ", d,
                    "]; expected [num_blocks, ", H, ", block_size, ", 2 * d, "]");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong,
                    "write_context_kv: slot_mapping must be a 1-D int64 tensor, "
                    "got ", slot_mapping.scalar_type(), " of shape ",
                    slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.size(0) <= key.size(0),
                    "write_context_kv: slot_mapping has ", slot_mapping.size(0),
                    " entries but key has only ", key.size(0), " rows");
  for (const at::Tensor* t : {&value, &kv_cache, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device() == key.device(), "write_context_kv: all "
                      "tensors must be on one device; key is on ", key.device(),
                      " but another input is on ", t->device());
  }
  TORCH_CHECK_VALUE(kv_cache.stride(3) == 1, "write_context_kv: the last "
                    "kv_cache dim must be contiguous (stride 1), got strides ",
                    kv_cache.strides());

  KVShape s{slot_mapping.size(0), H, d, kv_cache.size(0), kv_cache.size(2),
            KVLayout::kFlash};
  if (layout == "flash") {
    s.layout = KVLayout::kFlash;
  } else if (layout == "cpu") {
    s.layout = resolve_cpu_layout(kv_cache.scalar_type(), s.block_size, d);
  } else if (layout == "cpu_vec") {
    s.layout = KVLayout::kCpuVec;
  } else if (layout == "cpu_amx") {
    s.layout = KVLayout::kCpuAmx;
  } else {
    TORCH_CHECK_VALUE(false, "write_context_kv: unknown layout '",
                      std::string(layout), "'; use 'cpu' (vLLM CPU attention), "
                      "'flash' (FlashAttention), 'cpu_vec' or 'cpu_amx'");
  }
  if (s.layout != KVLayout::kFlash) {
    TORCH_CHECK_VALUE(kv_cache.device().is_cpu(), "write_context_kv: layout '",
                      std::string(layout), "' is vLLM's CPU attention layout "
                      "but kv_cache is on ", kv_cache.device(),
                      "; use layout='flash' on CUDA");
    TORCH_CHECK_VALUE(kv_cache.stride(2) == 2 * d, "write_context_kv: the CPU "
                      "layout needs each [block_size, 2*head_size] page "
                      "contiguous, got kv_cache strides ", kv_cache.strides());
  }
  if (s.layout == KVLayout::kCpuAmx) {
    TORCH_CHECK_VALUE(kv_cache.element_size() == 2 && s.block_size % 32 == 0 &&
                          d % 16 == 0,
                      "write_context_kv: the AMX layout needs a 16-bit cache, "
                      "block_size % 32 == 0 and head_size % 16 == 0, got ",
                      kv_cache.scalar_type(), ", block_size=", s.block_size,
                      ", head_size=", d);
  }
  return s;
}

}  // namespace vllm_dflash
