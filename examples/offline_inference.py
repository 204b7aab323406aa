"""Offline generation with vllm-dflash's DFlash: `LLM(...).generate()`.

    python examples/offline_inference.py                        # the bundled toy pair
    python examples/offline_inference.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 \
        --dtype bfloat16 --prompt "Write a quicksort in Python."

Once vllm-dflash is installed, `speculative_config={"method": "dflash", ...}` runs
this plugin's DFlash. Prompts go through the target's chat template; the script
prints each answer, then the acceptance vLLM measured (from `LLM.get_metrics()`).
"""

from __future__ import annotations

import argparse
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = [
    "Write the Python function `flatten` that flattens a nested list.",
    "What is 17 times 23?",
    "Describe a quiet morning by the sea.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=os.path.join(REPO, "models", "toy-target"), help="target model (folder or hub id)")
    p.add_argument("--draft", default=os.path.join(REPO, "models", "toy-draft"),
                   help="DFlash draft (folder or hub id); '' picks z-lab's draft for a known target")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="draft tokens per step (default: block_size - 1)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three toy prompts)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    p.add_argument("--dtype", default="float32", help="model dtype (float32 is fastest on CPUs without AMX)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start, slower steps)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="default: 0.9 on CUDA, 0.5 on CPU (vLLM's CPU worker checks its NUMA node's free memory)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU; ignored on CUDA
    import torch
    from vllm import LLM, SamplingParams

    speculative_config = {"method": "dflash"}
    if args.draft:
        speculative_config["model"] = args.draft
    if args.num_spec_tokens is not None:
        speculative_config["num_speculative_tokens"] = args.num_spec_tokens
    memory = args.gpu_memory_utilization or (0.9 if torch.cuda.is_available() else 0.5)
    llm = LLM(args.target, speculative_config=speculative_config, dtype=args.dtype, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=memory,
              enforce_eager=args.enforce_eager, disable_log_stats=False)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False) for p in args.prompt or DEFAULT_PROMPTS]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for prompt, out in zip(args.prompt or DEFAULT_PROMPTS, llm.generate(prompts, params)):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}")

    counters = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    drafts = counters["vllm:spec_decode_num_drafts"].value
    accepted = counters["vllm:spec_decode_num_accepted_tokens"].value
    per_position = counters["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    print(f"\nDFlash: {drafts} drafting steps, {accepted} draft tokens accepted, "
          f"mean acceptance length {1 + accepted / max(drafts, 1):.2f} (bonus token included)")
    print("accepted per draft position:", per_position)


if __name__ == "__main__":
    main()
