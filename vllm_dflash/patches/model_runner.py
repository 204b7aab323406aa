"""Reaching the model runner of an in-process engine, and what is wrapped on it.

Tests, the benchmark and the profiling script run the engine in their own
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) to look at the runner, its drafter
and its sampler; `model_runner_of` is the one place that walks vLLM's object
chain to it. The profiler (vllm_dflash.profiler) wraps runner methods, and
the methods of vLLM's in-tree DFlash proposer when it profiles that one.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.patches.internal import VllmInternal

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
CHAIN = "LLM.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner"
UNTIL = "vLLM offers a public handle on the in-process model runner"


def model_runner_of(llm: Any) -> Any | None:
    """The model runner of an `LLM` whose engine runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def scheduler_of(llm: Any) -> Any | None:
    """The scheduler of an `LLM` whose engine runs in this process, else None."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler
    except AttributeError:
        return None


def _hop(symbol: str, name: str) -> VllmInternal:
    return VllmInternal(
        symbol=symbol,
        kind="read",
        process=("bench",),
        why=f"one hop of {CHAIN} (model_runner_of)",
        how=f"getattr(.., {name!r})",
        remove_when=UNTIL,
        names=(name,),
    )


ENTRIES: list[VllmInternal] = [
    _hop("vllm.v1.engine.llm_engine:LLMEngine", "engine_core"),
    _hop("vllm.v1.engine.core_client:InprocClient", "engine_core"),
    VllmInternal(
        symbol="vllm.v1.engine.core:EngineCore",
        kind="read",
        process=("bench",),
        why=f"one hop of {CHAIN} (model_runner_of); the bench reaches the in-process scheduler there "
        "(scheduler_of) to cap the requests in flight per cell",
        how="getattr(engine_core, 'model_executor'), getattr(engine_core, 'scheduler')",
        remove_when=UNTIL + "; scheduler: when LLM.generate takes a per-call limit on concurrent requests",
        names=("model_executor", "scheduler"),
    ),
    VllmInternal(
        symbol="vllm.v1.core.sched.scheduler:Scheduler",
        kind="read",
        process=("bench",),
        why="concurrency c in the bench means c requests in flight, a finished one replaced at once by the next "
        "(as `vllm bench serve --max-concurrency`), on one engine built for the largest c: the cell lowers "
        "the scheduler's limits on running and admitted requests to c and restores them after",
        how="set scheduler.max_num_running_reqs and scheduler.max_num_active_reqs; schedule() admits a waiting "
        "request only while len(running) is below max_num_active_reqs",
        remove_when="LLM.generate takes a per-call limit on concurrent requests",
        names=("max_num_running_reqs", "max_num_active_reqs"),
    ),
    VllmInternal(
        symbol="vllm.v1.core.sched.scheduler:Scheduler.schedule",
        kind="mirror",
        process=("bench",),
        why="the per-cell cap on requests in flight works only while schedule() reads the limit at every call",
        how="source_has: the admission check against max_num_active_reqs",
        remove_when="LLM.generate takes a per-call limit on concurrent requests",
        source_has=("if num_running >= self.max_num_active_reqs:",),
    ),
    _hop("vllm.v1.executor.uniproc_executor:UniProcExecutor", "driver_worker"),
    _hop("vllm.v1.worker.worker_base:WorkerWrapperBase", "worker"),
    _hop("vllm.v1.worker.gpu_worker:Worker", "model_runner"),
    VllmInternal(
        symbol=RUNNER,
        kind="read",
        process=("bench", "worker"),
        why="tests and the bench look at the drafter and the samplers the runner built; in the worker, the "
        "proposer and the CPU seeded-request rewind (patches.vllm_fixes) read which requests' samples vLLM "
        "discards this step (partial prefills): a seeded request draws its sampled drafts from its own "
        "generator except in those steps; the propose_draft_token_ids patch (patches.serving), returning draft "
        "lists itself on a step without drafting, leaves the draft-probability state as vLLM's method does; "
        "the proposer reads the batch's request ids (input_batch) and, writing held-back context rows, which "
        "requests the runner still holds (requests: finished ones are popped at the start of a step), to drop "
        "the rows of finished ones; a step continuing a coasting run copies its context rows' positions from "
        "the runner's position buffer (DFlashProposer._coast_on)",
        how="runner.drafter, runner.sampler, runner.rejection_sampler; runner.discard_request_mask.np[:num_reqs]; "
        "set runner._draft_probs = runner._draft_prob_req_ids = None; runner.input_batch; req_id in runner.requests; "
        "runner.positions (a numpy view kept while it is the same tensor) unless runner.uses_mrope",
        remove_when=UNTIL + "; discard_request_mask: when vLLM's draft sampler takes per-request generators; "
        "_draft_probs*: with the propose_draft_token_ids patch",
        names=("drafter", "sampler", "rejection_sampler", "discard_request_mask", "_draft_probs",
               "_draft_prob_req_ids", "input_batch", "requests", "positions", "uses_mrope"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}.execute_model",
        kind="wrap",
        process=("bench",),
        why="the step timer counts engine steps and times them (with sample_tokens)",
        how="instance attribute replaced by a timing wrapper",
        remove_when="vLLM reports the per-step split (target / draft / verify) itself",
        params=("self", "scheduler_output", "intermediate_tensors"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}.sample_tokens",
        kind="wrap",
        process=("bench",),
        why="the second half of an engine step (sampling, verification, drafting)",
        how="instance attribute replaced by a timing wrapper",
        remove_when="vLLM reports the per-step split itself",
        params=("self", "grammar_output"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}._model_forward",
        kind="wrap",
        process=("bench",),
        why="the target forward of a step",
        how="instance attribute replaced by a timing wrapper",
        remove_when="vLLM reports the per-step split itself",
        params=("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}.propose_draft_token_ids",
        kind="wrap",
        process=("bench",),
        why="the drafting part of a step, whatever the proposer",
        how="instance attribute replaced by a timing wrapper",
        remove_when="vLLM reports the per-step split itself",
        params=("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
                "slot_mappings"),
    ),
    VllmInternal(
        symbol="vllm.v1.spec_decode.dflash:DFlashProposer.set_inputs_first_pass",
        kind="wrap",
        process=("bench",),
        why="the profiler's 'inputs' phase of vLLM's in-tree proposer (the plugin's rival, timed side by side "
        "by scripts/profile_propose.py)",
        how="profiler.PROPOSER_HOOKS['vllm']: instance attribute replaced by a timing wrapper",
        remove_when="never while the in-tree proposer is profiled",
        params=("self", "target_token_ids", "next_token_ids", "target_positions", "target_hidden_states",
                "token_indices_to_sample", "cad", "num_rejected_tokens_gpu"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM.combine_hidden_states",
        kind="wrap",
        process=("bench",),
        why="the profiler's 'context_kv' phase of the in-tree draft model",
        how="profiler.PROPOSER_HOOKS['vllm']: instance attribute replaced by a timing wrapper",
        remove_when="never while the in-tree proposer is profiled",
        params=("self", "hidden_states"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM.precompute_and_store_context_kv",
        kind="wrap",
        process=("bench",),
        why="the profiler's 'context_kv' phase of the in-tree draft model",
        how="profiler.PROPOSER_HOOKS['vllm']: instance attribute replaced by a timing wrapper",
        remove_when="never while the in-tree proposer is profiled",
        params=("self", "context_states", "context_positions", "context_slot_mapping"),
    ),
    VllmInternal(
        symbol="vllm.v1.worker.gpu_input_batch:InputBatch",
        kind="read",
        process=("worker",),
        why="the runner's batch state by row: adaptive speculation matches outcomes by request id (rows move "
        "between steps) and reads how many drafts of each request the target verified (the scheduler may trim "
        "them); the CPU seeded-request rewind (patches.vllm_fixes) finds the step's per-request generators",
        how="runner.input_batch.req_ids[row], len(runner.input_batch.spec_token_ids[row]) for rows 0..B-1; "
        "input_batch.generators ({row: torch.Generator}) and num_reqs, swapped for the span of the wrapped "
        "_bookkeeping_sync; the CPU prepare_next_token_ids_padded reads req_ids, num_tokens_no_spec and "
        "vocab_size",
        remove_when="vLLM hands verification outcomes to the drafter, and rewinds CPU generators itself",
        names=("req_ids", "spec_token_ids", "generators", "num_reqs", "num_tokens_no_spec", "vocab_size"),
    ),
    VllmInternal(
        symbol="vllm.v1.worker.gpu_input_batch:CachedRequestState",
        kind="read",
        process=("worker",),
        why="adaptive budgets stop at the drafts a request's next step can still turn into output: its "
        "max_tokens less the tokens it has (this step's 1 + accepted are appended by _bookkeeping_sync, which "
        "runs after a hidden-state drafter proposes)",
        how="runner.requests[req_id].sampling_params.max_tokens - len(runner.requests[req_id].output_token_ids)",
        remove_when="the scheduler trims drafts past a request's token limit itself",
        names=("sampling_params", "output_token_ids"),
    ),
    VllmInternal(
        symbol="vllm.v1.worker.gpu_input_batch:CachedRequestState.get_token_id",
        kind="call",
        process=("worker",),
        why="the next token of a partial prefill (discarded row) is the request's last token, as vLLM's "
        "prepare_next_token_ids_padded looks it up",
        how="requests[req_id].get_token_id(num_tokens_no_spec[row] - 1), only for rows without a valid sample",
        remove_when="with the CPU prepare_next_token_ids_padded override (vllm_dflash.patches.serving)",
        params=("self", "idx"),
    ),
]
