# Shared by scripts/gpu_setup.sh and scripts/vllm_setup.sh (sourced, not run): installing carried
# wheels, asking the host's Python what it has, and reassembling files split across bundle parts.
# The sourcing script sets BASE_PY (the Python that holds torch), G (its work folder) and say().

install_wheel() {  # WHEEL TARGET_DIR: unzip a wheel (what pip install --no-deps --target does, but merging)
  "$BASE_PY" - "$1" "$2" "$(say)" <<'PY'
import hashlib, os, shutil, sys, zipfile
whl, target, prefix = sys.argv[1], sys.argv[2], sys.argv[3].strip()
digest = hashlib.sha256(open(whl, "rb").read()).hexdigest()
with zipfile.ZipFile(whl) as z:
    names = z.namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    marker = os.path.join(target, dist_info, "PERGOLA_WHEEL_SHA256")
    if os.path.isfile(marker) and open(marker).read() == digest:
        print(f"{prefix}   {os.path.basename(whl)}: already in {target}")
        sys.exit(0)
    for info in z.infolist():
        parts = info.filename.split("/")
        if info.filename.endswith("/"):
            continue
        if parts[0].endswith(".data"):
            if parts[1] not in ("purelib", "platlib"):
                continue  # scripts/headers/data: not needed here
            parts = parts[2:]
        dest = os.path.join(target, *parts)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(info) as src, open(dest + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(dest + ".tmp", ((info.external_attr >> 16) & 0o777) or 0o644)
        os.replace(dest + ".tmp", dest)
    open(marker, "w").write(digest)
print(f"{prefix}   {os.path.basename(whl)} -> {target}")
PY
}

host_satisfies() {  # SPEC: does the host's own Python (PYTHONPATH aside) have a version satisfying SPEC?
  PYTHONPATH='' "$BASE_PY" - "$1" "$(say)" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.requirements import Requirement
except ImportError:
    sys.exit(1)
req, prefix = Requirement(sys.argv[1]), sys.argv[2].strip()
try:
    have = version(req.name)
except PackageNotFoundError:
    sys.exit(1)
ok = req.specifier.contains(have, prereleases=True)
print(f"{prefix}   host has {req.name} {have}: {'keeps it' if ok else 'does not satisfy ' + str(req.specifier)}")
sys.exit(0 if ok else 1)
PY
}

try_assemble() {  # DEST COUNT TOTAL SHA256: concatenate the pieces once all are here, check size and sha256
  local out=$G/$1 n=$2 total=$3 sha=$4 dir=$G/chunks/$4 k
  [[ -f $out.sha256 && $(cat "$out.sha256") == "$sha" && -f $out ]] && return 0
  for ((k = 1; k <= n; k++)); do [[ -f $dir/$(printf %03d $k) ]] || return 0; done
  mkdir -p "$(dirname "$out")"
  for ((k = 1; k <= n; k++)); do cat "$dir/$(printf %03d $k)"; done > "$out.tmp"
  [[ $(stat -c %s "$out.tmp") == "$total" ]] || { say "$1: reassembled size is wrong" >&2; exit 1; }
  [[ $(sha256sum "$out.tmp" | cut -d' ' -f1) == "$sha" ]] || { say "$1: sha256 mismatch" >&2; exit 1; }
  mv "$out.tmp" "$out"; echo "$sha" > "$out.sha256"; rm -rf "$dir"
  say "  reassembled $out ($n pieces, $total bytes, sha256 ok)"
}

take_chunk() {  # PART DEST K N TOTAL SHA256 FILE: keep one piece of DEST, reassemble when all are in
  local part=$1 dest=$2 k=$3 n=$4 total=$5 sha=$6 file=$7 piece
  if [[ -f $G/$dest.sha256 && $(cat "$G/$dest.sha256") == "$sha" && -f $G/$dest ]]; then
    say "  $dest: already assembled"; return 0
  fi
  mkdir -p "$G/chunks/$sha"; piece=$G/chunks/$sha/$(printf %03d "$k")
  cp "$part/$file" "$piece.tmp"; mv "$piece.tmp" "$piece"; say "  $dest: piece $k of $n"
  try_assemble "$dest" "$n" "$total" "$sha"
}
