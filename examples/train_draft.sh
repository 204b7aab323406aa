#!/usr/bin/env bash
# Train a DFlash drafter for the bundled toy target: the recipe behind models/toy-draft
# (see its README for the measured run). Run from anywhere; paths are the repository's.
#
#   examples/train_draft.sh [OUT]              # full recipe: about 30 minutes on 2 CPU cores
#   STEPS=3 NUM_PROMPTS=8 BATCH_SIZE=4 GEN_EAGER=1 examples/train_draft.sh /tmp/tiny-run   # a smoke run
#
# Stage 1 generates responses with the target through vLLM and caches target features;
# stage 2 trains the draft (random anchors, decayed loss), exports it in z-lab's format to
# EXPORT (default OUT/draft) and measures its acceptance length tau on held-out prompts.
# Every knob below can be overridden from the environment.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$REPO/runs/toy-draft}
TARGET=${TARGET:-$REPO/models/toy-target}
EXPORT=${EXPORT:-$OUT/draft}
NUM_PROMPTS=${NUM_PROMPTS:-3000}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-448}
MAX_LEN=${MAX_LEN:-512}
NUM_LAYERS=${NUM_LAYERS:-2}
BLOCK_SIZE=${BLOCK_SIZE:-16}
LR=${LR:-1.5e-3}
MINUTES=${MINUTES:-18}
STEPS=${STEPS:-}                 # a step count instead of the time budget
BATCH_SIZE=${BATCH_SIZE:-}       # sequences per step (default: the trainer's)
EVAL_NUM=${EVAL_NUM:-8}          # held-out prompts per category for tau
EVAL_MAX_NEW_TOKENS=${EVAL_MAX_NEW_TOKENS:-128}
GEN_DTYPE=${GEN_DTYPE:-}         # vLLM dtype for generation (default: the target's)
GEN_EAGER=${GEN_EAGER:-}         # non-empty: generate with enforce_eager (no torch.compile start-up)
TARGET_DTYPE=${TARGET_DTYPE:-auto}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
if [ -z "${VLLM_DFLASH:-}" ]; then
  VLLM_DFLASH=$(command -v vllm-dflash || echo "$REPO/.venv/bin/vllm-dflash")
fi

data=(--target "$TARGET" --out "$OUT" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS"
      --max-len "$MAX_LEN" --target-dtype "$TARGET_DTYPE")
[ -n "$GEN_DTYPE" ] && data+=(--gen-dtype "$GEN_DTYPE")
[ -n "$GEN_EAGER" ] && data+=(--gen-eager)
budget=(--minutes "$MINUTES")
[ -n "$STEPS" ] && budget=(--steps "$STEPS")
[ -n "$BATCH_SIZE" ] && budget+=(--batch-size "$BATCH_SIZE")

echo "[train_draft] 1/2 responses from the target and the target-feature cache in $OUT"
"$VLLM_DFLASH" train "${data[@]}" --stop-after features

echo "[train_draft] 2/2 the drafter (${budget[*]}), export to $EXPORT, tau on held-out prompts"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VLLM_DFLASH" train "${data[@]}" \
  --num-layers "$NUM_LAYERS" --block-size "$BLOCK_SIZE" --lr "$LR" "${budget[@]}" --run-name main \
  --export "$EXPORT" \
  --eval-prompts "$TARGET/eval_prompts.json" --eval-num "$EVAL_NUM" --eval-max-new-tokens "$EVAL_MAX_NEW_TOKENS"
echo "[train_draft] done: serve it with --speculative-config '{\"method\": \"dflash\", \"model\": \"$EXPORT\"}'"
