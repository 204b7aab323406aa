"""Shared by every test area: tests/{unit,ops,verifier,serving,training,e2e}.

tests/ goes on sys.path, so `from helpers import ...`, `from serving_pairs
import ...` and `from engines import ...` work from every folder (test file
names are unique across the tree). What the tests depend on in the process is
set by the session fixtures below, not by importing a test module, so a file
run alone behaves as it does in the suite.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def vllm_cpu_kv_cache_space():
    """vLLM's CPU backend needs a KV cache size (GiB): 1 unless set (`make test` sets 2)."""
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    """torch's intra-op threads in the test process: OMP_NUM_THREADS, else 1.

    No result depends on it (tests/ops/test_threads.py runs every native op
    with 1 and with several threads and compares the bytes); one thread keeps
    a shared machine's cores free for the engines the tests start. In-process
    engines set their own count when they start, as vLLM's CPU worker does.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    yield
    torch.set_num_threads(before)
