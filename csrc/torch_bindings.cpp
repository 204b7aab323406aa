// Schemas of the vllm_dflash ops and the Python module entry point.
//
// Device implementations are registered in one place per device:
// csrc/cpu_bindings.cpp (CPU) and csrc/cuda_bindings.cpp (CUDA); fake (meta)
// implementations for torch.compile live in vllm_dflash/ops/native.py, and
// vllm_dflash/ops/dispatch.py lists every op below (a test checks).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(vllm_dflash, m) {
  // Concatenate rows `indices` of L hidden-state tensors [T, D] into a
  // contiguous [n, L*D] tensor (the DFlash draft's fc input).
  m.def("gather_hidden_states(Tensor[] hidden_states, Tensor indices) -> Tensor");
  m.def(
      "gather_hidden_states_out(Tensor[] hidden_states, Tensor indices, "
      "Tensor(a!) out) -> ()");
  // Scatter context K/V [n, H, d] into one layer of vLLM's paged KV cache.
  m.def(
      "store_context_kv_layer(Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, str layout) -> ()");
  // Context K/V of every draft layer from projected keys/values [n, L, H, d]:
  // per-head RMSNorm of K (the layer's k_norm weight), RoPE at `positions`
  // from vLLM's cos_sin_cache, both written into each layer's paged cache.
  m.def(
      "store_context_kv_fused(Tensor key, Tensor value, Tensor k_norm_weight, "
      "float eps, Tensor cos_sin_cache, Tensor positions, bool is_neox, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, str layout) -> ()");
  // RMSNorm over the last dim with vLLM's native rounding: fp32 statistics,
  // x * rsqrt(mean(x^2) + eps) rounded to the dtype, times the weight.
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  // Per row of draft logits [rows, vocab]: the argmax (first index on ties)
  // and the top-1 minus top-2 logit (0 on a tie), float32.
  m.def("logits_top2(Tensor logits) -> (Tensor ids, Tensor margin)");
  // One drafting step's inputs from the runner's batch: context rows (the
  // verified target rows, their positions and slots) and the query block
  // [bonus, MASK x k] (ids, positions, slots), the block's seq_lens and
  // query_start_loc.
  m.def(
      "prepare_dflash_inputs(Tensor query_start_loc, Tensor? num_rejected, "
      "Tensor target_positions, Tensor slot_mapping, Tensor next_token_ids, "
      "Tensor block_table, int block_size, int mask_token_id, "
      "int num_speculative_tokens, int num_rows, bool compact) -> "
      "(Tensor context_rows, Tensor context_positions, Tensor context_slots, "
      "Tensor input_ids, Tensor positions, Tensor slots, Tensor seq_lens, "
      "Tensor query_start_loc_out)");
  // Rejection-sampling verifier: accept / recover per request, [B, K + 1]
  // int32 tokens with -1 after the emitted ones (vllm_dflash/ops/reference.py).
  m.def(
      "rejection_sample(Tensor draft_token_ids, Tensor cu_num_draft_tokens, "
      "Tensor target_probs, Tensor? draft_probs, Tensor? bonus_token_ids, "
      "Tensor? is_greedy, Tensor? uniforms, Tensor? exp_noise, "
      "int max_spec_len) -> Tensor");
}

// `import vllm_dflash._C` loads the library (and with it the registrations
// above); the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0,
                                      nullptr};
  return PyModule_Create(&module);
}
