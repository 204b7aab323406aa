"""Training steps per second of `vllm-dflash train` in fp32 and in bf16 autocast on this machine.

Builds a small feature cache from the target on random-token sequences (timing does not
depend on the text), then times the same training steps under each autocast setting.
Prints the machine, the load average and what `--autocast auto` would choose.

    python scripts/autocast_speed.py --target models/toy-target --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="models/toy-target")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting (after one warm-up step)")
    p.add_argument("--seq-len", type=int, default=300)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--settings", default="fp32,bf16")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from vllm_dflash import precision
    from vllm_dflash.machine import describe
    from vllm_dflash.reference import DFlashDraftModel, new_draft_config
    from vllm_dflash.training.data import Sample
    from vllm_dflash.training.features import build_feature_cache
    from vllm_dflash.training.trainer import TrainConfig, Trainer

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(16, vocab, (args.seq_len,), generator=gen).tolist(), 32)
               for _ in range(args.sequences)]
    config = new_draft_config(target.config, num_layers=args.num_layers, block_size=16, mask_token_id=4)
    result = {"machine": describe(), "auto": precision.resolve("auto", "cpu").describe(), "threads": args.threads,
              "seq_len": args.seq_len, "batch_size": args.batch_size, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cache = build_feature_cache(target, samples, list(config.dflash_config["target_layer_ids"]),
                                    os.path.join(tmp, "features"), dtype="fp32")
        for setting in args.settings.split(","):
            torch.manual_seed(0)
            trainer = Trainer(DFlashDraftModel(config), target.get_input_embeddings().weight,
                              target.get_output_embeddings().weight, cache,
                              TrainConfig(max_steps=args.steps + 1, batch_size=args.batch_size, autocast=setting),
                              os.path.join(tmp, setting))
            batches = trainer.batch_stream()
            trainer.train_step(next(batches))   # warm-up
            load0 = os.getloadavg()[0]
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step(next(batches))
            seconds = (time.perf_counter() - start) / args.steps
            result["settings"][setting] = {"seconds_per_step": seconds, "steps_per_s": 1 / seconds,
                                           "load_avg_1min": [load0, os.getloadavg()[0]]}
            print(f"{setting}: {seconds:.2f} s/step ({1 / seconds:.3f} steps/s), load {load0:.1f}", flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
