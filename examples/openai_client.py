"""Stream a chat completion from a `vllm serve` DFlash server and print the acceptance.

    vllm serve models/toy-target --dtype float32 --gpu-memory-utilization 0.5 \
        --speculative-config '{"method": "dflash", "model": "models/toy-draft"}'   # another shell
    python examples/openai_client.py --base-url http://127.0.0.1:8000

The answer streams as it is generated (a DFlash step can add several tokens at
once). Acceptance comes from the server's Prometheus `/metrics`: the
spec-decode counters' increase over this request.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--prompt", default="Write the Python function `flatten` that flattens a nested list.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    return p.parse_args()


def spec_counters(base_url: str) -> dict:
    """{counter: total, PER_POSITION: [per position]} summed over engines, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict = {name: 0.0 for name in COUNTERS}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if name in COUNTERS and s.name.endswith("_total"):
                out[name] += s.value
            elif name == PER_POSITION and s.name.endswith("_total"):
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    if not per_pos:
        sys.exit(f"{base_url}/metrics has no spec-decode counters: is the server running with --speculative-config?")
    out[PER_POSITION] = [per_pos[i] for i in sorted(per_pos)]
    return out


def main() -> None:
    args = parse_args()
    from openai import OpenAI

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key="unused")
    model = args.model or client.models.list().data[0].id
    before = spec_counters(args.base_url)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
        temperature=args.temperature, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    after = spec_counters(args.base_url)

    drafts = after[COUNTERS[0]] - before[COUNTERS[0]]
    drafted = after[COUNTERS[1]] - before[COUNTERS[1]]
    accepted = after[COUNTERS[2]] - before[COUNTERS[2]]
    per_pos = [a - b for a, b in zip(after[PER_POSITION], before[PER_POSITION] + [0.0] * len(after[PER_POSITION]))]
    print(f"\n\n{usage.completion_tokens if usage else '?'} tokens; DFlash: {drafts:.0f} drafting steps, "
          f"{accepted:.0f} of {drafted:.0f} draft tokens accepted, "
          f"mean acceptance length {1 + accepted / max(drafts, 1):.2f} (bonus token included)")
    print("acceptance rate per draft position:", [round(a / max(drafts, 1), 3) for a in per_pos])


if __name__ == "__main__":
    main()
