#!/usr/bin/env bash
# One device call: voicewire's side of the omni duel with the step probe (bench/gpu/step_probe) loaded in every
# process, so that each talker step of vllm-omni's pipeline is timed (where a burst's first frames go).
#   bash bench/gpu/probe_burst.sh [omni_duel.sh ARGS...]     (default: --concurrency 1,16,64 --modes ws)
# carry: as omni_duel.sh. Back in $OUT: omni_duel.sh's files, and probe.txt (every process's VWPROBE lines,
# `VWPROBE pid what start_s ms details`, start on CLOCK_MONOTONIC, written there as they happen, so a call
# stopped at its limit still brings them back), read with `python -m bench.probe_report probe.txt`.
set -uo pipefail
cd "$(dirname "$0")/../.."
export VW_PROBE=1 VW_PROBE_FILE="$OUT/probe.txt" PYTHONPATH="$PWD/bench/gpu/step_probe${PYTHONPATH:+:$PYTHONPATH}"
bash bench/gpu/omni_duel.sh --servers voicewire --modes ws --concurrency 1,16,64 "$@"
rc=$?
wc -l "$OUT/probe.txt"
exit $rc
