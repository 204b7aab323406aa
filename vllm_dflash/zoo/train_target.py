"""Train the toy target from scratch and save it in Hugging Face format.

nanoGPT-style loop: documents (chat turns ending in <|endoftext|>) are packed into
fixed-length rows, AdamW with linear warmup then cosine decay, bf16 autocast where the
CPU computes bf16 natively (float32 elsewhere),
gradient clipping, periodic per-category loss on training and held-out rows.

With a wall-clock budget (`minutes`) the cosine decay runs over the time left after
warmup, so a shared, busy CPU still gets the whole budget used and the schedule
completed; the step count reached is recorded, and `steps=N` replays the same data
order with a step-based cosine over N steps (the same schedule up to load jitter).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from vllm_dflash.precision import resolve as resolve_precision
from vllm_dflash.zoo import CATEGORIES, ENDOFTEXT, MASK_TOKEN, MASK_TOKEN_ID
from vllm_dflash.zoo.card import write_card
from vllm_dflash.zoo.corpus import Corpus, Example, build_corpus
from vllm_dflash.zoo.model import GENERATION_EOS, TargetShape, count_parameters, make_model
from vllm_dflash.zoo.tokenizer import render_chat, train_tokenizer, wrap

TOKENIZER_STRIDE = 3


def _log(t_start: float, msg: str) -> None:
    tqdm.write(f"[zoo {time.time() - t_start:6.1f}s] {msg}")


@dataclass
class BuildConfig:
    out: str = "models/toy-target"
    corpus: str = "stdlib"           # stdlib | unix (see corpus.build_corpus)
    seed: int = 0
    minutes: float | None = 40.0     # training-loop budget; ignored when steps is set
    steps: int | None = None
    shape: TargetShape = field(default_factory=TargetShape)
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    math_train: int = 30000
    math_heldout: int = 400
    max_modules: int | None = None   # cut the stdlib walk short (smoke builds)
    eval_rows: int = 8               # rows of seq_len per category and split
    evals: int = 8                   # evaluations during the run
    eval_prompts: int = 48           # held-out prompts per category in eval_prompts.json
    threads: int = 1                 # 2 threads on a shared 2-core CPU were 10x slower (OpenMP waits)
    autocast: str = "auto"          # auto | bf16 | fp32 (vllm_dflash.precision)
    smoke: bool = False
    command: str = ""

    def validate(self) -> None:
        if self.steps is None and (self.minutes is None or self.minutes <= 0):
            raise ValueError("minutes: give a positive training budget (--minutes) or a step count (--steps)")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        if self.seq_len < 32 or self.seq_len > self.shape.max_position_embeddings:
            raise ValueError(f"seq_len={self.seq_len}: must be in [32, max_position_embeddings]")
        self.shape.validate(smoke=self.smoke)


def smoke_config(out: str, seed: int = 0, corpus: str = "stdlib") -> BuildConfig:
    """A tiny build for tests: seconds, not minutes."""
    return BuildConfig(
        out=out, corpus=corpus, seed=seed, minutes=None, steps=40, seq_len=128, batch_size=4, lr=3e-3, warmup_steps=4,
        shape=TargetShape(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, intermediate_size=128,
                          max_position_embeddings=256),
        math_train=300, math_heldout=32, max_modules=40, eval_rows=2, evals=2, eval_prompts=8,
        threads=1, smoke=True)


def lr_at(step: int, total: int, cfg: BuildConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def doc_text(ex: Example) -> str:
    return render_chat(ex.prompt, ex.response) + ENDOFTEXT


def pack(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate documents and cut into [rows, seq_len]; the tail is dropped."""
    flat = [t for ids in token_lists for t in ids]
    rows = len(flat) // seq_len
    if rows == 0:
        raise ValueError(f"seq_len={seq_len}: corpus has only {len(flat)} tokens; lower seq_len")
    return torch.tensor(flat[:rows * seq_len], dtype=torch.long).view(rows, seq_len)


def eval_sets(corpus: Corpus, tok, cfg: BuildConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Fixed rows per (split, category): a sample of training docs and the held-out docs."""
    rng = random.Random(f"{cfg.seed}/eval-sets")
    out: dict[str, dict[str, torch.Tensor]] = {"train": {}, "heldout": {}}
    for split in out:
        for cat, exs in sorted(corpus.by_category(split).items()):
            exs = list(exs)
            rng.shuffle(exs)
            ids = [e.ids for e in tok.encode_batch([doc_text(x) for x in exs[:cfg.eval_rows * 40]])]
            out[split][cat] = pack(ids, cfg.seq_len)[:cfg.eval_rows]
    return out


@torch.no_grad()
def evaluate(model, sets, bf16: bool) -> dict[str, dict[str, float]]:
    model.eval()
    res: dict[str, dict[str, float]] = {}
    for split, cats in sets.items():
        res[split] = {}
        for cat, rows in cats.items():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                res[split][cat] = round(float(model(input_ids=rows, labels=rows).loss), 4)
    model.train()
    return res


def pick_eval_prompts(corpus: Corpus, cfg: BuildConfig) -> dict[str, list[str]]:
    rng = random.Random(f"{cfg.seed}/eval-prompts")
    out = {}
    held = corpus.by_category("heldout")
    for cat in CATEGORIES:
        prompts = sorted({e.prompt for e in held.get(cat, [])})
        if len(prompts) < cfg.eval_prompts and not cfg.smoke:
            raise ValueError(f"eval_prompts={cfg.eval_prompts}: only {len(prompts)} held-out {cat} prompts")
        out[cat] = rng.sample(prompts, min(cfg.eval_prompts, len(prompts)))
    return out


def build(cfg: BuildConfig) -> dict:
    """Corpus -> tokenizer -> training -> files in cfg.out. Returns the training record."""
    cfg.validate()
    t_start = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    os.makedirs(cfg.out, exist_ok=True)
    precision = resolve_precision(cfg.autocast, "cpu")
    bf16 = precision.bf16
    _log(t_start, f"autocast: {precision.describe()}")

    corpus = build_corpus(cfg.seed, cfg.math_train, cfg.math_heldout, cfg.max_modules, cfg.corpus)
    train_texts = [doc_text(e) for e in corpus.train]
    _log(t_start, f"corpus: {len(train_texts)} training docs, {sum(map(len, train_texts)):,} chars")
    # Every TOKENIZER_STRIDE-th document is plenty for 8k merges and keeps BPE training fast.
    tok = train_tokenizer(train_texts[::TOKENIZER_STRIDE], cfg.shape.vocab_size)
    _log(t_start, f"tokenizer: {tok.get_vocab_size()} tokens")
    cfg.shape.vocab_size = tok.get_vocab_size()   # BPE may stop short on a tiny corpus

    order = list(range(len(train_texts)))
    random.Random(f"{cfg.seed}/doc-order").shuffle(order)
    data = pack([e.ids for e in tok.encode_batch([train_texts[i] for i in order])], cfg.seq_len)
    sets = eval_sets(corpus, tok, cfg)
    _log(t_start, f"packed {data.numel():,} training tokens into {len(data)} rows of {cfg.seq_len}")

    model = make_model(cfg.shape)
    n_params = count_parameters(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(cfg.seed)
    perm, cursor = torch.randperm(len(data), generator=gen), 0

    history = [{"step": 0, "tokens": 0, **evaluate(model, sets, bf16)}]
    t_loop = time.time()
    deadline = t_loop + (cfg.minutes or 0) * 60
    t_warm = None          # when warmup ended (time mode)
    next_eval = t_loop + (deadline - t_loop) / cfg.evals
    step_times: list[float] = []
    train_losses: list[float] = []
    model.train()
    bar = tqdm(total=cfg.steps, desc="train target", unit="step", dynamic_ncols=True)
    step = 0
    while True:
        if cfg.steps is not None:
            if step >= cfg.steps:
                break
            lr = lr_at(step, cfg.steps, cfg)
        elif step < cfg.warmup_steps:
            lr = cfg.lr * (step + 1) / cfg.warmup_steps
        else:
            # After warmup the cosine runs over the wall-clock time left, so the budget is
            # used whatever the machine's load does; the step count is recorded.
            t_warm = t_warm or time.time()
            progress = (time.time() - t_warm) / max(1e-9, deadline - t_warm)
            if progress >= 1.0:
                break
            lr = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        t0 = time.time()
        if cursor + cfg.batch_size > len(data):
            perm, cursor = torch.randperm(len(data), generator=gen), 0
        batch = data[perm[cursor:cursor + cfg.batch_size]]
        cursor += cfg.batch_size
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        train_losses.append(float(loss.detach()))
        step_times.append(time.time() - t0)
        bar.update(1)
        bar.set_postfix(loss=f"{train_losses[-1]:.3f}", lr=f"{lr:.2e}")

        due = (step % max(1, cfg.steps // cfg.evals) == 0) if cfg.steps else time.time() >= next_eval
        if due and step != cfg.steps:
            next_eval += (deadline - t_loop) / cfg.evals
            history.append({"step": step, "tokens": step * cfg.batch_size * cfg.seq_len,
                            **evaluate(model, sets, bf16)})
            tqdm.write(f"step {step}: heldout {history[-1]['heldout']}")
    bar.close()
    loop_seconds = time.time() - t_loop
    final = evaluate(model, sets, bf16)
    history.append({"step": step, "tokens": step * cfg.batch_size * cfg.seq_len, **final})

    # Cast weights only: the RoPE inv_freq buffer stays float32, as from_pretrained builds it,
    # so the returned model and a reload give identical logits.
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(cfg.out, safe_serialization=True)
    _patch_config(cfg.out)
    GenerationConfig(eos_token_id=GENERATION_EOS, pad_token_id=model.config.pad_token_id,
                     bos_token_id=None, do_sample=False).save_pretrained(cfg.out)
    _save_tokenizer(wrap(tok, cfg.shape.max_position_embeddings), cfg.out)
    prompts = pick_eval_prompts(corpus, cfg)
    with open(os.path.join(cfg.out, "eval_prompts.json"), "w") as f:
        json.dump(prompts, f, indent=1)

    record = {
        "command": cfg.command, "config": {k: v for k, v in asdict(cfg).items() if k != "command"},
        "parameters": n_params, "steps": step, "tokens_trained": step * cfg.batch_size * cfg.seq_len,
        "corpus_tokens": int(data.numel()),
        "corpus_docs": {c: len(v) for c, v in sorted(corpus.by_category("train").items())},
        "heldout_docs": {c: len(v) for c, v in sorted(corpus.by_category("heldout").items())},
        "train_loop_seconds": round(loop_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
        "median_step_seconds": round(statistics.median(step_times), 4),
        "final_train_loss_last50": round(statistics.mean(train_losses[-50:]), 4),
        "first_train_loss": round(train_losses[0], 4),
        "final_losses": final, "history": history,
        "mask_token": MASK_TOKEN, "mask_token_id": MASK_TOKEN_ID,
        "threads": cfg.threads, "autocast": precision.name, "autocast_reason": precision.reason,
        "corpus": cfg.corpus,
    }
    with open(os.path.join(cfg.out, "training_info.json"), "w") as f:
        json.dump(record, f, indent=1)
    if not cfg.smoke:
        write_card(cfg.out)
    record["model"] = model
    return record


def _patch_config(out: str) -> None:
    """Write the dtype under both names: transformers 5 says `dtype`, older readers `torch_dtype`."""
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _save_tokenizer(hf_tok, out: str) -> None:
    """save_pretrained, plus the chat template and special-token map inside the JSON files
    that older transformers and vLLM read."""
    hf_tok.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = hf_tok.chat_template
    tc["additional_special_tokens"] = tc.get("extra_special_tokens", [])
    with open(path, "w") as f:
        json.dump(tc, f, indent=2)
    special = {"eos_token": tc["eos_token"], "pad_token": tc["pad_token"],
               "additional_special_tokens": tc["additional_special_tokens"]}
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
