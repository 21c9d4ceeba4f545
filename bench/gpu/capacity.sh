#!/usr/bin/env bash
# One device call of bench/capacity.py on the GPU machine's 16-core host, no GPU used (bench/gpu/README.md):
# issue 17's CPU target measured as it asks, the server and its engine processes pinned to two cores and the
# clients on others.
#   bash bench/gpu/capacity.sh [BENCH ARGS...]
# carry: .vllmpay/vw_extra.tar.xz .vllmpay/cpu_extra.tar.xz
# It picks two CPUs on different physical cores (SERVER_CPUS overrides, e.g. 0,1), gives the clients four
# others (CLIENT_CPUS), prints the topology, then runs: python3 -m bench.capacity --server-cpus S
#   --client-cpus C --fractions 0.75,0.8,0.85 --rounds 3 --budget-s B ARGS
# (a later argument wins). B makes the bench start no trial past DEADLINE seconds from the call's start,
# less TRIAL_S (default 570 and 45; the run's timeout_s should be 600); it then prints what ran.
# Back in $OUT: run.log (every trial as it ends, then the bench's tables), nvidia_smi.csv.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
TRIAL_S=${TRIAL_S:-45}
mkdir -p "${OUT:?OUT: the folder whose files come back from the device call}"

first_cpus() { # first_cpus N: N online CPUs, no two of them SMT siblings of one physical core
  local want=$1 cpu seen=" " picked=()
  for cpu in $(seq 0 $(( $(nproc) - 1 ))); do
    local core
    core=$(cat "/sys/devices/system/cpu/cpu$cpu/topology/core_id" 2>/dev/null)-$(cat \
      "/sys/devices/system/cpu/cpu$cpu/topology/physical_package_id" 2>/dev/null)
    case $seen in *" $core "*) continue ;; esac
    seen="$seen$core "; picked+=("$cpu")
    [ "${#picked[@]}" -ge "$want" ] && break
  done
  local IFS=,; echo "${picked[*]}"
}

main() {
  source bench/gpu/device_env.sh vw_extra.tar.xz cpu_extra.tar.xz
  python3 -c 'import voicewire.realtime.app, voicewire.adapters.hibari, hibari, websockets, msgspec' \
    || { stop_smi; return 4; }
  lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node)" || true
  local six server clients
  six=$(first_cpus 6)
  server=${SERVER_CPUS:-$(echo "$six" | cut -d, -f1-2)}
  clients=${CLIENT_CPUS:-$(echo "$six" | cut -d, -f3-6)}
  echo "server on CPUs $server, clients on $clients"
  local left=$(( DEADLINE - $(elapsed) ))
  echo "[$(elapsed) s] bench starts; $left s left before the deadline"
  timeout -s TERM -k 20 "$left" python3 -m bench.capacity --server-cpus "$server" --client-cpus "$clients" \
    --fractions 0.75,0.8,0.85 --rounds 3 --budget-s $(( left - TRIAL_S )) "$@"
  local rc=$?
  echo; echo "[$(elapsed) s] bench exited with $rc"
  stop_smi
  ls -la "$OUT"
  return $rc
}

main "$@" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
