#!/usr/bin/env bash
# One device call: voicewire's side of the omni duel with the step probe (bench/gpu/step_probe) loaded in every
# process, so that each talker step of vllm-omni's pipeline is timed (where a burst's first frames go).
#   bash bench/gpu/probe_burst.sh [omni_duel.sh ARGS...]     (default: --concurrency 1,16,64 --modes ws)
# carry: as omni_duel.sh. Back in $OUT: omni_duel.sh's files, and probe.txt (every VWPROBE line of the
# server's log: `VWPROBE pid what start_s ms details`, start on CLOCK_MONOTONIC), read with
# `python -m bench.probe_report probe.txt`.
set -uo pipefail
cd "$(dirname "$0")/../.."
export VW_PROBE=1 PYTHONPATH="$PWD/bench/gpu/step_probe${PYTHONPATH:+:$PYTHONPATH}"
probe_lines() { grep -ah "VWPROBE" "$OUT"/duel/voicewire.log 2>/dev/null | sed 's/.*VWPROBE/VWPROBE/' > "$OUT/probe.tmp" \
  && mv "$OUT/probe.tmp" "$OUT/probe.txt"; }
# every few seconds too, so that a call stopped at its limit still brings the lines back
( while sleep 5; do probe_lines; done ) &
copier=$!
bash bench/gpu/omni_duel.sh --servers voicewire --modes ws --concurrency 1,16,64 "$@"
rc=$?
kill "$copier" 2>/dev/null
wait "$copier" 2>/dev/null
probe_lines
grep -v "VWPROBE" "$OUT/duel/voicewire.log" > "$OUT/duel/voicewire.log.tmp" && mv "$OUT/duel/voicewire.log.tmp" "$OUT/duel/voicewire.log"
wc -l "$OUT/probe.txt"
exit $rc
