"""Engines of several modes alive in one process, generate calls taking turns: ratios of adjacent calls.

    python scripts/paired_engines.py --dtype bfloat16 --concurrency 16 --modes none,pause,adaptive
    python scripts/paired_engines.py --dtype float32 --concurrency 8 --waves 8 --modes none,adaptive,static

Between processes the same engine's speed differs by 5-15% on a shared CPU, and over minutes it drifts
by more: a 3% question (what does a step without drafts cost?) cannot be answered by engines in separate
processes. Here every mode's engine is built in this process (vLLM's in-process engine), and each
repetition runs one generate call per mode, the order reversed every other repetition; each ratio
compares calls seconds apart in the same process. `--learn-at 1,2,4,8,16` first takes every engine
through calls at those concurrencies (what the bench's earlier cells teach adaptive speculation), with
room for the largest (`max_num_seqs`). Modes: none (no speculation), adaptive (the plugin's
default), static (`adaptive: false`, k every step), pause (adaptive speculation forced to draft nothing,
every step: what speculation costs when it is off). A mode may carry a label after `#` (none#2): a second
engine of the same mode, the control that shows how far two identical engines in one process differ (their
memory lies in different places: 2-5% apart on this kind of machine). Requests: the toy prompts of --categories cycled to
waves x concurrency, at most `concurrency` in flight. Prints tok/s per call, the median ratio to the first
mode, for adaptive engines the share of each call's steps that drafted and the drain factor after it
(`adaptive.drain`), where each engine's step time goes (ms per step), and its steps split by batch: at the full
concurrency, or fewer requests (the tail of a call, once no request waits: speculation puts requests out
of step, so they finish apart; without it a wave of equal requests finishes together).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

MODES = ("none", "adaptive", "static", "pause")
PHASES = (  # (owner: the LLM's engine, its engine core, scheduler, runner; method): the parts of a step timed
    ("engine", "step"), ("", "post_step"), ("scheduler", "schedule"), ("scheduler", "update_from_output"),
    ("runner", "execute_model"), ("runner", "_model_forward"), ("runner", "sample_tokens"),
    ("runner", "propose_draft_token_ids"), ("runner", "_bookkeeping_sync"))


def build(mode: str, args):
    from vllm import LLM

    # The forced schedule is read when the proposer is built: set it for this engine only.
    os.environ.pop("VLLM_DFLASH_ADAPTIVE_SCHEDULE", None)
    if mode == "pause":
        os.environ["VLLM_DFLASH_ADAPTIVE_SCHEDULE"] = "pause:0:1000000000"
    spec = None if mode == "none" else {"method": "dflash", "model": args.draft, "num_speculative_tokens": args.k,
                                        "adaptive": mode != "static"}
    try:
        return LLM(args.target, speculative_config=spec, dtype=args.dtype,
                   max_num_seqs=max([args.concurrency, *args.learn_at]),
                   gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024,
                   enable_prefix_caching=False, async_scheduling=False, skip_tokenizer_init=True, seed=0)
    finally:
        os.environ.pop("VLLM_DFLASH_ADAPTIVE_SCHEDULE", None)


def time_phases(llm, timer) -> None:
    """Wrap the step's parts of one engine into `timer` (a profiler.PhaseTimer), one phase each."""
    from vllm_dflash.patches.model_runner import model_runner_of, scheduler_of

    owners = {"engine": llm.llm_engine, "": llm.llm_engine.engine_core.engine_core, "scheduler": scheduler_of(llm),
              "runner": model_runner_of(llm)}
    for owner, name in PHASES:
        obj = owners[owner]
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, timer.wrap(getattr(obj, name), f"{owner or 'core'}.{name}"))


def adaptive_of(llm):
    """The engine's adaptive speculation (`AdaptiveSpeculation`), None without it."""
    from vllm_dflash.patches.model_runner import model_runner_of

    return getattr(getattr(model_runner_of(llm), "drafter", None), "adaptive", None)


def log_batches(llm, log: list) -> None:
    """Append [requests scheduled, seconds until the next schedule, tokens sampled, start] for every
    step of `llm` (a call's last step: until the call returns, `close_batches`)."""
    from vllm_dflash.patches.model_runner import scheduler_of

    scheduler = scheduler_of(llm)
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def timed_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        now = time.perf_counter()
        close_batches(log, now)
        log.append([len(out.num_scheduled_tokens), 0.0, 0, now])
        return out

    def counted_update(scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        if log and sampled is not None:
            log[-1][2] += sum(len(ids) for ids in sampled)
        return update(scheduler_output, model_runner_output)

    scheduler.schedule, scheduler.update_from_output = timed_schedule, counted_update


def close_batches(log: list, now: float | None = None) -> None:
    """The last logged step, if still open, ends at `now` (the next step's schedule; None: its
    call returned, so it ends at this moment)."""
    if log and log[-1][1] == 0.0:
        log[-1][1] = (time.perf_counter() if now is None else now) - log[-1][3]


def by_batch(log: list, concurrency: int) -> dict:
    """{"full" | "fewer": [steps, seconds, tokens]}: steps at `concurrency` requests and below it."""
    out = {"full": [0, 0.0, 0], "fewer": [0, 0.0, 0]}
    for requests, seconds, tokens, _ in log:
        part = out["full" if requests >= concurrency else "fewer"]
        part[0] += 1
        part[1] += seconds
        part[2] += tokens
    return out


def concurrencies(text: str) -> list[int]:
    """--learn-at: comma-separated request counts (empty: none)."""
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = [0]
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated request counts >= 1, e.g. 1,2,4,16")
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="none,pause,adaptive", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--waves", type=int, default=4, help="requests per call: waves x concurrency")
    p.add_argument("--categories", default="code,prose,math")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    p.add_argument("--target", default="models/toy-target")
    p.add_argument("--draft", default="models/toy-draft")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--learn-at", type=concurrencies, default=[],
                   help="concurrencies every engine runs through first (e.g. 1,2,4,8,16)")
    args = p.parse_args()
    modes = args.modes.split(",")
    bad = [m for m in modes if m.split("#")[0] not in MODES]
    if bad or not modes or len(set(modes)) < len(modes):
        raise SystemExit(f"--modes={args.modes}: choose distinct modes from {', '.join(MODES)} "
                         "(a repeated mode takes a label: none,adaptive,none#2)")

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dflash.bench import prompts as toy
    from vllm_dflash.bench.runner import in_flight
    from vllm_dflash.machine import describe, machine_info
    from vllm_dflash.profiler import PhaseTimer

    print(f"machine: {describe(machine_info())}", flush=True)
    llms = {m: build(m.split("#")[0], args) for m in modes}
    sets = toy.encode(toy.load_prompt_sets("toy", args.target), args.target)
    pool = [ids for c in args.categories.split(",") for ids in sets[c]]

    def requests_for(concurrency: int) -> list:
        """The toy prompts cycled to waves x `concurrency` requests."""
        return [TokensPrompt(prompt_token_ids=pool[i % len(pool)]) for i in range(args.waves * concurrency)]

    prompts = requests_for(args.concurrency)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def generate(llm, concurrency: int, batch: list, log: list | None = None) -> None:
        with in_flight(llm, concurrency):
            llm.generate(batch, params, use_tqdm=False)
        if log is not None:
            close_batches(log)

    for llm in llms.values():  # first calls (compilation of new shapes) stay out
        for c in args.learn_at:
            generate(llm, c, requests_for(c))
        generate(llm, args.concurrency, prompts)
    batches = {m: [] for m in modes}
    for m in modes:
        log_batches(llms[m], batches[m])
    timers = {m: PhaseTimer() for m in modes}
    for m in modes:
        time_phases(llms[m], timers[m])
    tok_s = collections.defaultdict(list)
    decided = collections.defaultdict(list)  # adaptive engines, per call: (share of steps drafting, drain factor)
    for rep in range(args.repeats):
        for m in modes if rep % 2 == 0 else modes[::-1]:
            adaptive = adaptive_of(llms[m])
            before = adaptive.stats.snapshot()["query_hist"] if adaptive is not None else None
            t0 = time.perf_counter()
            generate(llms[m], args.concurrency, prompts, batches[m])
            tok_s[m].append(len(prompts) * args.max_tokens / (time.perf_counter() - t0))
            if adaptive is not None:
                hist = [a - b for a, b in zip(adaptive.stats.snapshot()["query_hist"], before)]
                decided[m].append((1.0 - hist[0] / max(sum(hist), 1), adaptive.controller.drain.factor(args.concurrency)))
    base = modes[0]
    print(f"{args.dtype}, {args.concurrency} in flight, {len(prompts)} requests x {args.max_tokens} tokens, "
          f"{args.repeats} repetitions")
    for m in modes:
        ratios = [a / b for a, b in zip(tok_s[m], tok_s[base])]
        print(f"{m:9s} tok/s {' '.join(f'{x:.0f}' for x in tok_s[m])}   / {base}: median "
              f"{statistics.median(ratios):.3f} [{' '.join(f'{x:.2f}' for x in ratios)}]")
        if decided[m]:
            print(f"{'':9s} steps drafting {' '.join(f'{d:.2f}' for d, _ in decided[m])}; drain factor after the "
                  f"call {' '.join(f'{f:.2f}' for _, f in decided[m])}")
    seconds = {m: {k: v["seconds"] for k, v in timers[m].phases.items()} for m in modes}
    keys = sorted({k for m in modes for k in seconds[m]}, key=lambda k: -seconds[base].get(k, 0.0))
    print("ms per engine step (each mode's own steps): " + " ".join(f"{m:>9s}" for m in modes))
    for k in keys:
        row = []
        for m in modes:
            steps = timers[m].phases.get("runner.execute_model", {}).get("calls") or 1
            row.append(f"{seconds[m].get(k, 0.0) / steps * 1e3:9.3f}")
        print(f"  {k:30s} {' '.join(row)}")
    print(f"steps by batch: at {args.concurrency} requests | fewer (steps, seconds, tokens, tok/s)")
    for m in modes:
        parts = by_batch(batches[m], args.concurrency)
        print(f"  {m:9s} " + " | ".join(f"{n} {s:.2f} s {t} {t / s if s else 0.0:.0f}" for n, s, t in parts.values()))


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
