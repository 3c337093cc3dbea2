#!/usr/bin/env bash
# The paper's figure 3 at our scale: the 'paper' recipe (0.75/0.22/0.03) against
# 'no-three-pass' (0.75/0.25), same budget as the default, with the default model beside them.
# About 2 x 11 minutes of training on 2 CPU cores, then two minutes of analysis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
FBT=.venv/bin/fbt-probe
for cfg in paper no-three-pass; do
    if [ ! -f "runs/$cfg/model/model.safetensors" ]; then
        rm -rf "runs/$cfg"
        $FBT train --config "$cfg" --out "runs/$cfg"
    fi
done
$FBT stability --model default --model runs/paper --model runs/no-three-pass --passes 30 --out figures/stability "$@"
