// Rejection-sampling verifier, plain CUDA launcher (no torch headers).
// Semantics: vllm_dflash/verifier/reference.py. All pointers are device
// pointers to contiguous arrays; optional ones may be null.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vllm_dflash {

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

}  // namespace vllm_dflash
