# Sourced by bench/h200_distill_dflash.sh and bench/h200_gemma_dspark.sh: one device call distills a
# drafter within BUDGET seconds (answers, then training), exports it and measures it; `more` trains on
# from the last export. The sourcing script sets C, OUT, DTYPE, BUDGET, GEN_FRAC, TRAIN_FRAC, W,
# ARCH, TRAIN, DATA_OPTS, KIND (dspark | dflash), EXPORT_BITS (empty: bf16), PROMPT_GLOB and defines
# `evaluate DRAFTER_DIR` (acceptance into $OUT/report.md). $OUT ends with at most 8 files, what a
# device call returns: drafter/ (config.json, draft_vocab.json, [pair.json], model.safetensors parts
# of 16.7 MB, model.sha256), report.md and whatever `evaluate` leaves (accept.json).
[ "$BUDGET" -gt 480 ] && { echo "BUDGET $BUDGET > 480 s: refused"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 MLX_DSPARK_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(el) )); }

prompts() {  # the training prompt files: $C/train, or $C/train.tar.gz unpacked
  local d=$C/train
  if [ ! -d "$d" ] && [ -f "$C/train.tar.gz" ]; then
    d=$W.prompts/train; mkdir -p "$W.prompts" && tar -xzf "$C/train.tar.gz" -C "$W.prompts"
  fi
  (cd "$d" 2>/dev/null && ls $PROMPT_GLOB 2>/dev/null) | sed "s|^|$d/|" | tr '\n' ' '
}

finish() {  # export the drafter trained in $1, evaluate it, leave its files in $OUT
  local R=$1
  [ -f "$R/model.safetensors" ] || { echo "no drafter was written"; tail -20 "$OUT/distill-train.log"; return 1; }
  rm -rf "$W.x"; mkdir -p "$OUT/drafter"
  python3 -m mlx_dspark.train.export "$R" "$W.x" ${EXPORT_BITS:+--bits $EXPORT_BITS}
  echo "export rc=$? at $(el)s" | tee -a "$OUT/timings"
  cp "$W.x"/config.json "$OUT/drafter/"; cp "$W.x"/draft_vocab.json "$OUT/drafter/" 2>/dev/null
  evaluate "$W.x"
  echo "accept rc=$? at $(el)s" | tee -a "$OUT/timings"
  cp "$W.x/pair.json" "$OUT/drafter/" 2>/dev/null
  # a call returns at most 8 files: with 4 weight parts pair.json is the ninth, so report.md holds it too
  [ -f "$W.x/pair.json" ] && { echo; echo "## pair.json"; cat "$W.x/pair.json"; } >> "$OUT/report.md"
  split -b 16700000 -d "$W.x/model.safetensors" "$OUT/drafter/model.safetensors.part"  # under 16 MiB each
  sha256sum "$W.x/model.safetensors" | tee "$OUT/drafter/model.sha256"
  { echo; echo "## distill"; grep -hE "^distill:" "$OUT/distill-data.log" "$OUT/distill-train.log" 2>/dev/null | tail -8
    echo; echo "train_log.jsonl, first and last 3 rows:"; head -3 "$R/train_log.jsonl"; tail -3 "$R/train_log.jsonl"
    echo; cat "$OUT/timings"; } >> "$OUT/report.md" 2>/dev/null
  rm -f "$OUT"/distill-*.log "$OUT"/bench-*.log "$OUT/timings"
}

for step in "$@"; do
  case $step in
  setup)
    source "$(dirname "$0")/h200_wheels.sh"
    python3 -c "import mlx.core as mx, mlx_lm; print('MLX', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)"
    T0=$(date +%s)  # the budget counts from here
    ;;
  run)
    P=$(prompts)
    [ -z "$P" ] && { echo "no train prompts ($PROMPT_GLOB) under $C/train (or $C/train.tar.gz)"; exit 2; }
    rm -rf "$W" "$W.gen"
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
    # (--init-from: its architecture, its weights; a fresh warmup + cosine at LR_MORE).
    P=$(prompts); N=$W.m$(date +%s); mkdir -p "$N" && cp "$W/samples.jsonl" "$N/" || exit 1
    TRAIN_S=$(( BUDGET * ${MORE_FRAC:-70} / 100 ))
    timeout $(( TRAIN_S + 40 )) python3 -m mlx_dspark distill $DATA_OPTS --kind "$KIND" --init-from "$W.x" \
      --prompts $P --out "$N" --steps 20000 --train-seconds $TRAIN_S ${TRAIN/--lr 6e-4/--lr ${LR_MORE:-3e-4}} \
      --save-every 100 --no-eval > "$OUT/distill-train.log" 2>&1
    echo "more rc=$? at $(el)s" | tee -a "$OUT/timings"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -3
    finish "$N" || exit 1
    echo "done at $(el)s"
    ;;
  gen)
    # A call of answers only (the whole budget): more data than `run` can make and train on in
    # one call. The answers stay in $W on this warm machine for the next call's `train`.
    P=$(prompts)
    [ -z "$P" ] && { echo "no train prompts ($PROMPT_GLOB) under $C/train (or $C/train.tar.gz)"; exit 2; }
    rm -rf "$W" "$W.gen"
    GEN_S=$(( $(left) - 75 ))
    echo "budget ${BUDGET}s: answers only, ${GEN_S}s; prompts: $P" | tee "$OUT/timings"
    timeout $(( GEN_S + 60 )) python3 -m mlx_dspark distill $DATA_OPTS $ARCH --prompts $P --out "$W.gen" \
      --steps 0 --no-eval --gen-seconds $GEN_S > "$OUT/distill-data.log" 2>&1
    echo "data rc=$? at $(el)s" | tee -a "$OUT/timings"; grep -E "^distill:" "$OUT/distill-data.log" | tail -3
    [ -f "$W.gen/samples.jsonl" ] || { echo "no answers were made"; tail -20 "$OUT/distill-data.log"; exit 1; }
    mkdir -p "$W" && cp "$W.gen/samples.jsonl" "$W/" && ls -la "$W/samples.jsonl"
    { grep -hE "^distill:" "$OUT/distill-data.log"; cat "$OUT/timings"; } > "$OUT/report.md"
    rm -f "$OUT/distill-data.log" "$OUT/timings"
    echo "done at $(el)s"
    ;;
  train)
    # A call of training on the answers a `gen` call left in $W (the same DATA_OPTS: reused, not
    # regenerated), from INIT, for the budget less export and evaluation; then finish as `run` does.
    [ -f "$W/samples.jsonl" ] || { echo "no answers in $W: run the gen step first (same warm machine)"; exit 2; }
    P=$(prompts); rm -rf "$W.t"; mkdir -p "$W.t" && cp "$W/samples.jsonl" "$W.t/"
    TRAIN_S=$(( BUDGET * ${TRAIN_ONLY_FRAC:-72} / 100 ))
    echo "budget ${BUDGET}s: training ${TRAIN_S}s on $(wc -l < "$W/samples.jsonl") answers" | tee "$OUT/timings"
    timeout $(( TRAIN_S + 40 )) python3 -m mlx_dspark distill $DATA_OPTS $ARCH --prompts $P --out "$W.t" \
      --steps 20000 --train-seconds $TRAIN_S $TRAIN --save-every 100 --no-eval > "$OUT/distill-train.log" 2>&1
    echo "train rc=$? at $(el)s" | tee -a "$OUT/timings"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -3
    finish "$W.t" || exit 1
    echo "done at $(el)s"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
