"""Limits the tests put on what they start.

HANG_GUARD_S bounds the subprocesses, servers and requests the tests start. It
guards against hangs and is not a speed check (speed goals live in
`vllm-dflash bench`): it is the suite's whole budget (DEVELOPERS.md), so no CPU
kind trips it. bf16 GEMMs run 8-20x slower on CPUs without AVX-512/AMX than on
ones with AMX, and a shared machine slows everything further.
"""

HANG_GUARD_S = 30 * 60
