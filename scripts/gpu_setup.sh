#!/usr/bin/env bash
# Unpack one part of the offline GPU bundle (built by scripts/gpu_bundle.py) on the air-gapped GPU host.
# Usage, from the repository root, once per part (any order, idempotent; parts may come in separate calls):
#     bash scripts/gpu_setup.sh .bundle/partN
#     source /tmp/pergola-gpu/env.sh    # PERGOLA_STUB_BIN (the stub's numpy-1 venv), PATH, PYTHONPATH, PERGOLA_TRITON_ROOT, PERGOLA_DEFAULT_MODEL
# Puts tritonserver in /tmp/pergola-gpu/triton, wheels in /tmp/site, the stub's venv (numpy 1.26.4) in /tmp/stubvenv.
# Overrides: PERGOLA_GPU_DIR, PERGOLA_SITE, PERGOLA_STUBVENV, PERGOLA_BASE_PYTHON (the Python that holds torch).
set -euo pipefail

PART=${1:?usage: bash scripts/gpu_setup.sh .bundle/partN}
PART=$(cd "$PART" && pwd)
[[ -f $PART/MANIFEST ]] || { echo "gpu_setup: no MANIFEST in $PART" >&2; exit 2; }
[[ $(head -1 "$PART/MANIFEST") == "# pergola-gpu-bundle 1" ]] || { echo "gpu_setup: unknown bundle format" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
G=${PERGOLA_GPU_DIR:-/tmp/pergola-gpu}
SITE=${PERGOLA_SITE:-/tmp/site}
VENV=${PERGOLA_STUBVENV:-/tmp/stubvenv}
if [[ -n ${PERGOLA_BASE_PYTHON:-} ]]; then BASE_PY=$PERGOLA_BASE_PYTHON
elif [[ -x /opt/torch/.venv/bin/python3 ]]; then BASE_PY=/opt/torch/.venv/bin/python3
else BASE_PY=$(command -v python3); fi
mkdir -p "$G/bin" "$G/chunks" "$G/parts" "$SITE"
say() { echo "gpu_setup: $*"; }

purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }

ensure_stubvenv() {
  if [[ ! -x $VENV/bin/python3 ]]; then
    say "creating the stub's venv $VENV from $BASE_PY"
    "$BASE_PY" -m venv --without-pip "$VENV"
  fi
  local sp base; sp=$(purelib "$VENV/bin/python3"); base=$(purelib "$BASE_PY")
  # After the venv's own site-packages (numpy 1.26.4): the carried wheels, then the torch environment.
  echo "import site; site.addsitedir('$SITE'); site.addsitedir('$base')" > "$sp/pergola_base.pth"
}

# shellcheck source=scripts/bundle_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/bundle_lib.sh"

say "unpacking $PART"
bundle="" chunked_wheels=()
while read -r kind a b c d e f <&3; do
  case $kind in
    "#"* | "") ;;
    bundle) bundle=$a; mkdir -p "$G/parts/$a"; echo "$c" > "$G/parts/$a/count" ;;
    triton)
      key=$(sha256sum "$PART/$a" | cut -d' ' -f1)
      if [[ -f $G/triton/.sha256 && $(cat "$G/triton/.sha256") == "$key" ]]; then say "  tritonserver: already unpacked"
      else
        rm -rf "$G/triton.new"; mkdir -p "$G/triton.new"
        tar -xJf "$PART/$a" -C "$G/triton.new"; echo "$key" > "$G/triton.new/.sha256"
        rm -rf "$G/triton"; mv "$G/triton.new" "$G/triton"
        say "  tritonserver -> $G/triton"
      fi ;;
    wheel)
      case $a in
        stubvenv) ensure_stubvenv; install_wheel "$PART/$b" "$(purelib "$VENV/bin/python3")" ;;
        site) install_wheel "$PART/$b" "$SITE" ;;
        if:*) if host_satisfies "${a#if:}"; then :; else install_wheel "$PART/$b" "$SITE"; fi ;;
        *) say "unknown wheel target $a" >&2; exit 2 ;;
      esac ;;
    fiaot)  # prebuilt FlashInfer kernels: FlashInfer loads <site>/flashinfer/data/aot/<name>/<name>.so first
      mkdir -p "$SITE/flashinfer/data/aot"; tar -xJf "$PART/$a" -C "$SITE/flashinfer/data/aot"
      say "  FlashInfer prebuilt kernels -> $SITE/flashinfer/data/aot" ;;
    model) mkdir -p "$G/models"; tar -xzf "$PART/$a" -C "$G/models"; say "  model files -> $G/models" ;;
    cache) mkdir -p "$G/cache"; tar -xJf "$PART/$a" -C "$G/cache"; say "  pergola cache (Qwen3 tokenizer) -> $G/cache" ;;
    perf)
      rm -rf "$G/perf"; mkdir -p "$G/perf"; tar -xJf "$PART/$a" -C "$G/perf"
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/perf/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s/perf/bin/perf_analyzer "$@"\n' \
        "$G" "$G" > "$G/bin/perf_analyzer"
      chmod +x "$G/bin/perf_analyzer"; say "  perf_analyzer -> $G/bin/perf_analyzer" ;;
    chunk)  # DEST K N TOTAL SHA256 FILE
      take_chunk "$PART" "$a" "$b" "$c" "$d" "$e" "$f"
      [[ $a == wheels/*.whl ]] && chunked_wheels+=("$a") ;;
    *) say "unknown MANIFEST line: $kind" >&2; exit 2 ;;
  esac
done 3< "$PART/MANIFEST"
# A wheel split across parts (the CuTe DSL libraries of --with-fa4) goes into the site once the part
# that completes it has run; install_wheel skips it when that copy is already there.
for w in "${chunked_wheels[@]}"; do
  [[ -f $G/$w.sha256 && -f $G/$w ]] && install_wheel "$G/$w" "$SITE"
done
[[ -n $bundle ]] && touch "$G/parts/$bundle/$(sed -n 's/^bundle [^ ]* \([0-9]*\) .*/\1/p' "$PART/MANIFEST")"

# --- env.sh: what is there so far -----------------------------------------------------------------
progress=""  # "parts in: 1 2 5 of 5" while some part has not run yet
if [[ -n $bundle ]]; then
  n=$(cat "$G/parts/$bundle/count"); done_parts=$(ls "$G/parts/$bundle" | grep -v count | sort -n | tr '\n' ' ')
  if (( $(ls "$G/parts/$bundle" | grep -vc count) < n )); then progress="parts in: ${done_parts}of $n"; fi
fi
TRITON=$G/triton/pytriton/tritonserver
MODEL=$G/models/all-MiniLM-L6-v2
{
  echo "# written by scripts/gpu_setup.sh: source it from the repository root"
  echo "_pergola_repo=\${PERGOLA_REPO:-\$PWD}"
  echo "[ -d \"\$_pergola_repo/python_models/pergola\" ] || _pergola_repo='$REPO'"
  # The stub runs the numpy-1 venv's python3 (PERGOLA_STUB_BIN); everything else keeps the host's
  # python3 (numpy 2, which its scipy/sklearn need).
  echo "export PERGOLA_STUB_BIN=\"$VENV/bin\""
  echo "export PATH=\"$G/bin:\$PATH\""
  echo "export PYTHONPATH=\"$SITE:\$_pergola_repo/python_models:\$_pergola_repo/client:\$_pergola_repo/tests/support\${PYTHONPATH:+:\$PYTHONPATH}\""
  # `cutlass` (flash-attn-4's CuTe DSL) is put on sys.path by a .pth file, which PYTHONPATH does not read
  [[ -d $SITE/nvidia_cutlass_dsl/dsl_packages ]] && echo "export PYTHONPATH=\"\$PYTHONPATH:$SITE/nvidia_cutlass_dsl/dsl_packages\""
  if [[ -x $TRITON/bin/tritonserver ]]; then echo "export PERGOLA_TRITON_ROOT='$TRITON'"
  else echo "# PERGOLA_TRITON_ROOT: the part with triton.tar.xz is not unpacked yet"; fi
  [[ -d $G/cache ]] && echo "export PERGOLA_CACHE='$G/cache'"
  if [[ -f $MODEL/model.safetensors && -f $MODEL/config.json ]]; then echo "export PERGOLA_DEFAULT_MODEL='$MODEL'"
  else echo "# PERGOLA_DEFAULT_MODEL: the model is not complete yet"; fi
  # perf/gpu_session.sh warns while this is set: the tests import the gateway's wheels (part 3) and copy
  # the default model (part 4), the servers need tritonserver
  echo "export PERGOLA_GPU_BUNDLE_INCOMPLETE='$progress'"
} > "$G/env.sh"

# --- progress and a smoke check once everything is in -------------------------------------------
if [[ -n $bundle ]]; then
  say "bundle $bundle: parts in: ${done_parts}of $n"
  [[ -n $progress ]] && { say "wrote $G/env.sh (incomplete)"; exit 0; }
fi
for need in "$TRITON/bin/tritonserver" "$VENV/bin/python3" "$MODEL/model.safetensors"; do
  [[ -e $need ]] || { say "missing $need: run the part that holds it again"; exit 1; }
done
say "all parts in; checking"
libdir=$("$VENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
missing=$(for b in "$TRITON/bin/tritonserver" "$TRITON/backends/python/libtriton_python.so" \
                   "$TRITON"/python_backend_stubs/*/triton_python_backend_stub; do
            LD_LIBRARY_PATH="$G/triton/nvidia_pytriton.libs:$libdir" ldd "$b" | grep 'not found' || true; done)
if [[ -x $G/perf/bin/perf_analyzer ]]; then
  missing+=$(LD_LIBRARY_PATH="$G/perf/lib" ldd "$G/perf/bin/perf_analyzer" | grep 'not found' || true)
fi
[[ -z $missing ]] || { say "missing libraries: $missing" >&2; exit 1; }
(
  # shellcheck disable=SC1091
  cd "$REPO" && source "$G/env.sh" && "$VENV/bin/python3" - <<'PY'
import importlib.util, sys, numpy, tritonclient.grpc, tritonclient.http, pergola.triton.server as s
from pergola.cli import default_model_folder
assert numpy.__version__.startswith("1."), f"the stub's python3 has numpy {numpy.__version__}"
if importlib.util.find_spec("torch"):
    import torch
    print(f"gpu_setup: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
else:
    print("gpu_setup: torch not found on this python3's path")
inst = s.TritonInstall.prepare()
print(f"gpu_setup: python3={sys.executable} {sys.version.split()[0]} numpy {numpy.__version__}; "
      f"tritonserver {inst.binary}; default model {default_model_folder()}")
PY
)
say "ready: source $G/env.sh"
