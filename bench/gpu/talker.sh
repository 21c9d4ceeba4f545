#!/usr/bin/env bash
# One device call of bench/talker_gpu.py on the H200 (bench/gpu/README.md):
#   bash bench/gpu/talker.sh [BENCH ARGS...]
# carry: .vllmpay/vllm026.tar.xz .vllmpay/vw_extra.tar.xz
# After unpacking it runs: python3 -m bench.talker_gpu --no-micro --concurrency 1,64,128,256 --rounds 5
#   --out $OUT/talker --budget-s B ARGS
# (a later argument wins). B makes the bench start no round past DEADLINE seconds from the call's start,
# less ROUND_S (default 570 and 60; the run's timeout_s should be 600); it then prints what ran.
# Env: DEADLINE, ROUND_S, MICRO=1 (drop --no-micro: the codec micro-benchmark too, about a minute).
# Back in $OUT: run.log, nvidia_smi.csv, talker/talker_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
ROUND_S=${ROUND_S:-60}
mkdir -p "${OUT:?OUT: the folder whose files come back from the device call}"

main() {
  source bench/gpu/device_env.sh vllm026.tar.xz vw_extra.tar.xz
  python3 -c 'import importlib.util as u, voicewire.realtime.app, websockets, av
assert all(u.find_spec(m) for m in ("vllm", "snac", "soxr", "soundfile")), "payload incomplete"' \
    || { stop_smi; return 4; }
  local left=$(( DEADLINE - $(elapsed) )) micro=--no-micro
  [ "${MICRO:-0}" = 1 ] && micro=
  echo "[$(elapsed) s] bench starts; $left s left before the deadline"
  mkdir -p "$OUT/talker"
  timeout -s TERM -k 20 "$left" python3 -m bench.talker_gpu $micro --concurrency 1,64,128,256 --rounds 5 \
    --out "$OUT/talker" --budget-s $(( left - ROUND_S )) "$@"
  local rc=$?
  echo; echo "[$(elapsed) s] bench exited with $rc"
  stop_smi
  ls -la "$OUT" "$OUT/talker"
  return $rc
}

main "$@" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
