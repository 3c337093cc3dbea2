#!/usr/bin/env bash
# Set up (if needed) and run the default test suite (slow tests excluded; FBT_SLOW=1 adds them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${FBT_SLOW:-0}" = "1" ]; then
    exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -m "not slow" "$@"
