"""Acceptance length (tau) of a drafter, measured with the reference speculative loop.

tau = tokens emitted per target verification round (accepted drafts + the bonus
token), pooled over all rounds of a category's prompts. Greedy by default, as in
the paper's headline numbers. Loss and accuracy only predict tau; this measures it.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

from vllm_dflash.reference.spec_decode import spec_generate
from vllm_dflash.training.data import Prompt


def measure_tau(target, draft, prompts: list[Prompt], max_new_tokens: int = 128,
                stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                block_size: int | None = None, seed: int = 0, progress: bool = True) -> dict:
    """{category: {"tau", "rounds", "tokens", "prompts"}} plus an "all" entry."""
    if not prompts:
        raise ValueError("no evaluation prompts; pass --eval-prompts with at least one prompt")
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])   # emitted, rounds, prompts
    for p in tqdm(prompts, desc="measuring tau", unit="prompt", disable=not progress, leave=False):
        ids = torch.tensor([p.prompt_ids], device=device)
        result = spec_generate(target, draft, ids, max_new_tokens, block_size=block_size,
                               temperature=temperature, stop_token_ids=stop_token_ids, generator=generator)
        for cat in (p.category, "all"):
            sums[cat][0] += sum(result.acceptance_lengths)
            sums[cat][1] += len(result.acceptance_lengths)
            sums[cat][2] += 1
    return {cat: {"tau": (e / r if r else float("nan")), "rounds": r, "tokens": e, "prompts": n}
            for cat, (e, r, n) in sorted(sums.items())}


def format_tau(result: dict) -> str:
    return "  ".join(f"{cat}={v['tau']:.2f}" for cat, v in result.items())
