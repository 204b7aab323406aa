// Rejection-sampling verifier on CPU: torch.ops.vllm_dflash.rejection_sample.
//
// Same semantics as vllm_dflash/verifier/reference.py, which documents them;
// the tests check this kernel against it bit for bit. Rows (requests) run in
// parallel with at::parallel_for (OpenMP in PyTorch's CPU builds, sized by
// torch.set_num_threads). A row visits its draft positions in order and stops
// at the first rejection, so it reads one target row per visited position (the
// whole row only for greedy argmax) plus one full row for the recovery or bonus
// sample: O(visited) instead of vLLM's O(num_drafts * vocab) recovery pass.

#include "../rejection_sample.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace vllm_dflash {
namespace {

constexpr int32_t kPlaceholder = -1;

// First index of the maximum (torch.argmax semantics for non-NaN rows).
// Two passes: SIMD max, then a SIMD scan for the first index holding it.
// Both use SSE2 (every x86-64 CPU) so the kernel needs no -march flags; other
// CPUs take the scalar loops. ~4x faster than a branchy single pass, and far
// faster than torch.argmax on CPU.
int64_t argmax_row(const float* row, int64_t vocab) {
  const float inf = std::numeric_limits<float>::infinity();
  float best = -inf;
  int64_t v = 0;
#if defined(__SSE2__)
  __m128 m0 = _mm_set1_ps(-inf), m1 = m0, m2 = m0, m3 = m0;
  for (; v + 16 <= vocab; v += 16) {
    m0 = _mm_max_ps(_mm_loadu_ps(row + v), m0);  // max_ps(x, m) == x > m ? x : m
    m1 = _mm_max_ps(_mm_loadu_ps(row + v + 4), m1);
    m2 = _mm_max_ps(_mm_loadu_ps(row + v + 8), m2);
    m3 = _mm_max_ps(_mm_loadu_ps(row + v + 12), m3);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
  for (const float x : lanes) best = x > best ? x : best;
#endif
  for (; v < vocab; ++v) best = row[v] > best ? row[v] : best;
  v = 0;
#if defined(__SSE2__)
  const __m128 target = _mm_set1_ps(best);
  for (; v + 4 <= vocab; v += 4) {
    const int hits = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(row + v), target));
    if (hits != 0) return v + __builtin_ctz(hits);
  }
#endif
  for (; v < vocab; ++v) {
    if (row[v] == best) return v;
  }
  return 0;  // only NaN
}

// Exponential race over [begin, end): each entry scores w(v) / e_v when
// w(v) > 0, else 0, with w = p - q (kHasQ) or p. Two passes like argmax_row:
// the largest score, then the first index reaching it. The SSE2 path does the
// same IEEE float ops as the scalar one, so results are identical.
template <bool kHasQ>
float race_max(const float* p, const float* q, const float* noise, int64_t begin,
               int64_t end) {
  float best = 0.0f;
  int64_t v = begin;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  __m128 m0 = zero, m1 = zero;
  for (; v + 8 <= end; v += 8) {
    __m128 w0 = _mm_loadu_ps(p + v), w1 = _mm_loadu_ps(p + v + 4);
    if (kHasQ) {
      w0 = _mm_sub_ps(w0, _mm_loadu_ps(q + v));
      w1 = _mm_sub_ps(w1, _mm_loadu_ps(q + v + 4));
    }
    const __m128 s0 = _mm_and_ps(_mm_cmpgt_ps(w0, zero), _mm_div_ps(w0, _mm_loadu_ps(noise + v)));
    const __m128 s1 = _mm_and_ps(_mm_cmpgt_ps(w1, zero), _mm_div_ps(w1, _mm_loadu_ps(noise + v + 4)));
    m0 = _mm_max_ps(s0, m0);
    m1 = _mm_max_ps(s1, m1);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(m0, m1));
  for (const float x : lanes) best = x > best ? x : best;
#endif
  for (; v < end; ++v) {
    const float w = kHasQ ? p[v] - q[v] : p[v];
    const float score = w > 0.0f ? w / noise[v] : 0.0f;
    best = score > best ? score : best;
  }
  return best;
}

template <bool kHasQ>
int64_t race_find(const float* p, const float* q, const float* noise, int64_t begin,
                  int64_t end, float best) {
  for (int64_t v = begin; v < end; ++v) {
    const float w = kHasQ ? p[v] - q[v] : p[v];
    if (w > 0.0f && w / noise[v] == best) return v;
  }
  return -1;
}

// First index of max_v w(v) / e_v over w(v) > 0, -1 if none; w = p - q (q
// given) or p with entry `removed` (if >= 0) left out.
int64_t race(const float* p, const float* q, int64_t removed, const float* noise,
             int64_t vocab) {
  if (q != nullptr) {
    const float best = race_max<true>(p, q, noise, 0, vocab);
    return best > 0.0f ? race_find<true>(p, q, noise, 0, vocab, best) : -1;
  }
  const int64_t cut = removed >= 0 ? removed : vocab;
  const int64_t resume = removed >= 0 ? removed + 1 : vocab;
  const float best = std::max(race_max<false>(p, nullptr, noise, 0, cut),
                              race_max<false>(p, nullptr, noise, resume, vocab));
  if (!(best > 0.0f)) return -1;
  const int64_t found = race_find<false>(p, nullptr, noise, 0, cut, best);
  return found >= 0 ? found : race_find<false>(p, nullptr, noise, resume, vocab, best);
}

// Sample of the residual; rounding can empty it, then sample p, then argmax p.
int64_t recover(const float* p, const float* q, int64_t removed,
                const float* noise, int64_t vocab) {
  int64_t token = race(p, q, removed, noise, vocab);
  if (token < 0 && (q != nullptr || removed >= 0)) {
    token = race(p, nullptr, -1, noise, vocab);
  }
  return token >= 0 ? token : argmax_row(p, vocab);
}

void rejection_sample_row(int64_t b, int64_t start, int64_t num_drafts,
                          const int32_t* drafts, const float* target,
                          const float* draft_probs, const int32_t* bonus,
                          bool greedy, const double* uniforms,
                          const float* noise, int64_t vocab,
                          int64_t max_spec_len, int32_t* out) {
  // Target row of draft position i; requests own n + 1 rows when the bonus
  // token is sampled here, n rows when the caller passes it.
  const int64_t row_offset = bonus == nullptr ? b : 0;
  const float* row_noise = noise != nullptr ? noise + b * vocab : nullptr;
  int64_t accepted = 0;
  int64_t final_token = -1;
  for (; accepted < num_drafts; ++accepted) {
    const int64_t t = start + accepted;
    const float* p = target + (t + row_offset) * vocab;
    const int64_t x = drafts[t];
    const bool in_vocab = x >= 0 && x < vocab;
    if (greedy) {
      const int64_t top = argmax_row(p, vocab);
      if (x != top) {
        final_token = top;
        break;
      }
      continue;
    }
    const double q_x =
        draft_probs == nullptr ? 1.0
                               : (in_vocab ? draft_probs[t * vocab + x] : 0.0);
    if (in_vocab && uniforms[t] * q_x < static_cast<double>(p[x])) continue;
    const float* q = (in_vocab && draft_probs != nullptr)
                         ? draft_probs + t * vocab
                         : nullptr;
    const int64_t removed = (in_vocab && draft_probs == nullptr) ? x : -1;
    final_token = recover(p, q, removed, row_noise, vocab);
    break;
  }
  if (accepted == num_drafts) {
    if (bonus != nullptr) {
      final_token = bonus[b];
    } else {
      const float* p = target + (start + num_drafts + row_offset) * vocab;
      final_token = greedy ? argmax_row(p, vocab)
                           : recover(p, nullptr, -1, row_noise, vocab);
    }
  }
  int32_t* out_row = out + b * (max_spec_len + 1);
  for (int64_t j = 0; j <= max_spec_len; ++j) {
    out_row[j] = j < accepted    ? drafts[start + j]
                 : j == accepted ? static_cast<int32_t>(final_token)
                                 : kPlaceholder;
  }
}

at::Tensor rejection_sample_cpu(
    const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& bonus_token_ids,
    const std::optional<at::Tensor>& is_greedy,
    const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len) {
  at::Tensor out = check_rejection_sample_args(
      draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs,
      bonus_token_ids, is_greedy, uniforms, exp_noise, max_spec_len);
  const int64_t batch = cu_num_draft_tokens.size(0);
  const int64_t vocab = target_probs.size(1);
  const int32_t* cu = cu_num_draft_tokens.data_ptr<int32_t>();
  // Validate the row layout serially so errors raise before any work.
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = b == 0 ? 0 : cu[b - 1];
    TORCH_CHECK(cu[b] >= start && cu[b] - start <= max_spec_len,
                "rejection_sample: cu_num_draft_tokens must be non-decreasing "
                "with per-request counts <= max_spec_len (", max_spec_len,
                "); row ", b, " has ", cu[b] - start);
  }
  TORCH_CHECK(batch == 0 || cu[batch - 1] == draft_token_ids.size(0),
              "rejection_sample: cu_num_draft_tokens[-1] must equal "
              "len(draft_token_ids)");

  const int32_t* drafts = draft_token_ids.data_ptr<int32_t>();
  const float* target = target_probs.data_ptr<float>();
  const float* q = draft_probs ? draft_probs->data_ptr<float>() : nullptr;
  const int32_t* bonus = bonus_token_ids ? bonus_token_ids->data_ptr<int32_t>() : nullptr;
  const bool* greedy = is_greedy ? is_greedy->data_ptr<bool>() : nullptr;
  const double* u = uniforms ? uniforms->data_ptr<double>() : nullptr;
  const float* noise = exp_noise ? exp_noise->data_ptr<float>() : nullptr;
  int32_t* out_ptr = out.data_ptr<int32_t>();

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b == 0 ? 0 : cu[b - 1];
      rejection_sample_row(b, start, cu[b] - start, drafts, target, q, bonus,
                           greedy == nullptr || greedy[b], u, noise, vocab,
                           max_spec_len, out_ptr);
    }
  });
  return out;
}

}  // namespace

at::Tensor check_rejection_sample_args(
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

TORCH_LIBRARY_FRAGMENT(vllm_dflash, m) {
  m.def(
      "rejection_sample(Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor target_probs, Tensor? draft_probs, Tensor? bonus_token_ids, "
      "Tensor? is_greedy, Tensor? uniforms, Tensor? exp_noise, "
      "int max_spec_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_dflash, CPU, m) {
  m.impl("rejection_sample", &vllm_dflash::rejection_sample_cpu);
}
