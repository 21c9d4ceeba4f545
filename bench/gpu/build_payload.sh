#!/usr/bin/env bash
# Build the GPU benches' payload (bench/gpu/README.md) into .vllmpay/ (git-ignored). Run on a CPU machine
# with PyPI, from anywhere in the checkout; about 3-5 minutes on 2 cores (most of it xz).
#   usage: bench/gpu/build_payload.sh [OUTDIR=.vllmpay] [PART...]    PARTs: vllm omni serve vw cpu (default: all)
#   env:   WHEELS=DIR  wheel download cache (default ~/.cache/voicewire-gpu-wheels; kept between builds)
#          XZ_THREADS=N  (default 2)
# Output (each tarball unpacks into one site folder, put first on PYTHONPATH; extract vllm026 first):
#   vllm026.tar.xz      vLLM 0.26.0 (built for torch 2.11.0+cu130, CUDA 13) and the ~30 small packages its
#                       offline AsyncLLM path imports that the device image lacks; kernels pruned to sm_90
#   omni026.tar.xz      vllm-omni 0.26.0 and what its offline AsyncOmni path imports beyond that
#   serve_extra.tar.xz  what vllm-omni's OpenAI API server (`vllm_omni.entrypoints.cli.main serve --omni`)
#                       imports beyond the two above (the duel's vllm-omni side; voicewire's omni engine
#                       imports vllm-omni's speech serving module too, so both sides carry it)
#   vw_extra.tar.xz     what voicewire itself needs beyond the device image: soxr, soundfile (+ cffi,
#                       pycparser), snac (the talker's codec), websockets (the bench clients) and the PyAV
#                       stand-in from bench/gpu/av_standin (PyAV with FFmpeg is too large to carry)
#   cpu_extra.tar.xz    what the CPU capacity bench (capacity.sh) needs beyond vw_extra: hibari-tts (weights
#                       inside) and msgspec (the vllm part carries the same pin; capacity.sh carries no vllm)
# The device (nvidia-h200): Python 3.12.3, torch 2.11.0+cu130, transformers 5.17, aiohttp, numpy, scipy,
# pyyaml, prometheus-client, uvloop, onnx, onnxruntime, safetensors, tokenizers, einops, httpx, ... and no
# network (/work/.library/device/KINDS.md has the list). Everything is cp312 manylinux x86_64 wheels.
# From the workplace recipe build_vllm_h200_payload.sh (vllm and omni parts: same packages and pruning,
# except soundfile, cffi and pycparser, which moved to vw_extra, carried by every bench).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-$ROOT/.vllmpay}; shift || true
PARTS=${*:-vllm omni serve vw cpu}
WHEELS=${WHEELS:-$HOME/.cache/voicewire-gpu-wheels}
XZ_THREADS=${XZ_THREADS:-2}
mkdir -p "$OUT" "$WHEELS"; OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PY=(--python-version 3.12 --implementation cp --only-binary=:all:
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
    --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

quiet() { grep -v "^WARNING: \(Location '.*' is ignored\|Running pip as the 'root' user\)" || true; }
dl() { # dl PART NAME==VERSION...: download into the cache folder of PART (already there: not again)
  python3 -m pip download -q --no-deps --disable-pip-version-check "${PY[@]}" -d "$WHEELS/$1" "${@:2}" 2>&1 | quiet
}
wheels_of() { # wheels_of PART NAME==VERSION...: the cached wheel file of each pin (fails if one is missing)
  local part=$1 pin want f found; shift
  for pin in "$@"; do
    want=$(norm "${pin%%==*}")-${pin#*==}; found=
    for f in "$WHEELS/$part"/*.whl; do
      b=$(basename "$f"); [ "$(norm "${b%%-*}")-$(echo "$b" | cut -d- -f2)" = "$want" ] && { found=$f; break; }
    done
    [ -n "$found" ] || { echo "no wheel for $pin in $WHEELS/$part" >&2; exit 1; }
    echo "$found"
  done
}
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed 's/[-_.]\{1,\}/_/g'; }
unzip_all() { # unzip_all DIR WHEEL...: unpack wheels as they are (the recipe's way; pure site-packages trees)
  local dir=$1 w; shift; mkdir -p "$dir"
  for w in "$@"; do python3 -m zipfile -e "$w" "$dir"; done
}
pip_target() { # pip_target DIR WHEEL...: install wheels into DIR for the device's Python (no deps, no .pyc)
  local dir=$1; shift
  python3 -m pip install -q --no-deps --no-compile --no-cache-dir --disable-pip-version-check "${PY[@]}" \
    --target "$dir" "$@" 2>&1 | quiet
  rm -rf "$dir/bin"
}
pack() { # pack DIR NAME: DIR's contents -> OUT/NAME.tar.xz (no bytecode, stable order and owners)
  find "$1" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$1" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | xz -9 -T"$XZ_THREADS" > "$OUT/$2.tar.xz"
  echo "$2.tar.xz: $(du -b "$OUT/$2.tar.xz" | cut -f1) bytes"
}

VLLM=(vllm==0.26.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1
      cachetools==8.0.2 openai-harmony==0.0.8 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2
      truststore==0.10.5 sniffio==1.3.1 jiter==0.19.0 fastapi==0.136.3 starlette==1.10.0
      llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 partial-json-parser==0.2.1.1.post7
      compressed-tensors==0.17.0 loguru==0.7.3 blake3==1.0.11 setproctitle==1.3.8 depyf==0.20.0
      astor==0.8.1 dill==0.4.1 python-json-logger==4.2.0)
OMNI=(vllm-omni==0.26.0 aenum==3.1.16 omegaconf==2.4.0 prettytable==3.19.0 wcwidth==0.9.4
      diffusers==0.38.0 importlib-metadata==10.2.0 janus==2.0.0)
SERVE=(uvicorn==0.55.0 python-multipart==0.0.34 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0
       model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
       pydantic-settings==2.16.3 python-dotenv==1.2.4 mistral_common==1.13.1 ijson==3.6.0
       jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
       pydantic-extra-types==2.11.1 pycountry==26.2.16)
CPU=(hibari-tts==0.2.1 msgspec==0.23.0)
VW=(soxr==1.0.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 snac==1.2.1 websockets==17.4)

for part in $PARTS; do
  case $part in
  vllm)
    dl vllm "${VLLM[@]}"; ws=$(wheels_of vllm "${VLLM[@]}")
    unzip_all "$W/vllm" $ws
    V="$W/vllm/vllm"
    # Not needed for a dense bf16 model on sm_90: FA2 (FA3 is used on Hopper), the Rust frontend,
    # MoE/MLA/FP4/DeepGEMM/Blackwell kernels. Each is imported behind try/except or on demand.
    rm -rf "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$V/vllm-rs" "$V/_moe_C_stable_libtorch.abi3.so" \
           "$V"/_flashmla_C.abi3.so "$V"/_flashmla_extension_C.abi3.so "$V/_qutlass_C.abi3.so" \
           "$V/third_party/deep_gemm" "$V/third_party/fmha_sm100"
    # Keep only sm_90 cubins (+ PTX <= 90) in the one mandatory kernel library.
    python3 "$HERE/prune_fatbin.py" "$V/_C_stable_libtorch.abi3.so" 90
    pack "$W/vllm" vllm026 ;;
  omni)
    dl omni "${OMNI[@]}"; ws=$(wheels_of omni "${OMNI[@]}")
    unzip_all "$W/omni" $ws
    pack "$W/omni" omni026 ;;
  serve)
    dl serve "${SERVE[@]}"; ws=$(wheels_of serve "${SERVE[@]}")
    pip_target "$W/serve" $ws
    # mistral_common's tokenizer files (tekken JSON, sentencepiece models) and pycountry's translations are
    # read only by code the TTS server never runs; the modules that import them stay.
    find "$W/serve/mistral_common/data" -type f ! -name '*.py' -size +64k -delete
    rm -rf "$W/serve/pycountry/locales"
    pack "$W/serve" serve_extra ;;
  vw)
    dl vw "${VW[@]}"; ws=$(wheels_of vw "${VW[@]}")
    pip_target "$W/vw" $ws
    cp -r "$HERE/av_standin/av" "$W/vw/av"
    pack "$W/vw" vw_extra ;;
  cpu)
    dl cpu "${CPU[@]}"; ws=$(wheels_of cpu "${CPU[@]}")
    pip_target "$W/cpu" $ws
    pack "$W/cpu" cpu_extra ;;
  *) echo "unknown part $part (vllm omni serve vw cpu)" >&2; exit 2 ;;
  esac
done

# What each bench's device call sends, against its 64 MiB: the carried files plus the working tree that
# travels anyway (tracked and untracked-not-ignored files).
cd "$ROOT"
tracked=$(git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
size() { local t=0 f; for f in "$@"; do [ -e "$OUT/$f" ] && t=$((t + $(du -cb "$OUT/$f" | tail -1 | cut -f1))); done; echo $t; }
limit=$((64 * 1024 * 1024))
for bench in "omni_duel: vllm026.tar.xz omni026.tar.xz serve_extra.tar.xz vw_extra.tar.xz" \
             "talker: vllm026.tar.xz vw_extra.tar.xz" "capacity: vw_extra.tar.xz cpu_extra.tar.xz"; do
  name=${bench%%:*}; read -r -a files <<< "${bench#*:}"
  total=$(( $(size "${files[@]}") + tracked ))
  printf '%-10s %s + tracked tree %s = %s bytes (%s MiB of 64)%s\n' "$name" "$(size "${files[@]}")" "$tracked" \
    "$total" "$(awk "BEGIN { printf \"%.1f\", $total / 1048576 }")" "$([ "$total" -lt $limit ] || echo '  OVER THE LIMIT')"
done
ls -l "$OUT"
