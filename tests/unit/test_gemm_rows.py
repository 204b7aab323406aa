"""The row-count grid of CPU GEMMs (serving.gemm_rows) and the kernels made for it at load."""

from __future__ import annotations

import torch
from torch import nn

from vllm_dflash.serving import gemm_rows


def test_grid_is_exact_up_to_16_then_eight_values_per_octave_with_under_an_eighth_padding():
    assert [gemm_rows.grid_value(n) for n in range(1, 17)] == list(range(1, 17))
    for n in range(17, 9000):
        value = gemm_rows.grid_value(n)
        assert n <= value < n + n / 8, (n, value)
        assert gemm_rows.grid_value(value) == value  # a grid value is its own
    octave = [v for v in gemm_rows.grid(4096) if 512 < v <= 1024]
    assert octave == list(range(576, 1025, 64))
    assert len(gemm_rows.grid(4096)) == 16 + 8 * 8


def test_grid_lists_every_value_a_row_count_up_to_the_limit_pads_to():
    for limit in (1, 16, 17, 100, 1000, 2048):
        grid = gemm_rows.grid(limit)
        expected = sorted({gemm_rows.grid_value(n) for n in range(1, limit + 1)} - set(range(limit + 1, 10 ** 6)))
        assert grid == expected, limit
        for n in range(1, limit + 1):  # on the grid, or (its grid value past the limit) as it is
            assert gemm_rows.padded_rows(n, limit) in (grid if gemm_rows.grid_value(n) <= limit else [n]), (limit, n)


def test_rows_whose_grid_value_is_past_the_limit_are_left_as_they_are():
    assert gemm_rows.padded_rows(100, 1000) == 104
    assert gemm_rows.padded_rows(100, 102) == 100  # 104 would not fit the buffers
    assert gemm_rows.padded_rows(5000, 4096) == 5000


class FakeLinear(nn.Module):
    """A linear as vLLM's CPU dispatch leaves it: sizes, cpu_linear, and an empty weight where
    the kernel holds a packed one (`packed`)."""

    def __init__(self, size_in: int, size_out: int, packed: bool = True, bias: bool = False):
        super().__init__()
        self.input_size_per_partition, self.output_size_per_partition = size_in, size_out
        self.weight = nn.Parameter(torch.empty(0) if packed else torch.zeros(size_out, size_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size_out), requires_grad=False) if bias else None
        self.rows: list[int] = []

    def cpu_linear(self, x, weight, bias):
        assert weight is None and x.shape[1] == self.input_size_per_partition and bias is self.bias
        self.rows.append(x.shape[0])
        return torch.zeros(x.shape[0], self.output_size_per_partition, dtype=x.dtype)


def test_only_linears_whose_weight_went_into_a_kernel_are_found():
    model = nn.Sequential(FakeLinear(8, 16), FakeLinear(8, 16, packed=False), nn.Linear(8, 8))
    assert gemm_rows.shape_compiled_linears(model) == [model[0]]


class FakeReplicatedLinear(FakeLinear):
    """vLLM's ReplicatedLinear names its sizes input_size / output_size (no per-partition ones)."""

    def __init__(self, size_in: int, size_out: int):
        super().__init__(size_in, size_out)
        del self.input_size_per_partition, self.output_size_per_partition
        self.input_size, self.output_size = size_in, size_out

    def cpu_linear(self, x, weight, bias):
        assert weight is None and x.shape[1] == self.input_size
        self.rows.append(x.shape[0])
        return torch.zeros(x.shape[0], self.output_size, dtype=x.dtype)


def test_replicated_linears_get_their_kernels_too():
    fc = FakeReplicatedLinear(40, 8)
    shapes, _, _ = gemm_rows.make_kernels([fc, FakeLinear(8, 16)], 100, torch.float32)
    assert shapes == 2 and fc.rows == gemm_rows.grid(100)


def test_kernels_are_made_once_per_weight_shape_at_every_grid_row_count():
    a, b, c, d = FakeLinear(8, 16), FakeLinear(8, 16), FakeLinear(16, 8), FakeLinear(8, 16, bias=True)
    shapes, counts, _ = gemm_rows.make_kernels([a, b, c, d], 300, torch.bfloat16)
    grid = gemm_rows.grid(300)
    assert (shapes, counts) == (3, len(grid))
    assert a.rows == grid and b.rows == [] and c.rows == grid and d.rows == grid  # b shares a's shape
