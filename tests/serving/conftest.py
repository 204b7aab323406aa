"""Servers shared by the tests in tests/serving/ (one start per session of this folder).

Three real `vllm serve` processes of the bundled toy pair (float32, torch.compile
off: --enforce-eager only shortens start-up), started together:

* "dflash": DFlash with every other setting at its default (k = block_size - 1 =
  15, draft_sample "sample", max_model_len 2048, vLLM's default token budget,
  which DFlash caps at 2048, so prefills get chunked under load);
* "plain": no speculation, a small token budget (--max-num-batched-tokens 64:
  every long prompt is prefilled in chunks); the greedy reference;
* "dflash_small": DFlash with a small token budget and a tiny KV cache
  (max_model_len 512, 8 sequences, 24 blocks of 32 tokens): chunked prefills,
  preemption and recompute under load.
"""

from __future__ import annotations

import pytest
from vllm_server import running, toy_server_specs


@pytest.fixture(scope="package")
def toy_servers(tmp_path_factory):
    with running(toy_server_specs(str(tmp_path_factory.mktemp("toy-servers")))) as servers:
        yield servers
