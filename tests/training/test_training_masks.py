"""The packed DFlash training mask and packed forward: every allowed and forbidden
(query, key) pair of a small example, flex attention == SDPA, and the packed
training forward == the drafter's inference-time forward, block by block."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers import random_draft, tiny_target
from vllm_dflash.training.masks import block_position_ids, dense_mask, flex_block_mask
from vllm_dflash.training.trainer import draft_blocks



def test_every_pair_of_a_small_packed_example():
    # Context of 6 positions, blocks of 2, anchors 2 and 4 (row 0) and 5 plus a padding block (row 1).
    # keys: 0..5 context, 6-7 block 0, 8-9 block 1; queries: 0-1 block 0, 2-3 block 1.
    anchors = torch.tensor([[2, 4], [5, 0]])
    allowed = {
        0: {0: {0, 1, 6, 7}, 1: {0, 1, 6, 7}, 2: {0, 1, 2, 3, 8, 9}, 3: {0, 1, 2, 3, 8, 9}},
        1: {0: {0, 1, 2, 3, 4, 6, 7}, 1: {0, 1, 2, 3, 4, 6, 7}, 2: {8, 9}, 3: {8, 9}},
    }
    mask = dense_mask(anchors, context_len=6, block_size=2)
    assert mask.shape == (2, 1, 4, 10) and mask.dtype == torch.bool
    checked = 0
    for b in range(2):
        for q in range(4):
            for k in range(10):
                assert bool(mask[b, 0, q, k]) == (k in allowed[b][q]), (b, q, k)
                checked += 1
    assert checked == 80


def test_rules_hold_on_a_random_packing():
    gen = torch.Generator().manual_seed(0)
    S, B, N = 40, 4, 6
    anchors = torch.stack([torch.randperm(S - B, generator=gen)[:N].sort().values + 1 for _ in range(3)])
    mask = dense_mask(anchors, S, B)[:, 0]
    for b in range(3):
        for q in range(N * B):
            j, a = q // B, int(anchors[b, q // B])
            ctx = mask[b, q, :S]
            assert ctx[:a].all() and not ctx[a:].any()          # context strictly before the anchor
            blocks = mask[b, q, S:].view(N, B)
            assert blocks[j].all()                               # own block, both directions
            assert not torch.cat([blocks[:j], blocks[j + 1:]]).any()   # never another block


def test_position_ids():
    pos = block_position_ids(torch.tensor([[3, 7]]), context_len=5, block_size=3)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 7, 8, 9]]


def test_flex_block_mask_equals_dense_mask_in_attention():
    anchors = torch.tensor([[3, 5, 9], [4, 6, 0]])
    S, B = 12, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3 * B, 16, generator=gen)
    k = torch.randn(2, 2, S + 3 * B, 16, generator=gen)
    v = torch.randn(2, 2, S + 3 * B, 16, generator=gen)
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, v, block_mask=flex_block_mask(anchors, S, B), enable_gqa=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(anchors, S, B), enable_gqa=True)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


def test_flex_attention_has_no_cpu_backward_in_this_torch():
    """Why CPU training uses SDPA + a dense mask: fails (and should be revisited) once torch adds it."""
    from torch.nn.attention.flex_attention import flex_attention

    anchors = torch.tensor([[3, 5]])
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    k = torch.randn(1, 2, 12 + 8, 16)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        torch.compile(flex_attention)(q, k, k, block_mask=flex_block_mask(anchors, 12, 4)).sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention training runs on CUDA")
def test_compiled_flex_attention_matches_sdpa_forward_and_backward_on_cuda():
    from vllm_dflash.reference.model import _attention

    anchors = torch.tensor([[3, 5, 9], [4, 6, 0]], device="cuda")
    S, B = 12, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 3 * B, 16, generator=gen, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, S + 3 * B, 16, generator=gen, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, S + 3 * B, 16, generator=gen, device="cuda", requires_grad=True)
    flex = _attention(q, k, v, flex_block_mask(anchors, S, B))
    grads = torch.autograd.grad(flex.square().sum(), (q, k, v))
    sdpa = _attention(q, k, v, dense_mask(anchors, S, B).cuda())
    ref_grads = torch.autograd.grad(sdpa.square().sum(), (q, k, v))
    torch.testing.assert_close(flex, sdpa, atol=2e-5, rtol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(vocab_size=128, hidden_size=64, num_layers=4)
    return target, random_draft(target, num_layers=2, block_size=4, num_features=2)


def _features(target, draft, tokens):
    from vllm_dflash.reference import TargetFeatures

    with TargetFeatures(target, draft.target_layer_ids) as hooks, torch.no_grad():
        target(input_ids=tokens)
        return hooks.pop()


def test_packed_forward_equals_inference_forward(pair):
    """Each packed block = the draft run alone on features of positions < anchor (as at inference)."""
    target, draft = pair
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 127, (2, 30), generator=gen)
    feats = _features(target, draft, tokens)
    anchors = torch.tensor([[5, 6, 17, 26], [1, 12, 20, 0]])
    embed = target.get_input_embeddings().weight
    with torch.no_grad():
        packed = draft_blocks(draft, embed, tokens, feats, anchors)
        for b in range(2):
            for j in range(4):
                a = int(anchors[b, j])
                block = torch.full((1, 4), draft.mask_token_id)
                block[0, 0] = tokens[b, a]
                context = draft.project_context(feats[b:b + 1, :a])
                alone = draft(F.embedding(block, embed), context, torch.arange(a + 4)[None])
                torch.testing.assert_close(packed[b, j], alone[0], atol=2e-5, rtol=1e-4)


def test_packed_forward_ignores_future_context_and_other_blocks(pair):
    target, draft = pair
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 127, (1, 24), generator=gen)
    feats = _features(target, draft, tokens)
    anchors = torch.tensor([[4, 10, 15]])
    embed = target.get_input_embeddings().weight
    with torch.no_grad():
        base = draft_blocks(draft, embed, tokens, feats, anchors)
        # Change everything at or after position 10 (block 1's anchor) except the anchor tokens.
        feats2, tokens2 = feats.clone(), tokens.clone()
        feats2[:, 10:] += torch.randn(feats2[:, 10:].shape, generator=gen)
        tokens2[:, 4] = (tokens2[:, 4] + 1) % 127   # block 0's anchor token: only block 0 may change
        moved = draft_blocks(draft, embed, tokens2, feats2, anchors)
    torch.testing.assert_close(moved[0, 1], base[0, 1], atol=0, rtol=0)   # block 1 sees only < 10
    assert not torch.allclose(moved[0, 0], base[0, 0])                   # its own anchor moved it
    assert not torch.allclose(moved[0, 2], base[0, 2])                   # context 10..14 moved it
