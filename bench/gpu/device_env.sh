# Sourced by omni_duel.sh and talker.sh on the GPU machine, in the repository root:
#   source bench/gpu/device_env.sh TARBALL...
# Unpacks the named payload tarballs (names in .vllmpay/, built by build_payload.sh) into $SITE (default
# /tmp/site, each once per machine), maps the `voicewire` package onto the checkout's folders there, sets
# the environment every GPU bench runs under and starts sampling nvidia-smi into $OUT/nvidia_smi.csv
# (`stop_smi` ends it). Sets T0 (the call's start, seconds) and `elapsed` (seconds since T0).
T0=${T0:-$(date +%s)}
elapsed() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:?OUT: the folder whose files come back from the device call}
PAYLOAD=${PAYLOAD:-.vllmpay}
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE" "$OUT"
pids=()
for name in "$@"; do
  [ -f "$PAYLOAD/$name" ] || { echo "missing $PAYLOAD/$name: build it (bench/gpu/build_payload.sh) and carry it" >&2; exit 3; }
  [ -e "$SITE/.unpacked-$name" ] && continue
  ( xz -dc -T0 "$PAYLOAD/$name" | tar -C "$SITE" -xf - && touch "$SITE/.unpacked-$name" ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "unpacking failed" >&2; exit 3; }; done
# voicewire's packages are the checkout's top-level folders (pyproject.toml's package-dir); a namespace
# package of links in the site folder gives them their import names.
mkdir -p "$SITE/voicewire"
for pkg in protocol realtime adapters; do ln -sfn "$PWD/$pkg" "$SITE/voicewire/$pkg"; done
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       VLLM_USE_FLASHINFER_SAMPLER=0
echo "[$(elapsed) s] payload unpacked into $SITE: $*"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,clocks.sm --format=csv \
  -l "${SMI_EVERY:-15}" > "$OUT/nvidia_smi.csv" 2>&1 &
SMI_PID=$!
stop_smi() { kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; true; }
trim_logs() { # trim_logs DIR: keep every log under DIR within what comes back (16 MiB a file): head + tail
  local f max=$((15 * 1024 * 1024))
  for f in "$1"/*.log; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt "$max" ] || continue
    { head -c 2000000 "$f"; printf '\n[... trimmed by trim_logs ...]\n'; tail -c 12000000 "$f"; } > "$f.tmp" && mv "$f.tmp" "$f"
  done
}
