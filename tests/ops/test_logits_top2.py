"""logits_top2 (the draft's tokens and their confidence margin): the native kernel against
the torch reference, exactly: argmax's first index on ties, top-1 minus top-2 in float32."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (7, 3), (5, 17), (15, 1000), (3, 2049), (40, 8192)])
def test_matches_reference_exactly(device, dtype, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).to(device)
    ids, margin = ops.logits_top2(x)
    want_ids, want_margin = ops.reference.logits_top2_ref(x)
    assert ids.dtype == torch.int64 and margin.dtype == torch.float32 and ids.shape == margin.shape == (shape[0],)
    assert torch.equal(ids, want_ids) and torch.equal(margin, want_margin)


def test_ties_take_the_first_index_and_a_zero_margin(device):
    """Ties within one lane of the kernel (indices 16 apart), across lanes, across its
    1024-element chunks, at the end of a row, and a row of -inf (argmax 0, margin nan, as torch)."""
    x = torch.zeros(6, 3000)
    x[0, 5] = x[0, 21] = 4.0       # same lane
    x[1, 5] = x[1, 6] = 4.0        # neighbouring lanes
    x[2, 1500] = x[2, 2900] = 4.0  # different chunks
    x[3, 2998] = x[3, 2999] = 4.0  # the tail
    x[4, 100] = 4.0
    x[4, 2100] = 3.5               # a unique maximum: margin 0.5
    x[5] = float("-inf")
    ids, margin = ops.logits_top2(x.to(device))
    assert ids.tolist() == [5, 5, 1500, 2998, 100, 0]
    assert margin[:5].tolist() == [0.0, 0.0, 0.0, 0.0, 0.5] and torch.isnan(margin[5])
    want_ids, want_margin = ops.reference.logits_top2_ref(x)
    assert torch.equal(ids.cpu(), want_ids) and torch.equal(margin[:5].cpu(), want_margin[:5])


def test_strided_rows_and_empty(device):
    x = torch.randn(6, 300, device=device)
    view = x[:, :200]
    got, want = ops.logits_top2(view), ops.reference.logits_top2_ref(view.contiguous())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ids, margin = ops.logits_top2(torch.empty(0, 300, device=device))
    assert ids.shape == margin.shape == (0,)


def test_bad_input_names_the_op_and_the_fix():
    if not ops.dispatch.use_native("logits_top2", "cpu"):
        pytest.skip("the native library is not built")
    with pytest.raises(ValueError, match=r"logits_top2: logits must be \[rows, vocab\]"):
        ops.logits_top2(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="logits_top2: unsupported dtype Int; use float32, float16 or bfloat16"):
        ops.logits_top2(torch.zeros(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_argmax_is_torch_argmax_for_any_leading_shape(device, dtype):
    x = torch.randn(3, 5, 700, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1, 2, 10] = x[1, 2, 600] = x[1, 2].max() + 1  # a tie: the first index
    x = x.to(device)
    got = ops.logits_argmax(x)
    assert got.shape == (3, 5) and torch.equal(got, x.argmax(dim=-1)) and got[1, 2] == 10
