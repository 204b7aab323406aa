"""vLLM internals adaptive speculation relies on without patching them: the
runner's batch state it reads, the paths that carry per-request draft lists
of any length, async scheduling (which it must turn off), and the metrics
registry. Behaviours are entries of kind "mirror": our code relies on the
rule their source states (`source_has`), so an upgrade that changes it fails
the drift test."""

from __future__ import annotations

from vllm_dflash.patches.internal import VllmInternal

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
VARIABLE_DRAFTS = "a runner API for variable-length drafts (Model Runner V2's adaptive verification)"
OUTCOMES = "vLLM hands verification outcomes to the drafter"

ENTRIES: list[VllmInternal] = [
    VllmInternal(
        symbol=f"{RUNNER}._get_draft_token_ids_cpu",
        kind="mirror",
        process=("worker",),
        why="adaptive speculation returns per-request draft lists of any length (0 included) from propose()",
        how="a list[list[int]] from the drafter is passed through unchanged to the scheduler "
        "(_copy_draft_token_ids_to_cpu skips the tensor copy, take_draft_token_ids returns the lists)",
        remove_when=VARIABLE_DRAFTS,
        source_has=("if isinstance(self._draft_token_ids, list):",),
    ),
    VllmInternal(
        symbol=f"{RUNNER}._get_spec_decode_draft_probs",
        kind="mirror",
        process=("worker",),
        why="sampled drafts shorter than the drafted block keep their draft probabilities",
        how="the runner slices the proposer's [B, q, V] probabilities to each request's scheduled length",
        remove_when=VARIABLE_DRAFTS,
        source_has=("self._draft_probs[row_idx, :num_draft]",),
    ),
    VllmInternal(
        symbol="vllm.v1.spec_decode.utils:eagle_prepare_inputs_padded_kernel",
        kind="mirror",
        process=("worker",),
        why="accepted drafts per request = verified - num_rejected_tokens_gpu",
        how="num_rejected = drafts + 1 - valid sampled tokens (0 without drafts), passed to propose()",
        remove_when=OUTCOMES,
        source_has=("num_rejected_tokens = num_draft_tokens + 1 - valid_count",),
    ),
    VllmInternal(
        symbol="vllm.distributed.parallel_state:GroupCoordinator.broadcast_object",
        kind="call",
        process=("worker",),
        why="tensor-parallel ranks must draft the same query length (the draft forward is collective)",
        how="get_tp_group().broadcast_object(q, src=0) (only when the TP group has more than one rank)",
        remove_when="never: ranks time their own steps",
        params=("self", "obj", "src"),
    ),
    VllmInternal(
        symbol="vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
        kind="mirror",
        process=("engine",),
        why="per-request draft lists of any length become each request's spec_token_ids",
        how="the runner's lists are stored as they are (structured output may trim them)",
        remove_when="never (it is how the scheduler takes drafts)",
        source_has=("request.spec_token_ids = self.structured_output_manager.validate_tokens(",),
    ),
    VllmInternal(
        symbol="vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
        kind="mirror",
        process=("engine",),
        why="async scheduling schedules fixed-length placeholder drafts before the drafter runs, so adaptive "
        "speculation turns it off (the create_speculative_config patch) and the proposer refuses it",
        how="EngineArgs.async_scheduling = False when adaptive is on and it was unset; True is an error",
        remove_when="placeholders sized per request",
        source_has=("request.spec_token_ids = self._spec_token_placeholders",),
    ),
    VllmInternal(
        symbol="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        kind="mirror",
        process=("frontend",),
        why="the create_speculative_config patch sets EngineArgs.async_scheduling for adaptive speculation",
        how="vLLM must read it (SchedulerConfig) after create_speculative_config has run",
        remove_when="with the create_speculative_config patch",
        source_has=("self.create_speculative_config(", "async_scheduling=self.async_scheduling"),
    ),
    VllmInternal(
        symbol="vllm.v1.metrics.prometheus:get_prometheus_registry",
        kind="mirror",
        process=("frontend",),
        why="adaptive metrics reach /metrics through a collector in prometheus_client's REGISTRY",
        how="with one API server /metrics serves REGISTRY (LLM.get_metrics() reads it too, names starting "
        "'vllm:'); with PROMETHEUS_MULTIPROC_DIR a multiprocess registry without them",
        remove_when="vLLM offers a hook for plugin metrics",
        source_has=("return REGISTRY",),
    ),
]
