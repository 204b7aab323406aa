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


// store_context_kv_fused on the FlashAttention layout: per (token i, layer l, head
// h) with slot_mapping[i] >= 0, K = RoPE(RMSNorm(key[i, l, h]) * w[l]) at
// positions[i], written with V = value[i, l, h] to caches[l][b, h, o].
// Element strides; dtype / cache_dtype: 0 float32, 1 float16, 2 bfloat16.
struct StoreContextKVFusedArgs {
  const void* key;
  const void* value;
  int64_t key_stride[3];    // token, layer, head
  int64_t value_stride[3];  // token, layer, head
  const void* k_norm_weight;
  int64_t weight_stride[2];  // layer, dim
  const void* cos_sin_cache;
  int64_t cos_sin_stride[2];  // position, dim
  const int64_t* positions;
  const int64_t* slot_mapping;
  void* const* caches;  // host array of num_layers device pointers
  int64_t cache_block_stride, cache_head_stride, cache_token_stride;
  int64_t n, num_layers, num_heads, head_size, rot_dim;
  int64_t num_blocks, block_size, max_pos;
  float eps;
  bool is_neox;
  int dtype;
  int cos_sin_dtype;
};

cudaError_t launch_store_context_kv_fused(const StoreContextKVFusedArgs& args,
                                    cudaStream_t stream);

// prepare_dflash_inputs without compaction (see csrc/cpu/prepare_dflash_inputs.cpp
// for the semantics): one thread block per request plus one for padding rows.
struct PrepareInputsArgs {
  const int32_t* query_start_loc;  // [B + 1]
  const void* num_rejected;        // [B] or null
  bool num_rejected_int64;
  const int64_t* target_positions;  // [num_rows]
  const int64_t* slot_mapping;      // [num_rows]
  const void* next_token_ids;       // [B]
  bool next_token_ids_int64;
  const int32_t* block_table;  // [>= B, max_blocks], row stride below
  int64_t block_table_stride;
  int64_t max_blocks, block_size, mask_token_id, q_len, batch, num_rows;
  int64_t* context_rows;       // [num_rows]
  int64_t* context_positions;  // [num_rows]
  int64_t* context_slots;      // [num_rows]
  int32_t* input_ids;          // [B * q_len]
  int64_t* positions;          // [B * q_len]
  int64_t* slots;              // [B * q_len]
  int32_t* seq_lens;           // [B]
  int32_t* query_start_loc_out;  // [B + 1]
};

cudaError_t launch_prepare_dflash_inputs(const PrepareInputsArgs& args,
                                         cudaStream_t stream);


// RMSNorm of `rows` dense rows of d elements (see csrc/cpu/rms_norm.cpp);
// dtype: 0 float32, 1 float16, 2 bfloat16 (input, weight and out alike).
cudaError_t launch_rms_norm(const void* x, const void* weight, void* out, int64_t rows,
                            int64_t d, float eps, int dtype, cudaStream_t stream);

// Rejection-sampling verifier (semantics: vllm_dflash/ops/reference.py), one
// thread block per request. Device pointers to contiguous arrays; optional
// ones may be null:
// out:             [batch, max_spec_len + 1] int32 (every slot written, -1 = placeholder)
// draft_token_ids: [num_tokens] int32
// cu_num_draft:    [batch] int32, inclusive cumulative draft counts
// target_probs:    [num_tokens + batch, vocab] float32 if bonus_token_ids is null
//                  (request b owns n_b + 1 rows), else [num_tokens, vocab]
// draft_probs:     [num_tokens, vocab] float32 or null (point-mass drafts)
// bonus_token_ids: [batch] int32 or null (sample the bonus from the last row)
// is_greedy:       [batch] bool or null (every row greedy; uniforms/exp_noise unused)
// uniforms:        [num_tokens] float64 in [0, 1)
// exp_noise:       [batch, vocab] float32 Exp(1) draws
cudaError_t launch_rejection_sample(
    int32_t* out, const int32_t* draft_token_ids, const int32_t* cu_num_draft,
    const float* target_probs, const float* draft_probs,
    const int32_t* bonus_token_ids, const bool* is_greedy,
    const double* uniforms, const float* exp_noise, int64_t batch,
    int64_t vocab, int64_t max_spec_len, cudaStream_t stream);

}  // namespace vllm_dflash::cuda
