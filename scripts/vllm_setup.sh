#!/usr/bin/env bash
# Unpack one part of an offline vLLM bundle (built by scripts/vllm_bundle.py) on the air-gapped GPU host.
# Usage, from the repository root, once per part (any order, idempotent; parts may come in separate calls
# while the machine stays warm):
#     bash scripts/vllm_setup.sh .bundle/vllm_partN        # vLLM 0.22.0, the seeds' baseline
#     bash scripts/vllm_setup.sh .bundle/vllm0250_partN    # vLLM 0.25.0
# The part's MANIFEST line `vllm VERSION SITE` names the release and its site (a part without one is
# 0.22.0's: /tmp/vllm-site): 0.22.0 goes into /tmp/vllm-site, 0.25.0 into /tmp/vllm-site-0.25.0, each
# with its own env.sh and work folder (/tmp/vllm-gpu, /tmp/vllm-gpu-0.25.0), so both can be set up side by side.
# Each part installs its wheels into the site and keeps its pieces of vllm.tar.xz in the work folder;
# the part that completes vllm.tar.xz unpacks it into the site; once every part is in, the imports
# are checked. perf/bench_vllm.py puts the site (--vllm-site, default /tmp/vllm-site) first on its own path;
# for a shell that should import vllm: source SITE/env.sh
# The sites are kept apart from pergola's /tmp/site (flashinfer 0.5.3, apache-tvm-ffi 0.1.15): vLLM
# needs flashinfer-python 0.6.11.post2 (0.25.0: 0.6.13) and apache-tvm-ffi 0.1.9, so only vLLM's
# processes may see them first.
# Overrides (local tests): VLLM_SITE, VLLM_GPU_DIR, VLLM_BASE_PYTHON (the Python that holds torch).
set -euo pipefail

PART=${1:?usage: bash scripts/vllm_setup.sh .bundle/vllm_partN}
PART=$(cd "$PART" && pwd)
[[ -f $PART/MANIFEST ]] || { echo "vllm_setup: no MANIFEST in $PART" >&2; exit 2; }
[[ $(head -1 "$PART/MANIFEST") == "# pergola-vllm-bundle 1" ]] || { echo "vllm_setup: $PART is not a vLLM bundle part" >&2; exit 2; }

read -r VERSION MANIFEST_SITE < <(awk '$1 == "vllm" {print $2, $3; exit}' "$PART/MANIFEST") || true
VERSION=${VERSION:-0.22.0} MANIFEST_SITE=${MANIFEST_SITE:-/tmp/vllm-site}
SUFFIX=$([[ $VERSION == 0.22.0 ]] || echo "-$VERSION")
G=${VLLM_GPU_DIR:-/tmp/vllm-gpu$SUFFIX}
SITE=${VLLM_SITE:-$MANIFEST_SITE}
if [[ -n ${VLLM_BASE_PYTHON:-} ]]; then BASE_PY=$VLLM_BASE_PYTHON
elif [[ -n ${PERGOLA_BASE_PYTHON:-} ]]; then BASE_PY=$PERGOLA_BASE_PYTHON
elif [[ -x /opt/torch/.venv/bin/python3 ]]; then BASE_PY=/opt/torch/.venv/bin/python3
else BASE_PY=$(command -v python3); fi
mkdir -p "$G/chunks" "$G/parts" "$SITE"
say() { echo "vllm_setup: $*"; }

# shellcheck source=scripts/bundle_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/bundle_lib.sh"

say "unpacking $PART (vLLM $VERSION) into $SITE (python: $BASE_PY)"
bundle="" part_no="" vllm_sha=""
while read -r kind a b c d e f <&3; do
  case $kind in
    "#"* | "" | vllm) ;;
    bundle) bundle=$a part_no=$b; mkdir -p "$G/parts/$a"; echo "$c" > "$G/parts/$a/count" ;;
    wheel)
      case $a in
        site) install_wheel "$PART/$b" "$SITE" ;;
        if:*) if host_satisfies "${a#if:}"; then :; else install_wheel "$PART/$b" "$SITE"; fi ;;
        *) say "unknown wheel target $a" >&2; exit 2 ;;
      esac ;;
    cache)  # the Qwen3 tokenizer in pergola's cache layout (perf/bench_vllm.py uses it if PERGOLA_CACHE has none)
      mkdir -p "$SITE/pergola-cache"; tar -xJf "$PART/$a" -C "$SITE/pergola-cache"
      say "  Qwen3 tokenizer -> $SITE/pergola-cache" ;;
    chunk)  # DEST K N TOTAL SHA256 FILE
      [[ $a == vllm.tar.xz ]] && vllm_sha=$e
      take_chunk "$PART" "$a" "$b" "$c" "$d" "$e" "$f" ;;
    *) say "unknown MANIFEST line: $kind" >&2; exit 2 ;;
  esac
done 3< "$PART/MANIFEST"
[[ -n $bundle ]] || { say "MANIFEST has no bundle line" >&2; exit 2; }
touch "$G/parts/$bundle/$part_no"
echo "$bundle" > "$G/bundle"

# --- vllm.tar.xz: unpack into the site once it is complete (the package and its dist-info) ------------------
if [[ -f $G/vllm.tar.xz.sha256 ]]; then
  sha=$(cat "$G/vllm.tar.xz.sha256")
  if [[ -f $SITE/.vllm-tar.sha256 && $(cat "$SITE/.vllm-tar.sha256") == "$sha" ]]; then say "  vllm: already unpacked"
  elif [[ -n $vllm_sha && $vllm_sha != "$sha" ]]; then say "  vllm.tar.xz in $G is from another bundle: run every part again" >&2; exit 1
  else
    say "  unpacking vllm.tar.xz into $SITE (about 310-330 MB)"
    rm -rf "$SITE/vllm" "$SITE"/vllm-*.dist-info
    tar -xJf "$G/vllm.tar.xz" -C "$SITE"
    echo "$sha" > "$SITE/.vllm-tar.sha256"
    say "  vllm -> $SITE/vllm"
  fi
fi

# --- env.sh ------------------------------------------------------------------------------------------------
{
  echo "# written by scripts/vllm_setup.sh: source it only where vLLM should run (its site comes first on the path)"
  echo "export VLLM_SITE='$SITE' VLLM_BUNDLE_VERSION='$VERSION'"
  echo "export VLLM_PYTHON='$BASE_PY'  # the Python that holds torch 2.11"
  echo "export PYTHONPATH=\"$SITE\${PYTHONPATH:+:\$PYTHONPATH}\""
  echo "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there"
} > "$SITE/env.sh"

n=$(cat "$G/parts/$bundle/count") have=()
for ((k = 1; k <= n; k++)); do [[ -f $G/parts/$bundle/$k ]] && have+=("$k"); done
say "bundle $bundle: parts in: ${have[*]} of $n"
if (( ${#have[@]} < n )); then say "wrote $SITE/env.sh; run the other parts"; exit 0; fi
[[ -f $SITE/.vllm-tar.sha256 ]] || { say "all parts in, but vllm is not unpacked: run every part again" >&2; exit 1; }

# --- check: every module vLLM imports at module level on the LLM and server paths, then the entry points ---
say "all parts in; checking imports (about a minute)"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  "$BASE_PY" - "$SITE" "$VERSION" <<'PY'
import importlib, os, sys, traceback
site, version = sys.argv[1], sys.argv[2]
# Module -> pip name, for what vllm imports at module level (found by reading vllm 0.22.0's imports;
# some only on paths these benchmarks do not take; 0.25.0's are the same less gguf, ijson and
# mistral_common, imported lazily there): a hint list. The entry-point imports below decide.
LLM_PATH = {"torch": "torch==2.11.0", "transformers": "transformers", "tokenizers": "tokenizers",
            "safetensors": "safetensors", "huggingface_hub": "huggingface_hub", "numpy": "numpy",
            "PIL": "pillow", "aiohttp": "aiohttp", "cachetools": "cachetools", "cbor2": "cbor2",
            "cloudpickle": "cloudpickle", "cpuinfo": "py-cpuinfo", "einops": "einops", "fastapi": "fastapi",
            "starlette": "starlette", "filelock": "filelock", "gguf": "gguf", "jinja2": "jinja2",
            "msgspec": "msgspec", "openai": "openai", "openai_harmony": "openai-harmony",
            "partial_json_parser": "partial-json-parser", "prometheus_client": "prometheus_client",
            "psutil": "psutil", "pybase64": "pybase64", "pydantic": "pydantic", "regex": "regex",
            "requests": "requests", "tqdm": "tqdm", "typing_extensions": "typing_extensions",
            "urllib3": "urllib3", "uvloop": "uvloop", "yaml": "pyyaml", "zmq": "pyzmq", "blake3": "blake3",
            "flashinfer": "flashinfer-python", "tvm_ffi": "apache-tvm-ffi==0.1.9",
            "triton": "triton"}
SERVER_PATH = {"uvicorn": "uvicorn", "model_hosting_container_standards": "model-hosting-container-standards",
               "prometheus_fastapi_instrumentator": "prometheus-fastapi-instrumentator", "ijson": "ijson",
               "watchfiles": "watchfiles", "jmespath": "jmespath", "xgrammar": "xgrammar",
               "mistral_common": "mistral_common"}
if version != "0.22.0":
    del LLM_PATH["gguf"]  # required by 0.22.0 only
missing = {}
for mods, what in ((LLM_PATH, "vllm"), (SERVER_PATH, "the OpenAI server")):
    for mod, pip in mods.items():
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - report them all at once
            missing[mod] = f"{pip} (needed by {what}): {type(e).__name__}: {str(e)[:160]}"
for mod, why in missing.items():
    print(f"vllm_setup: not importable: {mod}: {why}")

def where(mod):
    m = sys.modules.get(mod)
    return os.path.dirname(getattr(m, "__file__", "") or "?") if m else "not imported"

failed = []
for entry, what in (("vllm", "vllm"), ("vllm.entrypoints.llm", "the in-process LLM (suites inproc, scoring)"),
                    ("vllm.entrypoints.openai.api_server", "the OpenAI server (suite server, HTTP scoring)")):
    try:
        importlib.import_module(entry)
        print(f"vllm_setup: import {entry}: ok")
    except Exception as e:  # noqa: BLE001
        failed.append(entry)
        print(f"vllm_setup: import {entry} FAILED, so {what} cannot run: {type(e).__name__}: {e}")
        traceback.print_exc(limit=-3)
if "vllm" in sys.modules:
    import vllm
    print(f"vllm_setup: vllm {vllm.__version__} from {where('vllm')}")
    if vllm.__version__ != version:
        failed.append("vllm")
        print(f"vllm_setup: the MANIFEST says vLLM {version}, {site} holds {vllm.__version__}")
for mod in ("torch", "transformers", "flashinfer", "tvm_ffi", "pydantic", "fastapi"):
    m = sys.modules.get(mod)
    print(f"vllm_setup:   {mod} {getattr(m, '__version__', '?') if m else '-'} from {where(mod)}")
torch = sys.modules.get("torch")
if torch is not None and not torch.__version__.startswith("2.11.0"):
    print(f"vllm_setup: WARNING: vLLM {version} is built for torch 2.11.0, this Python has {torch.__version__}")
fi = sys.modules.get("flashinfer")
if fi is not None and not where("flashinfer").startswith(site):
    print(f"vllm_setup: WARNING: flashinfer comes from {where('flashinfer')}, not {site}: put {site} first")
sys.exit(1 if failed else 0)
PY
say "ready: python perf/bench_vllm.py --vllm-site $SITE --out perf/out/vllm.json   (or source $SITE/env.sh)"
