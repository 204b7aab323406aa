"""Pure-torch references of the six native ops: their specification.

The native kernels (csrc/) match these bit for bit (store_context_kv_fused
and rms_norm: within rounding, see their docstrings); the tests compare them
on every device. Every op falls back to its reference when the native one is
not used (vllm_dflash.ops.dispatch).

rejection_sample, in full. One request row holds n draft tokens x_0..x_{n-1} (n <= max_spec_len) and target
rows p_0..p_{n-1} (plus p_n for the bonus token unless the caller samples it).

- Greedy rows accept while x_i == argmax p_i, then emit argmax p_i (or the bonus).
- Sampled rows accept x_i when u_i * q_i(x_i) < p_i(x_i), i.e. with probability
  min(1, p_i(x_i) / q_i(x_i)) for u_i ~ U[0, 1) (Leviathan et al. 2023). On the
  first rejection they emit a sample of normalize(max(0, p_i - q_i)); with no
  draft probabilities the draft is a point mass, q_i = one-hot(x_i), so the
  residual is p_i with x_i removed. When all n are accepted the bonus token is a
  sample of p_n. Draft ids outside [0, vocab) (vLLM pads with -1) are rejected
  and the emitted token is a sample of p_i.
- Sampling is the exponential race: with e ~ Exp(1) i.i.d. per vocab entry, the
  index of max_v r(v) / e_v is distributed as r / sum(r) for any r >= 0 (the
  Gumbel-max trick in multiplicative form). Entries with r(v) = 0 never win.
  One noise row per request serves both the recovery and the bonus token: a
  request emits exactly one of them, so the draws are never reused.
- Ties go to the lowest index, as torch.argmax does. If rounding leaves an
  all-zero residual the row falls back to sampling p, then to argmax p.

Everything is elementwise float32 (scores) or float64 (the acceptance test)
followed by an argmax, so the C++ and CUDA kernels reproduce it exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_dflash.ops.kv_layout import resolve_kv_layout

# --------------------------------------------------------------------------
# gather_hidden_states
# --------------------------------------------------------------------------


def gather_hidden_states_ref(
    hidden_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``gather_hidden_states``; bounds are checked on CPU only (a
    check on CUDA would need a device sync)."""
    if len(hidden_states) == 0:
        raise ValueError("hidden_states is empty; pass one [T, D] tensor per captured layer")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int32/int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    num_rows = hidden_states[0].shape[0]
    if indices.device.type == "cpu" and indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"gather_hidden_states: index {bad} is out of range for hidden_states with "
                f"{num_rows} rows; indices must lie in [0, {num_rows})"
            )
    result = torch.cat([h.index_select(0, indices) for h in hidden_states], dim=-1)
    if out is None:
        return result
    out.copy_(result)
    return out


# --------------------------------------------------------------------------
# store_context_kv_layer / store_context_kv_fused
# --------------------------------------------------------------------------


def _check_kv_args(key, value, kv_cache, slot_mapping) -> None:
    if kv_cache.element_size() == 1:
        raise ValueError(
            f"kv_cache is {kv_cache.dtype} (an fp8/quantized KV cache); only unquantized caches are "
            "supported, start vLLM with kv_cache_dtype='auto'"
        )
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [n, num_kv_heads, head_size], got {tuple(key.shape)}, {tuple(value.shape)}")
    if kv_cache.dtype != key.dtype or value.dtype != key.dtype:
        raise ValueError(f"kv_cache is {kv_cache.dtype} but key/value are {key.dtype}/{value.dtype}; cast to the cache dtype")
    n, num_heads, head_size = key.shape
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_heads or kv_cache.shape[3] != 2 * head_size:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not fit key {tuple(key.shape)}; "
            f"expected [num_blocks, {num_heads}, block_size, {2 * head_size}]"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.shape[0] > n:
        raise ValueError(f"slot_mapping must be 1-D int64 with at most {n} entries, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def store_context_kv_layer_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str,
) -> None:
    """Pure-torch ``store_context_kv_layer`` (same layouts, same bytes)."""
    _check_kv_args(key, value, kv_cache, slot_mapping)
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    layout = resolve_kv_layout(layout, kv_cache.dtype, block_size, d)
    if layout != "flash" and kv_cache.device.type != "cpu":
        raise ValueError(f"layout={layout!r} is vLLM's CPU attention layout but kv_cache is on {kv_cache.device}")
    n = slot_mapping.shape[0]
    if kv_cache.device.type == "cpu" and n > 0 and int(slot_mapping.max()) >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())}, outside the cache "
            f"({num_blocks} blocks x {block_size} = {num_blocks * block_size} slots)"
        )
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key, value = key[:n][keep], value[:n][keep]
    blk, off = slots // block_size, slots % block_size
    if layout == "flash":
        kv_cache[blk, :, off, :d] = key
        kv_cache[blk, :, off, d:] = value
        return
    if layout == "cpu_amx" and (kv_cache.element_size() != 2 or block_size % 32 or d % 16):
        raise ValueError("the AMX layout needs a 16-bit cache, block_size % 32 == 0 and head_size % 16 == 0")
    # vLLM's CPU page per (block, head): [K part: N*d elements | V part: N*d elements].
    pages = kv_cache.view(num_blocks, num_heads, 2, block_size * d)
    k_part, v_part = pages[:, :, 0], pages[:, :, 1]
    if layout == "cpu_vec":
        k_part.view(num_blocks, num_heads, d, block_size)[blk, :, :, off] = key
        v_part.view(num_blocks, num_heads, block_size, d)[blk, :, off, :] = value
    else:  # cpu_amx: pairs of 16-bit values share a 32-bit AMX lane
        p = 2
        k_tiles = k_part.view(num_blocks, num_heads, block_size // 16, d // p, 16, p)
        k_tiles[blk, :, off // 16, :, off % 16, :] = key.reshape(-1, num_heads, d // p, p)
        v_tiles = v_part.view(num_blocks, num_heads, d // 16, block_size // p, 16, p)
        v_tiles[blk, :, :, off // p, :, off % p] = value.reshape(-1, num_heads, d // 16, 16)


def _check_context_kv_args(key, value, k_norm_weight, cos_sin_cache, positions, kv_caches, slot_mapping) -> None:
    if key.dim() != 4 or value.shape != key.shape:
        raise ValueError(
            f"key/value must both be [n, num_layers, num_kv_heads, head_size], got "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    n, num_layers, _, head_size = key.shape
    if len(kv_caches) != num_layers:
        raise ValueError(f"got {len(kv_caches)} kv_caches for {num_layers} layers in key; pass one cache per layer")
    if tuple(k_norm_weight.shape) != (num_layers, head_size) or k_norm_weight.dtype != key.dtype:
        raise ValueError(
            f"k_norm_weight must be [{num_layers}, {head_size}] in {key.dtype}, got "
            f"{k_norm_weight.dtype} {tuple(k_norm_weight.shape)}"
        )
    rot = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if cos_sin_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16) or rot <= 0 or rot % 2 or rot > head_size:
        raise ValueError(
            f"cos_sin_cache must be a float [max_position, rotary_dim] tensor (cat(cos, sin), rotary_dim "
            f"even and <= head_size {head_size}), got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )
    if positions.dim() != 1 or positions.dtype != torch.int64 or positions.shape[0] < slot_mapping.shape[0]:
        raise ValueError(
            f"positions must be 1-D int64 with at least {slot_mapping.shape[0]} entries, got "
            f"{positions.dtype} {tuple(positions.shape)}"
        )
    for i, cache in enumerate(kv_caches[1:], 1):
        if cache.shape != kv_caches[0].shape or cache.stride() != kv_caches[0].stride() or cache.dtype != kv_caches[0].dtype:
            raise ValueError(f"kv_caches[{i}] differs from kv_caches[0]; all draft layers must share one cache spec")
    del n


def rms_norm_rope_ref(
    key: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """Per-head RMSNorm then RoPE of keys ``[n, L, H, d]`` (weight ``[L, d]``),
    with the arithmetic of vLLM's RMSNorm (fp32, rounded to the model dtype
    before the weight) and rotary embedding (fp32 rotation, rounded once)."""
    dtype = key.dtype
    k32 = key.float()
    normed = (k32 * torch.rsqrt(k32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype)
    x = (normed * k_norm_weight[:, None, :]).float()
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()[:, None, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:rot]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rot:]), dim=-1).to(dtype)


def store_context_kv_fused_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool,
    kv_caches: list[torch.Tensor] | tuple[torch.Tensor, ...],
    slot_mapping: torch.Tensor,
    layout: str,
) -> None:
    """Pure-torch ``store_context_kv_fused``: :func:`rms_norm_rope_ref`, then
    :func:`store_context_kv_layer_ref` per layer."""
    _check_context_kv_args(key, value, k_norm_weight, cos_sin_cache, positions, kv_caches, slot_mapping)
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    positions = positions[:n][keep]
    if positions.device.type == "cpu" and positions.numel() > 0:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"positions hold {lo if lo < 0 else hi}, outside cos_sin_cache ({cos_sin_cache.shape[0]} positions)"
            )
    keys = rms_norm_rope_ref(key[:n][keep], k_norm_weight, eps, cos_sin_cache, positions, is_neox)
    values, slots = value[:n][keep], slot_mapping[keep]
    for layer, cache in enumerate(kv_caches):
        store_context_kv_layer_ref(keys[:, layer], values[:, layer], cache, slots, layout)


# --------------------------------------------------------------------------
# rms_norm
# --------------------------------------------------------------------------


def logits_top2_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (torch.argmax, the first index of the maximum; top-1 minus top-2 of the
    float32 logits, from torch.topk: 0 where the maximum appears twice)."""
    if logits.dim() != 2:
        raise ValueError(f"logits_top2: logits must be [rows, vocab], got {list(logits.shape)}")
    x = logits.float()
    if x.shape[0] == 0:
        return x.new_empty(0, dtype=torch.int64), x.new_empty(0)
    top = x.topk(2, dim=-1).values
    return x.argmax(dim=-1), top[:, 0] - top[:, 1]


def rms_norm_ref(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's native RMSNorm (vllm/ir/ops/layernorm.py) and transformers'
    Qwen3RMSNorm: fp32 statistics, rounded to the dtype before the weight."""
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1] or weight.dtype != input.dtype:
        raise ValueError(
            f"weight must be [{input.shape[-1]}] in {input.dtype}, got {weight.dtype} {tuple(weight.shape)}"
        )
    x = input.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(weight.dtype) * weight


# --------------------------------------------------------------------------
# prepare_dflash_inputs
# --------------------------------------------------------------------------


class DFlashStepInputs(NamedTuple):
    """Context rows (target rows that become draft context K/V) and the query
    block ``[bonus, MASK x k]`` of every request, request-major."""

    context_rows: torch.Tensor  # [n] int64 target row of each context entry
    context_positions: torch.Tensor  # [n] int64
    context_slots: torch.Tensor  # [n] int64, -1 = do not write
    input_ids: torch.Tensor  # [B * (k + 1)] int32
    positions: torch.Tensor  # [B * (k + 1)] int64
    slots: torch.Tensor  # [B * (k + 1)] int64
    seq_lens: torch.Tensor  # [B] int32: context before the block + k + 1
    query_start_loc: torch.Tensor  # [B + 1] int32: r * (k + 1)


def prepare_dflash_inputs_ref(
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor | None,
    target_positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    next_token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    num_speculative_tokens: int,
    num_rows: int,
    compact: bool,
) -> DFlashStepInputs:
    """Pure-torch ``prepare_dflash_inputs`` (same outputs, element for element)."""
    batch = next_token_ids.shape[0]
    q_len = num_speculative_tokens + 1
    device = next_token_ids.device
    if block_size <= 0 or num_speculative_tokens < 0 or block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(
            f"block_size={block_size}, num_speculative_tokens={num_speculative_tokens}, block_table "
            f"{tuple(block_table.shape)}: need block_size > 0, k >= 0 and a [>= {batch}, max_blocks] table"
        )
    starts = query_start_loc[: batch + 1].long()
    rows = torch.arange(num_rows, device=device)
    rejected = torch.zeros(batch, dtype=torch.int64, device=device) if num_rejected is None else num_rejected[:batch].long()
    verified_end = torch.maximum(starts[:-1], starts[1:] - rejected)  # [B]
    if num_rejected is None:
        ctx_rows, ctx_slots = rows, slot_mapping[:num_rows].clone()
    else:
        request = torch.searchsorted(starts[1:], rows, right=True).clamp_(max=max(batch - 1, 0))
        verified = (rows < verified_end[request]) & (rows >= starts[0]) if batch else rows < 0
        if compact:
            ctx_rows = verified.nonzero().squeeze(1)
            ctx_slots = slot_mapping[ctx_rows]
        else:
            ctx_rows = rows
            ctx_slots = torch.where(verified, slot_mapping[:num_rows], -1)
    ctx_positions = target_positions[ctx_rows]

    has_verified = verified_end > starts[:-1]
    last = (verified_end - 1).clamp(min=0, max=max(num_rows - 1, 0))
    first = starts[:-1].clamp(max=max(num_rows - 1, 0))
    if num_rows > 0:
        start = torch.where(has_verified, target_positions[last] + 1, torch.where(starts[:-1] < num_rows, target_positions[first], 0))
    else:
        start = torch.zeros(batch, dtype=torch.int64, device=device)
    positions = (start[:, None] + torch.arange(q_len, device=device)).reshape(-1)
    input_ids = torch.full((batch, q_len), mask_token_id, dtype=torch.int32, device=device)
    input_ids[:, 0] = next_token_ids.to(torch.int32)
    block_idx = (positions // block_size).clamp_(max=block_table.shape[1] - 1)
    blocks = block_table[:batch].gather(1, block_idx.view(batch, q_len)).view(-1)
    return DFlashStepInputs(
        context_rows=ctx_rows,
        context_positions=ctx_positions,
        context_slots=ctx_slots,
        input_ids=input_ids.view(-1),
        positions=positions,
        slots=blocks.long() * block_size + positions % block_size,
        seq_lens=(start + q_len).to(torch.int32),
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len,
    )


# --------------------------------------------------------------------------
# rejection_sample
# --------------------------------------------------------------------------


PLACEHOLDER_TOKEN_ID = -1


def acceptance(p_x: torch.Tensor, q_x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Accept x with probability min(1, p(x)/q(x)); float64 so u = 0 and q = 0 stay exact."""
    return uniforms * q_x.double() < p_x.double()


def residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor, use_q: torch.Tensor) -> torch.Tensor:
    """Unnormalized recovery distribution: max(0, p - q), or p without x for point-mass drafts.

    Rows where `use_q` is False (bonus tokens, padded drafts) keep p unchanged.
    Negative entries are left in place; the race ignores every entry <= 0.
    """
    if q is not None:
        return torch.where(use_q[:, None], p - q, p)
    removed = torch.zeros_like(p, dtype=torch.bool)
    removed[torch.arange(p.shape[0], device=p.device), x.clamp(0, p.shape[1] - 1)] = True
    return p.masked_fill(removed & use_q[:, None], 0.0)


def exponential_race(weights: torch.Tensor, exp_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax_v weights(v) / e_v over entries with weights > 0; (index, found)."""
    scores = torch.where(weights > 0, weights / exp_noise, torch.zeros_like(weights))
    # argmax (not max) because only argmax documents "first maximal index".
    return scores.argmax(dim=-1), scores.amax(dim=-1) > 0


def sample_rows(weights: torch.Tensor, p: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Race on `weights`; rows left empty by rounding race on p, then take argmax p."""
    index, found = exponential_race(weights, exp_noise)
    from_p, found_p = exponential_race(p, exp_noise)
    return torch.where(found, index, torch.where(found_p, from_p, p.argmax(dim=-1)))


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [T] int
    cu_num_draft_tokens: torch.Tensor,  # [B] int, inclusive cumulative counts
    target_probs: torch.Tensor,  # [T + B, V] (bonus sampled here) or [T, V] float32
    draft_probs: torch.Tensor | None,  # [T, V] float32, None = point-mass drafts
    bonus_token_ids: torch.Tensor | None,  # [B] int, None = sample it from p_n
    is_greedy: torch.Tensor | None,  # [B] bool, None = every row greedy
    uniforms: torch.Tensor | None,  # [T] float64, needed unless all greedy
    exp_noise: torch.Tensor | None,  # [B, V] float32 Exp(1), needed unless all greedy
    max_spec_len: int,
) -> torch.Tensor:
    """Returns [B, max_spec_len + 1] int32 tokens, PLACEHOLDER_TOKEN_ID after the last one.

    Greedy rows only use the argmax of their target rows, so callers may pass
    logits there (keeps argmax ties identical to vLLM's non-speculative path).
    """
    device = target_probs.device
    batch, vocab = cu_num_draft_tokens.shape[0], target_probs.shape[1]
    num_tokens = draft_token_ids.shape[0]
    cu = cu_num_draft_tokens.long()
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    starts = cu - num_drafts
    rows_offset = (torch.arange(batch, device=device) if bonus_token_ids is None
                   else torch.zeros(batch, dtype=torch.long, device=device))

    positions = torch.arange(max_spec_len, device=device)
    valid = positions[None, :] < num_drafts[:, None]  # [B, K]
    token_idx = torch.where(valid, starts[:, None] + positions, num_tokens)  # pad -> index T
    padded_drafts = torch.cat([draft_token_ids.long(), draft_token_ids.new_full((1,), -1).long()])
    drafts = padded_drafts[token_idx]  # [B, K], -1 where invalid
    in_vocab = (drafts >= 0) & (drafts < vocab)
    safe_drafts = drafts.clamp(0, vocab - 1)

    num_rows = target_probs.shape[0]
    target_rows = (token_idx + rows_offset[:, None]).clamp(max=max(num_rows - 1, 0))
    greedy = (torch.ones(batch, dtype=torch.bool, device=device) if is_greedy is None
              else is_greedy.bool())

    argmax_rows = target_probs.argmax(dim=-1) if num_rows > 0 else target_probs.new_zeros(0, dtype=torch.long)
    if num_rows > 0 and max_spec_len > 0:
        accepted = drafts == argmax_rows[target_rows]
        if is_greedy is not None:
            p_x = target_probs[target_rows, safe_drafts]
            q_x = (draft_probs[token_idx.clamp(max=max(num_tokens - 1, 0)), safe_drafts]
                   if draft_probs is not None else torch.ones_like(p_x))
            padded_uniforms = torch.cat([uniforms.double(), uniforms.new_ones(1).double()])
            sampled_ok = in_vocab & acceptance(p_x, q_x, padded_uniforms[token_idx])
            accepted = torch.where(greedy[:, None], accepted, sampled_ok)
        accepted &= valid
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    rejected = num_accepted < num_drafts

    # The token after the accepted prefix: recovery if rejected, else the bonus.
    final_token_idx = (starts + num_accepted).clamp(max=max(num_tokens - 1, 0))
    needs_row = rejected | (bonus_token_ids is None)
    final_rows = torch.where(needs_row, starts + num_accepted + rows_offset, 0).clamp(max=max(num_rows - 1, 0))
    if num_rows > 0:
        final = argmax_rows[final_rows]
    else:
        final = torch.zeros(batch, dtype=torch.long, device=device)
    if is_greedy is not None and num_rows > 0:
        p = target_probs[final_rows]
        final_draft = padded_drafts[torch.where(rejected, starts + num_accepted, num_tokens)]
        use_q = rejected & (final_draft >= 0) & (final_draft < vocab)
        q = draft_probs[final_token_idx] if draft_probs is not None and num_tokens > 0 else None
        weights = residual(p, q, final_draft, use_q)
        sampled = sample_rows(weights, p, exp_noise)
        final = torch.where(greedy, final, sampled)
    if bonus_token_ids is not None:
        final = torch.where(rejected, final, bonus_token_ids.reshape(-1).long())

    columns = torch.arange(max_spec_len + 1, device=device)
    prefix = torch.cat([drafts, drafts.new_full((batch, 1), -1)], dim=1)
    out = torch.where(columns[None, :] < num_accepted[:, None], prefix,
                      torch.where(columns[None, :] == num_accepted[:, None], final[:, None],
                                  PLACEHOLDER_TOKEN_ID))
    return out.to(torch.int32)
