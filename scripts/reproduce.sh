#!/usr/bin/env bash
# Set up (if needed) and run the main job: fbt-probe reproduce on the built-in default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fbt-probe reproduce "$@"
