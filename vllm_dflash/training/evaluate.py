"""Acceptance length (tau) of a drafter, measured with the reference speculative loop.

tau = tokens emitted per target verification round (accepted drafts + the bonus
token), pooled over all rounds of a category's prompts. Greedy by default, as in
the paper's headline numbers. Loss and accuracy only predict tau; this measures it.

Every round is also filed by its context length (the tokens before its block),
so the report shows how tau holds up as the context grows. A conversation prompt
is decoded turn by turn, each turn's prompt holding the earlier turns and the
target's own answers, which is how long contexts arise in chat.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

from vllm_dflash.reference.spec_decode import spec_generate
from vllm_dflash.training import conversations
from vllm_dflash.training.data import Prompt
from vllm_dflash.training.tau_estimate import BUCKET_EDGES, bucket_name, bucket_names


def _turn_results(target, draft, p: Prompt, tokenizer, max_new_tokens, stops, temperature, block_size, generator):
    """(prompt_len, SpecResult) per turn of a prompt (one turn unless it is a conversation)."""
    device = next(target.parameters()).device
    max_pos = getattr(target.config.get_text_config(), "max_position_embeddings", None) or float("inf")
    answers, out = [], []
    for turn in range(p.turns):
        ids = p.prompt_ids if turn == 0 else conversations.template_ids(
            tokenizer, conversations.turn_messages(p.messages, turn, answers))
        if turn > 0 and len(ids) + max_new_tokens > max_pos:
            break   # the rest of the conversation would run past the target's positions
        result = spec_generate(target, draft, torch.tensor([ids], device=device), max_new_tokens,
                               block_size=block_size, temperature=temperature, stop_token_ids=stops,
                               generator=generator)
        out.append((len(ids), result))
        if turn + 1 < p.turns:
            answers.append(tokenizer.decode(result.output_ids, skip_special_tokens=True))
    return out


def measure_tau(target, draft, prompts: list[Prompt], max_new_tokens: int = 128,
                stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                block_size: int | None = None, seed: int = 0, progress: bool = True,
                tokenizer=None, edges=BUCKET_EDGES) -> dict:
    """{category: {"tau", "rounds", "tokens", "prompts"}} plus an "all" entry, whose
    "by_context" maps context-length buckets to {"tau", "rounds", "tokens"}."""
    if not prompts:
        raise ValueError("no evaluation prompts; pass --eval-prompts with at least one prompt")
    if any(p.turns > 1 for p in prompts) and tokenizer is None:
        raise ValueError("conversation prompts need the target's tokenizer to build their later turns")
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])   # emitted, rounds, prompts
    by_context = {name: [0, 0] for name in bucket_names(edges)}
    for p in tqdm(prompts, desc="measuring tau", unit="prompt", disable=not progress, leave=False):
        for prompt_len, result in _turn_results(target, draft, p, tokenizer, max_new_tokens, stop_token_ids,
                                                temperature, block_size, generator):
            context = prompt_len   # round k's block starts after the prompt and the tokens verified so far
            for emitted in result.acceptance_lengths:
                cell = by_context[bucket_name(context, edges)]
                cell[0] += emitted
                cell[1] += 1
                context += emitted
            for cat in (p.category, "all"):
                sums[cat][0] += sum(result.acceptance_lengths)
                sums[cat][1] += len(result.acceptance_lengths)
        for cat in (p.category, "all"):
            sums[cat][2] += 1
    out = {cat: {"tau": (e / r if r else float("nan")), "rounds": r, "tokens": e, "prompts": n}
           for cat, (e, r, n) in sorted(sums.items())}
    out["all"]["by_context"] = {name: {"tau": (e / r if r else None), "rounds": r, "tokens": e}
                                for name, (e, r) in by_context.items()}
    return out


def format_tau(result: dict) -> str:
    return "  ".join(f"{cat}={v['tau']:.2f}" for cat, v in result.items())


def context_table(by_context: dict) -> str:
    """Markdown table of tau by context-length bucket."""
    rows = ["| context tokens | tau | rounds | tokens |", "|---|---|---|---|"]
    for name, cell in by_context.items():
        tau = "-" if cell["tau"] is None else f"{cell['tau']:.2f}"
        rows.append(f"| {name} | {tau} | {cell['rounds']:,} | {cell['tokens']:,} |")
    return "\n".join(rows)


def plot_by_context(by_context: dict, path: str, title: str) -> str:
    """Bar chart of tau per context bucket (rounds written on the bars), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(by_context)
    taus = [by_context[n]["tau"] or 0.0 for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(names, taus, color="#4c72b0")
    for bar, n in zip(bars, names):
        ax.annotate(f"{by_context[n]['rounds']} rounds", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("context length (tokens before the block)")
    ax.set_ylabel("tau (tokens per round)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
