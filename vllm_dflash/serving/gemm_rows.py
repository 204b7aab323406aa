"""Row counts for vLLM's CPU GEMMs: a bounded grid, made once at load.

vLLM's CPU linears (`dispatch_cpu_unquantized_gemm`: oneDNN, or zentorch /
sgl kernels) generate a matmul kernel per row count M the first time it is
seen. Measured on an AVX-512 EPYC (bfloat16 and float32): 0.40-0.57 ms per
(weight shape, M) on first use, 0.02-0.11 ms a call afterwards. Without
speculation a step has M = one row per request, a handful of values; with
per-request draft lengths nearly every verify step, draft block and context
write has an M never seen before: about 15 ms on the bundled 8-layer target
(33 GEMMs), several times the step itself, and the cost model took those
steps for what drafting costs.

So rows that are not plain decode are padded up to a grid of eight values per
octave (at most 1/8 of a step's rows are padding, 1/16 on average; exact up
to 16), and every grid value is made at load for each weight shape
(`make_kernels`). Padded rows carry slot -1: nothing reads or writes the cache
for them, and their outputs are dropped.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

logger = logging.getLogger("vllm.vllm_dflash")

EXACT_UP_TO = 16  # row counts up to here are their own grid value
STEPS_PER_OCTAVE = 8  # power of two
MOST_ROWS = 8192  # kernels are made up to here at most (larger passes are rare and long)


def grid_value(rows: int) -> int:
    """The smallest grid value >= rows."""
    if rows <= EXACT_UP_TO:
        return rows
    step = max(1, (1 << (rows - 1).bit_length()) // (2 * STEPS_PER_OCTAVE))
    return -(-rows // step) * step


def padded_rows(rows: int, limit: int) -> int:
    """`rows` rounded up to the grid, or left as it is where the grid value is over `limit`
    (the size of the buffers the rows live in)."""
    padded = grid_value(rows)
    return padded if padded <= limit else rows


def grid(limit: int) -> list[int]:
    """Every grid value up to `limit`."""
    values, rows = [], 1
    while rows <= limit:
        value = grid_value(rows)
        if value > limit:
            break
        values.append(value)
        rows = value + 1
    return values


def shape_compiled_linears(*models: nn.Module) -> list[nn.Module]:
    """vLLM CPU linears whose kernels are made per row count: those that handed their weight to
    oneDNN, zentorch or an sgl kernel (vLLM leaves an empty `weight` behind, `cpu_linear`
    holds the packed one). Where the machine has no native GEMM for the dtype (bfloat16 on AVX2)
    the weight stays and torch's linear runs: nothing to make, nothing to pad for."""
    found = []
    for model in models:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if callable(getattr(module, "cpu_linear", None)) and isinstance(weight, torch.Tensor) \
                    and weight.numel() == 0:
                found.append(module)
    return found


def _size(linear: nn.Module, *names: str) -> int | None:
    """The first of `names` the layer holds as an int (vLLM's linears and embeddings name them differently)."""
    for name in names:
        size = getattr(linear, name, None)
        if isinstance(size, int):
            return size
    return None


def _input_size(linear: nn.Module) -> int | None:
    # Column/row-parallel layers hold their shard's sizes; ReplicatedLinear (the draft's fc and
    # context K/V projection) only the whole ones, which are its own.
    return _size(linear, "input_size_per_partition", "input_size", "embedding_dim")


def _output_size(linear: nn.Module) -> int | None:
    return _size(linear, "output_size_per_partition", "output_size", "num_embeddings_per_partition")


@torch.inference_mode()
def make_kernels(linears: list[nn.Module], limit: int, dtype: torch.dtype) -> tuple[int, int, float]:
    """Run one linear of each weight shape once at every grid row count up to `limit`, so no
    step pays for making a kernel: (shapes, row counts, seconds). Kernels are cached per shape
    process-wide, so one layer stands for all layers of its shape."""
    started = time.perf_counter()
    shapes: dict[tuple, nn.Module] = {}
    for linear in linears:
        size_in, size_out = _input_size(linear), _output_size(linear)
        if size_in is None:
            continue
        key = (size_in, size_out, getattr(linear, "bias", None) is not None) if size_out is not None else id(linear)
        shapes.setdefault(key, linear)
    rows = grid(limit)
    for linear in shapes.values():
        x = torch.zeros(rows[-1], _input_size(linear), dtype=dtype)
        bias = getattr(linear, "bias", None)
        for m in rows:
            linear.cpu_linear(x[:m], None, bias)
    seconds = time.perf_counter() - started
    logger.info("CPU GEMM kernels made for %d weight shapes x %d row counts (up to %d) in %.2f s",
                len(shapes), len(rows), limit, seconds)
    return len(shapes), len(rows), seconds
