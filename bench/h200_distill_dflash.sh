#!/bin/bash
# A DFlash drafter (z-lab packaging, block 16: 15 drafts per round) for the demo target, distilled
# on the H200 (MLX CUDA) within one call's time budget, then measured on eval prompts.
#
#   BUDGET=460 bash bench/h200_distill_dflash.sh setup run     # one device call (timeout_s >= BUDGET + 60)
#   BUDGET=460 bash bench/h200_distill_dflash.sh more          # (same warm machine) train on, from the last
#                                                              # export, on the same answers; measure again
#   BUDGET=460 ANSWERS=8 bash bench/h200_distill_dflash.sh setup gen   # more data: a call of answers only,
#   BUDGET=460 ANSWERS=8 bash bench/h200_distill_dflash.sh train       # then (same warm machine, same
#                                                              # data flags) a call of training from INIT
#
# `run` does, each step bounded in time (a cut step leaves what it made; the next one goes on):
#   1. the target (demo GGUF, bf16) answers the train/ prompts (only those) for GEN_FRAC of BUDGET
#      (`distill --steps 0 --gen-seconds`: samples.jsonl);
#   2. `distill --kind dflash` trains on those answers for TRAIN_FRAC of BUDGET (`--train-seconds`
#      fits the steps after the first 25; an outer `timeout` stops it with SIGTERM, state saved,
#      drafter written);
#   3. the compact bf16 copy (python -m mlx_dspark.train.export) into $OUT/drafter/;
#   4. bench/bench_dflash.py: mean acceptance on humaneval / mbpp / mt-bench eval prompts (SAMPLES
#      per domain, greedy, full block, drafts only), every prompt checked against plain greedy
#      (tokens and text), until the budget is spent; --register writes $OUT/drafter/pair.json.
# $OUT gets 8 files (what comes back from a device call): drafter/ (config.json, draft_vocab.json,
# pair.json; model.safetensors split into 16.7 MB parts + its sha256: `cat model.safetensors.part* >
# model.safetensors`), report.md (with the distill log lines, train_log.jsonl's ends, timings) and
# accept.json.
#
# Carry set (the lead's device-carry tooling): C holds
#   wheels/                          mlx-cuda-13 0.32.4, mlx 0.32.4, mlx-lm 0.32.2, gguf 0.19.0 (as 'distill')
#   SmolLM2-135M-Instruct.Q4_1.gguf  the demo model
#   eval/                            shared/data/prompts/eval (844 KB)
#   train/                           shared/data/prompts/train: arena-hard-v2, gsm8k, lbpp, livecodebench
#                                    (3.4 MB as is; 1.1 MB as train.tar.gz: either is read). The shipped
#                                    drafter's set also held arena-hard-v2.again.jsonl, a copy: chat x2
#                                    (`setup gen`, `train`, `more` with ANSWERS=4: dflash-h200.md)
# The steps are bench/h200_distill_lib.sh's. CPU rehearsal (tiny; INIT= for a random init):
#   C=DIR DTYPE=float32 BUDGET=150 MAX_PROMPTS=4 ANSWER_TOKENS=16 SAMPLES=1 EVAL_TOKENS=16 GEN_BATCH=4 ANSWERS=1 \
#   TRAIN="--batch-size 2 --anchors 4 --train-vocab auto" bash bench/h200_distill_dflash.sh run
set -uo pipefail
C=${C:-/var/tmp/carry/distill/files}
OUT=${OUT:-/tmp/out}
DTYPE=${DTYPE:-bfloat16}
BUDGET=${BUDGET:-460}
GEN_FRAC=${GEN_FRAC:-28}      # percent of BUDGET: the target's answers
TRAIN_FRAC=${TRAIN_FRAC:-47}  # percent of BUDGET: training; the rest: load, export, evaluation
GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf
W=${W:-/tmp/dflash_run}
export MLX_DSPARK_DEMO_GGUF=$GGUF
KIND=dflash
EXPORT_BITS=
PROMPT_GLOB="*.jsonl"

# INIT (default: the shipped DSpark drafter, 5 layers) lends its backbone: fc, hidden_norm, the layers
# and norm, with its taps and mask token; its heads are dropped (distill --kind dflash --init-from).
# INIT= (empty): a random init of LAYERS (3) layers of hidden 576 (9/3 heads), MLP 1024, the default
# taps 1,8,14,20,27. Either way block 16 (z-lab): ~19 MB (3 layers) or ~31 MB (5) in bf16.
INIT=${INIT-python/mlx_dspark/assets/dspark-smollm2-135m-instruct}
if [ -n "$INIT" ]; then
  ARCH=${ARCH:-"--kind dflash --init-from $INIT"}
else
  ARCH=${ARCH:-"--kind dflash --layers ${LAYERS:-3} --intermediate-size 1024"}
fi
TRAIN=${TRAIN:-"--batch-size 16 --anchors 64 --lr 6e-4 --warmup-ratio 0.04 --train-vocab auto"}
DATA_OPTS="--model $GGUF --dtype $DTYPE --answer-tokens ${ANSWER_TOKENS:-256} --gen-batch-size ${GEN_BATCH:-768} \
 --temperature ${TEMP:-0.3} --top-p 0.9 --answers-per-prompt ${ANSWERS:-3} --no-builtin-prompts \
 ${MAX_PROMPTS:+--max-train-prompts $MAX_PROMPTS}"

evaluate() {  # acceptance on eval prompts, lossless checked, for the rest of the budget; pair.json
  local EV=$(( $(left) - 25 )); [ $EV -lt 30 ] && EV=30
  timeout $(( EV + 60 )) python3 bench/bench_dflash.py --model "$GGUF" --dtype $DTYPE --drafter "$1" \
    --eval-dir "$C/eval" --samples ${SAMPLES:-10} --max-new-tokens ${EVAL_TOKENS:-128} --seconds $EV \
    --out "$OUT/report.md" --json "$OUT/accept.json" --register > "$OUT/bench-dflash.log" 2>&1
  local rc=$?
  grep -E "^\| |^- " "$OUT/bench-dflash.log" | head -12
  return $rc
}

source "$(dirname "$0")/h200_distill_lib.sh"
