"""The DFlash drafter training loop (nanoGPT-plain: one function per job).

One step: take a batch of cached sequences, draw fresh anchors, build the packed
rows (context features | N blocks of [anchor token, MASK x (B-1)]), run the draft
with the sparse block mask, apply the target's frozen LM head to block positions
1..B-1 and take the position-weighted cross-entropy. Only the draft's own
parameters (fc, norms, layers) train; embedding and LM head stay the target's.

Attention: flex attention with a `BlockMask` on CUDA (sparse, the recipe's
choice); on CPU, SDPA with the dense boolean mask of the same predicate, because
torch's flex attention has no CPU backward.

Data parallel (torchrun, see `distributed`): every rank draws the same global
batch of `batch_size` sequences from the same seeded stream and computes its
slice `batch[rank::world]`; anchors are drawn per sequence from (seed, step,
sequence), and the loss is normalised by the global batch's total weight, so
the gradient DDP averages is the one-process gradient, and a checkpoint (step,
epoch, position) resumes at any world size. Only rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_dflash import precision
from vllm_dflash.training import distributed as dist
from vllm_dflash.training.anchors import sample_anchors
from vllm_dflash.training.features import FeatureCache, OnlineFeatures
from vllm_dflash.training.loss import block_labels, block_loss, loss_normalizer, position_weights
from vllm_dflash.training.masks import block_position_ids, dense_mask, flex_block_mask
from vllm_dflash.training.tau_estimate import ChainTau, decode_chain, sequence_runs

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class TrainConfig:
    blocks_per_seq: int = 32      # anchors drawn per sequence per step
    batch_size: int = 8           # sequences per step
    lr: float = 6e-4
    min_lr_ratio: float = 0.1     # cosine floor, as a fraction of lr
    warmup: float = 0.04          # fraction of the run spent warming up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_steps: int | None = None
    max_minutes: float | None = None
    gamma: float | None = 7.0     # loss decay; None = uniform weights
    anchors: str = "random"
    attention: str = "auto"       # auto | sdpa | flex
    autocast: str = "auto"        # auto (bf16 where native) | bf16 | fp32
    val_fraction: float = 0.02
    max_val_sequences: int = 128  # the decode-chain estimate drafts every anchor of these
    eval_every: int = 0           # steps between evaluations (0: only at the end)
    checkpoint_every: int = 200   # steps between checkpoints
    log_every: int = 10
    seed: int = 0

    def validate(self) -> None:
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("set --steps or --minutes: the LR schedule needs a run length")
        for name in ("blocks_per_seq", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ValueError(f"attention={self.attention!r}: choose auto, sdpa or flex")
        if self.autocast not in precision.CHOICES:
            raise ValueError(f"autocast={self.autocast!r}: choose one of {', '.join(precision.CHOICES)}")
        if not 0 <= self.val_fraction < 0.5:
            raise ValueError(f"val_fraction={self.val_fraction} must be in [0, 0.5)")


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to `min_ratio` at progress 1."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    t = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def split_indices(n: int, val_fraction: float, seed: int, max_val: int | None = None
                  ) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = min(max(int(round(n * val_fraction)), 1 if val_fraction > 0 else 0), n - 1)
    if max_val is not None:
        n_val = min(n_val, max_val)
    return sorted(order[n_val:]), sorted(order[:n_val])


def length_batches(indices: list[int], lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of full batches; sequences of similar length share a batch (less padding).

    The one short batch an epoch would end with is dropped (its sequences come back
    in other epochs' batches), so every rank of a data-parallel run has a share.
    """
    order = list(indices)
    rng.shuffle(order)
    pool = batch_size * 32
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size)]
    rng.shuffle(batches)
    return batches


def sequence_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The anchor RNG of one sequence at one step: the same on whichever rank draws it."""
    key = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") & (2**63 - 1))


class Stats:
    """Running sums over steps (this rank's share), reduced over ranks into the logged numbers."""

    KEYS = ("correct", "count", "streak", "blocks", "ce_sum", "ce_count", "weighted_ce", "weight")

    def __init__(self, block_size: int):
        # Zeros of every shape up front: a rank with no rows (a tiny validation set) still joins the reduce.
        self.sums = {k: torch.zeros(block_size if k in ("correct", "count") else 1, dtype=torch.float64)
                     for k in self.KEYS}
        self.steps = 0

    def add(self, s: dict) -> None:
        self.steps += 1
        for key in self.KEYS:
            self.sums[key] += s[key].detach().double().reshape(-1).cpu()

    def summary(self, device: torch.device | None = None) -> dict:
        """Sums over every rank (one all-reduce) turned into loss, accuracy, block_tau."""
        keys = list(self.sums)
        flat = torch.cat([self.sums[k] for k in keys]).to(device or "cpu")
        flat = dist.all_reduce_sum(flat).cpu()
        sums, at = {}, 0
        for k in keys:
            n = self.sums[k].numel()
            sums[k], at = flat[at:at + n], at + n
        acc = (sums["correct"][1:] / sums["count"][1:].clamp(min=1)).tolist()
        blocks = max(float(sums["blocks"]), 1.0)
        return {"loss": float(sums["weighted_ce"]) / max(float(sums["weight"]), 1e-12),
                "ce": float(sums["ce_sum"]) / max(float(sums["ce_count"]), 1),
                "acc": acc, "acc1": acc[0], "acc_mean": sum(acc) / len(acc),
                "block_tau": 1.0 + float(sums["streak"]) / blocks}


@dataclass
class Batch:
    tokens: torch.Tensor          # [b, S] long (padded with 0)
    features: torch.Tensor        # [b, S, L*D]
    prompt_lens: list[int]
    seq_lens: list[int]


def collate(source: FeatureCache | OnlineFeatures, indices: list[int]) -> Batch:
    items = source.items(indices)
    width = max(len(t) for t, _, _ in items)
    device = items[0][2].device
    tokens = torch.zeros(len(items), width, dtype=torch.long, device=device)
    feats = torch.zeros(len(items), width, items[0][2].shape[-1], dtype=items[0][2].dtype, device=device)
    for row, (t, _, f) in enumerate(items):
        tokens[row, :len(t)] = t
        feats[row, :len(t)] = f
    return Batch(tokens, feats, [p for _, p, _ in items], [len(t) for t, _, _ in items])


def draft_blocks(draft, embed_weight: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
                 anchors: torch.Tensor, attention: str = "sdpa") -> torch.Tensor:
    """Draft hidden states [b, N, B, D] of N blocks per row in one packed forward.

    Block j of a row is [tokens[a_j], MASK x (B-1)] at positions a_j..a_j+B-1 and
    sees the features of positions < a_j: exactly the drafter's input at inference
    when a_j is the last verified token (tests check the two agree).
    """
    bs = draft.block_size
    batch, num_blocks = anchors.shape
    noise_ids = torch.full((batch, num_blocks, bs), draft.mask_token_id, dtype=torch.long, device=tokens.device)
    noise_ids[..., 0] = torch.gather(tokens, 1, anchors)
    context_len = tokens.shape[1]
    positions = block_position_ids(anchors, context_len, bs)
    if attention == "flex":
        mask = flex_block_mask(anchors, context_len, bs)
    else:
        mask = dense_mask(anchors, context_len, bs)
    context = draft.project_context(features)
    noise = F.embedding(noise_ids.flatten(1), embed_weight)
    hidden = draft(noise, context, positions, attn_mask=mask)
    return hidden.view(batch, num_blocks, bs, -1)


class BlockForward(torch.nn.Module):
    """The draft's packed block forward as one module call, so DDP sees every
    parameter's use (project_context included) inside `forward`."""

    def __init__(self, draft, attention: str):
        super().__init__()
        self.draft, self.attention = draft, attention

    def forward(self, embed_weight, tokens, features, anchors):
        return draft_blocks(self.draft, embed_weight, tokens, features, anchors, self.attention)


class Trainer:
    def __init__(self, draft, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 cache: FeatureCache | OnlineFeatures,
                 cfg: TrainConfig, out_dir: str, device: str | torch.device = "cpu",
                 evaluate: Callable | None = None, world: dist.World | None = None):
        cfg.validate()
        if list(cache.layer_ids) != list(draft.target_layer_ids):
            raise ValueError(f"feature cache holds target layers {cache.layer_ids} but the draft reads "
                             f"{list(draft.target_layer_ids)}; rebuild the cache or match --target-layer-ids")
        self.world = world or dist.World()
        if cfg.batch_size < self.world.size:
            raise ValueError(f"--batch-size {cfg.batch_size} is the global batch; it must be >= the "
                             f"{self.world.size} processes so every rank gets a sequence")
        self.cfg, self.out_dir, self.device = cfg, out_dir, torch.device(device)
        self.precision = precision.resolve(cfg.autocast, self.device)
        self.draft = draft.to(self.device).float().train()
        # float32 copies: a bf16 target's tables would otherwise force bf16 into fp32 runs.
        self.embed_weight = embed_weight.detach().to(self.device, torch.float32)
        self.lm_head_weight = lm_head_weight.detach().to(self.device, torch.float32)
        self.cache = cache
        self.block_size = draft.block_size
        self.weights = position_weights(self.block_size, cfg.gamma).to(self.device)
        self.evaluate = evaluate
        self.attention = cfg.attention if cfg.attention != "auto" else (
            "flex" if self.device.type == "cuda" else "sdpa")
        if self.attention == "flex" and self.device.type != "cuda":
            raise ValueError("attention=flex needs a CUDA device (torch's flex attention has no CPU "
                             "backward); use attention=sdpa on CPU")
        self.model = BlockForward(self.draft, self.attention)
        if dist.active():
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        decay = [p for n, p in self.draft.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.draft.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=cfg.lr, betas=(0.9, 0.95))
        self.train_idx, self.val_idx = split_indices(len(cache), cfg.val_fraction, cfg.seed, cfg.max_val_sequences)
        if len(self.train_idx) < cfg.batch_size:
            raise ValueError(f"{len(self.train_idx)} training sequences are fewer than --batch-size "
                             f"{cfg.batch_size}; lower it or give more prompts")
        self.step = 0
        self.elapsed = 0.0
        self.cpu_seconds = 0.0   # this process's CPU time in training steps: the load-free cost of the run
        self.epoch = self.epoch_pos = 0
        self.blocks_seen = 0   # training blocks so far; each predicts B-1 tokens
        self.history: list[dict] = []

    # -- one step -------------------------------------------------------------------------------
    def forward_loss(self, batch: Batch, generators: list[torch.Generator],
                     model: torch.nn.Module | None = None) -> tuple[torch.Tensor, dict]:
        """Loss of this rank's rows, normalised by the whole (all ranks') batch weight.

        `model` (validation: the module without DDP) skips that reduction, so ranks
        with different numbers of validation rows never wait on each other."""
        bs = self.block_size
        anchors, keep = sample_anchors(batch.prompt_lens, batch.seq_lens, bs, self.cfg.blocks_per_seq,
                                       self.cfg.anchors, generators)
        tokens = batch.tokens.to(self.device)
        anchors, keep = anchors.to(self.device), keep.to(self.device)
        normalizer = dist.all_reduce_sum(loss_normalizer(keep, self.weights)) if model is None else None
        use_bf16 = self.precision.bf16
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            feats = batch.features.to(self.device)
            hidden = (model or self.model)(self.embed_weight, tokens, feats if use_bf16 else feats.float(), anchors)
            logits = F.linear(hidden[:, :, 1:], self.lm_head_weight)
        loss, stats = block_loss(logits, block_labels(tokens, anchors, bs), keep, self.weights, normalizer)
        stats["weight"] = loss_normalizer(keep, self.weights)
        # DDP averages gradients over ranks; scaling by the world size makes that average the sum.
        return loss * self.world.size, stats

    def rank_slice(self, indices: list[int]) -> list[int]:
        return indices[self.world.rank::self.world.size]

    def train_step(self, indices: list[int]) -> dict:
        mine = self.rank_slice(indices)
        generators = [sequence_generator(self.cfg.seed, self.step, i) for i in mine]
        loss, stats = self.forward_loss(collate(self.cache, mine), generators)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        return stats

    @torch.no_grad()
    def validate(self) -> dict | None:
        """Held-out cached sequences: loss and accuracy at fixed anchors, and the tau that
        greedy decoding of them would get (the decode chain, see tau_estimate)."""
        if not self.val_idx:
            return None
        self.draft.eval()
        stats, chain = Stats(self.block_size), ChainTau()
        mine = self.rank_slice(self.val_idx)
        use_bf16 = self.precision.bf16
        for i in range(0, len(mine), self.cfg.batch_size):
            part = mine[i:i + self.cfg.batch_size]
            gens = [sequence_generator(self.cfg.seed + 1, 0, j) for j in part]
            stats.add(self.forward_loss(collate(self.cache, part), gens, model=self.model_no_sync)[1])
        for j in mine:
            tokens, prompt_len, feats = self.cache[j]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
                runs = sequence_runs(self.model_no_sync, self.embed_weight, self.lm_head_weight, tokens,
                                     prompt_len, feats if use_bf16 else feats.float(), self.block_size)
            chain.add(decode_chain(runs.tolist(), prompt_len, len(tokens)))
        summary = stats.summary(self.device)
        totals = dist.all_reduce_sum(chain.as_tensor().to(self.device)).cpu()
        summary.update(chain.from_tensor(totals).summary())
        self.draft.train()
        return summary

    @property
    def model_no_sync(self) -> torch.nn.Module:
        """The block forward without DDP (no gradient hooks): for evaluation."""
        return self.model.module if hasattr(self.model, "module") else self.model

    # -- the loop -------------------------------------------------------------------------------
    def progress(self) -> float:
        p = 0.0
        if self.cfg.max_steps:
            p = max(p, self.step / self.cfg.max_steps)
        if self.cfg.max_minutes:
            p = max(p, self.elapsed / (60 * self.cfg.max_minutes))
        return p

    def batch_stream(self):
        """Endless seeded epochs of global batches; (epoch, epoch_pos) in the checkpoint make
        resumption exact, at any world size."""
        while True:
            rng = random.Random(f"{self.cfg.seed}/{self.epoch}")
            batches = length_batches(self.train_idx, self.cache.lengths, self.cfg.batch_size, rng)
            while self.epoch_pos < len(batches):
                self.epoch_pos += 1
                yield batches[self.epoch_pos - 1]
            self.epoch, self.epoch_pos = self.epoch + 1, 0

    def run_eval(self) -> dict:
        record = {"step": self.step, "minutes": self.elapsed / 60}
        val = self.validate()
        if val is not None:
            record["val"] = val
        if self.evaluate is not None and self.world.main:
            self.draft.eval()
            record["tau"] = self.evaluate(self.draft)
            self.draft.train()
        dist.barrier()
        self.log(record)
        return record

    def log(self, record: dict) -> None:
        self.history.append(record)
        if not self.world.main:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "history.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def train(self) -> dict:
        cfg = self.cfg
        window = Stats(self.block_size)
        last: dict = {}
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="training drafter", unit="step",
                   disable=not self.world.main)
        stream = self.batch_stream()
        tick = time.perf_counter()
        while self.progress() < 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(self.progress(), cfg.warmup, cfg.min_lr_ratio)
            cpu = time.process_time()
            stats = self.train_step(next(stream))
            self.cpu_seconds += time.process_time() - cpu
            self.step += 1
            now = time.perf_counter()
            # Rank 0's clock (the slowest rank's, in fact) decides a --minutes run's end for all.
            self.elapsed = dist.all_reduce_max(self.elapsed + now - tick, self.device)
            tick = now
            window.add(stats)
            self.blocks_seen += int(dist.all_reduce_sum(stats["blocks"].detach().double().reshape(1)).item()
                                    ) if self.world.parallel else int(stats["blocks"])
            if self.step % cfg.log_every == 0:
                last = {"step": self.step, "minutes": self.elapsed / 60,
                        "lr": self.optimizer.param_groups[0]["lr"], "train": window.summary(self.device)}
                self.log(last)
                s = last["train"]
                acc = s["acc"]   # block positions 1, B/2 and B-1
                bar.set_postfix(loss=f"{s['loss']:.3f}", block_tau=f"{s['block_tau']:.2f}",
                                acc=f"{acc[0]:.2f}/{acc[len(acc) // 2]:.2f}/{acc[-1]:.2f}")
                window = Stats(self.block_size)
            bar.update(1)
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                self.run_eval()
                tick = time.perf_counter()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
                tick = time.perf_counter()
        bar.close()
        if window.steps:
            last = {"step": self.step, "minutes": self.elapsed / 60, "train": window.summary(self.device)}
            self.log(last)
        self.save_checkpoint()
        final = self.run_eval()
        return {"steps": self.step, "minutes": self.elapsed / 60, "cpu_minutes": self.cpu_seconds / 60,
                "torch_threads": torch.get_num_threads(), "blocks_trained": self.blocks_seen,
                "positions_trained": self.blocks_seen * (self.block_size - 1), "train": last.get("train"),
                "val": final.get("val"), "tau": final.get("tau"), "autocast": self.precision.name,
                "world_size": self.world.size}

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Rank 0 writes; the state is the same on every rank (DDP keeps the replicas equal)."""
        if self.world.main:
            os.makedirs(self.out_dir, exist_ok=True)
            state = {"draft": self.draft.state_dict(), "draft_config": self.draft.config.to_dict(),
                     "optimizer": self.optimizer.state_dict(), "step": self.step, "elapsed": self.elapsed, "cpu_seconds": self.cpu_seconds,
                     "epoch": self.epoch, "epoch_pos": self.epoch_pos, "blocks_seen": self.blocks_seen,
                     "train_config": asdict(self.cfg), "world_size": self.world.size}
            path = os.path.join(self.out_dir, CHECKPOINT_NAME)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()

    def load_checkpoint(self) -> bool:
        path = os.path.join(self.out_dir, CHECKPOINT_NAME)
        if not os.path.exists(path):
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state["draft_config"] != self.draft.config.to_dict():
            raise ValueError(f"checkpoint {path} is for another draft config; use --fresh to start over "
                             "or another --out directory")
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.cpu_seconds = state.get("cpu_seconds", 0.0)
        self.epoch, self.epoch_pos = state["epoch"], state["epoch_pos"]
        self.blocks_seen = state.get("blocks_seen", 0)
        return True
