#!/usr/bin/env bash
# Make this Debian host ready to build and run pergola's CPU image with podman, with no image
# registry reachable (docs/container.md):
#   1. podman, runc, mmdebstrap, iptables, podman-compose from Debian's packages (apt-get, if missing);
#   2. /etc/containers/containers.conf, unless one that this script did not write is there:
#      runc with cgroupfs (crun refuses a host whose cgroups mix v1 and v2), events to a file (no
#      journald), and the open-files limit of this host's hard limit (podman's default, 1,048,576,
#      cannot be set where the hard limit is lower and without CAP_SYS_RESOURCE);
#   3. the base image IMAGE: Debian bookworm (minbase) with python3, its venv module and libpython
#      (the Triton Python stub links it), made by mmdebstrap from Debian's archive and `podman
#      import`ed; skipped when IMAGE exists.
#
#   scripts/container_base.sh [IMAGE]        IMAGE: default localhost/debian-python:bookworm
#   DEBIAN_MIRROR=http://deb.debian.org/debian DEBIAN_SECURITY=http://deb.debian.org/debian-security
set -euo pipefail

image=${1:-localhost/debian-python:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
conf=/etc/containers/containers.conf
marker="# Written by pergola's scripts/container_base.sh"

missing=()
for tool in podman:podman runc:runc mmdebstrap:mmdebstrap iptables:iptables podman-compose:podman-compose; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if ((${#missing[@]})); then
    echo "container_base.sh: installing ${missing[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

if [[ ! -e $conf ]] || head -1 "$conf" | grep -qF "$marker"; then
    limit=$(ulimit -Hn)
    [[ $limit == unlimited ]] && limit=1048576
    mkdir -p "$(dirname "$conf")"
    cat > "$conf" <<EOF
$marker (runc and cgroupfs: crun refuses cgroups that
# mix v1 and v2; the open-files limit: this host's hard limit, which containers cannot exceed).
[containers]
default_ulimits = ["nofile=$limit:$limit", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
else
    echo "container_base.sh: $conf was not written by this script; left as it is"
fi

if podman image exists "$image"; then
    echo "container_base.sh: $image is there"
    exit 0
fi
echo "container_base.sh: making $image from $mirror with mmdebstrap"
start=$(date +%s)
# docs, man pages and translations left out (~50 MB)
tarball=$(mktemp /var/tmp/debian-python.XXXXXX.tar)
trap 'rm -f "$tarball"' EXIT
mmdebstrap --variant=minbase --include=ca-certificates,python3,python3-venv,libpython3.11 \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm - "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb $security bookworm-security main" > "$tarball"
podman import --change 'CMD ["/bin/bash"]' "$tarball" "$image"
echo "container_base.sh: $image made in $(($(date +%s) - start)) s, $(podman image inspect "$image" --format '{{.Size}}') bytes"
