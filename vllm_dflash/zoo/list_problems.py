"""Seeded synthetic list tasks with worked answers: the `math` category of the `unix` corpus.

Sorting, extremes, running sums, counting and reversing: answers copy and reorder
what the prompt holds, a different skill from the stdlib corpus's word problems.
Problem `i` of a stream depends only on (seed, stream, i), like `math_problems`.
"""

from __future__ import annotations

import random

from vllm_dflash.zoo.math_problems import ANSWER_PREFIX, distinct_problems

WORDS = ("river", "stone", "cloud", "maple", "ember", "frost", "harbor", "lantern", "meadow", "orbit",
         "pebble", "quartz", "raven", "saddle", "timber", "velvet", "willow", "yarrow", "zephyr", "anchor",
         "basil", "cedar", "delta", "falcon", "garnet", "hazel", "island", "juniper", "kettle", "lotus")


def _numbers(r: random.Random, low: int = 3, high: int = 9) -> list[int]:
    return [r.randint(1, 99) for _ in range(r.randint(low, high))]


def _sort(r: random.Random) -> tuple[str, str]:
    xs = _numbers(r)
    descending = r.random() < 0.4
    order = "descending" if descending else "ascending"
    out = sorted(xs, reverse=descending)
    prompt = f"Sort the numbers {', '.join(map(str, xs))} in {order} order."
    steps = [f"There are {len(xs)} numbers.",
             f"{'Largest' if descending else 'Smallest'} first: {', '.join(map(str, out))}."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{', '.join(map(str, out))}"])


def _extremes(r: random.Random) -> tuple[str, str]:
    xs = _numbers(r, 4, 10)
    prompt = f"What are the largest and the smallest of {', '.join(map(str, xs))}?"
    steps = [f"Largest: {max(xs)}.", f"Smallest: {min(xs)}.",
             f"Difference: {max(xs)} - {min(xs)} = {max(xs) - min(xs)}."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{max(xs)} and {min(xs)}"])


def _running_sum(r: random.Random) -> tuple[str, str]:
    xs = _numbers(r, 3, 7)
    prompt = f"Add up {', '.join(map(str, xs))} step by step."
    steps, total = [f"Start with {xs[0]}."], xs[0]
    for x in xs[1:]:
        steps.append(f"{total} + {x} = {total + x}.")
        total += x
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{total}"])


def _count_word(r: random.Random) -> tuple[str, str]:
    pool = r.sample(WORDS, r.randint(2, 4))
    items = [r.choice(pool) for _ in range(r.randint(5, 12))]
    word = r.choice(pool)
    prompt = f"How many times does '{word}' appear in: {' '.join(items)}?"
    hits = [str(i + 1) for i, w in enumerate(items) if w == word]
    steps = [f"The list has {len(items)} words.",
             f"'{word}' is at positions {', '.join(hits)}." if hits else f"'{word}' does not appear."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{len(hits)}"])


def _reverse(r: random.Random) -> tuple[str, str]:
    items = r.sample(WORDS, r.randint(3, 7))
    prompt = f"Reverse the list: {', '.join(items)}."
    steps = [f"The last word is {items[-1]} and the first is {items[0]}.",
             f"Reversed: {', '.join(reversed(items))}."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{', '.join(reversed(items))}"])


TEMPLATES = (_sort, _extremes, _running_sum, _count_word, _reverse)


def problem(seed: int, stream: str, index: int) -> tuple[str, str]:
    """Task `index` of the named stream: (question, worked answer)."""
    r = random.Random(f"{seed}/lists/{stream}/{index}")
    return r.choice(TEMPLATES)(r)


def problems(seed: int, stream: str, count: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """`count` distinct tasks of a stream whose questions are not in `exclude`."""
    return distinct_problems(lambda i: problem(seed, stream, i), count, exclude)
