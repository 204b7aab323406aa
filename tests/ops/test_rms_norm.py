"""rms_norm (the draft's hidden_norm on the context path): native CPU/CUDA
kernels against the torch reference (vLLM's native RMSNorm math).

Tolerance: the kernels sum squares in another order than torch: float32
within rtol 1e-5, float16/bfloat16 within 2 units of the dtype's epsilon of
the row's scale, and >= 95% of 16-bit values bit for bit (the reference
rounds x * rsqrt(...) to the dtype before the weight; a kernel that did not
would miss far more).
"""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (17, 256), (3, 5, 96), (300, 1000)])
def test_matches_reference(device, dtype, shape):
    x, w = _inputs(shape, dtype, device, seed=shape[-1])
    got, want = ops.rms_norm(x, w, 1e-6), ops.reference.rms_norm_ref(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    eps = torch.finfo(dtype).eps
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
    assert ((got.float() - want.float()).abs() <= 2 * eps * scale).all()
    exact = (got == want).float().mean().item()
    assert exact >= 0.95, f"only {exact:.1%} bit-equal to the reference"


def test_reference_is_vllm_native_math():
    """fp64 formula: x / sqrt(mean(x^2) + eps) * w."""
    x, w = _inputs((8, 128), torch.float32, "cpu", seed=1)
    x64 = x.double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).double(), want, rtol=1e-5, atol=1e-6)


def test_strided_input_and_empty(device):
    x, w = _inputs((6, 128), torch.bfloat16, device, seed=2)
    view = x[:, :64]  # row-strided view
    torch.testing.assert_close(ops.rms_norm(view, w[:64].contiguous(), 1e-5), ops.rms_norm(view.contiguous(), w[:64].contiguous(), 1e-5))
    empty = torch.empty(0, 128, dtype=torch.bfloat16, device=device)
    assert ops.rms_norm(empty, w, 1e-5).shape == (0, 128)


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.ones(32), "weight must be \\[64\\]"),
        (torch.ones(64, dtype=torch.bfloat16), "weight is BFloat16 but input is Float"),
    ],
)
def test_bad_input_raises_value_error(weight, match):
    with pytest.raises(ValueError, match=match):
        ops.rms_norm(torch.ones(2, 64), weight, 1e-6)


def test_opcheck(device):
    x, w = _inputs((5, 64), torch.bfloat16, device, seed=3)
    torch.library.opcheck(torch.ops.vllm_dflash.rms_norm.default, (x, w, 1e-6))
