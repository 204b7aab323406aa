"""Seeded synthetic arithmetic word problems with step-by-step worked answers.

Every solution ends with the line `Answer: <number>`, so a model's output can be
checked for structure (and value) without a reference. Problem `i` of a stream
depends only on (seed, stream, i), so held-out problems never move when the
training set grows.
"""

from __future__ import annotations

import random

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jack",
         "Kara", "Leo", "Maya", "Noah", "Olga", "Paul", "Quinn", "Rosa", "Sam", "Tara")
ITEMS = (("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("book", "books"),
         ("ticket", "tickets"), ("sandwich", "sandwiches"), ("cup", "cups"), ("ball", "balls"),
         ("candle", "candles"), ("shirt", "shirts"), ("lamp", "lamps"), ("plant", "plants"))
THINGS = (("marble", "marbles"), ("stamp", "stamps"), ("card", "cards"), ("coin", "coins"),
          ("sticker", "stickers"), ("shell", "shells"), ("cookie", "cookies"), ("egg", "eggs"))
ANSWER_PREFIX = "Answer: "


def _shopping(r: random.Random) -> tuple[str, str]:
    name = r.choice(NAMES)
    (a1, a2), (b1, b2) = r.sample(ITEMS, 2)
    na, pa, nb, pb = r.randint(2, 9), r.randint(2, 25), r.randint(2, 9), r.randint(1, 15)
    ta, tb = na * pa, nb * pb
    total = ta + tb
    prompt = (f"{name} buys {na} {a2} at ${pa} each and {nb} {b2} at ${pb} each. "
              "How much does it cost in total?")
    steps = [f"The {a2} cost {na} x {pa} = {ta} dollars.",
             f"The {b2} cost {nb} x {pb} = {tb} dollars.",
             f"Total: {ta} + {tb} = {total} dollars."]
    if r.random() < 0.5:
        paid = (total // 10 + 1 + r.randint(0, 5)) * 10
        prompt = prompt.replace("How much does it cost in total?",
                                f"{name} pays with ${paid}. How much change does {name} get?")
        steps.append(f"Change: {paid} - {total} = {paid - total} dollars.")
        total = paid - total
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{total}"])


def _multi_step(r: random.Random) -> tuple[str, str]:
    name = r.choice(NAMES)
    one, many = r.choice(THINGS)
    start, lost = r.randint(20, 200), r.randint(1, 19)
    boxes, per_box = r.randint(2, 9), r.randint(2, 12)
    after = start - lost
    gained = boxes * per_box
    total = after + gained
    prompt = (f"{name} has {start} {many}. {name} gives away {lost}, then gets {boxes} packs "
              f"of {per_box} {many} each. How many {many} does {name} have now?")
    steps = [f"After giving away: {start} - {lost} = {after}.",
             f"New {many}: {boxes} x {per_box} = {gained}.",
             f"Now: {after} + {gained} = {total}."]
    if r.random() < 0.4:
        friends = r.choice([d for d in range(2, 10) if total % d == 0] or [1])
        if friends > 1:
            prompt += f" Then {name} shares them equally among {friends} friends. How many does each friend get?"
            steps.append(f"Each friend: {total} / {friends} = {total // friends}.")
            total //= friends
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{total}"])


def _division(r: random.Random) -> tuple[str, str]:
    one, many = r.choice(THINGS)
    groups, each = r.randint(2, 12), r.randint(2, 25)
    total = groups * each
    extra = r.randint(0, groups - 1) if r.random() < 0.3 else 0
    prompt = (f"There are {total + extra} {many} to pack equally into {groups} boxes. "
              f"How many {many} go in each box" + (" and how many are left over?" if extra else "?"))
    if extra:
        steps = [f"{total + extra} / {groups} = {each} remainder {extra}.",
                 f"Each box gets {each} {many} and {extra} are left over."]
    else:
        steps = [f"{total} / {groups} = {each}."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{each}"])


# (unit, its singular, smaller unit, how many smaller units make one)
_UNITS = (("meters", "meter", "centimeters", 100), ("kilometers", "kilometer", "meters", 1000),
          ("hours", "hour", "minutes", 60), ("minutes", "minute", "seconds", 60),
          ("kilograms", "kilogram", "grams", 1000), ("liters", "liter", "milliliters", 1000),
          ("feet", "foot", "inches", 12), ("days", "day", "hours", 24), ("weeks", "week", "days", 7),
          ("dollars", "dollar", "cents", 100))


def _units(r: random.Random) -> tuple[str, str]:
    big, single, small, factor = r.choice(_UNITS)
    whole, part = r.randint(2, 40), r.randint(1, factor - 1)
    base = whole * factor
    if r.random() < 0.5:
        prompt = f"How many {small} are in {whole} {big} and {part} {small}?"
        steps = [f"1 {single} = {factor} {small}.",
                 f"{whole} x {factor} = {base} {small}.",
                 f"{base} + {part} = {base + part} {small}."]
        return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{base + part}"])
    prompt = f"Convert {base + part} {small} to {big} and {small}."
    steps = [f"1 {single} = {factor} {small}.",
             f"{base + part} / {factor} = {whole} remainder {part}.",
             f"So it is {whole} {big} and {part} {small}."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{whole} {big} {part} {small}"])


def _expression(r: random.Random) -> tuple[str, str]:
    a, b, c, d = r.randint(2, 99), r.randint(2, 99), r.randint(2, 9), r.randint(1, 99)
    op1 = r.choice("+-")
    s1 = a + b if op1 == "+" else a - b
    prod = s1 * c
    op2 = r.choice("+-")
    result = prod + d if op2 == "+" else prod - d
    prompt = f"Compute ({a} {op1} {b}) x {c} {op2} {d}."
    steps = [f"First the brackets: {a} {op1} {b} = {s1}.",
             f"Then multiply: {s1} x {c} = {prod}.",
             f"Then {prod} {op2} {d} = {result}."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{result}"])


def _rate(r: random.Random) -> tuple[str, str]:
    name = r.choice(NAMES)
    speed, hours, extra = r.randint(3, 90), r.randint(2, 9), r.randint(1, 60)
    d1 = speed * hours
    prompt = (f"{name} travels at {speed} km per hour for {hours} hours, then walks another "
              f"{extra} km. How far does {name} go in total?")
    steps = [f"Distance at speed: {speed} x {hours} = {d1} km.",
             f"Total: {d1} + {extra} = {d1 + extra} km."]
    return prompt, "\n".join(steps + [f"{ANSWER_PREFIX}{d1 + extra}"])


TEMPLATES = (_shopping, _multi_step, _division, _units, _expression, _rate)


def problem(seed: int, stream: str, index: int) -> tuple[str, str]:
    """Problem `index` of the named stream: (question, worked solution)."""
    r = random.Random(f"{seed}/{stream}/{index}")
    return r.choice(TEMPLATES)(r)


def problems(seed: int, stream: str, count: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """`count` distinct problems of a stream whose questions are not in `exclude`."""
    return distinct_problems(lambda i: problem(seed, stream, i), count, exclude)


def distinct_problems(make, count: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """The first `count` problems `make(0), make(1), ...` with new questions (not in `exclude`)."""
    out, seen, index = [], set(exclude), 0
    while len(out) < count:
        q, a = make(index)
        index += 1
        if q not in seen:
            seen.add(q)
            out.append((q, a))
        if index > 50 * count + 1000:
            raise ValueError(f"count={count}: cannot find that many distinct problems; lower it")
    return out
