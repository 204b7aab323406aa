// Input validation and KV-layout resolution shared by the CPU and CUDA
// implementations, so both devices reject the same inputs with the same
// ValueError text (TORCH_CHECK_VALUE raises ValueError in Python).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
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
// store_context_kv_layer
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
                    "store_context_kv_layer: layout='cpu' is only implemented for "
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

inline KVShape check_store_context_kv_layer_inputs(const at::Tensor& key,
                                             const at::Tensor& value,
                                             const at::Tensor& kv_cache,
                                             const at::Tensor& slot_mapping,
                                             std::string_view layout) {
  TORCH_CHECK_VALUE(key.dim() == 3, "store_context_kv_layer: key must be 3-D "
                    "[n, num_kv_heads, head_size], got shape ", key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "store_context_kv_layer: value "
                    "shape ", value.sizes(), " differs from key shape ",
                    key.sizes());
  TORCH_CHECK_VALUE(value.scalar_type() == key.scalar_type(),
                    "store_context_kv_layer: value is ", value.scalar_type(),
                    " but key is ", key.scalar_type());
  TORCH_CHECK_VALUE(kv_cache.element_size() != 1,
                    "store_context_kv_layer: kv_cache is ", kv_cache.scalar_type(),
                    " (an fp8/quantized KV cache); only unquantized caches are "
                    "supported, start vLLM with kv_cache_dtype='auto'");
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == key.scalar_type(),
                    "store_context_kv_layer: kv_cache is ", kv_cache.scalar_type(),
                    " but key is ", key.scalar_type(),
                    "; cast key/value to the cache dtype");
  TORCH_CHECK_VALUE(kv_cache.element_size() == 2 || kv_cache.element_size() == 4,
                    "store_context_kv_layer: unsupported dtype ",
                    kv_cache.scalar_type(), "; use float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(kv_cache.dim() == 4, "store_context_kv_layer: kv_cache must be "
                    "one layer's cache [num_blocks, num_kv_heads, block_size, "
                    "2 * head_size], got shape ", kv_cache.sizes());
  const int64_t H = key.size(1), d = key.size(2);
  TORCH_CHECK_VALUE(kv_cache.size(1) == H && kv_cache.size(3) == 2 * d,
                    "store_context_kv_layer: kv_cache shape ", kv_cache.sizes(),
                    " does not fit key [n, ", H, ", ", d,
                    "]; expected [num_blocks, ", H, ", block_size, ", 2 * d, "]");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong,
                    "store_context_kv_layer: slot_mapping must be a 1-D int64 tensor, "
                    "got ", slot_mapping.scalar_type(), " of shape ",
                    slot_mapping.sizes());
  TORCH_CHECK_VALUE(slot_mapping.size(0) <= key.size(0),
                    "store_context_kv_layer: slot_mapping has ", slot_mapping.size(0),
                    " entries but key has only ", key.size(0), " rows");
  for (const at::Tensor* t : {&value, &kv_cache, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device() == key.device(), "store_context_kv_layer: all "
                      "tensors must be on one device; key is on ", key.device(),
                      " but another input is on ", t->device());
  }
  TORCH_CHECK_VALUE(kv_cache.stride(3) == 1, "store_context_kv_layer: the last "
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
    TORCH_CHECK_VALUE(false, "store_context_kv_layer: unknown layout '",
                      std::string(layout), "'; use 'cpu' (vLLM CPU attention), "
                      "'flash' (FlashAttention), 'cpu_vec' or 'cpu_amx'");
  }
  if (s.layout != KVLayout::kFlash) {
    TORCH_CHECK_VALUE(kv_cache.device().is_cpu(), "store_context_kv_layer: layout '",
                      std::string(layout), "' is vLLM's CPU attention layout "
                      "but kv_cache is on ", kv_cache.device(),
                      "; use layout='flash' on CUDA");
    TORCH_CHECK_VALUE(kv_cache.stride(2) == 2 * d, "store_context_kv_layer: the CPU "
                      "layout needs each [block_size, 2*head_size] page "
                      "contiguous, got kv_cache strides ", kv_cache.strides());
  }
  if (s.layout == KVLayout::kCpuAmx) {
    TORCH_CHECK_VALUE(kv_cache.element_size() == 2 && s.block_size % 32 == 0 &&
                          d % 16 == 0,
                      "store_context_kv_layer: the AMX layout needs a 16-bit cache, "
                      "block_size % 32 == 0 and head_size % 16 == 0, got ",
                      kv_cache.scalar_type(), ", block_size=", s.block_size,
                      ", head_size=", d);
  }
  return s;
}


// ---------------------------------------------------------------------------
// store_context_kv_fused
// ---------------------------------------------------------------------------

struct ContextKVShape {
  KVShape kv;          // per-layer cache shape (all layers alike) and layout
  int64_t num_layers;  // L
  int64_t rot_dim;     // rotated dims of each head (<= head_size, even)
  int64_t max_pos;     // rows of cos_sin_cache
};

// key/value [n', L, H, d] (last dim dense or fixed up by the caller),
// k_norm_weight [L, d] in key's dtype, cos_sin_cache [max_pos, rot_dim] =
// cat(cos, sin) of any float dtype, positions int64 [>= n], L caches that
// store_context_kv_layer would accept for key[:, l].
inline ContextKVShape check_store_context_kv_fused_inputs(
    const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& k_norm_weight, const at::Tensor& cos_sin_cache,
    const at::Tensor& positions, at::TensorList kv_caches,
    const at::Tensor& slot_mapping, std::string_view layout) {
  TORCH_CHECK_VALUE(key.dim() == 4, "store_context_kv_fused: key must be 4-D "
                    "[n, num_layers, num_kv_heads, head_size], got shape ",
                    key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "store_context_kv_fused: value "
                    "shape ", value.sizes(), " differs from key shape ",
                    key.sizes());
  const int64_t L = key.size(1), d = key.size(3);
  TORCH_CHECK_VALUE(static_cast<int64_t>(kv_caches.size()) == L,
                    "store_context_kv_fused: got ", kv_caches.size(), " kv_caches "
                    "for ", L, " layers in key; pass one cache per layer");
  TORCH_CHECK_VALUE(L > 0, "store_context_kv_fused: key has no layers");
  TORCH_CHECK_VALUE(k_norm_weight.dim() == 2 && k_norm_weight.size(0) == L &&
                        k_norm_weight.size(1) == d,
                    "store_context_kv_fused: k_norm_weight must be [", L, ", ", d,
                    "] (one k_norm weight per layer), got ",
                    k_norm_weight.sizes());
  TORCH_CHECK_VALUE(k_norm_weight.scalar_type() == key.scalar_type(),
                    "store_context_kv_fused: k_norm_weight is ",
                    k_norm_weight.scalar_type(), " but key is ",
                    key.scalar_type(), "; cast it to the model dtype");
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2 &&
                        (cos_sin_cache.scalar_type() == at::kFloat ||
                         cos_sin_cache.scalar_type() == at::kHalf ||
                         cos_sin_cache.scalar_type() == at::kBFloat16) &&
                        cos_sin_cache.size(1) % 2 == 0 &&
                        cos_sin_cache.size(1) > 0 && cos_sin_cache.size(1) <= d,
                    "store_context_kv_fused: cos_sin_cache must be a float32/16 "
                    "[max_position, rotary_dim] tensor (cat(cos, sin), "
                    "rotary_dim even and <= head_size ", d, "), got ",
                    cos_sin_cache.scalar_type(), " ", cos_sin_cache.sizes());
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                        positions.size(0) >= slot_mapping.size(0),
                    "store_context_kv_fused: positions must be 1-D int64 with at "
                    "least ", slot_mapping.size(0), " entries (one per slot), "
                    "got ", positions.scalar_type(), " ", positions.sizes());
  for (const at::Tensor* t : {&k_norm_weight, &cos_sin_cache, &positions}) {
    TORCH_CHECK_VALUE(t->device() == key.device(), "store_context_kv_fused: all "
                      "tensors must be on one device; key is on ", key.device(),
                      " but another input is on ", t->device());
  }
  ContextKVShape s{};
  s.num_layers = L;
  s.rot_dim = cos_sin_cache.size(1);
  s.max_pos = cos_sin_cache.size(0);
  const at::Tensor k0 = key.select(1, 0), v0 = value.select(1, 0);
  s.kv = check_store_context_kv_layer_inputs(k0, v0, kv_caches[0], slot_mapping,
                                       layout);
  for (int64_t l = 1; l < L; ++l) {
    const at::Tensor& c = kv_caches[l];
    TORCH_CHECK_VALUE(c.sizes() == kv_caches[0].sizes() &&
                          c.strides() == kv_caches[0].strides() &&
                          c.scalar_type() == kv_caches[0].scalar_type() &&
                          c.device() == kv_caches[0].device(),
                      "store_context_kv_fused: kv_caches[", l, "] (", c.scalar_type(),
                      " ", c.sizes(), ", strides ", c.strides(), ") differs "
                      "from kv_caches[0] (", kv_caches[0].scalar_type(), " ",
                      kv_caches[0].sizes(), ", strides ", kv_caches[0].strides(),
                      "); all draft layers must share one cache spec");
  }
  return s;
}


// ---------------------------------------------------------------------------
// prepare_dflash_inputs
// ---------------------------------------------------------------------------

struct PrepareShape {
  int64_t batch;       // B requests
  int64_t num_rows;    // T rows of the target pass
  int64_t q_len;       // k + 1
  int64_t max_blocks;  // block_table.size(1)
};

inline PrepareShape check_prepare_dflash_inputs(
    const at::Tensor& query_start_loc,
    const std::optional<at::Tensor>& num_rejected,
    const at::Tensor& target_positions, const at::Tensor& slot_mapping,
    const at::Tensor& next_token_ids, const at::Tensor& block_table,
    int64_t block_size, int64_t num_speculative_tokens, int64_t num_rows) {
  auto is_index = [](const at::Tensor& t) {
    return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
  };
  TORCH_CHECK_VALUE(next_token_ids.dim() == 1 && is_index(next_token_ids),
                    "prepare_dflash_inputs: next_token_ids must be 1-D "
                    "int32/int64 [num_reqs], got ", next_token_ids.scalar_type(),
                    " ", next_token_ids.sizes());
  const int64_t B = next_token_ids.size(0);
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 &&
                        query_start_loc.scalar_type() == at::kInt &&
                        query_start_loc.size(0) >= B + 1,
                    "prepare_dflash_inputs: query_start_loc must be 1-D int32 "
                    "with at least num_reqs + 1 = ", B + 1, " entries, got ",
                    query_start_loc.scalar_type(), " ", query_start_loc.sizes());
  if (num_rejected) {
    TORCH_CHECK_VALUE(num_rejected->dim() == 1 && is_index(*num_rejected) &&
                          num_rejected->size(0) >= B,
                      "prepare_dflash_inputs: num_rejected must be 1-D "
                      "int32/int64 with at least num_reqs = ", B,
                      " entries, got ", num_rejected->scalar_type(), " ",
                      num_rejected->sizes());
  }
  TORCH_CHECK_VALUE(num_rows >= 0 && target_positions.dim() == 1 &&
                        target_positions.scalar_type() == at::kLong &&
                        target_positions.size(0) >= num_rows,
                    "prepare_dflash_inputs: target_positions must be 1-D int64 "
                    "with at least num_rows = ", num_rows, " entries, got ",
                    target_positions.scalar_type(), " ", target_positions.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 &&
                        slot_mapping.scalar_type() == at::kLong &&
                        slot_mapping.size(0) >= num_rows,
                    "prepare_dflash_inputs: slot_mapping must be 1-D int64 with "
                    "at least num_rows = ", num_rows, " entries, got ",
                    slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  TORCH_CHECK_VALUE(block_table.dim() == 2 &&
                        block_table.scalar_type() == at::kInt &&
                        block_table.size(0) >= B && block_table.size(1) > 0 &&
                        block_table.stride(1) == 1,
                    "prepare_dflash_inputs: block_table must be a row-major "
                    "int32 [>= num_reqs, max_blocks] tensor, got ",
                    block_table.scalar_type(), " ", block_table.sizes(),
                    " strides ", block_table.strides());
  TORCH_CHECK_VALUE(block_size > 0, "prepare_dflash_inputs: block_size must be "
                    "positive, got ", block_size);
  TORCH_CHECK_VALUE(num_speculative_tokens >= 0, "prepare_dflash_inputs: "
                    "num_speculative_tokens must be >= 0, got ",
                    num_speculative_tokens);
  const at::Device dev = next_token_ids.device();
  for (const at::Tensor* t : {&query_start_loc, &target_positions, &slot_mapping,
                              &block_table}) {
    TORCH_CHECK_VALUE(t->device() == dev, "prepare_dflash_inputs: all tensors "
                      "must be on one device; next_token_ids is on ", dev,
                      " but another input is on ", t->device());
  }
  if (num_rejected) {
    TORCH_CHECK_VALUE(num_rejected->device() == dev, "prepare_dflash_inputs: "
                      "num_rejected is on ", num_rejected->device(),
                      " but next_token_ids is on ", dev);
  }
  return {B, num_rows, num_speculative_tokens + 1, block_table.size(1)};
}


// ---------------------------------------------------------------------------
// rms_norm
// ---------------------------------------------------------------------------

inline void check_rms_norm_inputs(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(input.dim() >= 1, "rms_norm: input must have at least one dim");
  const int64_t d = input.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == d,
                    "rms_norm: weight must be [", d, "] (the last dim of input), got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == input.scalar_type(),
                    "rms_norm: weight is ", weight.scalar_type(), " but input is ",
                    input.scalar_type(), "; cast one to the other");
  TORCH_CHECK_VALUE(input.scalar_type() == at::kFloat ||
                        input.scalar_type() == at::kHalf ||
                        input.scalar_type() == at::kBFloat16,
                    "rms_norm: unsupported dtype ", input.scalar_type(),
                    "; use float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(weight.device() == input.device(), "rms_norm: weight is on ",
                    weight.device(), " but input is on ", input.device());
}

// ---------------------------------------------------------------------------
// logits_top2
// ---------------------------------------------------------------------------

inline void check_logits_top2_inputs(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits_top2: logits must be [rows, vocab], got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) >= 2 || logits.size(0) == 0,
                    "logits_top2: a row needs at least 2 logits, got ", logits.size(1));
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat ||
                        logits.scalar_type() == at::kHalf ||
                        logits.scalar_type() == at::kBFloat16,
                    "logits_top2: unsupported dtype ", logits.scalar_type(),
                    "; use float32, float16 or bfloat16");
}

// ---------------------------------------------------------------------------
// rejection_sample
// ---------------------------------------------------------------------------

// Checks shapes, dtypes, devices and contiguity (TORCH_CHECK: RuntimeError; the
// Python entry point vllm_dflash.verifier.rejection raises ValueError first);
// returns the output tensor [batch, max_spec_len + 1] int32, uninitialized: the
// kernels write every slot.
inline at::Tensor check_rejection_sample_args(
    const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& bonus_token_ids,
    const std::optional<at::Tensor>& is_greedy,
    const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len) {
  const auto device = target_probs.device();
  auto check = [&](const at::Tensor& t, const char* name, at::ScalarType dtype,
                   int64_t dim) {
    TORCH_CHECK(t.scalar_type() == dtype, "rejection_sample: ", name,
                " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == dim, "rejection_sample: ", name, " must be ", dim,
                "-D, got ", t.dim(), "-D");
    TORCH_CHECK(t.device() == device, "rejection_sample: ", name,
                " must be on ", device, ", got ", t.device());
    TORCH_CHECK(t.is_contiguous(), "rejection_sample: ", name,
                " must be contiguous");
  };
  check(draft_token_ids, "draft_token_ids", at::kInt, 1);
  check(cu_num_draft_tokens, "cu_num_draft_tokens", at::kInt, 1);
  check(target_probs, "target_probs", at::kFloat, 2);
  const int64_t num_tokens = draft_token_ids.size(0);
  const int64_t batch = cu_num_draft_tokens.size(0);
  const int64_t vocab = target_probs.size(1);
  TORCH_CHECK(max_spec_len >= 0, "rejection_sample: max_spec_len must be >= 0");
  TORCH_CHECK(vocab > 0 || batch == 0, "rejection_sample: empty vocabulary");
  const int64_t rows = num_tokens + (bonus_token_ids ? 0 : batch);
  TORCH_CHECK(target_probs.size(0) == rows, "rejection_sample: target_probs must have ",
              rows, " rows (one per draft token", bonus_token_ids ? "" : " plus one per request",
              "), got ", target_probs.size(0));
  if (draft_probs) {
    check(*draft_probs, "draft_probs", at::kFloat, 2);
    TORCH_CHECK(draft_probs->size(0) == num_tokens && draft_probs->size(1) == vocab,
                "rejection_sample: draft_probs must be [", num_tokens, ", ", vocab, "]");
  }
  if (bonus_token_ids) {
    check(*bonus_token_ids, "bonus_token_ids", at::kInt, 1);
    TORCH_CHECK(bonus_token_ids->size(0) == batch,
                "rejection_sample: bonus_token_ids must have ", batch, " entries");
  }
  if (is_greedy) {
    check(*is_greedy, "is_greedy", at::kBool, 1);
    TORCH_CHECK(is_greedy->size(0) == batch, "rejection_sample: is_greedy must have ",
                batch, " entries");
    TORCH_CHECK(uniforms && exp_noise,
                "rejection_sample: uniforms and exp_noise are required unless "
                "is_greedy is None (all rows greedy)");
    check(*uniforms, "uniforms", at::kDouble, 1);
    TORCH_CHECK(uniforms->size(0) == num_tokens, "rejection_sample: uniforms must have ",
                num_tokens, " entries");
    check(*exp_noise, "exp_noise", at::kFloat, 2);
    TORCH_CHECK(exp_noise->size(0) == batch && exp_noise->size(1) == vocab,
                "rejection_sample: exp_noise must be [", batch, ", ", vocab, "]");
  }
  return at::empty({batch, max_spec_len + 1}, target_probs.options().dtype(at::kInt));
}

}  // namespace vllm_dflash
