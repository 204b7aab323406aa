"""Which confidence feature predicts DFlash acceptance better: top-1/top-2 logit margin or top-1 probability.

    python scripts/adaptive_features.py --out runs/features.json

One in-process engine (bundled toy pair unless --target/--draft, float32,
k = 15) drafts and verifies full blocks every step (adaptive speculation on
a forced full-block schedule, so no position is censored by the
controller), greedy and T = 1 requests over the toy prompt categories. Every
draft position's margin and top-1 features and its verification outcome are
recorded; then `AcceptanceModel` is run online on each feature
(prequential: predict each observed position from the past only, then
learn from it) and scored by log loss and Brier score per request kind. A
model without any confidence feature (position only) is the baseline,
"+request" adds each request's own shift (`RequestOffsets`), and "used" is
what the proposer scores with (the margin for argmax drafts, the drawn
token's draft probability q(x) for sampled ones).
Also: how well the plan's prior (before drafting) predicts the accepted
count, a request's own last survival row against the pooled mean.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(args) -> list[dict]:
    """Run the engine; per propose() call: req ids, verified / accepted counts of the
    previous drafts, and the features of this call's drafts."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_dflash.serving.proposer as proposer_module
    from vllm_dflash import envs
    from vllm_dflash.adaptive.confidence import argmax_with_confidence, draft_confidence

    calls: list[dict] = []
    os.environ[envs.ADAPTIVE_SCHEDULE_ENV] = "pause:1000000000:1000000001"  # full blocks, always
    llm = LLM(model=args.target, speculative_config={"method": "dflash", "model": args.draft,
                                                    "num_speculative_tokens": args.k},
              dtype="float32", seed=0, max_model_len=1024, max_num_seqs=args.concurrency, enforce_eager=True,
              gpu_memory_utilization=0.5, enable_prefix_caching=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    adaptive = runner.drafter.adaptive
    original_begin = adaptive.begin

    def begin(now, req_ids, verified, accepted, num_tokens, greedy, eligible, **kwargs):
        calls.append({"req_ids": list(req_ids), "verified": np.asarray(verified).tolist(),
                      "accepted": np.asarray(accepted).tolist(), "greedy": np.asarray(greedy).tolist(),
                      "eligible": np.asarray(eligible).tolist()})
        return original_begin(now, req_ids, verified, accepted, num_tokens, greedy, eligible, **kwargs)

    def record_both(logits):
        margin, _ = draft_confidence(logits, "margin")
        top1, _ = draft_confidence(logits, "top1")
        calls[-1]["margin"] = margin.cpu().numpy()
        calls[-1]["top1"] = top1.cpu().numpy()

    def both(logits, feature="margin"):  # sampled drafts' path
        record_both(logits)
        return draft_confidence(logits, "margin")

    def argmax_both(logits, feature="margin"):  # argmax drafts' path
        record_both(logits)
        return argmax_with_confidence(logits, "margin")

    original_draft_tokens = runner.drafter._draft_tokens

    def draft_tokens(*args, **kwargs):  # what the proposer finally scores drafts with (q(x) for sampled ones)
        ids, conf = original_draft_tokens(*args, **kwargs)
        if conf is not None:
            calls[-1]["used"], calls[-1]["used_prior"] = (c.cpu().numpy() for c in conf)
        return ids, conf

    adaptive.begin = begin
    runner.drafter._draft_tokens = draft_tokens
    proposer_module.draft_confidence = both
    proposer_module.argmax_with_confidence = argmax_both
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    with open(os.path.join(args.target, "eval_prompts.json")) as f:
        prompts = json.load(f)
    texts = [p for group in prompts.values() for p in group[: args.num_prompts]]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"] for t in texts]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                 seed=None if temperature == 0 else i) for i in range(len(ids))]
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=True)
    del llm
    gc.collect()
    return calls


def outcomes(calls: list[dict], k: int):
    """Rows (kind, margin [k], top1 [k], verified, accepted), in time order."""
    rows = []
    for prev, cur in zip(calls, calls[1:]):
        if "margin" not in prev:
            continue
        where = {r: i for i, r in enumerate(cur["req_ids"])}
        for i, req in enumerate(prev["req_ids"]):
            j = where.get(req)
            if j is None or not prev["eligible"][i] or cur["verified"][j] == 0:
                continue
            kind = 0 if prev["greedy"][i] else 1
            # Features were recorded flat, request-major: [B * k].
            flat = slice(i * k, (i + 1) * k)
            rows.append((kind, prev["margin"][flat], prev["top1"][flat], cur["verified"][j], cur["accepted"][j], req,
                         prev["used"][flat], prev["used_prior"][flat]))
    return rows


def prequential(rows, k: int, feature: str) -> dict:
    """Online log loss and Brier score of AcceptanceModel on one feature, per request kind."""
    from vllm_dflash.adaptive.calibration import KIND_NAMES, AcceptanceModel, RequestOffsets

    model, offsets = AcceptanceModel(k), RequestOffsets()
    loss = {name: [0.0, 0.0, 0] for name in KIND_NAMES}  # log loss sum, Brier sum, count
    for kind, margin_f, top1_f, n, a, req, used_f, used_prior in rows:
        if feature in ("used", "used+request"):  # margin for argmax drafts, q(x) for sampled ones
            f, prior = used_f, used_prior
        elif feature in ("margin", "margin+request"):
            f, prior = margin_f, (1 + margin_f) / 2  # tanh(d / 2) and sigmoid(d), as the proposer uses them
        elif feature == "top1":
            f, prior = top1_f, top1_f
        else:  # position only
            f, prior = np.full(k, 0.5), np.full(k, 0.5)
        shared = model.conditional(np.array([kind]), f[None, :], prior[None, :])
        p = offsets.apply([req], shared)[0] if feature.endswith("+request") else shared[0]
        observed = np.arange(k) < min(a + 1, n)
        y = (np.arange(k) < a)[observed]
        q = np.clip(p[observed], 1e-6, 1 - 1e-6)
        entry = loss[KIND_NAMES[kind]]
        entry[0] += float(-(y * np.log(q) + (1 - y) * np.log(1 - q)).sum())
        entry[1] += float(((q - y) ** 2).sum())
        entry[2] += int(observed.sum())
        model.update(np.array([kind]), f[None, :], np.array([n]), np.array([a]))
        offsets.update([req], shared, observed[None, :], (np.arange(k) < a)[None, :])
    return {name: {"log_loss": v[0] / v[2], "brier": v[1] / v[2], "observations": v[2]}
            for name, v in loss.items() if v[2]}


def prior_quality(rows_by_request, k: int) -> dict:
    """How well the plan's expected accepted count (sum of prior survival) predicts the
    realised one: each request's own last posterior row vs the pooled mean over recent
    drafts (`SurvivalPrior`), mean squared error over verified drafts, replayed online."""
    from vllm_dflash.adaptive.calibration import AcceptanceModel, SurvivalPrior

    model, prior = AcceptanceModel(k), SurvivalPrior(k)
    err = {"per_request": [0.0, 0], "pooled": [0.0, 0]}
    for req, kind, margin_f, n, a in rows_by_request:
        kinds = np.array([kind])
        for name, per_request in (("per_request", True), ("pooled", False)):
            expected = float(prior.rows([req], kinds, per_request)[0].sum())
            err[name][0] += (expected - a) ** 2
            err[name][1] += 1
        f = margin_f[None, :]
        survival = np.cumprod(model.conditional(kinds, f, (1 + f) / 2), axis=1)
        prior.record([req], kinds, survival)  # what the controller knows before the next draft
        model.update(kinds, f, np.array([n]), np.array([a]))
    return {name: v[0] / v[1] for name, v in err.items() if v[1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.path.join(REPO, "models", "toy-target"))
    p.add_argument("--draft", default=os.path.join(REPO, "models", "toy-draft"))
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default="runs/adaptive-features.json")
    p.add_argument("--rows", default=None,
                   help="score the rows a previous run saved (OUT.rows.pkl) instead of running the engine")
    args = p.parse_args()
    import pickle

    if args.rows:
        with open(args.rows, "rb") as f:
            rows = pickle.load(f)
    else:
        rows = outcomes(record(args), args.k)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".rows.pkl", "wb") as f:
            pickle.dump(rows, f)
    result = {feature: prequential(rows, args.k, feature)
              for feature in ("margin", "top1", "position", "margin+request", "used", "used+request")}
    priors = prior_quality([(req, kind, m, n, a) for kind, m, _, n, a, req, _, _ in rows], args.k)
    print(f"{len(rows)} verified drafts")
    print(f"{'feature':<16}{'kind':<9}{'log loss':>10}{'Brier':>9}{'observed':>10}")
    for feature, kinds in result.items():
        for kind, v in kinds.items():
            print(f"{feature:<16}{kind:<9}{v['log_loss']:>10.4f}{v['brier']:>9.4f}{v['observations']:>10d}")
    print("expected accepted tokens before drafting, mean squared error: " +
          ", ".join(f"{name} {v:.3f}" for name, v in priors.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "drafts": len(rows), "scores": result, "prior_mse": priors}, f, indent=1)
    print(f"Written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
