"""Pure-torch rejection sampling: the specification the native kernels match bit for bit.

One request row holds n draft tokens x_0..x_{n-1} (n <= max_spec_len) and target
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

import torch

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


def rejection_sample_reference(
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
