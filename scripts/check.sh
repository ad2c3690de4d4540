#!/usr/bin/env bash
# Install what the tests need, then run every check: formatting, lint, types, tests.
# Extra arguments go to pytest (e.g. scripts/check.sh -m unit).
source "$(dirname "$0")/_env.sh"
echo "==> Debian packages the tests need"
bash scripts/system_packages.sh
echo "==> the RocketMQ 5 Node.js client the tests drive"
bash scripts/node_clients.sh
echo "==> ruff format --check"
uv run --frozen ruff format --check .
echo "==> ruff check"
uv run --frozen ruff check .
echo "==> mypy --strict"
# one run per package: each has its own tests/conftest.py, which one mypy run would see twice
for part in libs/* services/* testkit e2e bench scripts; do
  uv run --frozen mypy "$part"
done
echo "==> pytest"
uv run --frozen pytest "$@"
