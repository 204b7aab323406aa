"""vllm-dflash's DFlash inside vLLM's engine, end to end (CPU, float32).

One tiny random Qwen3 target and random 2-layer DFlash drafts (block 16, two
target features, correlated with the target so drafts get accepted now and
then). Engines, one at a time, all with the same scheduler settings (block
size 32, a KV cache small enough to preempt, 128-token steps so long prompts
are chunked, prefix caching):

* no speculation: the reference output;
* the plugin's DFlash with k = 3, 7 (eager) and 15 (torch.compile, vLLM's default);
* vLLM's in-tree DFlash with k = 7, in a subprocess (VLLM_DFLASH_IMPL=vllm).

Every DFlash engine records each propose() call: per request, the position of
its bonus token and the k draft tokens. Checks: greedy outputs equal the
no-spec engine's token for token; every decode-time draft equals the
pure-torch reference draft (`vllm_dflash.reference`) run on the same prefix;
and the plugin's drafts equal the in-tree DFlash's step for step.

The in-tree comparison uses a draft whose layers share one k_norm weight:
vLLM 0.32's in-tree DFlash normalises context keys of all layers in one
`ops.rms_norm` call with stacked [L, head_dim] weights
(model_executor/models/qwen3_dflash.py:643, `_normalize_context_k`), and the
CPU kernel applies weight row 0 to every layer (its output equals the row-0
result exactly), so on CPU the in-tree drafts are wrong for drafts whose
layers differ in k_norm. The k = 3 and 15 engines use distinct k_norms,
checked against the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_dflash import envs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))

VOCAB = 256
BLOCK_SIZE = 16
NUM_PROMPTS = 32
LONG_PROMPT_LEN = 300  # > max_num_batched_tokens: prefilled in chunks
K_VALUES = (3, 7, 15)
COMPILED_K = 15  # this engine runs vLLM's default torch.compile path (the draft's forward too)
ORACLE_K = 7

pytestmark = pytest.mark.vllm

def build_models(root: str) -> dict[str, str]:
    """target, draft (distinct k_norms) and draft_shared_knorm folders under root."""
    import copy

    import torch
    from helpers import correlate_pair, random_draft, save_pair, tiny_target

    from vllm_dflash.reference import save_draft

    target = tiny_target(vocab_size=VOCAB, seed=0)
    draft = random_draft(target, num_layers=2, block_size=BLOCK_SIZE, seed=1, target_layer_ids=[0, 2])
    correlate_pair(target, draft)
    target_dir, draft_dir = save_pair(target, draft, root)
    shared = copy.deepcopy(draft)
    with torch.no_grad():
        for layer in shared.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(shared.layers[0].self_attn.k_norm.weight)
    shared_dir = os.path.join(root, "draft_shared_knorm")
    save_draft(shared, shared_dir)
    return {"target": target_dir, "draft": draft_dir, "draft_shared_knorm": shared_dir}


def draft_for(k: int) -> str:
    return "draft_shared_knorm" if k == ORACLE_K else "draft"


def workload() -> tuple[list[list[int]], list[int], list[int]]:
    """32 prompts with varied lengths and output budgets (requests finish at
    different steps, new ones join running decodes) and one long prompt."""
    from helpers import random_prompts

    prompts = random_prompts(NUM_PROMPTS, VOCAB, min_len=4, max_len=60, seed=0)
    max_tokens = [16 + (7 * i) % 25 for i in range(NUM_PROMPTS)]
    (long_prompt,) = random_prompts(1, VOCAB, LONG_PROMPT_LEN, LONG_PROMPT_LEN, seed=1)
    return prompts, max_tokens, long_prompt


def engine_kwargs(target_dir: str, draft_dir: str, k: int | None, adaptive: bool = False,
                  eager: bool | None = None, prefix_caching: bool = True) -> dict:
    kwargs = dict(
        model=target_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=384,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        block_size=32,
        num_gpu_blocks_override=14,  # ~13 usable blocks for 8 requests: forces preemption
        enable_prefix_caching=prefix_caching,
        enforce_eager=k != COMPILED_K if eager is None else eager,
    )
    if k is not None:
        kwargs["speculative_config"] = {"method": "dflash", "model": draft_dir, "num_speculative_tokens": k,
                                        "adaptive": adaptive}
    return kwargs


class ProposalRecorder:
    """Wraps runner.drafter.propose: per call, {prompt index: (bonus position,
    drafts)} for requests whose sampled token is kept (partial-prefill chunks,
    also of requests resumed after preemption, draft from a placeholder and
    their drafts are discarded: not recorded). The drafts are the whole
    drafted block (adaptive speculation hands out a prefix of it; its
    lengths go to `handed`, per call {prompt index: length}); calls that
    drafted nothing (adaptive q = 0) record no drafts, steps that the proposer
    settled before vLLM's glue (`propose_unverified_step`: nothing verified,
    nothing to draft) too, so there is one call per engine step."""

    def __init__(self, runner, prompts: list[list[int]]):
        self.runner = runner
        self.index = {tuple(p): i for i, p in enumerate(prompts)}
        self.calls: list[dict[int, tuple[int, list[int]]]] = []
        self.handed: list[dict[int, int]] = []
        self.unverified_steps = 0  # steps settled before vLLM's drafting glue
        drafter = runner.drafter
        self.original = drafter.propose
        drafter.propose = self.propose
        self.original_unverified = getattr(drafter, "propose_unverified_step", None)
        if self.original_unverified is not None:
            drafter.propose_unverified_step = self.propose_unverified_step
        # Of those: steps that continued a coasting run the quick way (DFlashProposer._coast_on), and
        # of these the first steps of runs (_coast_first).
        self.quick_coasting_steps = self.run_opening_steps = 0
        self._count_settled(drafter, "_coast_on", "quick_coasting_steps")
        self._count_settled(drafter, "_coast_first", "run_opening_steps")
        # Per sampled step: None (plain step, vLLM's own sampler) or the longest draft verified.
        self.verified_spec_len: list[int | None] = []
        self.original_sample = runner._sample
        runner._sample = self.sample
        # Per target pass: (scheduled tokens, requests, tokens the pass ran with, padding included,
        # whether the step verifies drafts).
        self.target_rows: list[tuple[int, int, int, bool | None]] = []
        self.original_padding = runner._determine_batch_execution_and_padding
        runner._determine_batch_execution_and_padding = self.padding
        # Per context K/V projection: (context rows, rows its GEMMs ran with).
        self.context_rows: list[tuple[int, int]] = []
        model = drafter.model.unwrap() if hasattr(drafter.model, "unwrap") else drafter.model
        writer = getattr(model, "context_kv_writer", None)  # vLLM's in-tree draft has none
        if writer is not None:
            project, native = writer.project, writer._project_native

            def recording_project(features):
                self.context_rows.append((features.shape[0], None))
                return project(features)

            def recording_native(features):
                self.context_rows[-1] = (self.context_rows[-1][0], features.shape[0])
                return native(features)

            writer.project, writer._project_native = recording_project, recording_native

    def padding(self, num_tokens, num_reqs, *args, **kwargs):
        result = self.original_padding(num_tokens, num_reqs, *args, **kwargs)
        # (set by the plugin's _prepare_inputs wrap; vLLM's in-tree proposer runs without it)
        verifies = getattr(self.runner, "_dflash_verifies_drafts", None)
        self.target_rows.append((num_tokens, num_reqs, result[1].num_tokens, verifies))
        return result

    def sample(self, logits, spec_decode_metadata):
        self.verified_spec_len.append(None if spec_decode_metadata is None else spec_decode_metadata.max_spec_len)
        return self.original_sample(logits, spec_decode_metadata)

    def _count_settled(self, drafter, method: str, counter: str) -> None:
        """Count in `counter` the calls of the drafter's `method` that settled the step (not None)."""
        original = getattr(drafter, method, None)
        if original is None:
            return

        def counting(*args):
            drafts = original(*args)
            setattr(self, counter, getattr(self, counter) + (drafts is not None))
            return drafts

        setattr(drafter, method, counting)

    def propose_unverified_step(self, runner, *args):
        drafts = self.original_unverified(runner, *args)
        if drafts is not None:
            self.unverified_steps += 1
            discarded = runner.discard_request_mask.np[:len(drafts)].tolist()
            self.calls.append({})
            self.handed.append({self.index.get(tuple(runner.requests[req_id].prompt_token_ids), -1): len(d)
                                for req_id, d, gone in zip(runner.input_batch.req_ids, drafts, discarded)
                                if not gone})
        return drafts

    def propose(self, **kwargs):
        drafts = self.original(**kwargs)
        block = getattr(self.runner.drafter, "last_draft_block", None)  # vLLM's in-tree proposer has none
        block = drafts if block is None else block
        cad = kwargs["common_attn_metadata"]
        rejected = kwargs["num_rejected_tokens_gpu"]
        batch = len(drafts)
        last = cad.query_start_loc[1 : batch + 1].long() - 1
        if rejected is not None:
            last = last - rejected.long()
        bonus_pos = (kwargs["target_positions"][last] + 1).tolist()
        discarded = self.runner.discard_request_mask.np[:batch].tolist()
        call, handed = {}, {}
        for row, req_id in enumerate(self.runner.input_batch.req_ids[:batch]):
            if discarded[row]:
                continue
            prompt = tuple(self.runner.requests[req_id].prompt_token_ids)
            if block.shape[1]:
                call[self.index.get(prompt, -1)] = (bonus_pos[row], block[row].tolist())
            handed[self.index.get(prompt, -1)] = len(drafts[row])
        self.calls.append(call)
        self.handed.append(handed)
        return drafts


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs]


def run_engine(target_dir: str, draft_dir: str, k: int | None, phases=("batch8", "batch1", "long"),
               adaptive: bool = False, schedule: str | None = None, eager: bool | None = None,
               prefix_caching: bool = True) -> dict:
    """Run the workload on one engine; returns outputs, drafter facts and proposals.
    `schedule`: a forced adaptive schedule (VLLM_DFLASH_ADAPTIVE_SCHEDULE, test hook)."""
    from engines import vllm_engine

    env = {envs.ADAPTIVE_SCHEDULE_ENV: schedule} if schedule else None  # read when the proposer is built
    with vllm_engine(env=env, **engine_kwargs(target_dir, draft_dir, k, adaptive, eager, prefix_caching)) as llm:
        return _run_workload(llm, k, phases)


def _run_workload(llm, k: int | None, phases) -> dict:
    from vllm_dflash.patches import model_runner_of

    prompts, max_tokens, long_prompt = workload()
    core = llm.llm_engine.engine_core.engine_core  # the scheduler, for preemptions
    runner = model_runner_of(llm)
    preemptions = []
    original_preempt = core.scheduler._preempt_request

    def count_preemption(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return original_preempt(request, *args, **kwargs)

    core.scheduler._preempt_request = count_preemption
    result: dict = {"preemptions": 0}
    recorder = None
    if k is not None:
        drafter = runner.drafter
        result["drafter"] = f"{type(drafter).__module__}.{type(drafter).__qualname__}"
        model = drafter.model.unwrap() if hasattr(drafter.model, "unwrap") else drafter.model
        result["draft_model"] = f"{type(model).__module__}.{type(model).__qualname__}"
        recorder = ProposalRecorder(runner, prompts + [long_prompt])
        if getattr(drafter, "adaptive", None) is not None:
            result["adaptive_stats"] = drafter.adaptive.stats
    for phase in phases:
        start = len(recorder.calls) if recorder else 0
        if phase == "batch8":  # max_num_seqs=8: up to 8 requests per step
            result[phase], _ = generate(llm, prompts, max_tokens)
        elif phase == "batch1":  # one request at a time
            result[phase] = [generate(llm, [p], [m])[0][0] for p, m in zip(prompts, max_tokens)]
        elif phase == "long":  # chunked prefill, then the same prompt again: prefix-cache hit
            first, _ = generate(llm, [long_prompt], [24])
            second, cached = generate(llm, [long_prompt], [24])
            result[phase] = first + second
            result["long_cached_tokens"] = cached[0]
        if recorder:
            result[f"proposals_{phase}"] = recorder.calls[start:]
            result[f"handed_{phase}"] = recorder.handed[start:]
            result[f"unverified_steps_{phase}"] = recorder.unverified_steps
            result[f"quick_coasting_steps_{phase}"] = recorder.quick_coasting_steps
            result[f"run_opening_steps_{phase}"] = recorder.run_opening_steps
    if recorder:
        result["verified_spec_len"] = recorder.verified_spec_len
        result["target_rows"] = recorder.target_rows
        result["context_rows"] = recorder.context_rows
        result["gemm_row_limit"] = getattr(runner.drafter, "gemm_row_limit", None)  # ours only
        result["max_num_tokens"] = runner.max_num_tokens
        from vllm_dflash.serving import gemm_rows

        result["shape_compiled_linears"] = len(gemm_rows.shape_compiled_linears(runner.model))
    result["preemptions"] = len(preemptions)
    if "adaptive_stats" in result:
        result["adaptive_stats"] = result["adaptive_stats"].snapshot()
        result["dropped_context_rows"] = runner.drafter.deferred_context.dropped_rows
        result["context_row_seconds"] = runner.drafter._context_write_cost.per_row()
        result["switch_cost_wired"] = runner.drafter.adaptive.controller.switch_cost == runner.drafter._switch_cost
    return result


def accepted_lengths(proposals, prompts, outputs) -> list[int]:
    """Per recorded draft: how many leading tokens greedy verification accepts,
    scored against the no-spec outputs."""
    lengths = []
    for call in proposals:
        for idx, (pos, drafts) in call.items():
            if not 0 <= idx < len(outputs):
                continue
            truth = outputs[idx][pos - len(prompts[idx]) + 1 :]
            n = 0
            while n < min(len(drafts), len(truth)) and drafts[n] == truth[n]:
                n += 1
            lengths.append(n)
    return lengths


def reference_drafts(models: dict[str, str], draft_name: str, calls, sequences: dict) -> list:
    """The pure-torch reference's drafts for every decode-time call in `calls`:
    target features of the request's first `pos` tokens (HF target), block
    [token at pos, MASK x k] at positions [pos, pos + k]. `sequences` maps a
    prompt index to (prompt, greedy output). Returns
    [(call index, prompt index, ours, reference)]."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_dflash.reference import TargetFeatures, load_draft
    from vllm_dflash.reference.spec_decode import draft_block

    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    draft = load_draft(models[draft_name])
    features = {}
    compared = []
    with torch.no_grad(), TargetFeatures(target, draft.target_layer_ids) as recorder:
        for step, call in enumerate(calls):
            for idx, (pos, drafts) in call.items():
                if idx not in sequences:
                    continue
                prompt, output = sequences[idx]
                seq = list(prompt) + list(output)
                if pos >= len(seq):
                    continue  # a request that just ended: no ground truth to draft from
                if idx not in features:
                    target(torch.tensor([seq]))
                    features[idx] = recorder.pop()
                ref = draft_block(
                    draft, target, seq[pos], features[idx][:, :pos], pos, len(drafts) + 1, draft.new_kv_cache()
                )
                compared.append((step, idx, list(drafts), ref))
    return compared


# ------------------------------------------------------------------ fixtures --


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(str(tmp_path_factory.mktemp("dflash_e2e")))


@pytest.fixture(scope="module")
def baseline(models):
    return run_engine(models["target"], None, k=None)


@pytest.fixture(scope="module")
def plugin(models):
    import vllm_dflash

    vllm_dflash.register()  # no-op when vLLM already loaded it through the entry point
    return {k: run_engine(models["target"], models[draft_for(k)], k=k) for k in K_VALUES}


# Adaptive speculation (k = 15 at most), on the same workload: two forced
# schedules (test hook) and the cost-driven controller.
PAUSE = (4, 40)  # no drafting in steps 4..39
ADAPTIVE_RUNS = {
    # q jumps between 0 (no draft forward) and 15 step to step; requests of a batch get
    # different budgets (0, 15 and in between); chunked prefill, prefix cache, preemption.
    "jump": dict(schedule="jump", phases=("batch8", "long"), eager=True),
    # full blocks, except 36 steps without drafting: the context KV must be intact after.
    "pause": dict(schedule=f"pause:{PAUSE[0]}:{PAUSE[1]}", phases=("batch8",), eager=True),
    # the same without prefix caching: held context rows of requests that finish during the
    # pause are dropped, never written; the live requests' cache must still be intact.
    "pause_nocache": dict(schedule=f"pause:{PAUSE[0]}:{PAUSE[1]}", phases=("batch8",), eager=True,
                          prefix_caching=False),
    # the real controller, torch.compile on (vLLM's default path).
    "controller": dict(schedule=None, phases=("batch8", "long"), eager=False),
}


@pytest.fixture(scope="module")
def adaptive(models):
    import vllm_dflash

    vllm_dflash.register()
    return {name: run_engine(models["target"], models["draft"], k=15, adaptive=True, **kw)
            for name, kw in ADAPTIVE_RUNS.items()}


@pytest.fixture(scope="module")
def in_tree(models, tmp_path_factory):
    from limits import HANG_GUARD_S  # imported here: this file also runs as a script

    out = str(tmp_path_factory.mktemp("in_tree") / "in_tree.json")
    env = dict(os.environ, VLLM_DFLASH_IMPL="vllm", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(__file__), models["target"], models[draft_for(ORACLE_K)], str(ORACLE_K), out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


# --------------------------------------------------------------------- tests --


def test_plugin_proposer_and_draft_model_in_use(plugin):
    for k, run in plugin.items():
        assert run["drafter"] == "vllm_dflash.serving.proposer.DFlashProposer", k
        assert run["draft_model"] == "vllm_dflash.serving.draft_model.DFlashDraftForCausalLM", k
        assert len(run["proposals_batch8"]) > 0, k
        assert all(len(d) == k for call in run["proposals_batch8"] for _, d in call.values())


@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_output_identical_to_no_spec(baseline, plugin, k):
    run = plugin[k]
    assert len(baseline["batch8"]) == len(baseline["batch1"]) == NUM_PROMPTS
    assert run["batch8"] == baseline["batch8"]  # batches of up to 8, mixed prefill/decode
    assert run["batch1"] == baseline["batch1"]  # batch size 1


@pytest.mark.parametrize("k", K_VALUES)
def test_chunked_prefill_and_prefix_cache(baseline, plugin, k):
    run = plugin[k]
    assert run["long"] == baseline["long"]
    assert run["long"][0] == run["long"][1]
    assert run["long_cached_tokens"] >= 32, "the repeated prompt should hit the prefix cache"


def test_preemption_happened(baseline, plugin):
    # The small KV cache must force recomputation, or the tests above cover less.
    assert baseline["preemptions"] > 0
    assert all(run["preemptions"] > 0 for run in plugin.values())


def test_drafts_accepted_sometimes(baseline, plugin):
    """The correlated pair must exercise multi-token acceptance, or the output
    checks above only cover the all-rejected path."""
    prompts, _, _ = workload()
    for k, run in plugin.items():
        lengths = accepted_lengths(run["proposals_batch8"], prompts, baseline["batch8"])
        assert len(lengths) > 50, k
        assert sum(n >= 2 for n in lengths) >= 5, f"k={k}: accepted lengths {sorted(lengths)[-20:]}"


@pytest.mark.parametrize("k", K_VALUES)
def test_draft_tokens_equal_reference(models, baseline, plugin, k):
    """Every decode-time draft (batched, batch 1, chunked-prefill and
    prefix-cached requests, after preemptions) equals the pure-torch reference."""
    prompts, _, long_prompt = workload()
    run = plugin[k]
    for phase, sequences in (
        ("batch8", dict(enumerate(zip(prompts, baseline["batch8"])))),
        ("batch1", dict(enumerate(zip(prompts, baseline["batch1"])))),
        ("long", {len(prompts): (long_prompt, baseline["long"][0])}),  # recorder's index
    ):
        compared = reference_drafts(models, draft_for(k), run[f"proposals_{phase}"], sequences)
        assert len(compared) > 5, phase
        bad = [(step, idx, ours, ref) for step, idx, ours, ref in compared if ours != ref]
        assert not bad, f"{phase}: {len(bad)}/{len(compared)} drafts differ, first: {bad[:3]}"


def test_draft_tokens_equal_in_tree_dflash(baseline, plugin, in_tree):
    """Same weights, same prefixes: the plugin proposes exactly vLLM's in-tree drafts.

    Compared per (request, bonus position), not call by call: vLLM keeps K input slots per request
    out of the token budget for its in-tree DFlash and none for ours (register:
    SpeculativeConfig.max_num_new_slots_for_drafting), so prompts are chunked differently and the
    calls hold different batches; a draft depends only on its request's prefix."""
    assert in_tree["drafter"] == "vllm.v1.spec_decode.dflash.DFlashProposer"
    ours = plugin[ORACLE_K]
    assert in_tree["batch8"] == baseline["batch8"]
    theirs_calls = [{int(i): (p, d) for i, (p, d) in call.items()} for call in in_tree["proposals_batch8"]]
    ours_calls = [{int(i): (p, list(d)) for i, (p, d) in call.items()} for call in ours["proposals_batch8"]]
    theirs = {(i, p): d for call in theirs_calls for i, (p, d) in call.items()}
    mine = {(i, p): d for call in ours_calls for i, (p, d) in call.items()}
    common = sorted(theirs.keys() & mine.keys())
    assert len(common) >= max(20, len(theirs) // 2), (len(common), len(theirs), len(mine))
    bad = [(key, mine[key], theirs[key]) for key in common if mine[key] != theirs[key]]
    assert not bad, f"{len(bad)}/{len(common)} drafts differ, first: {bad[:3]}"
    prompts, _, _ = workload()
    assert sum(n >= 2 for n in accepted_lengths(ours_calls, prompts, baseline["batch8"])) >= 5


@pytest.mark.parametrize("name", list(ADAPTIVE_RUNS))
def test_adaptive_greedy_output_identical_to_no_spec(baseline, adaptive, name):
    run = adaptive[name]
    assert run["drafter"] == "vllm_dflash.serving.proposer.DFlashProposer"
    for phase in ADAPTIVE_RUNS[name]["phases"]:
        assert run[phase] == baseline[phase], phase
    assert run["preemptions"] > 0


def test_forced_schedule_mixes_budgets_within_batches(adaptive):
    """The jump schedule really did what it claims: steps without any draft, and
    batches whose requests were handed 0, 15 and lengths in between."""
    handed = adaptive["jump"]["handed_batch8"]
    no_draft = [h for h in handed if h and not any(h.values())]
    mixed = [h for h in handed if 0 in h.values() and 15 in h.values() and any(0 < n < 15 for n in h.values())]
    assert len(no_draft) >= 5 and len(mixed) >= 5, (len(no_draft), len(mixed))
    stats = adaptive["jump"]["adaptive_stats"]
    assert stats["steps"]["forced"] == len(handed) + len(adaptive["jump"]["handed_long"])
    assert stats["query_hist"][0] >= 5 and stats["query_hist"][15] >= 5


@pytest.mark.parametrize("name", ["jump", "pause", "pause_nocache"])
def test_adaptive_drafts_equal_reference_after_steps_without_drafting(models, baseline, adaptive, name):
    """Every decode-time draft block equals the pure-torch reference on the full prefix,
    including the first blocks after steps that drafted nothing: the context KV of
    every verified token was written in those steps too."""
    prompts, _, long_prompt = workload()
    run = adaptive[name]
    phases = {"batch8": dict(enumerate(zip(prompts, baseline["batch8"]))),
              "long": {len(prompts): (long_prompt, baseline["long"][0])}}
    for phase in ADAPTIVE_RUNS[name]["phases"]:
        compared = reference_drafts(models, "draft", run[f"proposals_{phase}"], phases[phase])
        assert len(compared) > 5, phase
        bad = [(step, idx, ours, ref) for step, idx, ours, ref in compared if ours != ref]
        assert not bad, f"{name}/{phase}: {len(bad)}/{len(compared)} drafts differ, first: {bad[:3]}"
    if name == "pause_nocache":  # requests finished during the pause: their held rows were dropped
        assert run["dropped_context_rows"] > 0
    elif name == "pause":  # with prefix caching every held row is written
        assert run["dropped_context_rows"] == 0
    if name.startswith("pause"):  # the pause happened, and drafting resumed after it
        calls = run["proposals_batch8"]
        assert all(not c for c in calls[PAUSE[0]:PAUSE[1]]) and sum(bool(c) for c in calls[PAUSE[1]:]) > 5
        # and (all but its first step, which verified the last drafts) it skipped vLLM's drafting
        # glue, its context held back until drafting resumed
        assert run["unverified_steps_batch8"] >= PAUSE[1] - PAUSE[0] - 1
        # most of them coasted the proposer's quick way (DFlashProposer._coast_on), the first steps
        # of runs included (_coast_first; a run is at most 16 steps, and ends where a request finishes)
        quick, opening = run["quick_coasting_steps_batch8"], run["run_opening_steps_batch8"]
        assert quick >= (PAUSE[1] - PAUSE[0]) // 2 and opening >= (PAUSE[1] - PAUSE[0]) // 16, (quick, opening)
        # the write of the held rows was timed: the controller prices the next switch to drafting by it
        assert run["switch_cost_wired"] and run["context_row_seconds"] > 0


def test_target_passes_with_drafts_run_on_the_gemm_row_grid(plugin, adaptive):
    """Where vLLM's CPU GEMMs make a kernel per row count (oneDNN), every target pass that verifies
    drafts and is not plain decode runs padded to serving.gemm_rows' grid; plain decode and steps
    that verify nothing (prompt chunks beside decodes, adaptive steps without drafts) run unpadded,
    as without speculation; the outputs stay those of no speculation (the tests above)."""
    from vllm_dflash.serving import gemm_rows

    runs = [*((f"k={k}", r) for k, r in plugin.items()), *adaptive.items()]
    if not runs[0][1]["shape_compiled_linears"]:
        pytest.skip("this machine's CPU linears are torch's own (no kernels per row count): nothing is padded")
    padded_context = 0
    for name, run in runs:
        limit = min(run["gemm_row_limit"], run["max_num_tokens"])
        padded = plain_chunks = 0
        for tokens, reqs, ran, verifies in run["target_rows"]:
            if tokens == reqs or not verifies:
                assert ran == tokens, (name, tokens, reqs, ran, verifies)
                plain_chunks += tokens != reqs and gemm_rows.padded_rows(tokens, limit) > tokens
            else:
                assert ran == gemm_rows.padded_rows(tokens, limit), (name, tokens, reqs, ran)
                padded += ran > tokens
        assert padded >= 5, (name, padded)
        assert plain_chunks >= 1, (name, "no prompt-chunk step off the grid was seen: the check above saw none")
        # the context K/V projections (float32 here: the model's own GEMMs) pad the same way
        context = run["context_rows"]
        assert context and all(ran == gemm_rows.padded_rows(rows, run["gemm_row_limit"]) for rows, ran in context), name
        assert any(ran > rows for rows, ran in context), name
        padded_context += sum(ran > rows for rows, ran in context)
    assert padded_context >= 5, padded_context


def test_steps_without_drafts_run_plain(plugin, adaptive):
    """A step in which no request verifies a draft is a plain step (no speculative metadata,
    vLLM's own sampler), and every step with speculative metadata verified drafts."""
    for name, run in [*((f"k={k}", r) for k, r in plugin.items()), *adaptive.items()]:
        lens = run["verified_spec_len"]
        assert None in lens and all(n is None or n > 0 for n in lens), (name, lens[:40])
        if name in ("jump", "pause", "pause_nocache"):   # the forced schedules' no-draft decode steps were plain
            assert lens.count(None) >= run["unverified_steps_batch8"], name


def test_acceptance_after_a_pause_equals_never_stopping(baseline, plugin, adaptive):
    """Drafts after the pause are the drafts the never-paused k = 15 engine made at the
    same request and position, so their acceptance is the same."""
    prompts, _, _ = workload()
    resumed = [c for c in adaptive["pause"]["proposals_batch8"][PAUSE[1]:] if c]
    never = {(idx, pos): d for call in plugin[15]["proposals_batch8"] for idx, (pos, d) in call.items()}
    matched = [(d, never[(idx, pos)]) for call in resumed for idx, (pos, d) in call.items() if (idx, pos) in never]
    assert len(matched) >= 20, len(matched)
    assert all(a == b for a, b in matched)
    ours = accepted_lengths(resumed, prompts, baseline["batch8"])
    assert sum(n >= 2 for n in ours) >= 3, "resumed drafts must be accepted, not collapsed"


def test_adaptive_counters_are_consistent(adaptive):
    """Outcomes were matched back to the drafts handed out (by request id): every
    engine observed verified positions, never more accepted than verified, and
    position j verified no more often than position j - 1. (Equality with vLLM's
    own counters: test_metrics.py.)"""
    for name, run in adaptive.items():
        stats = run["adaptive_stats"]
        verified, accepted = stats["verified_per_pos"], stats["accepted_per_pos"]
        assert sum(verified) > 0 and sum(accepted) > 0, name
        assert all(a <= v for a, v in zip(accepted, verified)), name
        assert all(a >= b for a, b in zip(verified, verified[1:])), name


if __name__ == "__main__":  # oracle mode: python test_serving_e2e.py TARGET DRAFT K OUT.json
    target_dir, draft_dir, k, out_path = sys.argv[1:5]
    assert envs.VLLM_DFLASH_IMPL == "vllm"
    res = run_engine(target_dir, draft_dir, int(k), phases=("batch8",))
    with open(out_path, "w") as f:
        json.dump(res, f)
