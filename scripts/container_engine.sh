#!/usr/bin/env bash
# Make podman usable for the image and compose tests on a Debian 12 machine that has no
# container engine and reaches no image registry: Debian's podman (with runc) and debootstrap,
# and a local `debian:bookworm-slim` base image (the FROM of every Apogee image), made with
# debootstrap from the Debian mirror apt uses. When that image cannot run a container, podman is
# configured for runc and no default ulimits (/etc/containers/containers.conf), what machines
# need where crun cannot set up cgroups (hybrid cgroups) and processes may not raise rlimits.
#
# Safe to run again: each step runs only when what it makes is missing, and nothing is printed
# then; each change made says so in one line. Runs apt-get as root, or through sudo.
# Exit status 1, with the reason on stderr, when podman cannot be made to run a container.
set -euo pipefail

BASE=docker.io/library/debian:bookworm-slim
PACKAGES=(podman runc debootstrap)

fail() {
  echo "container_engine.sh: $*" >&2
  exit 1
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    fail "run as root (no sudo here) to $*"
  fi
}

install_packages() {
  local missing=() pkg log
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
      || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return
  command -v apt-get >/dev/null 2>&1 || fail "no apt-get here; install ${missing[*]} by hand"
  log="$(mktemp)"
  if ! { as_root apt-get update -q \
    && as_root env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    fail "installing ${missing[*]} failed (apt-get's output above)"
  fi
  rm -f "$log"
  echo "container_engine.sh: installed ${missing[*]}"
}

# The first http(s) Debian archive (not the security one) named in apt's sources.
debian_mirror() {
  local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
  local url
  url="$(cat "${files[@]}" 2>/dev/null \
    | sed -nE 's#^(deb|URIs:)[[:space:]]+(\[[^]]*\][[:space:]]+)?(https?://[^[:space:]]+/debian)/?([[:space:]].*)?$#\3#p' \
    | head -n 1)"
  echo "${url:-http://deb.debian.org/debian}"
}

make_base_image() {
  as_root podman image exists "$BASE" && return
  local root mirror
  mirror="$(debian_mirror)"
  root="$(mktemp -d)"
  if ! as_root debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null 2>&1; then
    as_root rm -rf "$root"
    fail "debootstrap of bookworm from $mirror failed"
  fi
  # slim as Debian's official image: no package lists or downloaded packages, and dpkg keeps
  # no documentation, manual pages or translations (of what it installs later either)
  as_root rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
    "$root"/usr/share/locale/*
  as_root tee "$root/etc/dpkg/dpkg.cfg.d/slim" >/dev/null <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
DPKG
  if ! as_root tar -C "$root" -c . | as_root podman import --quiet - "$BASE" >/dev/null; then
    as_root rm -rf "$root"
    fail "podman import of the bookworm root filesystem failed"
  fi
  as_root rm -rf "$root"
  echo "container_engine.sh: made $BASE with debootstrap from $mirror"
}

can_run() {
  as_root podman run --rm --network none "$BASE" true >/dev/null 2>&1
}

configure_runtime() {
  local conf=/etc/containers/containers.conf
  if [ -e "$conf" ] && ! grep -q 'apogee: scripts/container_engine.sh' "$conf"; then
    fail "podman cannot run a container, and $conf is not ours to change; see 'podman run --rm $BASE true'"
  fi
  as_root mkdir -p /etc/containers
  as_root tee "$conf" >/dev/null <<'CONF'
# apogee: scripts/container_engine.sh - runc (crun cannot set up hybrid cgroups) and no
# default ulimits (processes here may not raise them)
[containers]
default_ulimits = []

[engine]
runtime = "runc"
CONF
  echo "container_engine.sh: podman set to runc without default ulimits ($conf)"
}

install_packages
make_base_image
if ! can_run; then
  configure_runtime
  can_run || fail "podman still cannot run a container: 'podman run --rm $BASE true' fails"
fi
