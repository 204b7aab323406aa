"""`vllm-dflash train`: target-generated data -> feature cache -> drafter -> z-lab checkpoint.

Under `torchrun --nproc-per-node N $(which vllm-dflash) train ...` the same command
trains data parallel (DDP; gloo on CPU, NCCL on CUDA): rank 0 generates the
responses, every rank computes its share of the feature shards and trains on its
slice of each global batch, and rank 0 alone writes logs, checkpoints and the export.

Every stage caches its output under --out and is skipped when already done, so a
rerun resumes and ablation runs (--run-name) share the responses and features:

    OUT/responses.jsonl              prompts + target responses (token ids)
    OUT/features-<layer ids>/        sharded, memory-mapped target features
    OUT/runs/<run name>/             checkpoint.pt, history.jsonl, summary.json
    OUT/runs/<run name>/draft/       exported checkpoint (or --export DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import time

from vllm_dflash import precision

STAGES = ("data", "features", "train", "export")
# Covers the bench's and demo's contexts (prompt + up to 384 new tokens) and multi-turn conversations.
MAX_LEN = 2048


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target and data")
    g.add_argument("--target", required=True, help="Hugging Face target folder (config, weights, tokenizer)")
    g.add_argument("--out", required=True, help="work folder: caches and runs")
    g.add_argument("--prompts", default="toy",
                   help="'toy' (the bundled corpus) or a .jsonl/.json/.txt prompt file (default: toy)")
    g.add_argument("--num-prompts", type=int, default=3000, help="prompts to use (default 3000)")
    g.add_argument("--prompt-turns", type=int, default=1,
                   help="chain this many prompts of a category into one conversation whose every turn the "
                        "target answers (long training contexts from short prompts; default 1)")
    g.add_argument("--max-new-tokens", type=int, default=384, help="response length cap (default 384)")
    g.add_argument("--temperatures", type=_floats, default=(0.0,),
                   help="comma list; one response per prompt per temperature (default 0 = greedy)")
    g.add_argument("--max-len", type=int, default=MAX_LEN,
                   help=f"prompt + response tokens kept, the longest training context (default {MAX_LEN}: "
                        "the bench and demo contexts and multi-turn conversations)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM engine setting")
    g.add_argument("--target-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="transformers dtype of the target for features and tau (default: as stored where "
                        "the device computes it natively, else float32; see --autocast)")
    g.add_argument("--gen-dtype", default="auto",
                   help="vLLM dtype for generation (default: the same rule as --target-dtype)")
    g.add_argument("--gen-eager", action="store_true", help="vLLM enforce_eager (skips graph compilation)")
    g = p.add_argument_group("drafter")
    g.add_argument("--num-layers", type=int, default=2, help="draft layers (default 2)")
    g.add_argument("--block-size", type=int, default=16, help="block size B (default 16)")
    g.add_argument("--num-target-layers", type=int, default=None,
                   help="number of target feature layers (z-lab's spacing rule; default: --num-layers)")
    g.add_argument("--target-layer-ids", type=_ints, default=None, help="explicit 0-based feature layers")
    g.add_argument("--init-draft", default=None,
                   help="start from this exported drafter (z-lab format) instead of random weights: "
                        "fine-tuning, e.g. on longer contexts; its layers, block size, feature layers and mask "
                        "token replace --num-layers, --block-size, --target-layer-ids and --mask-token-id")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="mask token id (default: the tokenizer's mask token or <|reserved_0|>)")
    g = p.add_argument_group("training")
    g.add_argument("--run-name", default=None, help="run folder under OUT/runs (default from the settings)")
    g.add_argument("--anchors", choices=("random", "fixed"), default="random")
    g.add_argument("--loss-decay", action=argparse.BooleanOptionalAction, default=True,
                   help="weight position k by exp(-(k-1)/gamma) (default on)")
    g.add_argument("--gamma", type=float, default=None, help="loss decay gamma (default 7 for B=16)")
    g.add_argument("--blocks-per-seq", type=int, default=32)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the run")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--steps", type=int, default=None, help="training steps")
    g.add_argument("--minutes", type=float, default=None, help="training time budget")
    g.add_argument("--autocast", choices=precision.CHOICES, default="auto",
                   help="auto (default): bf16 where the device computes it natively (CUDA with bf16, a CPU "
                        "with AMX or AVX512_BF16), else fp32; the choice and its reason are printed")
    g.add_argument("--attention", choices=("auto", "sdpa", "flex"), default="auto",
                   help="auto: flex attention on CUDA, SDPA + dense mask on CPU")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint of this run")
    g.add_argument("--checkpoint-every", type=int, default=200)
    g.add_argument("--log-every", type=int, default=10, help="steps per logged training window")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    g = p.add_argument_group("evaluation and export")
    g.add_argument("--eval-prompts", default=None, help="held-out prompt file (.json/.jsonl/.txt) for tau")
    g.add_argument("--eval-num", type=int, default=None, help="eval prompts per category (default: all)")
    g.add_argument("--eval-max-new-tokens", type=int, default=None,
                   help="response length of the tau evaluation (default: --max-new-tokens, the length the val "
                        "tau_est covers; tau falls as responses grow, so shorter evals read higher)")
    g.add_argument("--eval-draft", default=None,
                   help="only measure tau of this exported draft on --eval-prompts (no data, no training)")
    g.add_argument("--eval-every", type=int, default=0, help="steps between tau evaluations (0: at the end)")
    g.add_argument("--eval-turns", type=int, default=1,
                   help="chain this many eval prompts of a category into one conversation (long contexts)")
    g.add_argument("--export", default=None, help="export folder (default OUT/runs/<run>/draft)")
    g.add_argument("--export-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    g.add_argument("--feature-dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="storage dtype of the cached target features (default: the dtype the target computes "
                        "in, so training reads exactly the features decoding sees; bf16 halves the disk of fp32)")
    g.add_argument("--features", choices=("cache", "online"), default="cache",
                   help="cache (default): the target's features computed once into memory-mapped shards under "
                        "OUT; online: computed by the target at every step (no disk, a target forward per "
                        "step: for targets whose cache would not fit, e.g. Qwen3-8B at 40 KB per token)")
    g.add_argument("--stop-after", choices=STAGES, default="export", help="last stage to run")


def find_mask_token_id(tokenizer, vocab_size: int) -> int:
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return tokenizer.mask_token_id
        for name in ("<|reserved_0|>", "<|MASK|>", "<mask>"):
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and 0 <= tid < vocab_size:
                return tid
    raise ValueError("cannot pick a mask token: the tokenizer has no mask or <|reserved_0|> token; "
                     "pass --mask-token-id with an id the target never generates")


def adopt_init_draft(args, say) -> None:
    """The drafter's shape comes from --init-draft's config: its weights fit no other."""
    from vllm_dflash.config import parse_draft_config
    from vllm_dflash.reference.checkpoint import load_draft_config

    try:
        parsed = parse_draft_config(load_draft_config(args.init_draft))
    except ValueError as e:
        raise ValueError(f"--init-draft {args.init_draft}: {e}") from None
    adopted = {"num_layers": parsed.num_draft_layers, "block_size": parsed.block_size,
               "target_layer_ids": list(parsed.target_layer_ids), "mask_token_id": parsed.mask_token_id}
    for name, value in adopted.items():
        if getattr(args, name) not in (None, value):
            say(f"--{name.replace('_', '-')} {getattr(args, name)} replaced by --init-draft's {value}")
        setattr(args, name, value)
    say(f"init draft: {args.init_draft} ({adopted['num_layers']} layers, block {adopted['block_size']}, "
        f"feature layers {adopted['target_layer_ids']})")


def default_run_name(args, layer_ids: list[int]) -> str:
    decay = "decay" if args.loss_decay else "nodecay"
    return f"L{args.num_layers}-B{args.block_size}-F{'_'.join(map(str, layer_ids))}-{args.anchors}-{decay}"


def load_target(args, device, prec: precision.Precision):
    """The transformers target for features and tau: its stored dtype where the device
    computes it natively, float32 elsewhere (`--target-dtype` overrides)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "auto" if args.target_dtype == "auto" else getattr(torch, args.target_dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
    if args.target_dtype == "auto":
        target = target.to(precision.model_dtype(next(target.parameters()).dtype, prec))
    return target.to(device).eval().requires_grad_(False)


def generation_dtype(args, prec: precision.Precision) -> str:
    """vLLM's dtype for response generation, by the rule of `load_target`."""
    if args.gen_dtype != "auto":
        return args.gen_dtype
    from transformers import AutoConfig

    import torch

    config = AutoConfig.from_pretrained(args.target)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    return "auto" if precision.model_dtype(stored, prec) == stored else "float32"


def feature_dtype(args, target) -> str:
    """--feature-dtype, where `auto` stores features in the dtype the target computes them in."""
    if args.feature_dtype != "auto":
        return args.feature_dtype
    import torch

    dtype = next(target.parameters()).dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def eval_new_tokens(args) -> int:
    """The eval decodes responses as long as the training ones, so its tau and the val tau_est
    measure the same thing (second toy target: 5.90 at 128 tokens, 4.30 at 384, tau_est 4.33)."""
    return args.eval_max_new_tokens or args.max_new_tokens


def load_eval_prompts(args, tokenizer):
    """--eval-prompts, --eval-num per category, chained into --eval-turns conversations."""
    from vllm_dflash.training import data

    prompts = data.load_prompts(args.eval_prompts, tokenizer)
    return data.chain_turns(data.per_category(prompts, args.eval_num and args.eval_num * args.eval_turns),
                            args.eval_turns)


def eval_only(args, device) -> int:
    """Tau of an exported draft per category and by context length: OUT/tau-<draft name>.json,
    a PNG beside it, and the tables printed."""
    import torch

    from vllm_dflash.reference import load_draft
    from vllm_dflash.training import data
    from vllm_dflash.training.evaluate import context_table, format_tau, measure_tau, plot_by_context

    if not args.eval_prompts:
        raise ValueError("--eval-draft needs --eval-prompts (the held-out prompt file)")
    tokenizer = data.load_tokenizer(args.target)
    target = load_target(args, device, precision.resolve(args.autocast, device))
    draft = load_draft(args.eval_draft, device=device, dtype=torch.float32, target_config=target.config)
    prompts = load_eval_prompts(args, tokenizer)
    result = measure_tau(target, draft, prompts, eval_new_tokens(args),
                         data.stop_token_ids(args.target, tokenizer), tokenizer=tokenizer)
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(os.path.normpath(args.eval_draft))
    base = os.path.join(args.out, f"tau-{name}" + (f"-turns{args.eval_turns}" if args.eval_turns > 1 else ""))
    with open(base + ".json", "w") as f:
        json.dump({"draft": os.path.abspath(args.eval_draft), "target": os.path.abspath(args.target),
                   "max_new_tokens": eval_new_tokens(args), "prompts_per_category": args.eval_num,
                   "turns": args.eval_turns, "target_dtype": str(next(target.parameters()).dtype),
                   "tau": result}, f, indent=1)
    by_context = result["all"]["by_context"]
    plot_by_context(by_context, base + "-by-context.png",
                    f"{name}: tau by context ({args.eval_turns}-turn conversations)")
    print("tau: " + format_tau(result))
    print(context_table(by_context))
    print(f"wrote {base}.json and {base}-by-context.png")
    return 0


def run(args) -> int:
    import torch

    from vllm_dflash.training import distributed

    if not os.path.isfile(os.path.join(args.target, "config.json")):
        raise ValueError(f"--target {args.target!r} is not a Hugging Face model folder (no config.json)")
    requested = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world = distributed.init(requested.type)
    try:
        return _run(args, world, distributed.device_for(world, args.device))
    finally:
        distributed.shutdown()


def _run(args, world, device) -> int:
    import torch

    from vllm_dflash.training import data, distributed
    from vllm_dflash.training.responses import generate_responses

    say = print if world.main else (lambda *a, **k: None)
    prec = precision.resolve(args.autocast, device)
    say(f"autocast: {prec.describe()}")
    if args.eval_draft:
        return eval_only(args, device) if world.main else 0
    for name in ("num_prompts", "prompt_turns", "max_new_tokens", "max_len", "num_layers", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.stop_after in ("train", "export") and args.steps is None and args.minutes is None:
        raise ValueError("give --steps or --minutes (the training length)")
    os.makedirs(args.out, exist_ok=True)
    stages = STAGES[:STAGES.index(args.stop_after) + 1]
    if world.parallel:
        say(f"data parallel: {world.size} processes, global batch {args.batch_size} sequences")

    if args.init_draft:
        adopt_init_draft(args, say)
    from transformers import AutoConfig

    max_pos = getattr(AutoConfig.from_pretrained(args.target).get_text_config(), "max_position_embeddings", None)
    if max_pos and args.max_len > max_pos:
        say(f"--max-len {args.max_len} is past the target's max_position_embeddings; using {max_pos}")
        args.max_len = max_pos
    tokenizer = data.load_tokenizer(args.target)
    prompts = data.chain_turns(data.load_prompts(args.prompts, tokenizer, limit=args.num_prompts, seed=args.seed,
                                                 target=args.target), args.prompt_turns)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, temperatures=args.temperatures, max_len=args.max_len,
                      seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
                      engine_kwargs={"dtype": generation_dtype(args, prec), "enforce_eager": args.gen_eager},
                      tokenizer=tokenizer)
    responses = os.path.join(args.out, "responses.jsonl")
    if world.main:
        say(f"generation: vLLM dtype {gen_kwargs['engine_kwargs']['dtype']}")
        generate_responses(args.target, prompts, responses, **gen_kwargs)
    distributed.barrier()   # the others read the finished cache (no engine starts there)
    samples = data.usable(generate_responses(args.target, prompts, responses, **gen_kwargs),
                          args.block_size, args.max_len)
    say(f"data: {len(samples)} usable sequences, {sum(len(s.tokens) for s in samples)} tokens "
        f"({sum(s.response_len for s in samples)} response tokens)")
    if stages == ("data",):
        return 0

    from vllm_dflash.reference import DFlashDraftModel, load_draft, new_draft_config
    from vllm_dflash.training.evaluate import format_tau, measure_tau
    from vllm_dflash.training.export import export_draft
    from vllm_dflash.training.features import OnlineFeatures, build_feature_cache, check_cache_fits
    from vllm_dflash.training.loss import default_gamma
    from vllm_dflash.training.trainer import TrainConfig, Trainer

    target = load_target(args, device, prec)
    say(f"target: {next(target.parameters()).dtype} for features and tau")
    vocab = target.config.get_text_config().vocab_size
    mask_id = args.mask_token_id if args.mask_token_id is not None else find_mask_token_id(tokenizer, vocab)
    torch.manual_seed(args.seed)
    if args.init_draft:   # adopt_init_draft already set the flags from its config
        init = load_draft(args.init_draft, dtype=torch.float32, target_config=target.config).train()
        draft_config = init.config
    else:
        init = None
        draft_config = new_draft_config(target.config, num_layers=args.num_layers, block_size=args.block_size,
                                        mask_token_id=mask_id, target_layer_ids=args.target_layer_ids,
                                        num_features=args.num_target_layers)
    layer_ids = list(draft_config.dflash_config["target_layer_ids"])
    if args.features == "online":
        cache = OnlineFeatures(target, samples, layer_ids, feature_dtype(args, target))
        say(f"features: online, {len(cache)} sequences, {cache.num_tokens} tokens, layers {layer_ids}, "
            f"{cache.meta['dtype']}")
    else:
        cache_dir = os.path.join(args.out, "features-" + "_".join(map(str, layer_ids)))
        dtype = feature_dtype(args, target)
        check_cache_fits(cache_dir, samples, len(layer_ids) * target.config.get_text_config().hidden_size, dtype)
        cache = build_feature_cache(target, samples, layer_ids, cache_dir, dtype=dtype,
                                    target_name=os.path.abspath(args.target), rank=world.rank, world_size=world.size)
        say(f"features: {len(cache)} sequences, {cache.num_tokens} tokens, layers {layer_ids}, "
            f"stored {cache.meta['dtype']}")
    if stages[-1] == "features":
        return 0

    run_dir = os.path.join(args.out, "runs", args.run_name or default_run_name(args, layer_ids))
    gamma = None if not args.loss_decay else (args.gamma or default_gamma(args.block_size))
    cfg = TrainConfig(blocks_per_seq=args.blocks_per_seq, batch_size=args.batch_size, lr=args.lr,
                      warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      max_steps=args.steps, max_minutes=args.minutes, gamma=gamma, anchors=args.anchors,
                      attention=args.attention, autocast=prec.name, eval_every=args.eval_every,
                      checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                      min_lr_ratio=args.min_lr_ratio, seed=args.seed)
    evaluate = None
    if args.eval_prompts and world.main:
        eval_prompts = load_eval_prompts(args, tokenizer)
        stops = data.stop_token_ids(args.target, tokenizer)

        def evaluate(draft):
            return measure_tau(target, draft, eval_prompts, eval_new_tokens(args), stops, tokenizer=tokenizer)

    draft = init if init is not None else DFlashDraftModel(draft_config)
    trainer = Trainer(draft, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                      cache, cfg, run_dir, device, evaluate, world)
    if not args.fresh and trainer.load_checkpoint():
        say(f"resuming {run_dir} at step {trainer.step}")
    n_params = sum(p.numel() for p in draft.parameters())
    start = time.time()
    result = trainer.train()
    if not world.main:
        return 0
    summary = {"run": run_dir, "target": os.path.abspath(args.target), "draft_parameters": n_params,
               "target_layer_ids": layer_ids, "block_size": args.block_size, "num_layers": args.num_layers,
               "anchors": args.anchors, "gamma": gamma, "train_sequences": len(trainer.train_idx),
               "val_sequences": len(trainer.val_idx), "cache_tokens": cache.num_tokens,
               "autocast_reason": prec.reason, "max_new_tokens": args.max_new_tokens,
               "eval_max_new_tokens": eval_new_tokens(args), "wall_minutes": (time.time() - start) / 60, **result}
    if "export" in stages:
        path = export_draft(trainer.draft.cpu().eval(), args.export or os.path.join(run_dir, "draft"),
                            args.export_dtype)
        summary["export"] = path
        print(f"exported {path}")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    nan = float("nan")
    train, val = result.get("train") or {}, result.get("val") or {}
    print(f"done: {result['steps']} steps in {result['minutes']:.1f} min "
          f"({result['steps'] / max(result['minutes'] * 60, 1e-9):.3f} steps/s at load {os.getloadavg()[0]:.1f}; "
          f"{result['cpu_minutes'] * 60 / max(result['steps'], 1):.2f} CPU-s/step on {result['torch_threads']} "
          f"thread(s)); train loss "
          f"{train.get('loss', nan):.3f}, val loss {val.get('loss', nan):.3f}, val acc@1 {val.get('acc1', nan):.3f}, "
          f"val tau_est {val.get('tau_est', nan):.2f} (decode chain; block mean {val.get('block_tau', nan):.2f})")
    if result.get("tau"):
        print(f"tau (reference loop, {eval_new_tokens(args)} new tokens): " + format_tau(result["tau"]))
    return 0
