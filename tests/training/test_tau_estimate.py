"""The trainer's tau estimate is the tau that greedy decoding gets (the train/decode gap's cause).

Before, `val tau_est` was 1 + the mean run of correct drafts over random anchors.
Decoding does not draft at random anchors: each block starts where the previous
one's bonus token landed, so it spends few rounds where drafts run long and many
where they fail, and the uniform mean overstated tau by up to 2x (2.85 against
1.48 on the second toy target). The estimate now walks the chain decoding walks,
from a run computed at every anchor; on a float32 target with target-greedy
cached responses it must give the reference loop's rounds exactly.
"""

import os

import pytest
import torch

from helpers import correlate_pair, random_draft, random_prompts, tiny_target
from vllm_dflash.reference import spec_generate, target_greedy_generate
from vllm_dflash.training.data import Sample
from vllm_dflash.training.features import build_feature_cache
from vllm_dflash.training.tau_estimate import ChainTau, bucket_name, decode_chain, sequence_runs
from vllm_dflash.training.trainer import TrainConfig, Trainer

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
BLOCK = 8
NEW_TOKENS = 40


def test_decode_chain_walks_from_the_first_response_token():
    # prompt 3, sequence 12: anchors 3..10; runs per anchor (index = anchor - 3).
    runs = [2, 0, 7, 1, 0, 3, 5, 0]
    # a=3: run 2 -> emits 3 (2 drafts + bonus) -> a=6: run 1 -> 2 -> a=8: run 3 -> 3 -> a=11 = last: stop.
    assert decode_chain(runs, 3, 12) == [(3, 3), (6, 2), (8, 3)]
    # Emission stops at the end: a run past it emits only the tokens that remain.
    assert decode_chain([7, 7, 7], 3, 6) == [(3, 2)]
    chain = ChainTau(edges=(4, 8))
    chain.add(decode_chain(runs, 3, 12))
    assert chain.summary()["tau_est"] == 8 / 3
    assert chain.summary()["tau_est_by_context"] == {
        "0-4": {"tau": 3.0, "rounds": 1}, "4-8": {"tau": 2.0, "rounds": 1}, "8+": {"tau": 3.0, "rounds": 1}}
    assert [bucket_name(n) for n in (0, 255, 256, 1023, 1024, 10**6)] == [
        "0-256", "0-256", "256-1024", "256-1024", "1024+", "1024+"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_target(vocab_size=96, hidden_size=64, num_layers=4)
    draft = random_draft(target, num_layers=1, block_size=BLOCK, seed=5)
    correlate_pair(target, draft)   # drafts accepted now and then: runs of every length
    samples = []
    for p in random_prompts(16, 95, min_len=3, max_len=12, seed=3):
        samples.append(Sample(p + target_greedy_generate(target, torch.tensor([p]), NEW_TOKENS), len(p)))
    cache = build_feature_cache(target, samples, list(draft.target_layer_ids),
                                str(tmp_path_factory.mktemp("tau") / "features"), dtype="fp32")
    cfg = TrainConfig(max_steps=1, val_fraction=0.49, batch_size=4, autocast="fp32")
    trainer = Trainer(draft, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                      cache, cfg, str(tmp_path_factory.mktemp("run")))
    return target, trainer, samples


def test_estimate_replays_the_reference_loop_round_for_round(setup):
    target, trainer, samples = setup
    draft = trainer.draft.eval()
    emitted = rounds = 0
    for i in trainer.val_idx:
        tokens, prompt_len, feats = trainer.cache[i]
        ref = spec_generate(target, draft, tokens[None, :prompt_len], NEW_TOKENS)
        assert ref.output_ids == tokens[prompt_len:].tolist()   # greedy spec decoding == the cached response
        runs = sequence_runs(trainer.model_no_sync, trainer.embed_weight, trainer.lm_head_weight, tokens,
                             prompt_len, feats, BLOCK)
        assert [e for _, e in decode_chain(runs.tolist(), prompt_len, len(tokens))] == ref.acceptance_lengths
        emitted += sum(ref.acceptance_lengths)
        rounds += len(ref.acceptance_lengths)
    val = trainer.validate()
    assert val["tau_est"] == pytest.approx(emitted / rounds, rel=1e-12)
    # Power: the old estimate (mean over random anchors) is far off on the same data, so a trainer
    # that still reported it would fail the equality above.
    assert abs(val["block_tau"] - val["tau_est"]) > 0.1 * val["tau_est"], val
