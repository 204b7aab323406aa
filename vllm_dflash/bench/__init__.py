"""Benchmark and demo: `vllm-dflash bench` (cli), `vllm-dflash demo` (demo).

runner runs one mode on a fresh engine in its own process; prompts loads the
workload; metrics turns raw measurements into figures; plots draws them;
draft_cost measures draft time vs block size in plain torch.
"""
