"""DFlash drafter training: target-generated data (data), target feature cache
(features), anchors and the packed block mask (anchors, masks), position-weighted
loss (loss), the loop (trainer), tau measurement (evaluate), z-lab export (export)
and the `vllm-dflash train` command (cli).
"""
