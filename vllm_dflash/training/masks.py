"""The packed DFlash training mask, from one predicate for every attention backend.

A training row holds one sequence's context features followed by N draft blocks:

    keys    = [context 0 .. S-1 | block 0 (B tokens) | block 1 | ... | block N-1]
    queries = [block 0 | block 1 | ... | block N-1]

Block j (anchor a_j) may attend to context positions < a_j (what the target has
verified when the drafter runs at inference) and to its own B tokens in both
directions; never to another block. `mask_mod` states that rule once; the dense
boolean mask (SDPA, CPU training) and flex attention's sparse `BlockMask` (GPU
training) are both built by evaluating it, so they cannot drift apart.
"""

from __future__ import annotations

from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_mask_mod(anchors: torch.Tensor, context_len: int, block_size: int) -> MaskMod:
    """`mask_mod(b, h, q_idx, kv_idx) -> bool` in flex attention's signature.

    anchors: [batch, num_blocks] absolute anchor positions. Padding blocks (rows
    with fewer valid anchors) need no special case: give them anchor 0 and zero
    loss weight; they then see only themselves and cannot reach a real block.
    """
    num_blocks = anchors.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        anchor = anchors[b, q_block.clamp(max=num_blocks - 1)]
        in_context = kv_idx < context_len
        sees_context = in_context & (kv_idx < anchor)
        sees_own_block = ~in_context & ((kv_idx - context_len) // block_size == q_block)
        return sees_context | sees_own_block

    return mask_mod


def dense_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [batch, 1, N*B, S + N*B] for `scaled_dot_product_attention` (True = attend)."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q_idx = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv_idx = torch.arange(context_len + q_len, device=device).view(1, 1, 1, -1)
    return make_mask_mod(anchors, context_len, block_size)(b, h, q_idx, kv_idx)


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """flex attention `BlockMask` of the same predicate (sparse: skips whole empty tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    return create_block_mask(make_mask_mod(anchors, context_len, block_size), B=batch, H=None,
                             Q_LEN=q_len, KV_LEN=context_len + q_len, device=anchors.device)


def block_position_ids(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Absolute RoPE positions [batch, S + N*B]: context 0..S-1, block j at a_j .. a_j+B-1."""
    batch = anchors.shape[0]
    ctx = torch.arange(context_len, device=anchors.device).expand(batch, context_len)
    blocks = anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)
    return torch.cat([ctx, blocks.reshape(batch, -1)], dim=1)
