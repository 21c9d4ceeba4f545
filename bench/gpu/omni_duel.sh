#!/usr/bin/env bash
# One device call of bench/omni_duel.py on the H200, one server a call (bench/gpu/README.md):
#   bash bench/gpu/omni_duel.sh --servers vllm-omni [BENCH ARGS...]
#   bash bench/gpu/omni_duel.sh --servers voicewire [BENCH ARGS...]
# carry: .vllmpay/vllm026.tar.xz .vllmpay/omni026.tar.xz .vllmpay/serve_extra.tar.xz .vllmpay/vw_extra.tar.xz
# After unpacking it runs: python3 -m bench.omni_duel --shape 1.7b --frames 150 --concurrency 1,4,16,64
#   --rounds 3 --gpu-share 0.2 --kv-cache-gib 8 --out $OUT/duel --budget-s B --start-timeout S ARGS
# (a later argument wins, so ARGS can change any of these). B and S make the bench stop starting rounds in
# time for the call to end by DEADLINE seconds after it began (the run's timeout_s should be 600); the
# bench then prints what ran. `python3 -m bench.omni_duel --report A.json B.json` joins two calls' results.
# Env: DEADLINE (default 570), ROUND_S (seconds kept for the last round, default 60), POSTLOAD (1: run
# the Code2Wav decoder's post-load steps under dummy weights, as a real checkpoint's load does; default 1).
# Back in $OUT: run.log, nvidia_smi.csv, duel/omni_duel.json, duel/<server>.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
ROUND_S=${ROUND_S:-60}
mkdir -p "${OUT:?OUT: the folder whose files come back from the device call}"

main() {
  source bench/gpu/device_env.sh vllm026.tar.xz omni026.tar.xz serve_extra.tar.xz vw_extra.tar.xz
  # Code2Wav's production post-load steps under load_format=dummy (bench/gpu/dummy_postload_patch.py);
  # the patch does nothing unless QWEN3TTS_POSTLOAD=1.
  export QWEN3TTS_POSTLOAD=${POSTLOAD:-1}
  if [ "$QWEN3TTS_POSTLOAD" = 1 ]; then
    local loader="$SITE/vllm/model_executor/model_loader/dummy_loader.py"
    [ -f "$loader" ] || { echo "no $loader: not vLLM 0.26's payload?"; stop_smi; return 3; }
    grep -q QWEN3TTS_POSTLOAD "$loader" || cat bench/gpu/dummy_postload_patch.py >> "$loader"
  fi
  # a quick look before the servers' minutes-long start (vLLM itself is imported by the servers)
  python3 -c 'import importlib.util as u, voicewire.realtime.app, websockets, av
assert all(u.find_spec(m) for m in ("vllm", "vllm_omni", "uvicorn", "snac", "soxr", "soundfile")), "payload incomplete"' \
    || { stop_smi; return 4; }
  local left=$(( DEADLINE - $(elapsed) ))
  echo "[$(elapsed) s] bench starts; $left s left before the deadline"
  mkdir -p "$OUT/duel"
  timeout -s TERM -k 20 "$left" python3 -m bench.omni_duel --shape 1.7b --frames 150 --concurrency 1,4,16,64 \
    --rounds 3 --gpu-share 0.2 --kv-cache-gib 8 --out "$OUT/duel" \
    --budget-s $(( left - ROUND_S )) --start-timeout $(( left - ROUND_S - 10 )) "$@"
  local rc=$?
  echo; echo "[$(elapsed) s] bench exited with $rc"
  stop_smi
  local f
  for f in "$OUT"/duel/*.log; do
    [ -f "$f" ] || continue
    echo "== $f (selected lines)"
    grep -aE 'Error|Traceback|ready|Uvicorn running|Captur|postload|KV cache|init engine|Failed to use custom|voicewire_qwen3_tts_paced|talker codec' "$f" | tail -15
  done
  trim_logs "$OUT/duel"
  ls -la "$OUT" "$OUT/duel"
  return $rc
}

main "$@" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
