"""How likely each draft position is to be accepted, learned online from verification.

A DFlash draft of length b for one request is accepted as a prefix: the
target keeps positions 1..a and rejects a+1 (a < b), or keeps all b. So the
quantity to model is the *conditional* acceptance

    p_j(c) = P(position j accepted | positions < j accepted, confidence c_j),

and the survival S_j = p_1 * ... * p_j is the probability that position j
yields a token. Position j of a draft verified with a accepted is observed
when j <= min(a + 1, b): accepted for j <= a, rejected for j = a + 1.
Positions after a + 1 (and after b) were never put to the target: they are
censored, never counted as failures.

Estimate (numpy, no vLLM): counts over (request kind, confidence bin,
position) with exponential forgetting (memory in observations, so the model
follows a workload that changes), shrunk toward the same bin pooled over
positions, whose own prior is the draft's confidence itself:

    p_bin  = (A_bin + s0 * prior) / (N_bin + s0)
    p_cell = (a_cell + s1 * p_bin) / (n_cell + s1)

`prior` is the probability the confidence feature stands for (the top-1
probability, or the two-way probability of the top-1/top-2 margin). Greedy
and sampled requests accept differently, so each kind has its own tables.

`RequestOffsets` shifts the shared estimate per request on the logit scale,
learned from that request's own outcomes (its text may be easier or harder
than the confidence says); `SurvivalPrior` holds what a draft is expected
to yield before it exists, for choosing how much to draft.
"""

from __future__ import annotations

import math

import numpy as np

GREEDY, SAMPLED = 0, 1
KIND_NAMES = ("greedy", "sampled")
# A request's own survival row below this weight is left out of its prior (`SurvivalPrior.rows`).
OWN_ROW_MIN_WEIGHT = 1e-3


def odds_against(p: np.ndarray) -> np.ndarray:
    """(1 - p) / p of probabilities `p`, kept 1e-6 off 0 and 1 first."""
    q = np.minimum(np.maximum(p, 1e-6), 1 - 1e-6)
    return (1.0 - q) / q


def logit_shifted(p: np.ndarray, shift) -> np.ndarray:
    """Probabilities `p` moved by `shift` on the logit scale (kept 1e-6 off 0 and 1 first)."""
    return 1.0 / (1.0 + odds_against(p) * np.exp(-shift))


class AcceptanceModel:
    """Conditional acceptance per (kind, confidence bin, position); see module docstring.

    Arguments are statistical, not machine constants: `num_bins` equal-width
    bins of the confidence feature in [0, 1]; `cell_strength` / `bin_strength`
    are the pseudo-observation weights of the two priors (16: a cell's own
    counts take over once they are about as precise as a binomial rate from
    16 observations, sd <= 0.125); `memory` is the number of observed
    positions after which old evidence has decayed to 1/e. Measured
    (scripts/adaptive_features.py, prequential log loss on the bundled pair):
    strengths 16 beat 4 for greedy and sampled drafts (0.413 vs 0.422,
    0.597 vs 0.607), and a position effect added on the logit scale did not
    help (0.411 / 0.599).
    """

    def __init__(self, num_positions: int, num_bins: int = 16, cell_strength: float = 16.0,
                 bin_strength: float = 16.0, memory: float = 10000.0):
        if num_positions < 1:
            raise ValueError(f"num_positions={num_positions} must be >= 1")
        if num_bins < 1 or cell_strength <= 0 or bin_strength <= 0 or memory <= 0:
            raise ValueError("num_bins >= 1, cell_strength > 0, bin_strength > 0 and memory > 0 are required")
        self.num_positions = num_positions
        self.num_bins = num_bins
        self.cell_strength = float(cell_strength)
        self.bin_strength = float(bin_strength)
        self.memory = float(memory)
        shape = (len(KIND_NAMES), num_bins, num_positions)
        self.accepted = np.zeros(shape)
        self.observed = np.zeros(shape)
        self._tables: tuple[np.ndarray, np.ndarray] | None = None  # see _linear_tables
        self._table_lists: tuple[list[float], list[float]] | None = None

    def bins(self, feature: np.ndarray) -> np.ndarray:
        """Bin index of each confidence value (values outside [0, 1] are clipped)."""
        idx = (np.asarray(feature, dtype=np.float64) * self.num_bins).astype(np.int64)
        return np.minimum(np.maximum(idx, 0), self.num_bins - 1)  # np.clip costs several times more here

    def conditional(self, kinds: np.ndarray, feature: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """[R, q] conditional acceptance of drafts with confidence `feature` [R, q]
        (the probability it stands for: `prior`), for requests of `kinds` [R]."""
        feature = np.asarray(feature, dtype=np.float64)
        rows, width = feature.shape
        if width > self.num_positions:
            raise ValueError(f"drafts of {width} positions; the model holds {self.num_positions}")
        alpha, beta = self._linear_tables()
        cell = (np.asarray(kinds, dtype=np.int64)[:, None] * self.num_bins + self.bins(feature)) * self.num_positions
        cell += np.arange(width)[None, :]
        return alpha[cell] + beta[cell] * prior

    def _linear_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Both shrinkage steps are linear in the prior, so per (kind, bin, position)
        p_cell = alpha + beta * prior, with

            p_bin  = u + v * prior,          u = A_bin / (N_bin + s0), v = s0 / (N_bin + s0)
            alpha  = (a + s1 * u) / (n + s1), beta = s1 * v / (n + s1)

        Recomputed after each update only; a step's lookup is then two gathers (this
        runs every engine step, where each numpy call counts)."""
        if self._tables is None:
            s0, s1 = self.bin_strength, self.cell_strength
            denom_bin = self.observed.sum(axis=2, keepdims=True) + s0
            u, v = self.accepted.sum(axis=2, keepdims=True) / denom_bin, s0 / denom_bin
            denom = self.observed + s1
            self._tables = (((self.accepted + s1 * u) / denom).ravel(), (s1 * v / denom).ravel())
        return self._tables

    def table_lists(self) -> tuple[list[float], list[float]]:
        """`_linear_tables` as Python lists (`few_requests`), made once per update."""
        if self._table_lists is None:
            alpha, beta = self._linear_tables()
            self._table_lists = (alpha.tolist(), beta.tolist())
        return self._table_lists

    def update(self, kinds: np.ndarray, feature: np.ndarray, num_verified: np.ndarray,
               num_accepted: np.ndarray) -> int:
        """Learn from verified drafts: request i's draft had confidences feature[i]
        (padded past its length), num_verified[i] of its positions went to the
        target and num_accepted[i] were accepted. Returns the number of observed positions."""
        feature = np.asarray(feature, dtype=np.float64)
        if feature.ndim != 2 or feature.shape[0] == 0:
            return 0
        n = np.asarray(num_verified, dtype=np.int64)
        a = np.asarray(num_accepted, dtype=np.int64)
        if ((a > n) | (a < 0) | (n > feature.shape[1])).any():
            raise ValueError(f"need 0 <= accepted <= verified <= {feature.shape[1]}: verified {n}, accepted {a}")
        pos = np.arange(feature.shape[1])[None, :]
        observed = pos < np.minimum(a + 1, n)[:, None]
        accepted = pos < a[:, None]
        count = int(observed.sum())
        if count == 0:
            return 0
        decay = np.exp(-count / self.memory)
        self.accepted *= decay
        self.observed *= decay
        kind = np.asarray(kinds, dtype=np.int64)[:, None]
        flat = (kind * self.num_bins + self.bins(feature)) * self.num_positions + pos
        size = self.observed.size
        self.observed += np.bincount(flat[observed], minlength=size).reshape(self.observed.shape)
        self.accepted += np.bincount(flat[accepted], minlength=size).reshape(self.accepted.shape)
        self._tables = self._table_lists = None
        return count


class RequestOffsets:
    """Per request, a shift of the conditional acceptance on the logit scale,
    learned from the request's own outcomes. The shared model maps confidence
    to acceptance over the whole workload; a request whose text is easier or
    harder than the draft's confidence says (prose vs math, say) accepts
    consistently above or below it. One Newton step from no shift:

        delta = sum(y - p) / (sum p (1 - p) + strength)

    over the request's observed positions (p: the shared model's prediction,
    y: accepted), with older outcomes fading by `decay` per update, so the
    shift follows the request's text; `strength` pseudo-observations of no
    shift keep a few outcomes from swinging it.
    """

    def __init__(self, strength: float = 4.0, decay: float = 0.95):
        self.strength, self.decay = float(strength), float(decay)
        self.residual: dict[str, float] = {}
        self.information: dict[str, float] = {}

    def shifts(self, req_ids: list[str]) -> np.ndarray:
        return np.array(self.shift_list(req_ids))

    def shift_list(self, req_ids: list[str]) -> list[float]:
        return [self.residual.get(r, 0.0) / (self.information.get(r, 0.0) + self.strength) for r in req_ids]

    def apply(self, req_ids: list[str], p: np.ndarray) -> np.ndarray:
        """Conditional acceptance [R, q] with each request's shift."""
        delta = self.shifts(req_ids)
        if not delta.any():
            return p
        return logit_shifted(p, delta[:, None])

    def update(self, req_ids: list[str], p: np.ndarray, observed: np.ndarray, accepted: np.ndarray) -> None:
        """p [N, w] the shared model's predictions for the requests' verified drafts;
        observed / accepted [N, w] masks."""
        resid = np.where(observed, accepted - p, 0.0).sum(axis=1)
        info = np.where(observed, p * (1.0 - p), 0.0).sum(axis=1)
        for i, req_id in enumerate(req_ids):
            self.residual[req_id] = self.decay * self.residual.get(req_id, 0.0) + float(resid[i])
            self.information[req_id] = self.decay * self.information.get(req_id, 0.0) + float(info[i])

    def forget(self, live_req_ids) -> None:
        if len(self.residual) > len(live_req_ids):
            live = set(live_req_ids)
            for req_id in [r for r in self.residual if r not in live]:
                del self.residual[req_id], self.information[req_id]


class SurvivalPrior:
    """What a draft is expected to yield before it exists: the mean survival
    per (kind, position) over recent drafts (every drafted row, verified or
    not, so selection by the controller does not bias it), and each
    request's own last survival row (a request drifts between easy and hard
    text slowly compared with one step).

    `memory` is in drafted rows. Positions never drafted continue the known
    ones at their mean conditional rate; with no draft at all yet, every
    position is a coin flip. A request's row shorter than k is continued
    with the kind's mean conditional rates from where it stops. A request's
    own row fades into the kind's mean with the steps since it was drafted
    (weight exp(-age / `fade_steps`)): a request that stops drafting because
    its row looked poor must not stay stuck on that row.
    """

    def __init__(self, num_positions: int, memory: float = 2000.0, fade_steps: float = 4.0,
                 recent_rows: int = 64):
        self.num_positions = num_positions
        self.memory = float(memory)
        self.fade_steps = float(fade_steps)
        self.sum = np.zeros((len(KIND_NAMES), num_positions))
        self.weight = np.zeros((len(KIND_NAMES), num_positions))
        # The last `recent_rows` drafted rows of each kind, extended to k (`recent`): a ring per kind.
        self._recent = np.zeros((len(KIND_NAMES), recent_rows, num_positions))
        self._recent_count = [0] * len(KIND_NAMES)
        self.last: dict[str, tuple[np.ndarray, int, int]] = {}  # request id -> (survival [q], step drafted, kind)
        self.step = 0  # counts forget() calls: one per engine step
        self._means: np.ndarray | None = None

    def record(self, req_ids: list[str], kinds: np.ndarray, survival: np.ndarray) -> None:
        """Posterior survival [R, q] of this step's drafts."""
        survival = np.asarray(survival, dtype=np.float64)
        rows, width = survival.shape
        if rows == 0 or width == 0:
            return
        decay = np.exp(-rows / self.memory)
        self.sum *= decay
        self.weight *= decay
        kinds = np.asarray(kinds, dtype=np.int64)
        if kinds.min() == kinds.max():  # the usual batch: one kind
            self.sum[kinds[0], :width] += survival.sum(axis=0)
            self.weight[kinds[0], :width] += rows
        else:
            for kind in range(len(KIND_NAMES)):
                sel = kinds == kind
                self.sum[kind, :width] += survival[sel].sum(axis=0)
                self.weight[kind, :width] += sel.sum()
        self._means = None
        self._keep_recent(survival, kinds)
        for i, req_id in enumerate(req_ids):  # extended to k only when read (rows())
            self.last[req_id] = (survival[i], self.step, int(kinds[i]))

    def _keep_recent(self, survival: np.ndarray, kinds: np.ndarray) -> None:
        """This batch's rows [R, q] (of `kinds` [R]) into each kind's ring of recent rows."""
        ring = self._recent.shape[1]
        rows = self._extend(survival, kinds)
        for kind in np.unique(kinds).tolist():
            mine = rows[kinds == kind][-ring:]
            slots = (self._recent_count[kind] + np.arange(mine.shape[0])) % ring
            self._recent[kind, slots] = mine
            self._recent_count[kind] += mine.shape[0]

    def recent(self, kind: int) -> np.ndarray:
        """[n, k] the last n (at most `recent_rows`) drafted rows of a kind, each extended to k
        with the kind's mean conditional rates: what the next draft may look like, as a
        sample. (Each row already holds its request's shift.)"""
        return self._recent[kind, : min(self._recent_count[kind], self._recent.shape[1])].copy()

    def _extend(self, survival: np.ndarray, kinds: np.ndarray, shift: float = 0.0) -> np.ndarray:
        """[R, q] -> [R, k]: positions past q follow the kind's mean conditional rates,
        moved by `shift` on the logit scale (the request's own, `RequestOffsets`): a
        request whose text the draft finds easier than the kind's average keeps that
        advantage past the positions it last drafted. Without it, a request planned
        short saw only the kind's average beyond its block, and stayed short."""
        rows, width = survival.shape
        if width >= self.num_positions:
            return survival[:, : self.num_positions].copy()
        means = self.means()[kinds]  # [R, k]
        before, after = means[:, width - 1 : -1], means[:, width:]
        rate = np.divide(after, before, out=np.zeros_like(after), where=before > 0)
        if shift:
            rate = logit_shifted(rate, shift)
        tail = survival[:, -1:] * np.cumprod(np.minimum(rate, 1.0), axis=1)
        return np.concatenate([survival, tail], axis=1)

    @staticmethod
    def shifted(survival: np.ndarray, shifts: np.ndarray) -> np.ndarray:
        """Survival rows [R, k] with each row's conditional rates moved by its logit shift [R]."""
        before = np.concatenate([np.ones((survival.shape[0], 1)), survival[:, :-1]], axis=1)
        rate = np.divide(survival, before, out=np.zeros_like(survival), where=before > 0)
        return np.cumprod(logit_shifted(rate, shifts[:, None]), axis=1)

    def forget(self, live_req_ids, steps: int = 1) -> None:
        """End of a step (`steps` steps): drop the rows of requests no longer running."""
        self.step += steps
        if len(self.last) > len(live_req_ids):
            live = set(live_req_ids)
            for req_id in [r for r in self.last if r not in live]:
                del self.last[req_id]

    def fading(self, req_ids: list[str], weight: float = 0.01) -> bool:
        """Some request's own row still weighs more than `weight` in `rows` (against the kind's
        mean; `rows` leaves out rows under OWN_ROW_MIN_WEIGHT)."""
        horizon, last, step = self.fade_steps * math.log(1.0 / weight), self.last, self.step
        for req_id in req_ids:
            entry = last.get(req_id)
            if entry is not None and step - entry[1] < horizon:
                return True
        return False

    def means(self) -> np.ndarray:
        """[kinds, k] mean survival per position."""
        if self._means is None:
            self._means = np.stack([self._mean(kind) for kind in range(len(KIND_NAMES))])
        return self._means

    def mean(self, kind: int) -> np.ndarray:
        return self.means()[kind]

    def _mean(self, kind: int) -> np.ndarray:
        w = self.weight[kind]
        known = w > 1e-9
        if not known.any():
            return 0.5 ** np.arange(1, self.num_positions + 1)
        out = np.zeros(self.num_positions)
        out[known] = self.sum[kind][known] / w[known]
        last = int(np.flatnonzero(known)[-1])  # drafts cover positions 1..q: the known ones are a prefix
        rate = out[last] ** (1.0 / (last + 1)) if out[last] > 0 else 0.0
        out[last + 1:] = out[last] * rate ** np.arange(1, self.num_positions - last)
        return np.minimum.accumulate(np.clip(out, 0.0, 1.0))

    def rows(self, req_ids: list[str], kinds: np.ndarray, per_request: bool = True,
             shifts: np.ndarray | None = None) -> np.ndarray:
        """[R, k] expected survival per request: its own last row where it has
        one (continued with its logit `shifts` [R], see `_extend`), fading into the
        kind's mean moved by the request's shift.

        The row fades within a few steps; the shift is the request's own evidence that
        lasts (`RequestOffsets`). Fading into the bare mean dropped it: at one request
        after a run of math, a prose request that drafted well was planned on the math-laden
        mean again four steps later, stopped drafting, and drafted only when exploration
        made it a new row (41% of steps drafting where static k = 15 ran 2.2x no speculation;
        float32, AVX-512 EPYC)."""
        out = self.means()[np.asarray(kinds, dtype=np.int64)]
        if shifts is not None and per_request:
            # Only a request that does better than its kind keeps its shift there: one that does
            # worse may stop drafting on it, and a request that drafts nothing learns nothing, so
            # it would never draft again; its faded prior is the kind's mean, as for a new one.
            easier = np.maximum(np.asarray(shifts, dtype=np.float64), 0.0)
            if easier.any():
                out = self.shifted(out, easier)
        if per_request and self.last:
            # A row older than this weighs under 1e-3: it is left out (at 64 requests, extending
            # every live request's long-faded row was most of a replan, ~1 ms of 1.6).
            faded = self.fade_steps * math.log(1.0 / OWN_ROW_MIN_WEIGHT)
            for i, req_id in enumerate(req_ids):
                entry = self.last.get(req_id)
                if entry is not None and self.step - entry[1] < faded:
                    row, step, kind = entry
                    w = np.exp(-(self.step - step) / self.fade_steps)
                    shift = 0.0 if shifts is None else float(shifts[i])
                    out[i] = w * self._extend(row[None, :], np.array([kind]), shift)[0] + (1.0 - w) * out[i]
        return out


def conditionals_of(survival: np.ndarray) -> np.ndarray:
    """[R, q] conditional acceptance of each position from survival [R, q] (the ratio to the
    position before; 0 after a survival of 0)."""
    survival = np.asarray(survival, dtype=np.float64)
    before = np.concatenate([np.ones((survival.shape[0], 1)), survival[:, :-1]], axis=1)
    return np.divide(survival, before, out=np.zeros_like(survival), where=before > 0)


class SurvivalCorrection:
    """Calibration in the large, per draft position: a shift of each position's conditional
    acceptance on the logit scale, learned so that the survival handed out matches the
    acceptance realised over the positions actually verified, applied to every new prediction.

    The conditional model is calibrated per confidence bin, yet the survival that decides a
    budget comes out biased: the controller verifies the positions whose estimates are highest
    (winner's curse), deep positions are rarely verified (censored) and lean on the bins pooled
    over positions, and a product of many slightly-off conditionals drifts. Measured on the
    bundled pair (k = 15, one request): about 0.7 accepted tokens per step predicted that never
    came with the first drafter; with the long-context one, deep positions realised 1.4x their
    prediction.

    Why the conditional scale: a factor on survival had to be capped at 1 and kept
    non-increasing along a draft, and where that bound it could not move what was handed out
    (replaying 997 recorded greedy drafts of the bundled pair with budgets chosen as the engine
    chooses them: 60-88% of the verified rows at positions 4-15 were bound, the factor's gain hit
    its limit, and positions 12-13 stayed 0.06 under their realised rate, as in the bench). A
    shifted conditional stays in (0, 1), so the survival, its product, is non-increasing and at
    most 1 as it is, and every shift moves it: in the same replay every position came within
    0.03 (`scripts/calibration_replay.py`).

    Each update takes one Newton step per position on the batch's residual (realised minus
    handed out, over the rows verified there), over the `information` the position has collected
    (the derivative of the survival handed out with respect to its shift, summed over verified
    rows, forgotten over `memory` rows) plus `pseudo` rows' worth of prior; a step is at most
    `max_step`. A position never verified takes the shift of the one before it. (Each shift
    defined as the one before plus an increment made a large correction at position 1 swing
    every later one: they overshot by tens of logits and oscillated.)
    """

    def __init__(self, num_positions: int, memory: float = 2000.0, pseudo: float = 5.0, confidence_z: float = 1.0,
                 max_step: float = 0.5):
        if num_positions < 1 or memory <= 0 or pseudo <= 0 or confidence_z < 0 or max_step <= 0:
            raise ValueError("SurvivalCorrection needs num_positions >= 1, memory > 0, pseudo > 0, "
                             "confidence_z >= 0 and max_step > 0")
        self.own = np.zeros(num_positions)  # each position's shift, learned from its own verified rows
        self.information = np.zeros(num_positions)
        self.memory, self.pseudo, self.confidence_z = float(memory), float(pseudo), float(confidence_z)
        self.max_step = float(max_step)
        self._odds_scales: tuple[np.ndarray, np.ndarray] | None = None
        self._lists: tuple[list[float], list[float]] | None = None

    def shifts(self) -> np.ndarray:
        """[k] each position's logit shift (a position never verified: the one before it's)."""
        out = self.own.copy()
        for j in np.flatnonzero(self.information <= 0.0):
            if j > 0:
                out[j] = out[j - 1]
        return out

    def upper_shifts(self) -> np.ndarray:
        """[k] an upper confidence bound of each shift: `confidence_z` standard errors above it,
        1 / sqrt(information + pseudo). What decisions use (`apply(optimistic=True)`): a position
        verified rarely cannot show that it is better than predicted, because the prediction keeps
        it from being verified (censoring); the bound shrinks as it is verified. Measured at one
        request on the bundled pair: positions 8-13 predicted 0.14-0.27, realised 0.5-0.75 the few
        times they were verified, and fewer tokens per step than static k = 15."""
        return self.shifts() + self.confidence_z / np.sqrt(self.information + self.pseudo)

    def odds_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(exp(-shift), exp(-upper shift)) per position: the factors on each conditional's
        odds against (1 - p) / p. Made once per update; `few_requests` takes the same numbers
        as lists, so both paths hand out the same survival to the last bit."""
        if self._odds_scales is None:
            self._odds_scales = (np.exp(-self.shifts()), np.exp(-self.upper_shifts()))
        return self._odds_scales

    def scale_lists(self) -> tuple[list[float], list[float]]:
        """`odds_scales` as Python lists (`few_requests`), made once per update."""
        if self._lists is None:
            scales, upper = self.odds_scales()
            self._lists = (scales.tolist(), upper.tolist())
        return self._lists

    @staticmethod
    def _shifted(odds: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Conditionals with odds against `odds` [R, q], shifted by the odds `scales` of `odds_scales`
        (`logit_shifted` with exp(-shift) made once per update)."""
        return 1.0 / (1.0 + odds * scales[None, : odds.shape[1]])

    def update(self, raw_survival: np.ndarray, num_verified: np.ndarray, num_accepted: np.ndarray) -> None:
        """raw_survival [N, w] (before correction) of verified drafts, with their verified / accepted counts."""
        raw_survival = np.asarray(raw_survival, dtype=np.float64)
        rows, width = raw_survival.shape
        if rows == 0 or width == 0:
            return
        pos = np.arange(width)[None, :]
        verified = pos < np.asarray(num_verified)[:, None]
        q = self._shifted(odds_against(conditionals_of(raw_survival)), self.odds_scales()[0])
        survival = np.cumprod(q, axis=1)
        self.information *= math.exp(-rows / self.memory)
        self.information[:width] += np.where(verified, survival * (1.0 - q), 0.0).sum(axis=0)
        residual = np.where(verified, (pos < np.asarray(num_accepted)[:, None]) - survival, 0.0).sum(axis=0)
        step = residual / (self.information[:width] + self.pseudo)
        self.own[:width] += np.minimum(np.maximum(step, -self.max_step), self.max_step)
        self._odds_scales = self._lists = None

    def apply(self, survival: np.ndarray, optimistic: bool = False) -> np.ndarray:
        """Corrected survival [R, q] of raw survival [R, q] (`optimistic`: at the shifts' upper
        bounds, for decisions)."""
        survival = np.asarray(survival, dtype=np.float64)
        if survival.shape[1] == 0:
            return survival
        scales, upper = self.odds_scales()
        return np.cumprod(self._shifted(odds_against(conditionals_of(survival)), upper if optimistic else scales),
                          axis=1)

    def estimate_and_bound(self, survival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(apply(survival), apply(survival, optimistic=True)), the conditionals taken back once."""
        survival = np.asarray(survival, dtype=np.float64)
        if survival.shape[1] == 0:
            return survival, survival
        odds = odds_against(conditionals_of(survival))
        scales, upper = self.odds_scales()
        return np.cumprod(self._shifted(odds, scales), axis=1), np.cumprod(self._shifted(odds, upper), axis=1)
