// CPU preparation of one DFlash drafting step, in one pass over the batch.
//
// Rows of the target pass are request-major (query_start_loc delimits
// request r's rows); in a verification step the last num_rejected[r] of them
// were rejected. Outputs:
//   context (rows whose hidden states become draft context K/V):
//     compact: the verified rows only, in order;
//     padded : all num_rows rows, slot -1 for rejected and padding rows
//              (no host-side count, as a CUDA graph-friendly kernel needs).
//     Without num_rejected every row is context with its own slot.
//   query block of request r, rows r*(k+1) .. r*(k+1)+k:
//     ids [next_token_ids[r], mask x k], positions p_r + j where p_r is one past
//     the position of r's last verified row (a request without verified rows,
//     whose drafts vLLM discards, starts at its first row's position), slots
//     from r's block table
//     (block index clamped to the table width, as vLLM's kernel does);
//   seq_lens[r] = p_r + k + 1 and query_start_loc_out[r] = r*(k+1).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "../ops_common.h"
#include "ops.h"

namespace vllm_dflash {
namespace {

int64_t read_index(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.const_data_ptr<int64_t>()[i]
                                      : t.const_data_ptr<int32_t>()[i];
}

// One past the position of the request's last verified row. A request with
// no verified row (vLLM discards its drafts) starts at its first row.
int64_t block_start(const int64_t* tpos, int64_t first, int64_t verified_end,
                    int64_t num_rows) {
  if (verified_end > first) return tpos[verified_end - 1] + 1;
  return first < num_rows ? tpos[first] : 0;
}

}  // namespace

PrepareDFlashInputsOut prepare_dflash_inputs_cpu(
    const at::Tensor& query_start_loc, const std::optional<at::Tensor>& num_rejected,
    const at::Tensor& target_positions, const at::Tensor& slot_mapping,
    const at::Tensor& next_token_ids, const at::Tensor& block_table,
    int64_t block_size, int64_t mask_token_id, int64_t num_speculative_tokens,
    int64_t num_rows, bool compact) {
  const PrepareShape s = check_prepare_dflash_inputs(
      query_start_loc, num_rejected, target_positions, slot_mapping,
      next_token_ids, block_table, block_size, num_speculative_tokens, num_rows);
  const int64_t B = s.batch, T = s.num_rows, q = s.q_len;
  const at::Tensor qsl_t = query_start_loc.contiguous();
  const at::Tensor pos_t = target_positions.contiguous();
  const at::Tensor slot_t = slot_mapping.contiguous();
  const at::Tensor next_t = next_token_ids.contiguous();
  const at::Tensor rej_t = num_rejected ? num_rejected->contiguous() : at::Tensor();
  const int32_t* qsl = qsl_t.const_data_ptr<int32_t>();
  const int64_t* tpos = pos_t.const_data_ptr<int64_t>();
  const int64_t* tslot = slot_t.const_data_ptr<int64_t>();
  const int32_t* bt = block_table.const_data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);

  // Verified rows of request r: [qsl[r], verified_end[r]).
  TORCH_CHECK_VALUE(qsl[0] >= 0 && qsl[B] <= T, "prepare_dflash_inputs: "
                    "query_start_loc spans rows [", qsl[0], ", ", qsl[B],
                    ") but the target pass has num_rows = ", T);
  std::vector<int64_t> verified_end(B);
  int64_t num_verified = 0;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t rej = rej_t.defined() ? read_index(rej_t, r) : 0;
    TORCH_CHECK_VALUE(qsl[r + 1] >= qsl[r] && rej >= 0,
                      "prepare_dflash_inputs: request ", r, " has rows [",
                      qsl[r], ", ", qsl[r + 1], ") and num_rejected = ", rej,
                      "; query_start_loc must not decrease and num_rejected "
                      "must be >= 0");
    verified_end[r] = std::max<int64_t>(qsl[r], qsl[r + 1] - rej);
    num_verified += verified_end[r] - qsl[r];
  }

  const auto i64 = next_token_ids.options().dtype(at::kLong);
  const auto i32 = next_token_ids.options().dtype(at::kInt);
  const bool all_rows = !rej_t.defined() || !compact;
  const int64_t n_ctx = !rej_t.defined() ? T : (compact ? num_verified : T);
  at::Tensor ctx_rows = at::empty({n_ctx}, i64);
  at::Tensor ctx_pos = at::empty({n_ctx}, i64);
  at::Tensor ctx_slots = at::empty({n_ctx}, i64);
  int64_t* crow = ctx_rows.data_ptr<int64_t>();
  int64_t* cpos = ctx_pos.data_ptr<int64_t>();
  int64_t* cslot = ctx_slots.data_ptr<int64_t>();
  if (all_rows) {
    for (int64_t i = 0; i < T; ++i) {
      crow[i] = i;
      cpos[i] = tpos[i];
      cslot[i] = rej_t.defined() ? -1 : tslot[i];  // rejected/padding: no write
    }
  }
  if (rej_t.defined()) {
    int64_t out = 0;
    for (int64_t r = 0; r < B; ++r) {
      for (int64_t i = qsl[r]; i < verified_end[r]; ++i) {
        const int64_t o = compact ? out++ : i;
        crow[o] = i;
        cpos[o] = tpos[i];
        cslot[o] = tslot[i];
      }
    }
  }

  at::Tensor ids = at::empty({B * q}, i32);
  at::Tensor qpos = at::empty({B * q}, i64);
  at::Tensor qslots = at::empty({B * q}, i64);
  at::Tensor seq_lens = at::empty({B}, i32);
  at::Tensor qsl_out = at::empty({B + 1}, i32);
  int32_t* id = ids.data_ptr<int32_t>();
  int64_t* qp = qpos.data_ptr<int64_t>();
  int64_t* qs = qslots.data_ptr<int64_t>();
  int32_t* sl = seq_lens.data_ptr<int32_t>();
  int32_t* qo = qsl_out.data_ptr<int32_t>();
  for (int64_t r = 0; r < B; ++r) {
    const int64_t start = block_start(tpos, qsl[r], verified_end[r], T);
    const int32_t* table = bt + r * bt_stride;
    for (int64_t j = 0; j < q; ++j) {
      const int64_t p = start + j;
      const int64_t blk = std::min(p / block_size, s.max_blocks - 1);
      id[r * q + j] = static_cast<int32_t>(j == 0 ? read_index(next_t, r) : mask_token_id);
      qp[r * q + j] = p;
      qs[r * q + j] = static_cast<int64_t>(table[blk]) * block_size + p % block_size;
    }
    sl[r] = static_cast<int32_t>(start + q);
    qo[r] = static_cast<int32_t>(r * q);
  }
  qo[B] = static_cast<int32_t>(B * q);
  return {ctx_rows, ctx_pos, ctx_slots, ids, qpos, qslots, seq_lens, qsl_out};
}

}  // namespace vllm_dflash
