"""`draft_sample`: how the DFlash draft picks its tokens, as a speculative-config key.

    speculative_config={"method": "dflash", "model": ..., "draft_sample": "argmax" | "sample"}

vLLM 0.32's `SpeculativeConfig` is a pydantic dataclass that forbids unknown
keys (`config/utils.py`, extra="forbid"), but it already carries the switch
we need: `draft_sample_method` "greedy" (argmax drafts, one-hot q in the
verifier) or "probabilistic" (each request's drafts are drawn from the draft's
softmax at that request's temperature, and the proposer hands those q,
[B, k, V] float32, to the rejection sampler through `take_last_draft_probs()`).
So `draft_sample` is translated into vLLM's field before `SpeculativeConfig`
sees the dict (the `create_speculative_config` patch in `vllm_dflash.patches`); vLLM's own key still works,
and the two must agree when both are given.

Greedy requests draft the argmax in both modes. At T > 0 a sampled draft is
accepted with probability sum_x min(p, q) per position, an argmax draft with
p(argmax q): which is larger depends on how close the draft is to the target,
so the default is measured on the bundled pair (see DEFAULT_DRAFT_SAMPLE).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DRAFT_SAMPLE_CHOICES = ("argmax", "sample")
TO_VLLM_DRAFT_SAMPLE_METHOD = {"argmax": "greedy", "sample": "probabilistic"}

# The one place the default lives: the mode with the higher acceptance length
# at T=1 on the bundled pair (models/toy-target + models/toy-draft, held-out
# chat prompts, k=15; the figures are in README "Results"). At T=0 both modes
# accept alike: greedy requests draft the argmax anyway.
DEFAULT_DRAFT_SAMPLE = "sample"


def vllm_draft_sample_method(spec: Mapping[str, Any], *, use_default: bool = True) -> str | None:
    """vLLM's `draft_sample_method` for a speculative-config dict (underscore keys).

    None means "leave the dict as it is" (no `draft_sample`, and either vLLM's
    key is set or `use_default` is off, e.g. when vLLM's in-tree DFlash serves
    and should keep its own default).
    """
    choice = spec.get("draft_sample")
    vllm_value = spec.get("draft_sample_method")
    if choice is None:
        if vllm_value is not None or not use_default or spec.get("method") != "dflash":
            return None
        choice = DEFAULT_DRAFT_SAMPLE
    if spec.get("method") != "dflash":
        raise ValueError(
            f"speculative_config.draft_sample is a vllm-dflash option for method='dflash' "
            f"(got method={spec.get('method')!r}); use vLLM's draft_sample_method "
            "('greedy' or 'probabilistic') for other methods"
        )
    if choice not in DRAFT_SAMPLE_CHOICES:
        raise ValueError(
            f"speculative_config.draft_sample={choice!r} is not valid; use one of "
            f"{' or '.join(repr(c) for c in DRAFT_SAMPLE_CHOICES)} (default {DEFAULT_DRAFT_SAMPLE!r})"
        )
    method = TO_VLLM_DRAFT_SAMPLE_METHOD[choice]
    if vllm_value is not None and vllm_value != method:
        raise ValueError(
            f"speculative_config.draft_sample={choice!r} contradicts "
            f"draft_sample_method={vllm_value!r} (vLLM's name for it is {method!r}); "
            "give only one of the two"
        )
    return method
