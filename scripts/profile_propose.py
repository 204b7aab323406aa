"""Per-step cost of DFlash's propose(): vllm-dflash's proposer beside vLLM's in-tree one.

    python scripts/profile_propose.py                       # tiny random target, k=15, batch 1 and 4
    python scripts/profile_propose.py --target toy --dtype bfloat16
    python scripts/profile_propose.py --impl plugin --mode eager --ops

Both proposers serve the same random target and the same random draft (all
layers share one k_norm weight: vLLM 0.32's CPU in-tree path applies layer 0's
k_norm to every layer, see tests/serving/test_intree_compat.py), so they draft the same
tokens and take the same number of steps. Each (impl, mode) runs one engine in
its own process (VLLM_DFLASH_IMPL picks the proposer at plugin load) with one
OpenMP thread; the engine serves every batch size, and by default the
implementations of a mode run side by side, so load from other processes hits
them alike.

Per batch size: a timed generate() run (tok/s), then one decode-step
propose() call is captured (arguments copied) and replayed --replays times;
propose() is idempotent (same K/V into the same slots), so the fastest replay
is its cost without interference from other processes. Its phases are timed
by vllm_dflash.profiler (the bench's phase names; "other" is the part of
propose() outside them):

    inputs         input preparation (positions, slots, ids, attention lengths)
    context_kv     target features -> context K/V in the draft's paged cache
    attn_metadata  draft attention metadata (vLLM's builder)
    draft_forward  query-block forward of the draft model
    sample         LM head + draft tokens

--ops also counts the torch ops dispatched from Python per propose() (top-level
profiler events; a compiled graph counts as one) and lists the costliest.
tok/s is generated tokens over the wall time of the timed generate() calls
(best repeat), tok/cpu-s the same tokens over the engine process's CPU time
(the robust figure when other processes share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_dflash.profiler import PROPOSE_OTHER, PROPOSE_PHASES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = (*PROPOSE_PHASES, PROPOSE_OTHER)


# ---------------------------------------------------------------- models --


def build_models(root: str, target: str, draft_layers: int, block_size: int) -> tuple[str, str]:
    """(target_dir, draft_dir): a random draft for `target` ("tiny" = a random
    4-layer Qwen3 built here, "toy" = models/toy-target, or a model folder)."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import random_draft, save_target, tiny_target

    from vllm_dflash.reference import save_draft

    if target == "tiny":
        hf_target = tiny_target(vocab_size=256, seed=0)
        target_dir = save_target(hf_target, os.path.join(root, "target"))
    else:
        from transformers import AutoModelForCausalLM

        target_dir = os.path.join(REPO, "models", "toy-target") if target == "toy" else target
        hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = random_draft(hf_target, num_layers=draft_layers, block_size=block_size, seed=1)
    with torch.no_grad():  # one k_norm for all layers: both proposers then compute the same drafts
        for layer in draft.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(draft.layers[0].self_attn.k_norm.weight)
    draft_dir = os.path.join(root, "draft")
    save_draft(draft, draft_dir)
    return target_dir, draft_dir


# ---------------------------------------------------------------- timing --


def summary(calls_log: list[dict], stat=statistics.median) -> dict:
    """`stat` (min: the least disturbed call) of every phase over the recorded
    propose() calls, ms; other = propose - phases, per call."""
    out = {key: 1e3 * stat([c[key] for c in calls_log]) for key in ("propose", *PROPOSE_PHASES)}
    out[PROPOSE_OTHER] = 1e3 * stat([c["propose"] - sum(c[p] for p in PROPOSE_PHASES) for c in calls_log])
    return out


def count_ops(drafter, num_calls: int) -> dict:
    """Profile the next `num_calls` propose() calls: top-level ops per call and
    the costliest op names (self + children CPU time, summed over calls)."""
    from torch.profiler import ProfilerActivity, profile

    propose = drafter.propose
    stats = {"calls": 0, "ops": 0, "by_name": {}, "sequence": []}

    def profiled(*args, **kwargs):
        if stats["calls"] >= num_calls:
            return propose(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = propose(*args, **kwargs)
        stats["calls"] += 1
        top = [e for e in prof.events() if e.cpu_parent is None and not e.name.startswith("ProfilerStep")]
        if stats["calls"] == num_calls:  # the last one: its op sequence, in order
            stats["sequence"] = [(e.name, round(e.cpu_time_total, 1)) for e in sorted(top, key=lambda e: e.time_range.start)]
        for evt in top:
            stats["ops"] += 1
            entry = stats["by_name"].setdefault(evt.name, [0, 0.0])
            entry[0] += 1
            entry[1] += evt.cpu_time_total / 1e3  # ms
        return out

    drafter.propose = profiled
    stats["restore"] = lambda: setattr(drafter, "propose", propose)
    return stats


# ---------------------------------------------------------------- replay --


def snapshot(value):
    """A private copy of a propose() argument: the runner reuses its buffers."""
    import dataclasses

    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if dataclasses.is_dataclass(value) and type(value).__name__ == "CommonAttentionMetadata":
        fields = {f.name: snapshot(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    return value


def capture_propose(drafter, batch: int) -> dict:
    """Keep a copy of the arguments of the latest verification-step propose()
    with `batch` requests (call `box["restore"]()` to unwrap)."""
    propose = drafter.propose
    box: dict = {}

    def capturing(*args, **kwargs):
        if kwargs["next_token_ids"].shape[0] == batch and kwargs.get("num_rejected_tokens_gpu") is not None:
            box["kwargs"] = {k: snapshot(v) for k, v in kwargs.items()}
        return propose(*args, **kwargs)

    drafter.propose = capturing
    box["restore"] = lambda: setattr(drafter, "propose", propose)
    return box


def replay(drafter, kwargs: dict, timer, num: int) -> None:
    """Run the same propose() `num` times (it is idempotent: the same K/V into
    the same slots); the timer records every call."""
    import torch

    timer.reset()
    with torch.inference_mode():
        for _ in range(num):
            drafter.propose(**kwargs)


# ---------------------------------------------------------------- worker --


def speculative_config(args) -> dict:
    """k draft tokens every step: this script times propose() at a fixed k, side by side with
    vLLM's in-tree proposer, which has no adaptive speculation. The plugin's adaptive default
    would draft nothing on these random prompts (steps without drafts never reach propose())."""
    config = {"method": "dflash", "model": args.draft_dir, "num_speculative_tokens": args.k}
    if args.impl == "plugin":
        config["adaptive"] = False
    return config


def worker(args) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dflash import profiler
    from vllm_dflash.patches import model_runner_of

    torch.manual_seed(0)
    llm = LLM(
        model=args.target_dir,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        seed=0,
        max_model_len=1024,
        max_num_seqs=max(args.batch),
        enable_prefix_caching=False,
        enforce_eager=args.mode == "eager",
        gpu_memory_utilization=0.5,
        speculative_config=speculative_config(args),
    )
    runner = model_runner_of(llm)
    drafter = runner.drafter
    drafter_name = f"{type(drafter).__module__}.{type(drafter).__qualname__}"
    timer = profiler.PhaseTimer(record_calls=True)
    hooks = profiler.PROPOSER_HOOKS["vllm" if args.impl == "vllm" else "plugin"]  # "before": the plugin, another checkout
    wrapped = profiler.time_proposer(drafter, timer, hooks)

    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (24 + 3 * i,), generator=gen).tolist() for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)

    def generate(batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    import vllm_dflash

    results = {"impl": args.impl, "mode": args.mode, "drafter": drafter_name, "wrapped": wrapped, "cells": [],
               "module_file": os.path.abspath(vllm_dflash.__file__)}
    for c in args.batch:
        batches = [prompts[i : i + c] for i in range(0, len(prompts) - c + 1, c)]
        generate(batches[0])  # warm-up: first-call costs stay out of the timing
        walls, cpus, tokens = [], [], 0
        timer.reset()
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            for batch in batches:
                tokens += generate(batch)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        calls = len(timer.calls_log)
        in_run = summary(timer.calls_log)  # medians over the calls of the timed run
        box = capture_propose(drafter, c)
        generate(batches[0])
        box.pop("restore")()
        replay(drafter, box["kwargs"], timer, args.replays)
        best = summary(timer.calls_log, min)
        cell = {
            "batch": c,
            "tok_s": tokens / sum(walls),
            "tok_s_best_repeat": tokens / args.repeats / min(walls),
            "tok_per_cpu_s": tokens / sum(cpus),
            "propose_calls": calls,
            "tokens_per_call": tokens / max(calls, 1),
            "propose_ms": best["propose"],
            "pieces_ms": {p: best[p] for p in COLUMNS},
            "run_median_ms": in_run,
        }
        if args.ops:
            stats = count_ops(drafter, num_calls=8)
            generate(batches[0])
            stats.pop("restore")()
            n = max(stats["calls"], 1)
            top = sorted(stats["by_name"].items(), key=lambda kv: -kv[1][1])[:12]
            cell["ops_per_call"] = stats["ops"] / n
            cell["top_ops"] = [(name, cnt / n, ms / n) for name, (cnt, ms) in top]
            cell["op_sequence"] = stats["sequence"]
        results["cells"].append(cell)
    llm.llm_engine.engine_core.shutdown()
    return results


# ---------------------------------------------------------------- parent --


def start_one(impl: str, mode: str, args, target_dir: str, draft_dir: str) -> tuple:
    """Start one engine process; returns what finish_one needs."""
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    code = args.before_repo if impl == "before" else REPO  # which vllm_dflash the engine loads
    env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")])
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = str(args.threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if impl == "vllm":
        env["VLLM_DFLASH_IMPL"] = "vllm"
    else:
        env.pop("VLLM_DFLASH_IMPL", None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--impl", impl, "--mode", mode,
           "--target-dir", target_dir, "--draft-dir", draft_dir, "--out", out, "--k", str(args.k),
           "--dtype", args.dtype, "--tokens", str(args.tokens), "--requests", str(args.requests),
           "--repeats", str(args.repeats), "--replays", str(args.replays), "--batch", *map(str, args.batch)] + (["--ops"] if args.ops else [])  # fmt: skip
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir())
    return impl, mode, proc, log, out


def finish_one(started: tuple) -> dict:
    impl, mode, proc, log, out = started
    if proc.wait() != 0:
        log.seek(0)
        sys.stderr.write(log.read()[-8000:])
        raise SystemExit(f"{impl}/{mode} failed (exit {proc.returncode})")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def print_table(results: list[dict], args) -> None:
    head = f"{'impl':7} {'mode':8} {'B':>2} {'propose':>8} " + " ".join(f"{p[:13]:>13}" for p in COLUMNS)
    head += f" {'tok/s':>7} {'tok/cpu-s':>9} {'tok/call':>8}"
    head += f" {'ops':>5}" if "ops_per_call" in results[0]["cells"][0] else ""
    print("propose() and its pieces: ms, fastest of the replays of one captured decode step (wall clock); "
          "tok/s: wall, best repeat; tok/cpu-s: tokens per CPU second of the engine process")
    print(head)
    print("-" * len(head))
    for res in results:
        for cell in res["cells"]:
            row = f"{res['impl']:7} {res['mode']:8} {cell['batch']:>2} {cell['propose_ms']:8.3f} "
            row += " ".join(f"{cell['pieces_ms'][p]:13.3f}" for p in COLUMNS)
            row += f" {cell['tok_s_best_repeat']:7.1f} {cell['tok_per_cpu_s']:9.1f} {cell['tokens_per_call']:8.2f}"
            if "ops_per_call" in cell:
                row += f" {cell['ops_per_call']:5.0f}"
            print(row)
    for res in results:
        for cell in res["cells"]:
            if "top_ops" in cell:
                print(f"\n{res['impl']} {res['mode']} B={cell['batch']}: top-level ops per call (count, ms)")
                for name, cnt, ms in cell["top_ops"]:
                    print(f"  {name[:70]:70} {cnt:5.1f} {ms:7.3f}")
                if args.trace:
                    print("  one call, in order (us): " + ", ".join(f"{n} {t:.0f}" for n, t in cell["op_sequence"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", nargs="+", default=["plugin", "vllm"], choices=["plugin", "vllm", "before"],
                        help="plugin: this checkout; vllm: vLLM's in-tree DFlash; before: --before-repo's plugin")
    parser.add_argument("--mode", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 4], help="concurrency levels")
    parser.add_argument("--k", type=int, default=15, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--target", default="tiny", help='"tiny" (random), "toy" (models/toy-target) or a folder')
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    parser.add_argument("--requests", type=int, default=8, help="prompts per batch size (cut into batches)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (tok/s: the best)")
    parser.add_argument("--ops", action="store_true", help="count top-level torch ops per propose()")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="OpenMP threads of each engine (0: leave the environment alone). One by default: on a shared "
        "machine a descheduled OpenMP thread stalls every barrier and compiled graphs slow down 10-50x",
    )  # fmt: skip
    parser.add_argument("--replays", type=int, default=300,
                        help="replays of one captured propose() per batch size (times: the fastest)")
    parser.add_argument("--trace", action="store_true", help="with --ops: print one call's op sequence")
    parser.add_argument("--before-repo", help="a checkout of vllm-dflash to run as --impl before (its vllm_dflash)")
    parser.add_argument(
        "--sequential", action="store_true",
        help="one engine at a time (default: the implementations of a mode run side by side, so that load from "
        "other processes hits them alike; each gets its own --threads)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target-dir", help=argparse.SUPPRESS)
    parser.add_argument("--draft-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if "before" in args.impl and not (args.worker or args.before_repo):
        parser.error("--impl before needs --before-repo PATH (a checkout whose vllm_dflash to run)")
    if args.requests < max(args.batch):
        parser.error(f"--requests {args.requests} is fewer than --batch {max(args.batch)}: each batch size needs "
                     "at least one full batch of prompts; raise --requests")
    if args.worker:
        args.impl, args.mode = args.impl[0], args.mode[0]
        res = worker(args)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return

    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as root:
        target_dir, draft_dir = build_models(root, args.target, args.draft_layers, block_size=args.k + 1)
        results = []
        for mode in tqdm(args.mode, desc="modes", file=sys.stderr):
            if args.sequential:
                for impl in args.impl:
                    results.append(finish_one(start_one(impl, mode, args, target_dir, draft_dir)))
            else:  # side by side: every implementation sees the same load from other processes
                started = [start_one(impl, mode, args, target_dir, draft_dir) for impl in args.impl]
                results += [finish_one(s) for s in started]
    for res in results:
        expect = "vllm.v1.spec_decode.dflash" if res["impl"] == "vllm" else "vllm_dflash.serving.proposer"
        if res["impl"] == "before" and not res.get("module_file", "").startswith(os.path.abspath(args.before_repo)):
            raise SystemExit(f"--impl before loaded vllm_dflash from {res.get('module_file')}, not {args.before_repo}")
        if not res["drafter"].startswith(expect):
            raise SystemExit(f"{res['impl']} ran {res['drafter']}, expected {expect}")
    print(f"k={args.k}, dtype={args.dtype}, target={args.target}, {args.tokens} tokens/request, "
          f"{args.requests} requests x {args.repeats} repeats per batch size, threads={args.threads or 'default'}")
    print_table(results, args)
    for b in args.batch:
        for mode in args.mode:
            by_impl = {r["impl"]: c for r in results if r["mode"] == mode for c in r["cells"] if c["batch"] == b}
            v = by_impl.get("vllm")
            for impl, p in by_impl.items():
                if v is None or impl == "vllm":
                    continue
                print(f"B={b} {mode}: {impl}/in-tree propose time {p['propose_ms'] / v['propose_ms']:.3f}, "
                      f"tok/s {p['tok_s_best_repeat'] / v['tok_s_best_repeat']:.3f}, "
                      f"tok/cpu-s {p['tok_per_cpu_s'] / v['tok_per_cpu_s']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
