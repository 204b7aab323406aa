"""What the end of a busy period costs a batch that drafted, per peak batch size.

Drafting puts requests out of step: each gains a different number of tokens
per step. When work stops arriving (the end of an offline batch, a lull in
serving), requests that would have finished together finish one by one, in
steps with fewer requests, which yield less for their time. No cycle shows
that cost: the arms (`realized.ArmRates`) compare cycles at one batch size.
Traced at 8 requests (float32, bundled pair, equal requests in three waves):
steps with all 8 requests drafting delivered 1414 tok/s against 1412 without
drafting, and the call lost 11% in the 208 steps with fewer requests after.

So each busy period (from the first step after the engine idled to the last
one before it idles again) is summed: its peak batch size P, the tokens and
seconds of its steps at P, and its drain, the steps after the last one at P.
The drain's loss, in tokens, is what the peak's rate would have produced in
the drain's time beyond the tokens it did produce. A period of N tokens that
lost L ran at rate(P) * N / (N + L). Per peak knot, kept apart for periods
that drafted at their peak and periods that did not (at most `no_draft_share`
of their steps at the peak drafted: exploration's share; some drafting puts
requests out of step for the rest of a period, so a period of 49 drafting
steps in 130 had drained like one that drafted throughout): the mean
loss of each kind and the mean tokens of a period (either kind: how much work
a busy period holds here). The controller scales drafting's value at that
batch size by `factor` = (N + L_none) / (N + L_draft): drafting pays only
where its measured advantage per cycle outlasts the drain it leaves, and the
longer the busy periods, the less the drain weighs (in steady serving, not at
all). A kind never measured counts no loss. While one kind runs, the other's
evidence fades, `stale_factor` times slower than it learns, and below
`min_weight` periods it counts as unmeasured again: a drain that once kept
drafting off is tried again, not kept for good.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dflash.adaptive.cost_model import nearest_knot


@dataclass
class _Period:
    """The open busy period's sums."""

    peak: int = 0  # the most requests in a step so far
    peak_tokens: float = 0.0  # tokens, seconds, steps and drafting steps at the peak
    peak_seconds: float = 0.0
    peak_steps: int = 0
    peak_drafted: int = 0
    drain_tokens: float = 0.0  # since the last step at the peak
    drain_seconds: float = 0.0
    tokens: float = 0.0  # the whole period


class DrainLoss:
    """See the module docstring. `step` takes every step of the open period in order;
    `end_period` closes it (the caller knows when the engine idled)."""

    def __init__(self, knots, memory: float = 8.0, stale_factor: float = 4.0, min_peak_steps: int = 4,
                 min_weight: float = 0.5, no_draft_share: float = 0.05):
        if (memory < 1 or stale_factor < 1 or min_peak_steps < 1 or not 0 < min_weight <= 1
                or not 0 <= no_draft_share < 1):
            raise ValueError("DrainLoss needs memory >= 1, stale_factor >= 1, min_peak_steps >= 1, "
                             "0 < min_weight <= 1 and 0 <= no_draft_share < 1")
        self.knots = [float(k) for k in knots]
        self.memory, self.stale_factor, self.min_peak_steps = float(memory), float(stale_factor), min_peak_steps
        self.min_weight, self.no_draft_share = float(min_weight), float(no_draft_share)
        # Per knot: forgetting sums [weight, tokens] of every period, and per kind (no draft,
        # drafted) [weight, lost tokens].
        self._periods = [[0.0, 0.0] for _ in self.knots]
        self._losses = [[[0.0, 0.0], [0.0, 0.0]] for _ in self.knots]
        self._open = _Period()
        self.periods_seen = 0

    def step(self, requests: int, drafted: bool, seconds: float, tokens: float) -> None:
        """A step of the open period: `requests` requests, `tokens` output in `seconds`;
        `drafted`: the cycle verified drafts (their drafting time is in `seconds`)."""
        if requests <= 0 or seconds <= 0:
            return
        p = self._open
        p.tokens += tokens
        if requests > p.peak:
            p.peak, p.peak_tokens, p.peak_seconds, p.peak_steps, p.peak_drafted = requests, 0.0, 0.0, 0, 0
        if requests == p.peak:
            p.peak_tokens += tokens
            p.peak_seconds += seconds
            p.peak_steps += 1
            p.peak_drafted += int(drafted)
            p.drain_tokens = p.drain_seconds = 0.0  # a dip the peak came back from was no drain
        else:
            p.drain_tokens += tokens
            p.drain_seconds += seconds

    def end_period(self) -> None:
        """Close the open period: its loss goes to its peak's knot (a period of one request
        has no drain; one with fewer than `min_peak_steps` steps at its peak has no rate)."""
        p, self._open = self._open, _Period()
        if p.peak < 2 or p.peak_steps < self.min_peak_steps or p.peak_tokens <= 0:
            return
        lost = p.drain_seconds * p.peak_tokens / p.peak_seconds - p.drain_tokens
        i = nearest_knot(self.knots, p.peak)
        keep = 1.0 - 1.0 / self.memory
        self._periods[i] = [self._periods[i][0] * keep + 1.0, self._periods[i][1] * keep + p.tokens]
        kind = int(p.peak_drafted > self.no_draft_share * p.peak_steps)
        self._losses[i][kind] = [self._losses[i][kind][0] * keep + 1.0, self._losses[i][kind][1] * keep + lost]
        fade = 1.0 - 1.0 / (self.memory * self.stale_factor)
        self._losses[i][1 - kind] = [v * fade for v in self._losses[i][1 - kind]]
        self.periods_seen += 1

    def lost_tokens(self, requests: int) -> tuple[float, float, float]:
        """(tokens of a period, tokens lost by a period without drafting, by one drafting)
        at this batch size's knot: means over the periods measured (0 where fewer than
        `min_weight` periods' evidence is left)."""
        i = nearest_knot(self.knots, requests)
        weight, tokens = self._periods[i]
        out = [tokens / weight if weight > 0 else 0.0]
        for w, lost in self._losses[i]:
            out.append(lost / w if w >= self.min_weight else 0.0)
        return out[0], out[1], out[2]

    def factor(self, requests: int) -> float:
        """Drafting's tokens per second at this batch size over a whole busy period, against
        its cycles' own: (N + L_none) / (N + L_draft); 1 where no period was measured."""
        tokens, lost_none, lost_draft = self.lost_tokens(requests)
        if tokens <= 0:
            return 1.0
        return (tokens + max(lost_none, 0.0)) / (tokens + max(lost_draft, 0.0))
