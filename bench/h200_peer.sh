#!/bin/bash
# Ours against mlx-dspark 0.20.3 (PyPI) on the H200 in one device call: bench/bench_peer.py (its
# header says what runs and how). In the repo root:
#   bash bench/h200_peer.sh                  # N=3 TOKENS=192 TRIALS=2 BUDGET=440 (seconds of the script);
#                                            # PEER_WHEELS=DIR where the wheels are not in .device-carry/peer-wheels;
#                                            # NO_PEER=1: ours against mlx-lm only; OURS_BITS=default,hostdraft: our rows
# Carry: ".device-carry/peer-wheels" (12 MB, git-ignored: the peer's wheel, mlx-vlm 0.7.10, and
# requests, urllib3, certifi, idna, charset-normalizer, pillow for cp312 where the machine lacks them),
# with the carry set 'inv' READY on the machine (C: wheels/ = mlx-cuda-13, mlx, mlx-lm, gguf; the demo
# GGUF; eval/), as bench/h200_invariance.sh stages it.
# Writes $OUT/peer-h200.md (the report, also on stdout) and $OUT/peer-h200.json (every figure); with the
# peer, $OUT/peer-h200.before-peer.md first (ours against mlx-lm: what a call cut during the peer keeps).
# The peer's side took ~6 min on an H100 (its one-time calibrations and first pass 146 s, a timed
# pass 208 s): give this script a device call of its own.
set -uo pipefail
C=${C:-/var/tmp/carry/inv/files}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_wheels.sh"
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1 MLX_DSPARK_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 bench/bench_peer.py --model "$C/SmolLM2-135M-Instruct.Q4_1.gguf" --eval-dir "$C/eval" ${PEER_WHEELS:+--peer-wheels "$PEER_WHEELS"} \
  ${NO_PEER:+--no-peer} ${OURS_BITS:+--ours-bits "$OURS_BITS"} --n "${N:-3}" --tokens "${TOKENS:-192}" --trials "${TRIALS:-2}" --budget-s "${BUDGET:-440}" \
  --out "$OUT/peer-h200.md" --json "$OUT/peer-h200.json"
