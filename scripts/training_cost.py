"""Cost of `vllm-dflash train` for a target: FLOPs, time per epoch, memory, feature-cache disk.

The FLOP model counts the matrix products of one training step (forward and
backward of the draft over the context features and the packed blocks, the frozen
LM head's forward and input gradient) and of feature extraction (one target
forward per token). `--measured-steps-per-s` checks it against a measured run:
FLOPs per step x steps/s = the throughput the run achieved. Time per epoch on
other hardware = FLOPs / (devices x an assumed sustained FLOP/s), so it is an
estimate from stated assumptions, not a measurement.

    python scripts/training_cost.py --target models/toy-target --num-layers 2 --num-features 2 \\
        --seq-len 300 --batch-size 8 --measured-steps-per-s 1.0
    python scripts/training_cost.py --preset qwen3-8b --num-layers 5 --num-features 5 --seq-len 2048 \\
        --samples 800000 --devices 8 --device-tflops 400
"""

from __future__ import annotations

import argparse
import json
import os

# Qwen3-8B's public config.json (36 layers, GQA 32/8, untied LM head).
PRESETS = {"qwen3-8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
                        "vocab_size": 151936, "tie_word_embeddings": False}}


def target_params(c: dict) -> float:
    d, h, kv, hd, inter, v = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                              c["head_dim"], c["intermediate_size"], c["vocab_size"])
    layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * inter
    return c["num_hidden_layers"] * layer + v * d * (1 if c.get("tie_word_embeddings") else 2)


def draft_params(c: dict, layers: int, features: int) -> float:
    d, h, kv, hd, inter = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                           c["intermediate_size"])
    return layers * (d * h * hd * 2 + d * kv * hd * 2 + 3 * d * inter) + features * d * d


def step_flops(c: dict, layers: int, features: int, block: int, blocks: int, seq: int) -> dict:
    """FLOPs of one training sequence (forward + backward = 3x forward for trained weights)."""
    d, h, kv, hd, inter, v = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                              c["head_dim"], c["intermediate_size"], c["vocab_size"])
    tokens = blocks * block                              # packed block tokens
    context = 2 * seq * (features * d * d + layers * 2 * d * kv * hd)    # fc + context K/V per layer
    layer = 2 * tokens * layers * (d * h * hd * 2 + d * kv * hd * 2 + 3 * d * inter)
    attention = 2 * 2 * tokens * layers * h * hd * (seq / 2 + block)   # scores + values, keys ~ S/2 + B
    lm_head = 2 * blocks * (block - 1) * d * v           # frozen: forward, and backward to its input only
    return {"draft": 3 * (context + layer + attention), "lm_head": 2 * lm_head}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target folder (reads config.json)")
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int, default=2, help="draft layers")
    p.add_argument("--num-features", type=int, default=2, help="target feature layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks-per-seq", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048, help="mean tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--samples", type=int, default=3000, help="training sequences per epoch")
    p.add_argument("--measured-steps-per-s", type=float, help="a measured run's steps/s (same settings)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--device-tflops", type=float, help="assumed sustained TFLOP/s per device")
    args = p.parse_args()
    if args.preset:
        c = dict(PRESETS[args.preset])
    elif args.target:
        with open(os.path.join(args.target, "config.json")) as f:
            c = json.load(f)
        c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    else:
        p.error("give --target or --preset")
    seq_flops = step_flops(c, args.num_layers, args.num_features, args.block_size, args.blocks_per_seq, args.seq_len)
    per_seq = sum(seq_flops.values())
    per_step = per_seq * args.batch_size
    n_draft = draft_params(c, args.num_layers, args.num_features)
    n_target = target_params(c)
    out = {"target_params": n_target, "draft_params": n_draft,
           "flops_per_sequence": seq_flops, "flops_per_step": per_step,
           "feature_flops_per_token": 2 * n_target,
           "feature_cache_bytes_per_token": args.num_features * c["hidden_size"] * 2,
           "train_memory_bytes": {"draft weights+grads+adam (fp32)": 16 * n_draft,
                                  "embedding + LM head (bf16, frozen)": 2 * c["vocab_size"] * c["hidden_size"] * 2,
                                  "LM-head logits+grad per sequence (fp32)":
                                      2 * 4 * args.blocks_per_seq * (args.block_size - 1) * c["vocab_size"]}}
    if args.measured_steps_per_s:
        out["measured_gflops_per_s"] = per_step * args.measured_steps_per_s / 1e9
    if args.device_tflops:
        rate = args.devices * args.device_tflops * 1e12
        out["epoch_train_hours"] = args.samples * per_seq / rate / 3600
        out["feature_extraction_hours"] = args.samples * args.seq_len * 2 * n_target / rate / 3600
        out["feature_cache_tb"] = args.samples * args.seq_len * out["feature_cache_bytes_per_token"] / 1e12
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
