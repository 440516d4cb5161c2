#!/bin/bash
# A DFlash drafter (z-lab packaging, block 16: 15 drafts per round) for the demo target, distilled
# on the H200 (MLX CUDA) within one call's time budget, then measured on eval prompts.
#
#   BUDGET=460 bash bench/h200_distill_dflash.sh setup run     # one device call (timeout_s >= BUDGET + 60)
#   BUDGET=460 bash bench/h200_distill_dflash.sh more          # (same warm machine) train on, from the last
#                                                              # export, on the same answers; measure again
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
# pair.json; model.safetensors split into 15 MB parts + its sha256: `cat model.safetensors.part* >
# model.safetensors`), report.md (with the distill log lines, train_log.jsonl's ends, timings) and
# accept.json.
#
# Carry set (the lead's device-carry tooling): C holds
#   wheels/                          mlx-cuda-13 0.32.4, mlx 0.32.4, mlx-lm 0.32.2, gguf 0.19.0 (as 'distill')
#   SmolLM2-135M-Instruct.Q4_1.gguf  the demo model
#   eval/                            shared/data/prompts/eval (844 KB)
#   train/                           shared/data/prompts/train: arena-hard-v2, gsm8k, lbpp, livecodebench
#                                    (3.4 MB as is; 1.1 MB as train.tar.gz: either is read)
# CPU rehearsal (tiny): C=DIR DTYPE=float32 BUDGET=120 MAX_PROMPTS=8 ANSWER_TOKENS=32 SAMPLES=1 \
#   INIT= LAYERS=1 TRAIN="--batch-size 2 --anchors 8" bash bench/h200_distill_dflash.sh run  (INIT= : a random init)
set -uo pipefail
C=${C:-/var/tmp/carry/distill/files}
OUT=${OUT:-/tmp/out}
DTYPE=${DTYPE:-bfloat16}
BUDGET=${BUDGET:-460}
[ "$BUDGET" -gt 480 ] && { echo "BUDGET $BUDGET > 480 s: refused"; exit 2; }
GEN_FRAC=${GEN_FRAC:-28}      # percent of BUDGET: the target's answers
TRAIN_FRAC=${TRAIN_FRAC:-47}  # percent of BUDGET: training; the rest: load, export, evaluation
GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf
W=${W:-/tmp/dflash_run}
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 MLX_DSPARK_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLX_DSPARK_DEMO_GGUF=$GGUF
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(el) )); }

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

prompts() {
  local d=$C/train
  if [ ! -d "$d" ] && [ -f "$C/train.tar.gz" ]; then
    d=/tmp/dflash_prompts/train; mkdir -p /tmp/dflash_prompts && tar -xzf "$C/train.tar.gz" -C /tmp/dflash_prompts
  fi
  ls "$d"/*.jsonl 2>/dev/null | tr '\n' ' '
}

finish() {  # 3. and 4. for the drafter trained in $1
  local R=$1
  cp "$R/train_log.jsonl" "$OUT/" 2>/dev/null
  [ -f "$R/model.safetensors" ] || { echo "no drafter was written"; tail -20 "$OUT/distill-train.log"; return 1; }
  rm -rf "$W.x"; mkdir -p "$OUT/drafter"
  # 3. the compact bf16 copy
    python3 -m mlx_dspark.train.export "$R" "$W.x"
    echo "export rc=$? at $(el)s" | tee -a "$OUT/timings"
    cp "$W.x"/config.json "$OUT/drafter/"; cp "$W.x"/draft_vocab.json "$OUT/drafter/" 2>/dev/null
  # 4. acceptance on eval prompts, lossless checked, for the rest of the budget
    EV=$(( $(left) - 25 )); [ $EV -lt 30 ] && EV=30
    timeout $(( EV + 60 )) python3 bench/bench_dflash.py --model "$GGUF" --dtype $DTYPE --drafter "$W.x" \
      --eval-dir "$C/eval" --samples ${SAMPLES:-10} --max-new-tokens ${EVAL_TOKENS:-128} --seconds $EV \
      --out "$OUT/report.md" --json "$OUT/accept.json" --register > "$OUT/bench-dflash.log" 2>&1
    echo "accept rc=$? at $(el)s" | tee -a "$OUT/timings"
    grep -E "^\| |^- " "$OUT/bench-dflash.log" | head -12
    cp "$W.x/pair.json" "$OUT/drafter/" 2>/dev/null
    split -b 15000000 -d "$W.x/model.safetensors" "$OUT/drafter/model.safetensors.part"
    sha256sum "$W.x/model.safetensors" | tee "$OUT/drafter/model.sha256"
    { echo; echo "## distill"; grep -hE "^distill:" "$OUT/distill-data.log" "$OUT/distill-train.log" 2>/dev/null | tail -8
      echo; echo "train_log.jsonl, first and last 3 rows:"; head -3 "$OUT/train_log.jsonl"; tail -3 "$OUT/train_log.jsonl"
      echo; cat "$OUT/timings"; } >> "$OUT/report.md" 2>/dev/null
    # At most 8 files come back from $OUT: the drafter's 6, report.md and accept.json.
    rm -f "$OUT"/distill-*.log "$OUT/bench-dflash.log" "$OUT/train_log.jsonl" "$OUT/timings"
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
    rm -rf "$W" "$W.gen"; mkdir -p "$OUT/drafter"
    GEN_S=$(( BUDGET * GEN_FRAC / 100 )); TRAIN_S=$(( BUDGET * TRAIN_FRAC / 100 ))
    echo "budget ${BUDGET}s: answers ${GEN_S}s, training ${TRAIN_S}s; prompts: $P" | tee "$OUT/timings"
    # 1. answers (the run folder keeps samples.jsonl; --steps 0 trains nothing)
    timeout $(( GEN_S + 90 )) python3 -m mlx_dspark distill $DATA_OPTS $ARCH --prompts $P --out "$W.gen" \
      --steps 0 --no-eval --gen-seconds $GEN_S > "$OUT/distill-data.log" 2>&1
    echo "data rc=$? at $(el)s" | tee -a "$OUT/timings"; grep -E "answers|tokens" "$OUT/distill-data.log" | tail -3
    [ -f "$W.gen/samples.jsonl" ] || { echo "no answers were made"; tail -20 "$OUT/distill-data.log"; exit 1; }
    mkdir -p "$W" && cp "$W.gen/samples.jsonl" "$W/"
    # 2. training, fitted to TRAIN_S (the same data flags: the answers are reused, not regenerated)
    LIM=$(( TRAIN_S + 40 )); [ $LIM -gt $(( $(left) - 30 )) ] && LIM=$(( $(left) - 30 ))
    timeout $LIM python3 -m mlx_dspark distill $DATA_OPTS $ARCH --prompts $P --out "$W" --steps 20000 \
      --train-seconds $TRAIN_S $TRAIN --save-every 100 --no-eval > "$OUT/distill-train.log" 2>&1
    echo "train rc=$? at $(el)s" | tee -a "$OUT/timings"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -3
    finish "$W" || exit 1
    echo "done at $(el)s"
    ;;
  more)
    # Another call's worth of training on the same answers: a warm start from the last export
    # (--init-from: its architecture, its weights; a fresh warmup + cosine at LR_MORE), then 3. and 4.
    P=$(prompts); N=$W.m$(date +%s); mkdir -p "$N" && cp "$W/samples.jsonl" "$N/" || exit 1
    TRAIN_S=$(( BUDGET * ${MORE_FRAC:-70} / 100 ))
    timeout $(( TRAIN_S + 40 )) python3 -m mlx_dspark distill $DATA_OPTS --kind dflash --init-from "$W.x" \
      --prompts $P --out "$N" --steps 20000 --train-seconds $TRAIN_S ${TRAIN/--lr 6e-4/--lr ${LR_MORE:-3e-4}} \
      --save-every 100 --no-eval > "$OUT/distill-train.log" 2>&1
    echo "more rc=$? at $(el)s" | tee -a "$OUT/timings"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -3
    finish "$N" || exit 1
    echo "done at $(el)s"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
