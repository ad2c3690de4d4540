#!/usr/bin/env bash
# Install the official RocketMQ 5 Node.js client that e2e/test_rocketmq_nodejs.py drives, as
# e2e/rocketmq_nodejs/package-lock.json pins it (npm ci); nothing to do when it is there.
# Needs node and npm (Debian's nodejs and npm packages will do).
set -euo pipefail
cd "$(dirname "$0")/../e2e/rocketmq_nodejs"
if [ -d node_modules/rocketmq-client-nodejs ] && [ node_modules/.package-lock.json -nt package-lock.json ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "node_clients.sh: npm is missing; install Debian's nodejs and npm packages" >&2
  exit 1
fi
echo "==> installing the RocketMQ 5 Node.js client (npm ci)"
npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
