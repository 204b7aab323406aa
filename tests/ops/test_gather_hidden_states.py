"""gather_hidden_states: native CPU/CUDA kernels against the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INDEX_DTYPES = [torch.int64, torch.int32]


def _layer(kind: str, num_rows: int, hidden: int, dtype, device, gen) -> torch.Tensor:
    """A [T, D] hidden-state tensor laid out the way vLLM may hand it over."""
    if kind == "contiguous":
        return torch.randn(num_rows, hidden, generator=gen).to(dtype).to(device)
    if kind == "row_strided":  # a column slice of a wider buffer, starting at an odd column
        wide = torch.randn(num_rows, hidden + 5, generator=gen).to(dtype).to(device)
        return wide[:, 1 : hidden + 1]
    assert kind == "transposed"  # no dense rows at all
    return torch.randn(hidden, num_rows, generator=gen).to(dtype).to(device).t()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_on_random_shapes(device, dtype, index_dtype, seed, bitwise_equal):
    gen = torch.Generator().manual_seed(seed)
    num_rows = int(torch.randint(1, 200, (1,), generator=gen))
    hidden = int(torch.randint(1, 300, (1,), generator=gen))
    num_layers = int(torch.randint(1, 7, (1,), generator=gen))
    n = int(torch.randint(0, 2 * num_rows, (1,), generator=gen))
    kinds = ["contiguous", "row_strided", "transposed"]
    hs = [_layer(kinds[(seed + l) % 3], num_rows, hidden, dtype, device, gen) for l in range(num_layers)]
    idx = torch.randint(0, num_rows, (n,), generator=gen).to(index_dtype).to(device)  # repeats allowed

    out = ops.gather_hidden_states(hs, idx)

    assert out.shape == (n, num_layers * hidden) and out.is_contiguous() and out.device.type == device
    bitwise_equal(out, ops.reference.gather_hidden_states_ref(hs, idx))
    for i in range(min(n, 3)):  # the definition itself, row by row
        row = torch.cat([h[int(idx[i])] for h in hs])
        bitwise_equal(out[i], row)


def test_qwen3_8b_sizes(device, bitwise_equal):
    """The real shape: 5 captured layers of D=4096 in bf16, rows from a padded batch."""
    hs = [torch.randn(300, 4096, device=device, dtype=torch.bfloat16) for _ in range(5)]
    idx = torch.randperm(300, device=device)[:257]
    bitwise_equal(ops.gather_hidden_states(hs, idx), ops.reference.gather_hidden_states_ref(hs, idx))


def test_more_layers_than_one_launch_holds(device, bitwise_equal):
    hs = [torch.randn(9, 24, device=device) for _ in range(19)]  # the CUDA kernel takes 16 per launch
    idx = torch.tensor([8, 0, 3, 3], device=device)
    bitwise_equal(ops.gather_hidden_states(hs, idx), ops.reference.gather_hidden_states_ref(hs, idx))


def test_empty_indices(device):
    hs = [torch.randn(4, 6, device=device) for _ in range(3)]
    out = ops.gather_hidden_states(hs, torch.empty(0, dtype=torch.int64, device=device))
    assert out.shape == (0, 18)


def test_out_is_filled_in_place(device, bitwise_equal):
    hs = [torch.randn(10, 8, device=device, dtype=torch.bfloat16) for _ in range(3)]
    idx = torch.tensor([9, 2, 2, 0], device=device, dtype=torch.int32)
    out = torch.full((4, 24), float("nan"), device=device, dtype=torch.bfloat16)
    result = ops.gather_hidden_states(hs, idx, out=out)
    assert result is out
    bitwise_equal(out, ops.reference.gather_hidden_states_ref(hs, idx))


@pytest.mark.parametrize(
    "out_shape, out_dtype, transpose, match",
    [
        ((4, 23), torch.float32, False, r"out must have shape \[4, 24\]"),
        ((4, 24), torch.float16, False, "out is Half"),
        ((24, 4), torch.float32, True, "out must be contiguous"),
    ],
)
def test_bad_out_raises(device, out_shape, out_dtype, transpose, match):
    hs = [torch.randn(10, 8, device=device) for _ in range(3)]
    out = torch.empty(out_shape, device=device, dtype=out_dtype)
    with pytest.raises(ValueError, match=match):
        ops.gather_hidden_states(hs, torch.tensor([1, 2, 3, 4], device=device), out=out.t() if transpose else out)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("bad", [10, -1])
def test_out_of_range_index_raises_on_cpu(index_dtype, bad):
    hs = [torch.randn(10, 8) for _ in range(2)]
    idx = torch.tensor([0, 9, bad], dtype=index_dtype)
    with pytest.raises(ValueError, match=rf"indices\[2\] = {bad} is out of range .* 10 rows"):
        ops.gather_hidden_states(hs, idx)
    with pytest.raises(ValueError, match=rf"index {bad} is out of range"):
        ops.reference.gather_hidden_states_ref(hs, idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_out_of_range_index_fails_the_cuda_kernel(cuda_script):
    result = cuda_script(
        "import torch\n"
        "from vllm_dflash import ops\n"
        "hs = [torch.randn(8, 16, device='cuda') for _ in range(2)]\n"
        "try:\n"
        "    ops.gather_hidden_states(hs, torch.tensor([1, 8], device='cuda'))\n"
        "    torch.cuda.synchronize()\n"
        "except RuntimeError as e:\n"
        "    print('CUDA_ERROR', e)\n"
        "    raise SystemExit(3)\n"
        "print('NO_ERROR')\n"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3 and "CUDA_ERROR" in output, output
    assert "vllm_dflash.gather_hidden_states" in output, output


def test_bad_inputs_raise_value_error(device):
    h = torch.randn(10, 8, device=device)
    idx = torch.tensor([1], device=device)
    with pytest.raises(ValueError, match="hidden_states is empty"):
        ops.gather_hidden_states([], idx)
    with pytest.raises(ValueError, match=r"hidden_states\[1\] has shape"):
        ops.gather_hidden_states([h, torch.randn(10, 9, device=device)], idx)
    with pytest.raises(ValueError, match=r"hidden_states\[1\] is Half"):
        ops.gather_hidden_states([h, h.half()], idx)
    with pytest.raises(ValueError, match="must be 2-D"):
        ops.gather_hidden_states([h[None]], idx)
    with pytest.raises(ValueError, match="indices must be int64 or int32"):
        ops.gather_hidden_states([h], idx.float())
    with pytest.raises(ValueError, match="indices must be 1-D"):
        ops.gather_hidden_states([h], idx[None])
    if device == "cuda":
        with pytest.raises(ValueError, match="move them to the same device"):
            ops.gather_hidden_states([h], idx.cpu())
