# Sourced by the other scripts: puts a working `uv` on PATH (installing it from PyPI if missing)
# and syncs the workspace from uv.lock.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export UV_PYTHON_DOWNLOADS=never
if ! command -v uv >/dev/null 2>&1; then
  echo "==> installing uv from PyPI"
  python3 -m pip install --quiet --disable-pip-version-check uv
  PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
  export PATH
fi
echo "==> syncing the workspace (uv.lock)"
uv sync --frozen --all-packages --python 3.11 --quiet
