"""`vllm-dflash demo` (`make demo`): the bundled pair with and without DFlash.

A small `vllm-dflash bench`: modes none and dflash-adaptive (the plugin as a
user runs it: adaptive speculation), concurrency 1, a few toy prompts per
category, one fresh engine per mode. Prints one generated text,
whether DFlash reproduced the no-spec output, the acceptance length and the
speedup per category.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

from vllm_dflash.bench import cli as bench_cli

SPEC_MODE = "dflash-adaptive"  # the plugin's default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="default: bundled models/toy-target")
    parser.add_argument("--draft", default=None, help="default: bundled models/toy-draft")
    parser.add_argument("--num-prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-spec-tokens", default=None, help="default: the draft's block_size - 1")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS per engine (1 keeps vLLM's CPU kernels steady on a busy machine)")
    parser.add_argument("--dtype", default="float32",
                        help="engine dtype; float32 (default) makes DFlash's greedy output bit-identical to "
                             "decoding without it, 'auto' runs the checkpoint's bfloat16 (faster; a (k+1)-token "
                             "verify pass may round a near-tie differently)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the engines (slower start; the demo runs eager by default)")
    parser.add_argument("--out", default=None, help="default: runs/demo-<time>")


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The bench namespace the demo runs: every bench flag at its default, then the demo's."""
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    b = parser.parse_args([])
    b.target, b.draft = args.target, args.draft
    b.modes, b.concurrency = f"none,{SPEC_MODE}", "1"
    b.num_prompts, b.max_tokens, b.threads = args.num_prompts, args.max_tokens, args.threads
    b.num_spec_tokens = args.num_spec_tokens
    b.keep_outputs, b.enforce_eager, b.dtype = True, not args.compile, args.dtype
    b.out = args.out or os.path.join("runs", "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return b


def _decode(target: str, ids: list[int]) -> str:
    from vllm_dflash.bench.prompts import has_tokenizer

    if not has_tokenizer(target):
        return f"(no tokenizer; token ids) {ids}"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target).decode(ids, skip_special_tokens=True)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(doc: dict) -> str:
    cfg = doc["config"]
    res = {(r["mode"], r["category"]): r for r in doc["results"]}
    cats = [c for c in dict.fromkeys(r["category"] for r in doc["results"]) if c != "all"]
    lines = []
    outputs = doc.get("outputs", {})
    spec_run = next((k for k in outputs if k.startswith("dflash")), None)
    if spec_run and cats:
        cat = "math" if "math" in cats else cats[0]  # the toy target's most readable category
        ids, ref = outputs[spec_run][cat][0], outputs["none"][cat][0]
        lines.append(f"--- prompt ({cat}): {doc['prompts'][cat]['texts'][0]}")
        lines.append(f"--- DFlash output ({len(ids)} tokens):")
        lines.append(_decode(cfg["target"], ids).strip())
        lines.append("---")
        pairs = [(a, b) for c in cats for a, b in zip(outputs[spec_run][c], outputs["none"][c])]
        same = sum(a == b for a, b in pairs)
        note = f"{same}/{len(pairs)} DFlash outputs are identical to the outputs without speculation"
        if same < len(pairs):
            first = min(_first_difference(a, b) for a, b in pairs if a != b)
            note += (f" (earliest difference at token {first}: in reduced precision (--dtype {cfg['dtype']}) a (k+1)-token"
                     " verify pass rounds differently from 1-token decoding and can flip near-ties;"
                     " use --dtype float32 to compare exactly)")
        lines.append(note)
    lines.append("Tokens/s per request (median; one request at a time), speedup, acceptance length:")
    lines.append(f"{'category':<10}{'no-spec tok/s':>14}{'DFlash tok/s':>14}{'speedup':>9}{'accept len':>12}")
    for cat in cats + ["all"]:
        base, spec = res.get(("none", cat)), res.get((SPEC_MODE, cat))
        if not base or not spec:
            continue
        tau = (spec.get("acceptance") or {}).get("mean_length", math.nan)
        lines.append(f"{cat:<10}{base['request_tokens_per_s_p50']:>14.1f}{spec['request_tokens_per_s_p50']:>14.1f}"
                     f"{spec['speedup_p50']:>8.2f}x{tau:>12.2f}")
    run = next((r for r in doc["runs"] if r["mode"] == SPEC_MODE), None)
    if run:
        lines.append(f"DFlash (adaptive, k <= {run['num_spec_tokens']}) proposer: {run['proposer']}")
    note = bench_cli.busy_note(doc)
    if note:
        lines.append(note)
    lines.append(f"Details: {os.path.join(cfg['out'], 'results.json')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    b = bench_args(args)
    try:
        doc = bench_cli.execute(b)
    except ValueError as e:
        print(f"vllm-dflash demo: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"vllm-dflash demo: {e}", file=sys.stderr)
        return 1
    print(report(doc))
    return 0
