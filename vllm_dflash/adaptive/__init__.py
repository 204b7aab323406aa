"""Adaptive speculation: verify only what pays, per request and per step.

Pure modules (numpy, no vLLM): `calibration` (acceptance per draft position
from the draft's confidence, learned from verification), `cost_model` (step
and draft time measured online), `controller` (the per-step decisions),
`speculation` (request bookkeeping between steps, the proposer's entry
point), `stats` (counters for metrics, shared through a memory-mapped file).
`prometheus` exposes those counters in the API server's /metrics.
"""
