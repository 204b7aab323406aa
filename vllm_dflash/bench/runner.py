"""One benchmark mode on one fresh engine, in its own process.

`python -m vllm_dflash.bench.runner SPEC.json RESULT.json`. The parent
(`bench.cli`) writes SPEC (mode, models, token-id prompts, sampling, sweep)
and sets the environment the mode needs (VLLM_DFLASH_IMPL). A process per
mode keeps engines from sharing memory, compiled state, patches or the
Prometheus registry, so each mode is measured as a user would run it.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the
runner can time the model runner's steps and its draft calls directly and
record which proposer class actually ran.

Concurrency c means c requests in flight, as `vllm bench serve
--max-concurrency c` has it: each (category, concurrency) cell hands all its
prompts (each category's cycled to a multiple of c) to one LLM.generate call,
and the scheduler runs at most c of them at a time, admitting the next one
as soon as one finishes. One engine serves every concurrency (max_num_seqs =
the largest); the cell lowers the scheduler's limit to c (`in_flight`).
Batches of c that each wait for their slowest request (`--batching waves`)
measure something else: a request that finishes early leaves its slot idle,
which no server does, and which costs speculation (requests finish at
different steps) but not plain decoding (same-length requests finish
together). The same holds, once, at the end of every in-flight cell: its last
requests drain with nothing to replace them, so `--waves W` gives each cell at
least W x c requests and the drain a smaller share of it (a server sees none).
Only the generate calls are timed; counters are read around each cell.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import sys
import time
from typing import Any

from vllm_dflash import envs, profiler
from vllm_dflash.bench.metrics import TIMED_PARTS
from vllm_dflash.bench.turns import Turns
from vllm_dflash.patches.model_runner import model_runner_of, scheduler_of

# dflash: the plugin drafting k tokens every step (`adaptive: false`); dflash-adaptive:
# the plugin's default, adaptive speculation with k the most per request and step.
# none-control: a second engine without speculation, the bar's own noise (`CONTROL`).
MODES = ("none", "none-control", "dflash", "dflash-adaptive", "dflash-vllm", "ngram", "eagle3")
# Two identical engines differ in speed by several percent for their whole life (where their
# memory happens to lie; measured 2-6.5% between two none engines in one process, AVX2 EPYC):
# a ratio to none within that spread says nothing, and the control shows how wide it is.
CONTROL = "none-control"
PLUGIN_MODES = ("dflash", "dflash-adaptive")


def speculative_config(spec: dict) -> dict | None:
    """vLLM speculative_config of a mode."""
    mode, k = spec["mode"], spec.get("num_spec_tokens")
    if mode in ("none", CONTROL):
        return None
    if mode in PLUGIN_MODES or mode == "dflash-vllm":
        cfg = {"method": "dflash", "model": spec["draft"], "num_speculative_tokens": k}
        if mode in PLUGIN_MODES:
            cfg["adaptive"] = mode == "dflash-adaptive"
        sample = spec.get("draft_sample")
        if sample is not None:
            # The plugin's key for the plugin; vLLM's own key (same meaning) for the in-tree proposer.
            if mode in PLUGIN_MODES:
                cfg["draft_sample"] = sample
            else:
                cfg["draft_sample_method"] = {"argmax": "greedy", "sample": "probabilistic"}[sample]
        return cfg
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if mode == "eagle3":
        return {"method": "eagle3", "model": spec["eagle3_head"], "num_speculative_tokens": k}
    raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}")


def mode_env(mode: str) -> dict[str, str | None]:
    """Environment changes of a mode (None = unset): dflash runs the plugin's
    proposer, dflash-vllm vLLM's in-tree one."""
    return {"VLLM_DFLASH_IMPL": "vllm" if mode == "dflash-vllm" else None}


def digest(token_ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


WARMUP_WAVES = 2  # in-flight warm-up: 2c requests, c at a time (`run`)


def warm_up_prompts(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """An in-flight warm-up's requests at `concurrency` c: WARMUP_WAVES x c of `prompts`, cycled
    where there are fewer (all of them at every c would be ~50 requests at c = 1)."""
    return cycled(prompts[:WARMUP_WAVES * concurrency], concurrency, WARMUP_WAVES)


def cycled(prompts: list[list[int]], concurrency: int, waves: int = 1) -> list[list[int]]:
    """The prompts repeated in order up to the next multiple of `concurrency`, and to at
    least `waves` times it."""
    n = max(math.ceil(len(prompts) / concurrency), waves) * concurrency
    return [prompts[i % len(prompts)] for i in range(n)]


def batches_for(prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
    """Cycle prompts to a multiple of `concurrency` and cut them into full batches."""
    requests = cycled(prompts, concurrency)
    return [requests[i:i + concurrency] for i in range(0, len(requests), concurrency)]


BATCHING = ("in-flight", "waves")  # --batching; the first is the default


@contextlib.contextmanager
def in_flight(llm: Any, limit: int):
    """At most `limit` requests run at once inside the block (the engine's own limit after)."""
    scheduler = scheduler_of(llm)
    if scheduler is None:
        raise RuntimeError("the bench caps requests in flight on the scheduler of an in-process engine; "
                           "run it with VLLM_ENABLE_V1_MULTIPROCESSING=0 (python -m vllm_dflash.bench.runner "
                           "sets it), or use --batching waves")
    saved = scheduler.max_num_running_reqs, scheduler.max_num_active_reqs
    scheduler.max_num_running_reqs = scheduler.max_num_active_reqs = min(limit, saved[0])
    try:
        yield
    finally:
        scheduler.max_num_running_reqs, scheduler.max_num_active_reqs = saved


def read_profile(path: str | None) -> dict | None:
    """The proposer's own profile (VLLM_DFLASH_PROFILE_FILE, written by
    vllm_dflash.profiler): {"phases": {name: {"calls", "seconds"}}}."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def run(spec: dict) -> dict:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dflash.bench.metrics import SpecCounters

    spec_cfg = speculative_config(spec)
    concurrency = list(spec["concurrency"])
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["target"],
        skip_tokenizer_init=not spec["has_tokenizer"],
        speculative_config=spec_cfg,
        max_num_seqs=max(concurrency),
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,  # repeats and warmup must not hit cached prefixes
        disable_log_stats=False,  # LLM.get_metrics() needs stat logging
        # Per-request acceptance histograms on each RequestOutput (vLLM >= 0.32).
        per_request_spec_decode_metrics="summary" if spec_cfg else "none",
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5),
        seed=spec["seed"],
        **spec.get("engine_kwargs", {}),
    )
    engine_start_s = time.perf_counter() - t0
    model_runner = model_runner_of(llm)
    drafter = getattr(model_runner, "drafter", None) if model_runner is not None else None
    adaptive = getattr(drafter, "adaptive", None)  # the plugin's adaptive speculation, when on
    proposer = None if drafter is None else f"{type(drafter).__module__}.{type(drafter).__qualname__}"
    timer = None
    if model_runner is not None and spec.get("time_steps", True):
        import torch

        timer = profiler.PhaseTimer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
        profiler.time_engine_steps(model_runner, timer)
    profile_file = envs.VLLM_DFLASH_PROFILE_FILE

    request_index = itertools.count()

    def params() -> Any:
        # Sampled runs: every request its own seed, the same sequence of seeds in every mode
        # (one seed for all requests would make them one correlated sample).
        return SamplingParams(temperature=spec["temperature"], max_tokens=spec["max_tokens"],
                              ignore_eos=spec["ignore_eos"], detokenize=False,
                              seed=None if spec["temperature"] == 0 else spec["seed"] + next(request_index))

    def generate(batch: list[list[int]], concurrency: int):
        """`batch`, at most `concurrency` requests in flight at a time."""
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch]
        with in_flight(llm, concurrency) if len(batch) > concurrency else contextlib.nullcontext():
            return llm.generate(prompts, [params() for _ in batch], use_tqdm=False)

    def counters() -> SpecCounters:
        return SpecCounters.from_metrics(llm.get_metrics())

    turns = Turns(**spec["turns"]) if spec.get("turns") else None  # --interleave: engines take turns per pass
    if turns is not None:
        turns.ready()
    turn = turns.turn if turns is not None else contextlib.nullcontext

    all_prompts = [p for ps in spec["prompts"].values() for p in ps]
    in_flight_cells = spec.get("batching", BATCHING[0]) == "in-flight"
    with turn():
        # First-call costs stay out of the timing, for every engine alike: per batch size, what an
        # engine pays once there (compiled shapes; adaptive speculation's warm-up steps and its
        # first measuring runs at a new size). With in-flight cells each warm-up holds c requests
        # in flight through WARMUP_WAVES waves, as the cells do. With one batch of c, whose
        # requests finish one by one, the first measuring runs fell in the timed cells, mostly the
        # first category at each size: cells holding one ran a median 0.90x of no speculation
        # against 0.96x for the others at 8-64 requests (96 cells, Zen 4 EPYC, runs/s1222).
        for _ in range(spec["warmup"]):
            for c in concurrency:
                generate(warm_up_prompts(all_prompts, c) if in_flight_cells else batches_for(all_prompts, c)[0], c)

    cells = []
    total = len(spec["prompts"]) * len(concurrency) * spec["repeats"]
    bar = tqdm(total=total, desc=f"{spec['mode']} k={spec.get('num_spec_tokens')}", file=sys.stderr)
    for category, prompts in spec["prompts"].items():
        for c in concurrency:
            if in_flight_cells:
                batches = [cycled(prompts, c, spec.get("waves", 1))]  # one call; c at a time
            else:
                batches = batches_for(prompts, c)
            cell: dict[str, Any] = {"category": category, "concurrency": c, "wall_s": 0.0,
                                    "prompt_tokens": 0, "output_tokens": 0, "requests": [],
                                    "output_digests": []}
            if spec["keep_outputs"]:
                cell["output_token_ids"] = []
            # With --interleave, each pass is one turn: the engines' passes over a cell alternate, so
            # a slow phase of the machine (seconds long, +-10% here) falls on all of them alike.
            for rep in range(spec["repeats"]):
                with turn():
                    if rep == 0:
                        start = counters()
                        step0 = profiler.step_split(timer.phases) if timer else None
                        prof0 = read_profile(profile_file)
                        adaptive0 = adaptive.stats.snapshot() if adaptive is not None else None
                    for batch in batches:
                        t = time.perf_counter()
                        outs = generate(batch, c)
                        cell["wall_s"] += time.perf_counter() - t
                        for o in outs:
                            ids = list(o.outputs[0].token_ids)
                            m = o.metrics
                            cell["prompt_tokens"] += len(o.prompt_token_ids)
                            cell["output_tokens"] += len(ids)
                            req = {"queued_ts": m.queued_ts, "first_token_ts": m.first_token_ts,
                                   "last_token_ts": m.last_token_ts, "num_output_tokens": len(ids)}
                            sd = getattr(o.outputs[0], "spec_decode_metrics", None)
                            if sd is not None:
                                req["spec_histogram"] = list(sd.histogram)
                                req["spec_draft_tokens"] = int(sd.num_draft_tokens)
                            cell["requests"].append(req)
                            if rep == 0:
                                cell["output_digests"].append(digest(ids))
                                if spec["keep_outputs"]:
                                    cell["output_token_ids"].append(ids)
                    bar.update(1)
                    if rep == spec["repeats"] - 1:
                        cell["counters"] = (counters() - start).to_dict() if spec_cfg else None
                        if timer:
                            now = profiler.step_split(timer.phases)
                            cell.update({name: now[name] - step0[name] for name in TIMED_PARTS})
                            if not spec_cfg:
                                cell["draft_s"] = 0.0
                        cell["proposer_profile"] = profiler.delta((prof0 or {}).get("phases"),
                                                                  (read_profile(profile_file) or {}).get("phases"))
                        if adaptive is not None:  # what adaptive speculation decided in this cell, and how well
                            from vllm_dflash.adaptive.stats import difference

                            cell["adaptive"] = difference(adaptive.stats.snapshot(), adaptive0)
            cells.append(cell)
    bar.close()
    return {"mode": spec["mode"], "num_spec_tokens": spec.get("num_spec_tokens"), "proposer": proposer,
            "dtype": spec.get("engine_kwargs", {}).get("dtype"), "engine_start_s": engine_start_s, "cells": cells}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m vllm_dflash.bench.runner SPEC.json RESULT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the engine's interpreter-exit teardown (seconds on CPU): the result is on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
