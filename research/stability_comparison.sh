#!/usr/bin/env bash
# The paper's figure 3 at our scale: the 'paper' recipe (0.75/0.22/0.03) against
# 'no-three-pass' (0.75/0.25) and the D recipe (0.25/0.55/0.10 + 4, 6, 12 passes), the three on one
# recipe but for the pass mix, with the built-in default model beside them.
# About 2 x 11 + 20 minutes of training on 2 CPU cores, then a few minutes of analysis.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
FBT=.venv/bin/fbt-probe
for cfg in D paper no-three-pass; do
    if [ ! -f "runs/$cfg/model/model.safetensors" ]; then
        rm -rf "runs/$cfg"
        $FBT train --config "$cfg" --out "runs/$cfg"
    fi
done
$FBT stability --model runs/D --model runs/paper --model runs/no-three-pass --model default --passes 30 --out figures/stability "$@"
