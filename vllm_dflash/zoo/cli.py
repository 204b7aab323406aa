"""`vllm-dflash zoo build`: make the bundled toy target offline and reproducibly."""

from __future__ import annotations

import argparse
import shlex
import sys

from vllm_dflash.precision import CHOICES
from vllm_dflash.zoo.corpus import CORPORA
from vllm_dflash.zoo.model import TargetShape
from vllm_dflash.zoo.train_target import BuildConfig, build, smoke_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="zoo_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="build the corpus and tokenizer, train the toy target, save it")
    d, s = BuildConfig(), TargetShape()
    b.add_argument("--out", default=d.out, help="output folder (Hugging Face format)")
    b.add_argument("--corpus", choices=CORPORA, default=d.corpus,
                   help="stdlib: Python source, docstrings, word problems (the bundled target); "
                        "unix: Perl source, man pages, list tasks")
    b.add_argument("--seed", type=int, default=d.seed)
    b.add_argument("--minutes", type=float, default=d.minutes,
                   help="wall-clock budget of the training loop; the step count is calibrated from it")
    b.add_argument("--steps", type=int, default=None,
                   help="exact step count (replays a recorded run; overrides --minutes)")
    b.add_argument("--vocab-size", type=int, default=s.vocab_size)
    b.add_argument("--hidden-size", type=int, default=s.hidden_size)
    b.add_argument("--layers", type=int, default=s.num_hidden_layers)
    b.add_argument("--heads", type=int, default=s.num_attention_heads)
    b.add_argument("--kv-heads", type=int, default=s.num_key_value_heads)
    b.add_argument("--head-dim", type=int, default=s.head_dim)
    b.add_argument("--intermediate-size", type=int, default=s.intermediate_size)
    b.add_argument("--seq-len", type=int, default=d.seq_len)
    b.add_argument("--batch-size", type=int, default=d.batch_size)
    b.add_argument("--lr", type=float, default=d.lr)
    b.add_argument("--math-problems", type=int, default=d.math_train, help="synthetic math problems to train on")
    b.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    b.add_argument("--autocast", choices=CHOICES, default=d.autocast,
                   help="auto (default): bf16 autocast where the CPU computes bf16 natively (AMX, "
                        "AVX512_BF16), float32 elsewhere")
    b.add_argument("--no-bf16", action="store_true", help="same as --autocast fp32")
    b.add_argument("--smoke", action="store_true", help="tiny model, few steps (tests)")
    c = sub.add_parser("card", help="rewrite README.md of a built target from its training record")
    c.add_argument("--out", default=d.out)


def config_from_args(args: argparse.Namespace) -> BuildConfig:
    if args.smoke:
        cfg = smoke_config(args.out, args.seed, args.corpus)
    else:
        shape = TargetShape(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                            intermediate_size=args.intermediate_size)
        cfg = BuildConfig(out=args.out, corpus=args.corpus, seed=args.seed, minutes=args.minutes, steps=args.steps,
                          shape=shape,
                          seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                          math_train=args.math_problems, threads=args.threads,
                          autocast="fp32" if args.no_bf16 else args.autocast)
    cfg.command = "vllm-dflash zoo " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["zoo"] else ""
    return cfg


def run(args: argparse.Namespace) -> int:
    if args.zoo_command == "card":
        from vllm_dflash.zoo.card import write_card

        print(write_card(args.out))
        return 0
    record = build(config_from_args(args))
    print(f"saved {args.out}: {record['parameters']:,} parameters, {record['steps']} steps, "
          f"{record['tokens_trained']:,} tokens, {record['train_loop_seconds']:.0f} s; "
          f"final losses {record['final_losses']}")
    return 0
