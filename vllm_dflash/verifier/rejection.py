"""Entry points of the verifier: argument checks, noise, and the accept / recover op.

`rejection_sample` checks and casts its arguments, then runs
`vllm_dflash.ops.rejection_sample` (C++/OpenMP on CPU, CUDA on GPU, the
pure-torch reference where the ops' dispatch policy says so); all give
identical tokens for the same noise. `draw_noise` makes that noise the way vLLM does, from each request's
seeded generator when it has one. `verify` chains logits processing, noise and
rejection sampling for callers outside vLLM (tests, benchmarks).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from vllm_dflash import ops
from vllm_dflash.ops import dispatch, reference
from vllm_dflash.verifier import sampling_params

IMPLS = ("auto", "native", "reference")


def _need(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ValueError(f"rejection_sample: {field} {message}")


def _check(draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs, bonus_token_ids,
           is_greedy, uniforms, exp_noise, max_spec_len) -> None:
    _need(draft_token_ids.dim() == 1, "draft_token_ids", "must be 1-D [num_tokens]")
    _need(cu_num_draft_tokens.dim() == 1, "cu_num_draft_tokens", "must be 1-D [batch]")
    _need(not draft_token_ids.is_floating_point(), "draft_token_ids", "must hold integer token ids")
    _need(target_probs.dim() == 2, "target_probs", "must be 2-D [rows, vocab]")
    num_tokens, batch = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0]
    vocab = target_probs.shape[1]
    rows = num_tokens + (0 if bonus_token_ids is not None else batch)
    _need(target_probs.shape[0] == rows, "target_probs",
          f"must have {rows} rows (one per draft token"
          f"{'' if bonus_token_ids is not None else ' plus one bonus row per request'}), "
          f"got {target_probs.shape[0]}; pass bonus_token_ids to drop the bonus rows")
    _need(max_spec_len >= 0, "max_spec_len", "must be >= 0")
    if draft_probs is not None:
        _need(tuple(draft_probs.shape) == (num_tokens, vocab), "draft_probs",
              f"must be [{num_tokens}, {vocab}], got {list(draft_probs.shape)}")
    if bonus_token_ids is not None:
        _need(bonus_token_ids.numel() == batch, "bonus_token_ids", f"must have {batch} entries")
    if is_greedy is not None:
        _need(tuple(is_greedy.shape) == (batch,), "is_greedy", f"must be [{batch}] bool")
        _need(uniforms is not None and exp_noise is not None, "uniforms/exp_noise",
              "are required when some rows sample (is_greedy given); draw them with draw_noise()")
        _need(tuple(uniforms.shape) == (num_tokens,), "uniforms", f"must be [{num_tokens}]")
        _need(tuple(exp_noise.shape) == (batch, vocab), "exp_noise", f"must be [{batch}, {vocab}]")
    for name, t in (("draft_token_ids", draft_token_ids), ("cu_num_draft_tokens", cu_num_draft_tokens),
                    ("draft_probs", draft_probs), ("bonus_token_ids", bonus_token_ids),
                    ("is_greedy", is_greedy), ("uniforms", uniforms), ("exp_noise", exp_noise)):
        if t is not None:
            _need(t.device == target_probs.device, name, f"must be on {target_probs.device}, got {t.device}")
    if cu_num_draft_tokens.device.type == "cpu" and batch > 0:  # content checks cost a sync elsewhere
        counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
        _need(bool((counts >= 0).all()) and int(counts.max()) <= max_spec_len, "cu_num_draft_tokens",
              f"must be non-decreasing with per-request counts <= max_spec_len ({max_spec_len})")
        _need(int(cu_num_draft_tokens[-1]) == num_tokens, "cu_num_draft_tokens",
              f"must end at len(draft_token_ids) = {num_tokens}")


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    bonus_token_ids: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
    max_spec_len: int | None = None,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Verify draft tokens; [B, max_spec_len + 1] int32 with -1 after the emitted tokens.

    Semantics and argument layout: `vllm_dflash.ops.reference.rejection_sample_ref`.
    Inputs are cast to the op's dtypes (int32 ids, float32 probabilities,
    float64 uniforms). impl: "auto" (the ops' dispatch policy), "native" (raise
    if the kernel is missing), "reference".
    """
    _need(impl in IMPLS, "impl", f"must be one of {IMPLS}, got {impl!r}")
    if max_spec_len is None:
        counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
        max_spec_len = int(counts.max()) if counts.numel() else 0
    _check(draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs, bonus_token_ids,
           is_greedy, uniforms, exp_noise, max_spec_len)
    args = (
        draft_token_ids.to(torch.int32).contiguous(),
        cu_num_draft_tokens.to(torch.int32).contiguous(),
        target_probs.to(torch.float32).contiguous(),
        None if draft_probs is None else draft_probs.to(torch.float32).contiguous(),
        None if bonus_token_ids is None else bonus_token_ids.reshape(-1).to(torch.int32).contiguous(),
        None if is_greedy is None else is_greedy.to(torch.bool).contiguous(),
        None if uniforms is None else uniforms.to(torch.float64).contiguous(),
        None if exp_noise is None else exp_noise.to(torch.float32).contiguous(),
        int(max_spec_len),
    )
    device_type = target_probs.device.type
    if impl == "reference":
        return reference.rejection_sample_ref(*args)
    if impl == "native":
        if not dispatch.has_kernel("rejection_sample", device_type):
            raise ValueError(f"rejection_sample: impl='native' but vllm_dflash._C has no {device_type} kernel; "
                             "build it with `pip install --no-build-isolation -e .` or use impl='auto'")
        return torch.ops.vllm_dflash.rejection_sample(*args)
    return ops.rejection_sample(*args)


def draw_noise(
    num_draft_tokens: Sequence[int],
    vocab_size: int,
    generators: dict[int, torch.Generator] | None,
    device: torch.device | str,
    *,
    bonus_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [T] float64, exp_noise [B, V] float32 Exp(1)), as vLLM draws them.

    Requests with a generator (a seed) draw their slice from it, uniforms first
    and exponentials second, and, like vLLM, draw nothing when they have no
    draft token, unless `bonus_rows` (the verifier then samples their bonus).
    float64 uniforms keep u = 0 rare (pytorch#16706, as in vLLM).
    """
    generators = generators or {}
    uniforms = torch.rand(sum(num_draft_tokens), dtype=torch.float64, device=device)
    exp_noise = torch.empty(len(num_draft_tokens), vocab_size, dtype=torch.float32, device=device)
    exp_noise.exponential_()
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    for b, generator in sorted(generators.items()):
        n = num_draft_tokens[b]
        if n > 0:
            uniforms[starts[b]:starts[b] + n].uniform_(generator=generator)
    for b, generator in sorted(generators.items()):
        if num_draft_tokens[b] > 0 or bonus_rows:
            exp_noise[b].exponential_(generator=generator)
    return uniforms, exp_noise


def verify(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    target_logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Logits in, tokens out: target_logits holds n_b + 1 rows per request (drafts, then bonus).

    Per-request [B] parameters; temperature None means every request is greedy.
    draft_probs [T, V] must be the distributions the drafts were sampled from
    (sampled at the draft's processed distribution); None means argmax drafts.
    """
    num_draft_tokens = [int(n) for n in num_draft_tokens]
    batch, device = len(num_draft_tokens), target_logits.device
    rows = [n + 1 for n in num_draft_tokens]
    _need(target_logits.dim() == 2 and target_logits.shape[0] == sum(rows), "target_logits",
          f"must be [{sum(rows)}, vocab] (num_draft_tokens + 1 rows per request)")
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        _need(t is None or tuple(t.shape) == (batch,), name, f"must be None or [{batch}] per-request values")
    expand = functools.partial(sampling_params.expand_per_request, rows_per_request=rows)
    logits = sampling_params.process_logits(
        target_logits.float().clone(), expand(temperature), expand(top_k), expand(top_p), expand(min_p))
    greedy = sampling_params.greedy_mask(temperature, batch, device)
    all_greedy = bool(greedy.all())
    target = sampling_params.target_for_verifier(
        logits, expand(greedy), all_greedy=all_greedy, all_random=not bool(greedy.any()))
    uniforms = exp_noise = None
    if not all_greedy:
        uniforms, exp_noise = draw_noise(num_draft_tokens, logits.shape[1], generators, device, bonus_rows=True)
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return rejection_sample(
        draft_token_ids, cu, target, draft_probs, None, None if all_greedy else greedy,
        uniforms, exp_noise, max(num_draft_tokens, default=0), impl=impl)
