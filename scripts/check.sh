#!/usr/bin/env bash
# Install what the tests need, then run every check: formatting, lint, types, tests.
# Extra arguments go to pytest (e.g. scripts/check.sh -m unit).
source "$(dirname "$0")/_env.sh"
echo "==> ruff format --check"
uv run --frozen ruff format --check .
echo "==> ruff check"
uv run --frozen ruff check .
echo "==> mypy --strict"
uv run --frozen mypy
echo "==> pytest"
uv run --frozen pytest "$@"
