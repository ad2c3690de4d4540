#!/usr/bin/env bash
# Install the Debian packages the tests need, each only when it is missing; silent when none is.
#   prometheus  its promtool checks and unit-tests the alert rules (charts/apogee/rules); its
#               server is what the local cluster's monitoring runs
#   openjdk-17-jre-headless  the Java that Spark runs on (libs/apogee-spark's tests)
#   chromium    the browser Playwright drives in the console's browser tests
#               (e2e/test_console_browser.py launches /usr/bin/chromium; no browser download)
#   etcd-server  the etcd that the tests of the replica groups' etcd backend start
#               (apogee.testkit.etcd runs /usr/bin/etcd on free ports)
# Runs apt-get as root, or through sudo when not root. Safe to run again.
set -euo pipefail
PACKAGES=(prometheus openjdk-17-jre-headless chromium etcd-server)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_packages.sh: no apt-get here; install these Debian packages by hand: ${missing[*]}" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "system_packages.sh: missing ${missing[*]}; run this script as root (no sudo here)" >&2
  exit 1
fi

echo "==> installing Debian packages: ${missing[*]}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { "${as_root[@]}" apt-get update -q \
  && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "system_packages.sh: installing ${missing[*]} failed (apt-get's output above)" >&2
  exit 1
fi
