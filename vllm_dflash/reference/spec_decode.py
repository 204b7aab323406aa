"""Reference DFlash speculative decoding loop (batch 1, plain PyTorch + transformers).

One round, with `start` = position of the last verified token `t`:

    1. draft: block [t, MASK x (B-1)] at positions [start, start+B); the new
       context (target features of tokens verified last round) is projected
       and its K/V appended to the draft's context cache; one forward gives
       B-1 draft tokens (argmax, or samples at T > 0).
    2. verify: the target runs the block [t, d1..d(B-1)] in one forward on
       its KV cache.
    3. accept: the longest prefix of drafts the target agrees with, plus one
       bonus token from the target; the target cache is cropped to the
       verified tokens and their features become the next round's context.

Greedy output equals the target's own greedy output token for token. At
T > 0 drafts are treated as a point mass (accept draft x with probability
p(x), else sample from p with x removed): the output is distributed exactly
as the target's samples, whatever the draft proposes, and no draft
probabilities are needed (as vLLM's default `draft_sample_method="greedy"`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_dflash.config import validate_draft_config
from vllm_dflash.reference.features import TargetFeatures
from vllm_dflash.reference.model import ContextKVCache, DFlashDraftModel


@dataclass
class SpecResult:
    """Outcome of one `spec_generate` call.

    output_ids: generated tokens (prompt excluded), at most max_new_tokens,
        ending at the first stop token if one was produced.
    acceptance_lengths: per round, tokens emitted by that target forward
        (accepted drafts + the bonus token), in [1, B]; truncation by
        max_new_tokens / stop tokens is applied, so
        `1 + sum(acceptance_lengths) == len(output_ids)` (the 1 is the prefill token).
    draft_tokens_per_step: the B-1 draft tokens proposed in each round.
    """

    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_tokens_per_step: list[list[int]] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: mean tokens per verification round (counts the bonus token)."""
        if not self.acceptance_lengths:
            return float("nan")
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


def _check_inputs(input_ids: torch.Tensor, max_new_tokens: int, temperature: float) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}; the reference loop takes one "
            "prompt of shape [1, n] with n >= 1"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")


def _sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Argmax at T = 0, else a sample of softmax(logits / T); logits [..., V] -> [...]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def _crop_target_cache(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # negative: remove this many tokens (transformers 4 and 5)


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> list[int]:
    """Tokens emitted for drafts [B-1] given target logits [B, V] of [t, d1..d(B-1)]."""
    posterior = target_logits.argmax(dim=-1).tolist()
    emitted = []
    for draft_token, target_token in zip(drafts, posterior, strict=False):
        if draft_token != target_token:
            break
        emitted.append(draft_token)
    emitted.append(posterior[len(emitted)])
    return emitted


def verify_sampled(
    drafts: list[int],
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling with the draft as a point mass: accept x w.p. p(x)."""
    probs = torch.softmax(target_logits.float() / temperature, dim=-1)
    emitted = []
    for i, x in enumerate(drafts):
        p = probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u < p[x]:
            emitted.append(x)
            continue
        residual = p.clone()
        residual[x] = 0.0
        emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return emitted


def draft_block(
    draft: DFlashDraftModel,
    target: nn.Module,
    last_token: int,
    new_context: torch.Tensor,
    start: int,
    block_size: int,
    kv_cache: ContextKVCache,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Propose B-1 tokens after `last_token` (at position `start`).

    new_context [1, c, L*D]: target features of positions [start - c, start),
    not yet in `kv_cache`.
    """
    device = new_context.device
    dtype = next(draft.parameters()).dtype
    block = torch.full((1, block_size), draft.mask_token_id, dtype=torch.long, device=device)
    block[0, 0] = last_token
    noise = target.get_input_embeddings()(block).to(dtype)
    context = draft.project_context(new_context.to(dtype))
    positions = torch.arange(kv_cache.length, start + block_size, device=device)[None]
    hidden = draft(noise, context, positions, kv_cache=kv_cache)
    lm_head = target.get_output_embeddings()
    logits = lm_head(hidden[:, 1:].to(lm_head.weight.dtype))
    return _sample(logits[0], temperature, generator).tolist()


@torch.inference_mode()
def spec_generate(
    target: nn.Module,
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int | None = None,
    temperature: float = 0.0,
    stop_token_ids: Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """DFlash speculative decoding of one prompt with an HF target and a reference draft."""
    from transformers import DynamicCache

    _check_inputs(input_ids, max_new_tokens, temperature)
    validate_draft_config(draft.config, target.config)
    block_size = block_size or draft.block_size
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2 (last token + at least one draft)")
    stop = set(stop_token_ids or ())
    result = SpecResult()
    out = result.output_ids

    def emit(tokens: list[int]) -> int:
        """Append tokens up to max_new_tokens / the first stop token; return how many."""
        n = 0
        for token in tokens[: max_new_tokens - len(out)]:
            out.append(token)
            n += 1
            if token in stop:
                break
        return n

    def done() -> bool:
        return len(out) >= max_new_tokens or (bool(out) and out[-1] in stop)

    target_cache = DynamicCache(config=target.config)
    kv_cache = draft.new_kv_cache()
    with TargetFeatures(target, draft.target_layer_ids) as features:
        prefill = target(
            input_ids=input_ids, past_key_values=target_cache, use_cache=True, logits_to_keep=1
        )
        new_context = features.pop()
        emit([int(_sample(prefill.logits[0, -1], temperature, generator))])
        start = input_ids.shape[1]
        while not done():
            drafts = draft_block(
                draft,
                target,
                out[-1],
                new_context,
                start,
                block_size,
                kv_cache,
                temperature,
                generator,
            )
            result.draft_tokens_per_step.append(drafts)
            block = torch.tensor([[out[-1], *drafts]], device=input_ids.device)
            positions = torch.arange(start, start + block_size, device=input_ids.device)[None]
            verify = target(
                input_ids=block,
                position_ids=positions,
                past_key_values=target_cache,
                use_cache=True,
            )
            logits = verify.logits[0]
            if temperature == 0:
                accepted = verify_greedy(drafts, logits)
            else:
                accepted = verify_sampled(drafts, logits, temperature, generator)
            result.acceptance_lengths.append(emit(accepted))
            # Verified tokens: t and the accepted drafts; the bonus token comes next round.
            num_verified = len(accepted)
            _crop_target_cache(target_cache, start + num_verified)
            new_context = features.pop()[:, :num_verified]
            start += num_verified
    return result


@torch.inference_mode()
def target_greedy_generate(
    target: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
) -> list[int]:
    """Plain greedy decoding, one token per forward: what greedy spec decoding must equal."""
    from transformers import DynamicCache

    _check_inputs(input_ids, max_new_tokens, 0.0)
    stop = set(stop_token_ids or ())
    cache = DynamicCache(config=target.config)
    logits = target(
        input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1
    ).logits
    out: list[int] = []
    while True:
        token = int(logits[0, -1].argmax())
        out.append(token)
        if len(out) >= max_new_tokens or token in stop:
            return out
        step = torch.tensor([[token]], device=input_ids.device)
        logits = target(input_ids=step, past_key_values=cache, use_cache=True).logits
