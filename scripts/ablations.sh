#!/usr/bin/env bash
# Issue 3's ablation table at small scale: the paper's design axes, one run each,
# same data, features, steps and learning rate. Fixed anchors yield ~3.5x fewer
# blocks per step (the grid), so two more runs compare the anchor choice at equal
# blocks and equal steps (1050 each; random with 8 blocks/seq). Summaries land in
# runs/toy-draft/runs/ab-*/summary.json; scripts/ablation_table.py tabulates them.
set -euo pipefail
STEPS=${STEPS:-300}
COMMON="--target models/toy-target --out runs/toy-draft --num-prompts 3000 --max-new-tokens 448 \
  --max-len 512 --block-size 16 --num-target-layers 2 --lr 1.5e-3 --steps $STEPS \
  --eval-prompts models/toy-target/eval_prompts.json --eval-num 16 --eval-max-new-tokens 192"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for spec in "ab-base --num-layers 2" "ab-fixed --num-layers 2 --anchors fixed" \
            "ab-fixed-sameblocks --num-layers 2 --anchors fixed --steps $((STEPS * 7 / 2))" \
            "ab-random-sameblocks --num-layers 2 --blocks-per-seq 8 --steps $((STEPS * 7 / 2))" \
            "ab-nodecay --num-layers 2 --no-loss-decay" "ab-L1 --num-layers 1" "ab-L3 --num-layers 3"; do
  set -- $spec
  name=$1; shift
  .venv/bin/vllm-dflash train $COMMON --run-name "$name" "$@"
done
