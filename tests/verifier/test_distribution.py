"""T>0 verification keeps the target distribution: chi-square goodness of fit.

A toy "language model" over 8 tokens whose next-token distribution depends only
on the position: the target emits p_j at position j, the drafter proposes from
q_j (or a fixed token: point-mass drafts). The exact target distribution of
the first emitted token is p_0 and of the first two tokens p_0(a) p_1(b). One
verification round with k = 2 drafts emits 1-3 tokens; rows that emit a single
token run a second round from position 1, as a serving loop would.

Threshold: a correct verifier must give p-value > ALPHA = 1e-3 (false alarm
rate 0.1% per test at a fixed seed, so the seeds below are not cherry-picked
for a flaky test). Power: the same test with the same N must reject each
deliberately broken verifier; we compute its power from the exact first-token
distribution of the broken algorithm (noncentral chi-square) and require
> 0.999, and check that the run does reject it. Tokens the target gives
probability 0 must never appear (checked separately: such cells are left out
of the chi-square).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from vllm_dflash.verifier.draft import sample_drafts

from vllm_dflash.ops import reference
from vllm_dflash.verifier import rejection_sample, verify

V = 8
K = 2
N = 200_000
ALPHA = 1e-3

P = torch.tensor([
    [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.00],  # token 7 impossible at position 0
    [0.05, 0.05, 0.10, 0.30, 0.20, 0.10, 0.10, 0.10],
    [0.125] * 8,
    [0.40, 0.20, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05],
])
Q = torch.tensor([
    [0.05, 0.10, 0.30, 0.20, 0.05, 0.10, 0.05, 0.15],  # proposes the impossible token 7
    [0.30, 0.05, 0.05, 0.20, 0.20, 0.10, 0.10, 0.00],  # never proposes token 7 (p = 0.1)
    [0.20, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.20],
])
POINT_MASS_DRAFTS = [2, 3, 7]  # fixed draft token per position


IMPLS = ["reference", "native", "cuda"]


def impl_fixture(request, impl: str) -> str:
    """"cuda" runs the native CUDA kernel (skipped without a GPU)."""
    if impl == "native":
        request.getfixturevalue("native_cpu")
    if impl == "cuda":
        request.getfixturevalue("native_cuda")
    return impl


def call(impl: str, *args, **kwargs) -> torch.Tensor:
    if impl != "cuda":
        return rejection_sample(*args, **kwargs, impl=impl)
    moved = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    return rejection_sample(*moved, **kwargs, impl="native").cpu()


def run_round(impl: str, start: int, n: int, point_mass: bool, gen: torch.Generator) -> torch.Tensor:
    """One verification of n identical-in-law rows starting at absolute position `start`."""
    if point_mass:
        drafts = torch.tensor(POINT_MASS_DRAFTS[start:start + K]).repeat(n)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(Q[start + i], n, replacement=True, generator=gen)
                              for i in range(K)], dim=1).reshape(-1)
        draft_probs = Q[start:start + K].repeat(n, 1)
    target = P[start:start + K + 1].repeat(n, 1)
    uniforms = torch.rand(n * K, dtype=torch.float64, generator=gen)
    noise = torch.empty(n, V).exponential_(generator=gen)
    cu = torch.arange(1, n + 1, dtype=torch.int32) * K
    return call(impl, drafts, cu, target, draft_probs, None, torch.zeros(n, dtype=torch.bool), uniforms, noise, K)


def first_two_tokens(impl: str, point_mass: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = run_round(impl, 0, N, point_mass, gen)
    assert ((out != -1).sum(1) >= 1).all()
    first, second = out[:, 0].long(), out[:, 1].long()
    short = second == -1
    second[short] = run_round(impl, 1, int(short.sum()), point_mass, gen)[:, 0].long()
    return first, second


def goodness_of_fit(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square statistic, p-value, count of tokens the target never emits)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    possible = probs > 0
    # Cells the target never emits are counted apart; the rest is tested given "possible".
    observed = counts[possible]
    expected = probs[possible].double() / probs[possible].double().sum() * observed.sum()
    result = stats.chisquare(observed.numpy(), expected.numpy())
    return float(result.statistic), float(result.pvalue), int(counts[~possible].sum())


def check(first: torch.Tensor, second: torch.Tensor) -> dict:
    pair_probs = (P[0][:, None] * P[1][None, :]).reshape(-1)
    single = goodness_of_fit(first, P[0])
    pair = goodness_of_fit(first * V + second, pair_probs)
    return {"first": single, "pair": pair}


def passes(result: tuple[float, float, int]) -> bool:
    return result[1] > ALPHA and result[2] == 0


# --- correct verifiers ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "point_mass"])
def test_first_and_pair_distribution_match_target(request, impl, point_mass):
    results = check(*first_two_tokens(impl_fixture(request, impl), point_mass, seed=1))
    print(f"{impl} point_mass={point_mass}: " + ", ".join(
        f"{name} chi2={s:.1f} p={p:.3f} impossible={z}" for name, (s, p, z) in results.items()))
    assert passes(results["first"]), results
    assert passes(results["pair"]), results


# --- broken verifiers must fail the same test -----------------------------------------------------

def _accept_ignoring_q(p_x, q_x, uniforms):
    return uniforms < p_x.double()


def _accept_inverted_ratio(p_x, q_x, uniforms):
    return uniforms * p_x.double() < q_x.double()


def _recover_from_p(p, q, x, use_q):
    return p


def _keep_point_mass_draft(p, q, x, use_q):
    return p


def _normalized(w: torch.Tensor) -> torch.Tensor:
    w = w.clamp_min(0).double()
    return w / w.sum()


def first_token_law(accept_prob: torch.Tensor, recovery: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Law of the first emitted token when drafts ~ q are accepted w.p. accept_prob[x]."""
    accepted = q.double() * accept_prob.double()
    return accepted + (1 - accepted.sum()) * recovery.double()


p0, q0 = P[0].double(), Q[0].double()
ratio = torch.where(q0 > 0, p0 / q0, torch.tensor(math.inf)).clamp(max=1)
x0 = POINT_MASS_DRAFTS[0]
point_mass_law = lambda rec: torch.nn.functional.one_hot(torch.tensor(x0), V).double() * p0[x0] + (1 - p0[x0]) * rec  # noqa: E731
BROKEN = {
    # name: (patched reference function, replacement, point-mass drafts?, exact first-token law)
    "accept_ignoring_q": ("acceptance", _accept_ignoring_q, False,
                          first_token_law(p0, _normalized(p0 - q0), q0)),
    "accept_inverted_ratio": ("acceptance", _accept_inverted_ratio, False,
                              first_token_law(torch.where(p0 > 0, q0 / p0, torch.tensor(math.inf)).clamp(max=1),
                                              _normalized(p0 - q0), q0)),
    "recover_from_p_not_residual": ("residual", _recover_from_p, False, first_token_law(ratio, p0, q0)),
    "point_mass_keeps_draft_token": ("residual", _keep_point_mass_draft, True, point_mass_law(p0)),
}


def test_correct_first_token_law_is_the_target():
    assert torch.allclose(first_token_law(ratio, _normalized(p0 - q0), q0), p0)
    removed = p0.clone()
    removed[x0] = 0
    assert torch.allclose(point_mass_law(_normalized(removed)), p0)


def power(law: torch.Tensor) -> float:
    """Power of the first-token test at N samples against a verifier emitting `law`."""
    possible = p0 > 0
    if float(law[~possible].sum()) * N > 30:  # emits impossible tokens: seen with prob > 1 - e^-30
        return 1.0
    df = int(possible.sum()) - 1
    noncentrality = N * float((((law - p0) ** 2)[possible] / p0[possible]).sum())
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, noncentrality))


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_verifier_is_rejected(monkeypatch, name):
    function, replacement, point_mass, law = BROKEN[name]
    assert not torch.allclose(law, p0)
    test_power = power(law)
    assert test_power > 0.999, f"{name}: power {test_power:.4f} at N={N}"
    monkeypatch.setattr(reference, function, replacement)
    results = check(*first_two_tokens("reference", point_mass, seed=2))
    print(f"{name}: power={test_power:.6f} " + ", ".join(
        f"{key} chi2={s:.1f} p={p:.2e} impossible={z}" for key, (s, p, z) in results.items()))
    assert not passes(results["first"]), results
    assert not passes(results["pair"]), results


# --- temperature, top-k, top-p, min-p -------------------------------------------------------------

TARGET_LOGITS = torch.tensor([
    [0.30, 0.21, 0.15, 0.11, 0.09, 0.07, 0.05, 0.02],
    [0.02, 0.05, 0.07, 0.09, 0.11, 0.15, 0.21, 0.30],
    [0.11, 0.30, 0.02, 0.21, 0.05, 0.15, 0.07, 0.09],
]).log()
DRAFT_LOGITS = torch.tensor([
    [0.10, 0.30, 0.20, 0.05, 0.15, 0.05, 0.05, 0.10],
    [0.15, 0.05, 0.05, 0.20, 0.10, 0.10, 0.30, 0.05],
]).log()
# (temperature, top_k, top_p, min_p) per request group; 0 / vocab / 1 / 0 disable a filter.
GROUPS = [
    (0.8, 3, 1.0, 0.0),
    (1.0, V, 0.7, 0.0),
    (1.3, V, 1.0, 0.3),
    (0.7, 6, 0.9, 0.05),
    (1.0, V, 1.0, 0.0),
    (0.0, 2, 0.5, 0.0),  # greedy request in the same batch
]


def filtered_law(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Written independently of sampling_params: temperature, min-p, top-k, top-p, renormalize."""
    z = [l / temperature for l in logits]
    w = [math.exp(v - max(z)) for v in z]
    probs = [v / sum(w) for v in w]
    keep = [pr >= min_p * max(probs) for pr in probs]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept_order = [i for i in order if keep[i]][:top_k]
    mass = sum(probs[i] for i in kept_order)
    final, before = [], 0.0
    for i in kept_order:
        if before < top_p:
            final.append(i)
        before += probs[i] / mass
    law = torch.zeros(len(z), dtype=torch.float64)
    for i in final:
        law[i] = probs[i]
    return law / law.sum()


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("draft_sample", ["sample", "argmax"])
def test_filtered_target_distribution(request, impl, draft_sample):
    impl = impl_fixture(request, impl)
    per_group = 40_000
    params = torch.tensor(GROUPS).repeat_interleave(per_group, dim=0)
    n = params.shape[0]
    temperature, top_k, top_p, min_p = params[:, 0], params[:, 1].int(), params[:, 2], params[:, 3]
    torch.manual_seed(3)  # sample_drafts' unseeded noise
    drafts, q = sample_drafts(DRAFT_LOGITS[None].expand(n, K, V), draft_sample, temperature=temperature,
                              top_k=top_k, top_p=top_p, min_p=min_p)
    out = verify(drafts.reshape(-1), [K] * n, TARGET_LOGITS.repeat(n, 1), temperature=temperature,
                 top_k=top_k, top_p=top_p, min_p=min_p, draft_probs=None if q is None else q.reshape(n * K, V),
                 generators={i: torch.Generator().manual_seed(i) for i in range(0, n, 997)}, impl=impl)
    for g, group in enumerate(GROUPS):
        first = out[g * per_group:(g + 1) * per_group, 0].long()
        if group[0] == 0.0:
            assert (first == TARGET_LOGITS[0].argmax()).all()
            continue
        law = filtered_law(TARGET_LOGITS[0].tolist(), *group)
        stat, pvalue, impossible = goodness_of_fit(first, law)
        print(f"{impl} {draft_sample} group {group}: kept {int((law > 0).sum())}, "
              f"chi2={stat:.1f} p={pvalue:.3f}")
        assert impossible == 0, (group, impossible)
        assert pvalue > ALPHA, (group, stat, pvalue)


def test_filtered_law_sanity():
    # The independent filter keeps what the group names promise.
    assert int((filtered_law(TARGET_LOGITS[0].tolist(), 0.8, 3, 1.0, 0.0) > 0).sum()) == 3
    assert int((filtered_law(TARGET_LOGITS[0].tolist(), 1.0, V, 0.7, 0.0) > 0).sum()) == 4
    assert int((filtered_law(TARGET_LOGITS[0].tolist(), 1.3, V, 1.0, 0.3) > 0).sum()) == 6


def test_dropping_min_p_is_detected():
    """vLLM 0.32's rejection sampler skips min-p at draft positions; this test would catch that."""
    n, group = 40_000, GROUPS[2]
    temperature = torch.full((n,), group[0])
    torch.manual_seed(4)
    drafts, q = sample_drafts(DRAFT_LOGITS[None].expand(n, K, V), "sample", temperature=temperature)
    out = verify(drafts.reshape(-1), [K] * n, TARGET_LOGITS.repeat(n, 1), temperature=temperature,
                 draft_probs=q.reshape(n * K, V), impl="reference")
    law = filtered_law(TARGET_LOGITS[0].tolist(), *group)
    stat, pvalue, impossible = goodness_of_fit(out[:, 0].long(), law)
    assert impossible > 0 or pvalue < ALPHA
