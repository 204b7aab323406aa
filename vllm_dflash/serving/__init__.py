"""vLLM-side DFlash: draft model on vLLM's layers and paged KV cache
(`draft_model`), the proposer the runner calls (`proposer`), its per-step
inputs (`inputs`) and speculative-config completion (`draft_resolution`).
Installed by `vllm_dflash.patches`; importing this package imports nothing.
"""
