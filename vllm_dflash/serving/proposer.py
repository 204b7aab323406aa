"""vllm-dflash's DFlash proposer: replaces vLLM's whenever method == "dflash".

The runner (`GPUModelRunner`, also the CPU runner's base) builds its drafter
as `DFlashProposer(vllm_config, device, runner)` and checks it with
`isinstance(..., DFlashProposer)`; `vllm_dflash.patches` points that name at
this class. `serving.drafter_base` answers the rest of what the runner calls
(model loading, draft attention groups, next-token and rejection
bookkeeping); this class owns what is DFlash:

1. context: the target hidden states of the newly verified tokens only
   (rejected drafts are skipped) -> fc + hidden_norm -> per-layer K/V written
   into the draft's paged cache at those tokens' slots. Earlier context is
   already cached, so nothing is recomputed.
2. one forward pass of the query block `[bonus, MASK x q]` at positions
   `[p, p + q]`, bidirectional within the block and over all context.
3. argmax (or, with vLLM's `draft_sample_method="probabilistic"`, sampled)
   draft tokens; sampled drafts leave their probabilities q for the
   rejection sampler (vLLM's `take_last_draft_probs()`).

Static speculation (`adaptive: false`) drafts q = k = num_speculative_tokens
every step. Adaptive speculation (the default, `vllm_dflash.adaptive`)
plans q per step, then hands each request the prefix of its draft worth
verifying, as lists. q = 0 runs no draft forward and queues the step's
context rows (`serving.context_queue`), written with the next drafting
step's; a step that also verified nothing is settled before vLLM's drafting
glue runs (`propose_unverified_step`, called by the patched runner).

The drafter's cache needs no per-request state: everything lives in vLLM's
block tables, so chunked prefill, prefix caching, preemption and requests
leaving the batch need no bookkeeping here. (Adaptive speculation
remembers, by request id, what it handed out, to learn from the outcome.)
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_dflash import envs, ops, profiler
from vllm_dflash.adaptive import prometheus
from vllm_dflash.adaptive.confidence import (DEFAULT_FEATURE, argmax_with_confidence, draft_confidence,
                                              sampled_confidence)
from vllm_dflash.adaptive.plan_trace import PlanTrace
from vllm_dflash.adaptive.speculation import AdaptiveSpeculation
from vllm_dflash.adaptive.stats import AdaptiveStats
from vllm_dflash.adaptive.write_cost import ContextWriteCost
from vllm_dflash.serving import gemm_rows
from vllm_dflash.serving.adaptive_option import adaptive_enabled
from vllm_dflash.serving.context_queue import ContextRows, DeferredContext, joined, max_held_rows
from vllm_dflash.serving.draft_model import DFlashDraftForCausalLM
from vllm_dflash.serving.draft_resolution import dflash_config_of
from vllm_dflash.serving.drafter_base import DrafterBase
from vllm_dflash.verifier import sampling_params
from vllm_dflash.verifier.draft import sample_drafts
from vllm_dflash.verifier.sampler import min_p_per_request

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers show it


def _tensor_parallel() -> tuple[int, int]:
    """(world size, rank) of this worker's tensor-parallel group; (1, 0) outside one."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # distributed not initialised (tests building a proposer alone)
        return 1, 0


class _StepInputs(NamedTuple):
    """What the runner hands propose() that drafting a block needs."""

    target_positions: torch.Tensor
    target_hidden_states: torch.Tensor
    next_token_ids: torch.Tensor
    cad: CommonAttentionMetadata
    sampling_metadata: SamplingMetadata
    num_rejected_tokens_gpu: torch.Tensor | None


class DFlashProposer(DrafterBase):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "dflash":
            raise ValueError("vllm-dflash's DFlashProposer needs speculative_config.method='dflash'")
        # The draft forward takes token ids only: target features enter through
        # the context KV written by store_context_kv, not as model inputs.
        super().__init__(vllm_config, device)
        self.dflash_config = dflash_config_of(spec)
        self.mask_token_id = self.dflash_config.mask_token_id
        # Batch state read from the runner (register: patches.serving / patches.adaptive): request ids,
        # verified drafts, discard_request_mask (adaptive budgets, seeded draft sampling).
        self.runner = runner
        self.last_draft_block: torch.Tensor | None = None  # [B, q] drafts of the last query block
        self._no_draft_blocks: dict[int, torch.Tensor] = {}  # per batch size, the [B, 0] block of a step drafting none
        # Numpy views of the runner's position buffer and of its slot-mapping buffer (`_host_step_index`).
        self._positions_source: torch.Tensor | None = None
        self._positions_view: np.ndarray | None = None
        self._slots_view: np.ndarray | None = None
        self._slots_address = 0
        self.confidence_feature = DEFAULT_FEATURE
        self._tp_size, tp_rank = _tensor_parallel()
        self._on_cuda = self.device.type == "cuda"
        self.adaptive = self._build_adaptive(vllm_config, runner, tp_rank) if adaptive_enabled(spec) else None
        # Adaptive steps that draft nothing hold their context writes back until drafting resumes.
        feature_bytes = (len(self.dflash_config.target_layer_ids) * vllm_config.model_config.get_hidden_size()
                         * vllm_config.model_config.dtype.itemsize)
        on_host = self.device.type == "cpu"
        self.deferred_context = DeferredContext(max_held_rows(
            vllm_config.scheduler_config.max_num_batched_tokens, feature_bytes, on_host), prefault=on_host)
        # Held rows of requests that finish before they are written are dropped, unless prefix caching may
        # let a later request read the finished one's blocks (serving.context_queue).
        self._drop_finished_context = not vllm_config.cache_config.enable_prefix_caching
        # A step in which no request verifies a draft runs vLLM's plain inputs and sampler (patches.serving:
        # _prepare_inputs), except on hybrid targets, whose recurrent layers read per-step draft counts.
        self.plain_steps_without_drafts = not vllm_config.model_config.is_hybrid
        self._planned_q: int | None = None  # set by propose_unverified_step when it leaves drafting to propose()
        # The draft lists propose_unverified_step last returned, all empty (None: it returned none):
        # the runner's take_draft_token_ids hands the scheduler nothing for them (patches.serving).
        self.handed_no_drafts: list[list[int]] | None = None
        # Row counts up to this are padded to serving.gemm_rows' grid (set at load; None: never).
        self.gemm_row_limit: int | None = None
        # This step's seconds of context work any q would have paid: rows held back by earlier steps,
        # and the rows of its prompt chunks (`_write_context`). Left out of the draft-time sample.
        self._not_drafting_seconds = 0.0
        self._prompt_rows = 0  # context rows of this step that are prompt tokens (set by _begin_adaptive)
        self._coast_asked = False  # _coast_first asked coast() this step (and was told no)
        # Seconds of the context writes, fixed part and per row (what a switch to drafting is priced at).
        self._context_write_cost = ContextWriteCost()
        if self.adaptive is not None:
            self.adaptive.controller.switch_cost = self._switch_cost
        logger.info(
            "vllm-dflash DFlash proposer: draft %s (block_size %d), %s",
            spec.model,
            self.dflash_config.block_size,
            f"adaptive speculation, at most {spec.num_speculative_tokens} draft tokens per request and step"
            if self.adaptive is not None else f"{spec.num_speculative_tokens} draft tokens per step",
        )

    def _build_adaptive(self, vllm_config: VllmConfig, runner, tp_rank: int) -> AdaptiveSpeculation:
        if runner is not None and getattr(runner, "use_async_scheduling", False):
            raise ValueError(
                "vllm-dflash adaptive speculation gives each request its own draft length, which vLLM's "
                "async scheduling cannot schedule: pass async_scheduling=False or speculative_config "
                "adaptive=false"
            )
        path = prometheus.stats_path(tp_rank) if tp_rank == 0 else None
        seed = vllm_config.model_config.seed
        adaptive = AdaptiveSpeculation(
            self.num_speculative_tokens,
            vllm_config.scheduler_config.max_num_seqs,
            seed=0 if seed is None else int(seed),
            schedule=envs.adaptive_schedule(),
            stats=AdaptiveStats(self.num_speculative_tokens, path=path),
        )
        trace = envs.VLLM_DFLASH_ADAPTIVE_TRACE
        if trace:
            try:
                adaptive.controller.trace = adaptive.controller.epochs.trace = PlanTrace(
                    trace if tp_rank == 0 else f"{trace}.rank{tp_rank}")
            except OSError as error:
                raise ValueError(f"VLLM_DFLASH_ADAPTIVE_TRACE={trace!r} cannot be opened for appending ({error}); "
                                 "give a writable file path, or unset it") from error
        return adaptive

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        if not isinstance(model, DFlashDraftForCausalLM):
            raise ValueError(
                f"the draft loaded as {type(model).__name__}; vllm-dflash needs "
                "architectures=['DFlashDraftModel'] in the draft's config.json"
            )
        self.gemm_row_limit = self._make_gemm_kernels(target_model, model)
        profiler.install_from_env(self)  # no-op unless VLLM_DFLASH_PROFILE_FILE is set

    def _make_gemm_kernels(self, target_model: torch.nn.Module, draft: DFlashDraftForCausalLM) -> int | None:
        """Where vLLM's CPU GEMMs make a kernel per row count (`serving.gemm_rows`): make the
        grid's up to the most rows a target pass, a query block or a context write of usual size
        has, and return that limit; the runner (target pass), the query block and the context
        writer pad their rows to the grid below it. None: nothing to pad (CUDA, torch's own linear,
        VLLM_DFLASH_GEMM_ROWS=0)."""
        if self.device.type != "cpu" or not envs.VLLM_DFLASH_GEMM_ROWS:
            return None
        linears = gemm_rows.shape_compiled_linears(target_model, draft)
        if not linears:
            return None
        target_rows = getattr(self.runner, "max_num_tokens", None) or \
            self.vllm_config.scheduler_config.max_num_batched_tokens
        limit = min(max(target_rows, self.max_batch_size * (1 + self.num_speculative_tokens)), gemm_rows.MOST_ROWS)
        gemm_rows.make_kernels(linears, limit, self.dtype)
        draft.context_kv_writer.gemm_row_limit = limit
        return limit

    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Peak-memory stand-in for one step: context K/V of `num_tokens`
        tokens (computed, not stored) and one query-block forward."""
        num_features = self.model.model.fc.input_size
        features = torch.zeros(num_tokens, num_features, dtype=self.dtype, device=self.device)
        self.model.store_context_kv(features, self.positions[:num_tokens], None)
        del features
        num_query = min(num_tokens, self.max_batch_size * (1 + self.num_speculative_tokens))
        with set_forward_context(None, self.vllm_config, num_tokens=num_query, slot_mapping={}):
            self.model(input_ids=self.input_ids[:num_query], positions=self.positions[:num_query])

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor | list[list[int]]:
        """Static: [B, k] draft token ids, k = `num_speculative_tokens`.
        Adaptive: per request a list of 0..k draft token ids (see `_propose_adaptive`).

        `target_hidden_states` is what vLLM 0.32's runner hands every
        hidden-state drafter: the captured target layers already concatenated
        per token, [T, L*D], for all T tokens of the last target pass
        (rejected drafts included).
        """
        step = _StepInputs(target_positions, target_hidden_states, next_token_ids, common_attn_metadata,
                           sampling_metadata, num_rejected_tokens_gpu)
        if self.adaptive is not None:
            return self._propose_adaptive(step)
        self.num_speculative_tokens = num_speculative_tokens
        return self._propose_block(num_speculative_tokens, step)[0]

    def _propose_block(
        self, q: int, inputs: _StepInputs, confidence: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Write the new context K/V, then draft the block [bonus, MASK x q]:
        ([B, q] draft ids, (feature, prior) [B, q] confidences or None).

        Per step: `ops.prepare_dflash_inputs` (context rows/positions/slots,
        the query block's ids/positions/slots and lengths),
        `ops.gather_hidden_states` when some rows were rejected (CPU),
        `store_context_kv` (fc and K/V GEMMs + `ops.store_context_kv_fused`), then
        vLLM's attention metadata and the query-block forward. q = 0 writes
        the context and drafts nothing.
        """
        self.last_draft_probs = None
        target_positions, target_hidden_states, next_token_ids, cad, sampling_metadata, num_rejected_tokens_gpu = inputs
        batch_size = next_token_ids.shape[0]
        num_rows = target_positions.shape[0]
        q_len = q + 1

        # One native call for every index the step needs. On CPU the context is
        # compacted to the verified rows (the count is free on the host); on
        # CUDA rejected rows stay, with slot -1, so nothing waits on the device.
        step = ops.prepare_dflash_inputs(
            cad.query_start_loc,
            num_rejected_tokens_gpu,
            target_positions,
            cad.slot_mapping,
            next_token_ids,
            cad.block_table_tensor,
            self.block_size,
            self.mask_token_id,
            q,
            num_rows,
            self.device.type == "cpu",
        )
        if step.context_rows.shape[0] == num_rows:  # every row (rows are 0..num_rows-1): no gather
            features = target_hidden_states if target_hidden_states.shape[0] == num_rows else target_hidden_states[:num_rows]
        else:
            features = ops.gather_hidden_states([target_hidden_states], step.context_rows)
        self._write_context(ContextRows(features, step.context_positions, step.context_slots),
                            hold=q == 0 and self.adaptive is not None)
        if q == 0:  # nothing to draft (the context is written or queued)
            self.last_draft_block = self._no_draft_block(batch_size)
            return self.last_draft_block, None

        if self.device.type == "cpu":  # the exact values are already on the host
            query_start_loc_cpu, seq_lens_upper = step.query_start_loc, step.seq_lens
        else:
            query_start_loc_cpu = torch.arange(batch_size + 1, dtype=torch.int32) * q_len
            upper = cad.seq_lens_cpu_upper_bound
            seq_lens_upper = None if upper is None else upper[:batch_size] + q_len
        block_cad = CommonAttentionMetadata(
            query_start_loc=step.query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=step.seq_lens,
            seq_lens_cpu_upper_bound=seq_lens_upper,
            num_reqs=batch_size,
            num_actual_tokens=batch_size * q_len,
            max_query_len=q_len,
            max_seq_len=cad.max_seq_len + q_len,
            block_table_tensor=cad.block_table_tensor[:batch_size],
            slot_mapping=step.slots,
            causal=False,
        )
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(block_cad)
        num_query = batch_size * q_len
        input_ids, positions, slots = step.input_ids, step.positions, step.slots
        if self.gemm_row_limit is not None:  # rows past num_query: no attention, no cache write (slot -1)
            extra = gemm_rows.padded_rows(num_query, self.gemm_row_limit) - num_query
            if extra:
                input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=self.mask_token_id)
                positions = torch.nn.functional.pad(positions, (0, extra))
                slots = torch.nn.functional.pad(slots, (0, extra), value=-1)
        with set_forward_context(
            per_layer_metadata,
            self.vllm_config,
            num_tokens=input_ids.shape[0],
            slot_mapping={name: slots for name in self.draft_attn_layer_names},
        ):
            hidden_states = self.model(input_ids=input_ids, positions=positions)[:num_query]
        # Row 0 of each block is the bonus token; rows 1..q predict the drafts.
        mask_hidden = hidden_states.view(batch_size, q_len, -1)[:, 1:].reshape(batch_size * q, -1)
        draft_ids, conf = self._draft_tokens(mask_hidden, sampling_metadata, q, confidence)
        self.last_draft_block = draft_ids.view(batch_size, q)
        if conf is not None:
            conf = tuple(c.view(batch_size, q) for c in conf)
        return self.last_draft_block, conf

    def _write_context(self, rows: ContextRows, hold: bool, owners: list[str] | None = None) -> None:
        """Write the context K/V of `rows` now, with whatever steps without drafting
        queued before (`serving.context_queue`: rows of requests finished meanwhile are
        dropped where nothing can read them); or, with `hold` (this step drafts nothing),
        queue them while the queue has room (`owners`: each row's request id).

        The time spent on held rows and on the step's prompt rows is not the draft time
        D(R, q + 1) of a decode step (`_not_drafting_seconds`). Counted in it, the first
        step of a fresh engine given 64 prompts made D(64, 1) 42 ms (2 ms without the
        prompt rows); as the only sample there it priced not drafting above drafting
        until the measured arms overruled it: 0.76x of no speculation over the first
        192 requests (float32, bundled pair, AVX2 EPYC)."""
        # runner.requests: every request the runner still holds state for (finished ones are popped
        # at the start of the step, before drafting); preempted ones stay in it.
        live = self.runner.requests if self._drop_finished_context and self.runner is not None else None
        own = rows.slots.shape[0]
        t0 = time.perf_counter()
        if hold and self.deferred_context.hold(rows, owners, live):
            self._charge_prompt_rows(time.perf_counter() - t0, own)
            return
        if not self.deferred_context.rows:
            rows = joined(rows)
            self.model.store_context_kv(rows.features, rows.positions, rows.slots)
            elapsed = time.perf_counter() - t0
            self._context_write_cost.add(own, elapsed)
            self._charge_prompt_rows(elapsed, own)
            return
        rows = self.deferred_context.take(rows, live)
        self.model.store_context_kv(rows.features, rows.positions, rows.slots)
        # The held rows written (dropped ones cost nothing) are what those steps would have paid:
        # their share is not this step's draft time.
        written = rows.features.shape[0]
        elapsed = time.perf_counter() - t0
        self._not_drafting_seconds += elapsed * (written - own) / written
        self._charge_prompt_rows(elapsed * own / written, own)
        self._context_write_cost.add(written, elapsed)

    def _charge_prompt_rows(self, seconds: float, own: int) -> None:
        """The prompt rows' share of `seconds` spent on this step's `own` context rows, left
        out of the draft time (any q pays for a prompt's context)."""
        if self._prompt_rows and own:
            self._not_drafting_seconds += seconds * min(self._prompt_rows, own) / own

    def _switch_cost(self, req_ids: list[str]) -> tuple[float, int | None]:
        """(seconds the next drafting step would spend on held context rows, output tokens the
        requests `req_ids` have left, None where one has no limit): what the controller weighs
        before it turns drafting back on (`BudgetController.switch_pays`). The held rows of live
        requests at the writes' per-row seconds (`ContextWriteCost`): the write's fixed part is
        the drafting step's own, held rows or not."""
        held = self.deferred_context.rows
        per_row = self._context_write_cost.per_row()
        if not held or per_row is None or self.runner is None:
            return 0.0, None
        requests = self.runner.requests
        live = requests if self._drop_finished_context else None
        seconds = self.deferred_context.live_rows(live) * per_row
        left = 0
        for req_id in req_ids:
            tokens = self._tokens_left(requests.get(req_id))
            if tokens is None:
                return seconds, None
            left += max(tokens, 0)
        return seconds, left

    @staticmethod
    def _tokens_left(state) -> int | None:
        """Output tokens a runner request state has left before max_tokens (None: no limit)."""
        params = None if state is None else state.sampling_params
        if params is None or params.max_tokens is None:
            return None
        return params.max_tokens - len(state.output_token_ids)

    def propose_unverified_step(
        self,
        runner,
        num_tokens: int,
        aux_hidden_states: list[torch.Tensor] | None,
        spec_decode_metadata,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
    ) -> list[list[int]] | None:
        """The whole drafting part of an adaptive step that verified no draft and plans
        none, called by the runner before its drafting glue (`patches.serving`): empty
        draft lists, with the `num_tokens` new tokens' context queued. None: the step
        verified drafts or plans some; the runner's glue runs and calls propose(),
        which uses the plan made here.

        Steps without drafting are the ones adaptive speculation must make as cheap as
        no speculation: vLLM's glue (next-token bookkeeping, input padding, concatenating
        every step's hidden states for a drafter) and the per-step context write are
        most of what a speculative engine adds to them."""
        self._planned_q = None
        self.handed_no_drafts = None
        if self.adaptive is None or aux_hidden_states is None:
            return None
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len > 0:
            return None
        batch_size = common_attn_metadata.num_reqs
        # Coasting (no plan needed, nothing drafted) is decided per rank: only alone, since
        # under tensor parallelism the ranks must agree on q through a collective.
        t0 = self._step_clock()
        if self._tp_size == 1:
            drafts = self._coast_on(runner, t0, num_tokens, aux_hidden_states, common_attn_metadata,
                                    sampling_metadata.all_greedy)
            if drafts is not None:
                return drafts
        req_ids = self.runner.input_batch.req_ids[:batch_size]
        asked, self._coast_asked = self._coast_asked, False  # (coast() said no to this step already)
        coasting = (self._tp_size == 1 and not asked
                    and self.adaptive.coast(t0, req_ids, num_tokens, sampling_metadata.all_greedy))
        # A coasting step's rows past one a request are a new request's prompt chunk (nothing was
        # verified); _begin_adaptive counts the other steps'.
        self._prompt_rows = num_tokens - batch_size
        if not coasting:
            q = self._begin_adaptive(batch_size, num_tokens, None, sampling_metadata, nothing_verified=True, t0=t0)
            if q > 0:
                self._planned_q = q
                return None
        # Copied side by side into the queue. Each tensor op here costs microseconds between
        # target forwards (the step runs cold), so exact-sized inputs are not sliced.
        features = (aux_hidden_states if aux_hidden_states[0].shape[0] == num_tokens
                    else tuple(h[:num_tokens] for h in aux_hidden_states))
        slots = common_attn_metadata.slot_mapping
        rows = ContextRows(features, runner._get_positions(num_tokens),
                           slots if slots.shape[0] == num_tokens else slots[:num_tokens])
        self._write_context(rows, hold=True, owners=self._row_owners(req_ids, num_tokens, common_attn_metadata))
        if coasting:
            return self._settle_without_drafts(t0, batch_size, self.adaptive.end_coast)
        self.last_draft_probs = None
        self.last_draft_block = self._no_draft_block(batch_size)
        drafts = self._finish_adaptive(self.last_draft_block, None)
        self.handed_no_drafts = drafts  # every list empty: the scheduler has nothing to take
        return drafts

    def _coast_on(self, runner, t0: float, num_tokens: int, aux_hidden_states: list[torch.Tensor],
                  cad: CommonAttentionMetadata, all_greedy: bool) -> list[list[int]] | None:
        """A step that continues the open coasting run (the same requests, plain decode),
        settled with the fewest statements: the general path below does the same for it
        (coast(), the held rows, end_coast()) with checks and slices that only other steps
        need, and on this CPU-bound path each costs microseconds (the step's Python runs
        from cold caches: ~110 us a coasting step at 32 requests, float32, AVX-512 EPYC).
        None: the general path takes the step."""
        if cad.num_reqs != num_tokens:
            return None
        req_ids = self.adaptive.coasting_run(num_tokens)
        if req_ids is None:
            return self._coast_first(runner, t0, num_tokens, aux_hidden_states, cad, all_greedy)
        if runner.input_batch.req_ids[:num_tokens] != req_ids:
            return None
        index = self._host_step_index(runner, cad, num_tokens)
        if index is None or not self.deferred_context.hold_on_host(aux_hidden_states, *index, num_tokens, req_ids):
            return None
        self._prompt_rows = 0
        return self._settle_without_drafts(t0, num_tokens, self.adaptive.coast_on)

    def _coast_first(self, runner, t0: float, num_tokens: int, aux_hidden_states: list[torch.Tensor],
                     cad: CommonAttentionMetadata, all_greedy: bool) -> list[list[int]] | None:
        """The first step of a coasting run (`AdaptiveSpeculation.coast` opens it), settled as
        `_coast_on` settles the run's other steps. The general path had taken it: at 16
        requests in bfloat16, the run's first steps cost ~0.3 ms each beside the ~0.07 ms of
        the others (Zen 4 EPYC). None: no run opens here (or the rows cannot be held on the
        host), and the general path takes the step."""
        index = self._host_step_index(runner, cad, num_tokens)
        if index is None or not self.deferred_context.room_on_host(num_tokens):
            return None
        req_ids = runner.input_batch.req_ids[:num_tokens]
        if not self.adaptive.coast(t0, req_ids, num_tokens, all_greedy):
            self._coast_asked = True  # the general path does not ask again
            return None
        self.deferred_context.hold_on_host(aux_hidden_states, *index, num_tokens, req_ids)
        self._prompt_rows = 0
        return self._settle_without_drafts(t0, num_tokens, self.adaptive.end_coast)

    def _settle_without_drafts(self, t0: float, batch_size: int, close) -> list[list[int]]:
        """The end of a coasting step, its context held: no draft block, the step closed in
        adaptive speculation (`close`: coast_on or end_coast, from t0 to now, less the
        seconds spent on context held back earlier), and empty draft lists handed out."""
        self.last_draft_probs = None
        self.last_draft_block = self._no_draft_block(batch_size)
        close(t0, time.perf_counter(), not_drafting=self._not_drafting_seconds)
        self._not_drafting_seconds = 0.0
        drafts = [[] for _ in range(batch_size)]
        self.handed_no_drafts = drafts  # every list empty: the scheduler has nothing to take
        return drafts

    def _host_step_index(self, runner, cad: CommonAttentionMetadata,
                         num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Numpy views of the runner's position buffer and of the step's slot mapping, at
        least `num_tokens` long (what `runner._get_positions` and the context write read),
        kept between steps while the runner keeps its buffers; None off the host or with
        M-RoPE positions. The views read the buffers' current contents. The checks run
        when a view is made (a tensor's .device alone costs microseconds here)."""
        positions = runner.positions
        if positions is not self._positions_source:
            if runner.uses_mrope or positions.device.type != "cpu":
                return None
            self._positions_source, self._positions_view = positions, positions.numpy()
        slots = cad.slot_mapping
        view = self._slots_view
        if view is None or slots.data_ptr() != self._slots_address or view.shape[0] < num_tokens:
            if slots.device.type != "cpu":
                return None
            # (the view keeps the buffer alive, so another buffer cannot take over its address)
            view = self._slots_view = slots.numpy()
            self._slots_address = slots.data_ptr()
        return self._positions_view, view

    def _no_draft_block(self, batch_size: int) -> torch.Tensor:
        """The [B, 0] draft block of a step that drafts nothing (one per batch size, never written)."""
        block = self._no_draft_blocks.get(batch_size)
        if block is None:
            block = self._no_draft_blocks[batch_size] = torch.empty(batch_size, 0, dtype=torch.int64,
                                                                    device=self.device)
        return block

    @staticmethod
    def _row_owners(req_ids: list[str], num_tokens: int, cad: CommonAttentionMetadata) -> list[str]:
        """The request id of each of the step's `num_tokens` rows (rows run request by request)."""
        batch_size = len(req_ids)
        if num_tokens == batch_size:  # one new token per request: plain decode
            return req_ids
        counts = (cad.query_start_loc_cpu[1:batch_size + 1] - cad.query_start_loc_cpu[:batch_size]).tolist()
        return [r for r, n in zip(req_ids, counts) for _ in range(n)]

    def _propose_adaptive(self, inputs: _StepInputs) -> list[list[int]]:
        """Per request, the draft tokens worth verifying (`vllm_dflash.adaptive`).

        The runner hands the lists to the scheduler as each request's
        spec_token_ids, any length (0 too). The context K/V of every verified
        token is written (or queued, when nothing is drafted) whatever q is.
        """
        q, self._planned_q = self._planned_q, None
        if q is None:
            q = self._begin_adaptive(inputs.next_token_ids.shape[0], inputs.target_positions.shape[0],
                                     inputs.num_rejected_tokens_gpu, inputs.sampling_metadata)
        drafts, conf = self._propose_block(q, inputs, confidence=True)
        return self._finish_adaptive(drafts, conf)

    def _begin_adaptive(self, batch_size: int, num_tokens: int, num_rejected_tokens_gpu: torch.Tensor | None,
                        sampling_metadata: SamplingMetadata, nothing_verified: bool = False,
                        t0: float | None = None) -> int:
        """The step's query length q, after the last step's outcomes are learned.

        From the runner's batch: the request ids (rows move between steps:
        outcomes are matched by id), how many drafts each request had verified
        this step (`input_batch.spec_token_ids`, what the scheduler actually
        scheduled) and, with `num_rejected_tokens_gpu`, how many were accepted;
        partial prefills (`discard_request_mask`) and seeded sampled requests
        (reproducibility) get no budget. The drafting clock starts here (or at `t0`,
        when the caller already read it)."""
        if t0 is None:
            t0 = self._step_clock()
        adaptive, runner = self.adaptive, self.runner
        batch = runner.input_batch
        req_ids = batch.req_ids[:batch_size]
        if nothing_verified:
            verified = np.zeros(batch_size, dtype=np.int64)
        else:
            verified = np.fromiter((len(batch.spec_token_ids[i]) for i in range(batch_size)), np.int64, batch_size)
        if num_rejected_tokens_gpu is None:
            accepted = verified
        else:
            accepted = np.maximum(verified - num_rejected_tokens_gpu[:batch_size].cpu().numpy(), 0)
        if sampling_metadata.all_greedy:
            greedy = np.ones(batch_size, dtype=bool)
        else:
            greedy = sampling_params.greedy_mask(sampling_metadata.temperature, batch_size, self.device).cpu().numpy()
        eligible = ~runner.discard_request_mask.np[:batch_size].astype(bool)
        # A seeded sampled request must give the same tokens every time it is sent: how much
        # randomness verification draws from its generator depends on its draft lengths, which
        # adaptive speculation ties to the engine's state. So it takes no drafts (its tokens
        # come from the sampler alone, as without speculation); greedy requests are unaffected.
        # (A forced test schedule keeps drafting them: its lengths are the point of the test.)
        if adaptive.schedule is None:
            for row in sampling_metadata.generators:
                if row < batch_size and not greedy[row]:
                    eligible[row] = False
        # Rows beyond one token per request and its verified drafts are prompt-chunk rows.
        self._prompt_rows = max(num_tokens - batch_size - int(verified.sum()), 0)
        useful = self._useful_drafts(req_ids, accepted)
        started = time.perf_counter()
        plan = adaptive.begin(t0, req_ids, verified, accepted, num_tokens, greedy, eligible, useful=useful)
        # Learning and planning are no part of D(R, q + 1): any q pays them, and steps on a cached
        # plan (runs) skip them. Counted in, a probe's no-draft steps, which always plan, measured
        # D(4, 1) at 0.6 ms against 0.12 ms for no-draft steps in a row (bfloat16, AVX-512 EPYC).
        self._not_drafting_seconds += time.perf_counter() - started
        return self._same_on_every_rank(plan.q)

    def _useful_drafts(self, req_ids: list[str], accepted: np.ndarray) -> np.ndarray:
        """Per request, the most drafts its next step can turn into output: it stops at
        max_tokens, and the step yields its accepted drafts plus one token. This step's
        tokens (1 + accepted) are not in the runner's request state yet: drafting runs
        before vLLM's bookkeeping appends them."""
        k = self.num_speculative_tokens
        requests = self.runner.requests
        useful = []  # Python ints: this runs every drafting step, where each numpy call counts
        for req_id, done in zip(req_ids, accepted.tolist()):
            tokens = self._tokens_left(requests.get(req_id))
            if tokens is None:
                useful.append(k)
            else:
                left = tokens - 1 - done
                useful.append(min(max(left - 1, 0), k))
        return np.array(useful, dtype=np.int64)

    def _step_clock(self) -> float:
        """Now, once the step's device work is done: it belongs to the step, not to the draft time."""
        if self._on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _finish_adaptive(self, drafts: torch.Tensor, conf: tuple[torch.Tensor, torch.Tensor] | None) -> list[list[int]]:
        """Budgets for the drafted block [B, q] (q = 0: none) and each request's list."""
        adaptive = self.adaptive
        batch_size, q = drafts.shape
        if q == 0:
            empty = np.zeros((batch_size, 0))
            adaptive.choose(time.perf_counter(), empty, empty)
            out: list[list[int]] = [[] for _ in range(batch_size)]
        else:
            feature, prior = (c.cpu().numpy() for c in conf)
            budgets = adaptive.choose(time.perf_counter(), feature, prior)
            out = [row[:b] for row, b in zip(drafts.tolist(), budgets.tolist())]
        adaptive.end(time.perf_counter(), not_drafting=self._not_drafting_seconds)
        self._not_drafting_seconds = 0.0
        return out

    def _same_on_every_rank(self, q: int) -> int:
        """Tensor-parallel ranks time their own steps, so they could plan differently;
        the draft forward is collective, so rank 0's q is everyone's."""
        if self._tp_size <= 1:
            return q
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().broadcast_object(q, src=0))

    def _draft_tokens(
        self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata, width: int, confidence: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(draft ids, (feature, prior) confidences or None).

        Argmax drafts, or sampled drafts with vLLM's `draft_sample_method=
        "probabilistic"` (their distributions q then go to the rejection
        sampler, through `last_draft_probs`), a seeded request's from its
        own generator (`_seeded_draft_generators`). Sampled
        drafts are scored by the probability they were drawn with
        (`sampled_confidence`), argmax drafts by the logit margin."""
        logits = self.model.compute_logits(hidden_states)
        sampled_drafts = self.draft_probs_enabled and not sampling_metadata.all_greedy
        if confidence and not sampled_drafts:
            return argmax_with_confidence(logits, self.confidence_feature)
        conf = draft_confidence(logits, self.confidence_feature) if confidence else None
        if sampled_drafts:
            batch_size = logits.shape[0] // width
            block_ids, block_probs = sample_drafts(
                logits.view(batch_size, width, -1), "sample",
                temperature=sampling_metadata.temperature, top_k=sampling_metadata.top_k,
                top_p=sampling_metadata.top_p, min_p=min_p_per_request(sampling_metadata, batch_size),
                generators=self._seeded_draft_generators(sampling_metadata, batch_size))
            self.last_draft_probs = block_probs
            draft_ids, probs = block_ids.view(-1), block_probs.view(batch_size * width, -1)
            if conf is not None:
                sampled = ~sampling_params.greedy_mask(sampling_metadata.temperature, probs.shape[0] // width,
                                                       probs.device).repeat_interleave(width)
                conf = sampled_confidence(conf, probs, draft_ids, sampled)
            return draft_ids, conf
        return ops.logits_argmax(logits), conf

    def _seeded_draft_generators(self, sampling_metadata: SamplingMetadata, batch_size: int) -> dict:
        """{row: generator} for sampled drafts: a seeded request draws its drafts from
        its own generator (vLLM draws them from the global RNG), so its output is
        reproducible. Rows whose sample is discarded this step (partial prefills)
        draw from the global RNG: vLLM rewinds only the sampler's draw there."""
        generators = sampling_metadata.generators
        if not generators or self.runner is None:
            return generators
        discarded = self.runner.discard_request_mask.np[:batch_size]
        return {i: g for i, g in generators.items() if i < batch_size and not discarded[i]}
