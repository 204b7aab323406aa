"""One dispatch policy for all six ops (vllm_dflash.ops.dispatch):
VLLM_DFLASH_NATIVE_OPS=0 routes every op to its pure-torch reference, 1 to
the native kernel, read at each call."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vllm_dflash import ops
from vllm_dflash.ops import dispatch, reference
from vllm_dflash.verifier import rejection_sample

ROOT = Path(__file__).resolve().parents[2]


def _kv(n=3, layers=None):
    shape = (n, 2, 8) if layers is None else (n, layers, 2, 8)
    return torch.randn(shape), torch.randn(shape)


CALLS = {
    "gather_hidden_states": lambda: ops.gather_hidden_states([torch.randn(4, 3)], torch.tensor([1, 0])),
    "store_context_kv_layer": lambda: ops.store_context_kv_layer(
        *_kv(), torch.zeros(2, 2, 4, 16), torch.tensor([0, 5, -1]), "flash"),
    "store_context_kv_fused": lambda: ops.store_context_kv_fused(
        *_kv(layers=2), torch.ones(2, 8), 1e-6, torch.randn(16, 8), torch.tensor([0, 1, 2]), True,
        [torch.zeros(2, 2, 4, 16), torch.zeros(2, 2, 4, 16)], torch.tensor([0, 5, -1]), "flash"),
    "rms_norm": lambda: ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6),
    "logits_top2": lambda: ops.logits_top2(torch.randn(3, 8)),
    "prepare_dflash_inputs": lambda: ops.prepare_dflash_inputs(
        torch.tensor([0, 2], dtype=torch.int32), None, torch.tensor([0, 1]), torch.tensor([0, 1]),
        torch.tensor([7]), torch.zeros(1, 4, dtype=torch.int32), 4, 9, 2, 2, True),
    # The verifier's entry point, as the sampler calls it.
    "rejection_sample": lambda: rejection_sample(
        torch.tensor([3, 1]), torch.tensor([2], dtype=torch.int32), torch.randn(3, 5).softmax(-1)),
}


def test_the_policy_covers_every_op_of_the_library():
    schemas = re.findall(r'm\.def\(\s*"(\w+)\(', (ROOT / "csrc" / "torch_bindings.cpp").read_text())
    assert set(dispatch.OPS) == {s for s in schemas if not s.endswith("_out")}
    assert set(CALLS) == set(dispatch.OPS)
    assert set(dispatch.OPS) <= set(ops.__all__)


@pytest.mark.parametrize("native_ops", ["0", "1"])
@pytest.mark.parametrize("op", dispatch.OPS)
def test_native_ops_switch_reaches_every_op(monkeypatch, op, native_ops):
    monkeypatch.setenv("VLLM_DFLASH_NATIVE_OPS", native_ops)
    called = []
    native_fn, ref_fn = getattr(torch.ops.vllm_dflash, op), getattr(reference, f"{op}_ref")

    def spy(path, fn):
        def wrapper(*args, **kwargs):
            called.append(path)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.ops.vllm_dflash, op, spy("native", native_fn))
    monkeypatch.setattr(reference, f"{op}_ref", spy("reference", ref_fn))
    CALLS[op]()
    assert called == (["reference"] if native_ops == "0" else ["native"])


def test_a_device_without_a_kernel_takes_the_reference():
    assert dispatch.has_kernel("rms_norm", "cpu")
    assert not dispatch.has_kernel("rms_norm", "xpu")  # no vllm_dflash kernel is built for it
    assert not dispatch.use_native("rms_norm", "xpu")
    with pytest.raises(ValueError, match="op='rms_nrom' is not a vllm_dflash op"):
        dispatch.has_kernel("rms_nrom", "cpu")
