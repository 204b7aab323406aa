"""vLLM-side DFlash: the draft model on vLLM's layers (`draft_model`), its
context-K/V writer into the paged cache (`context_kv`), the proposer the
runner calls (`proposer`), speculative-config completion and the DFlash
config that travels with it (`draft_resolution`), and the `draft_sample`
key (`draft_sample`). Installed by `vllm_dflash.patches`; importing this
package imports nothing.
"""
