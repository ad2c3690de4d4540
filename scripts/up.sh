#!/usr/bin/env bash
# Set up, then start what Apogee has so far: the storage engine. Writes and reads back messages
# in a local store (under .apogee/), then runs the store benchmark's quick mode.
# The cluster (nameserver, brokers, `apogee cluster up`) comes with the next milestone.
source "$(dirname "$0")/_env.sh"
echo "==> store demo"
uv run --frozen python -m apogee.store.demo .apogee/demo-store
echo "==> store benchmark, quick mode (figures in JSON, one case per line)"
uv run --frozen python bench/store_bench.py --quick --dir .apogee
echo
echo "Next: the full benchmark is 'uv run python bench/store_bench.py'; results are in"
echo "bench/RESULTS.md. The cluster (nameserver, brokers, producer SDK) comes next."
