#!/usr/bin/env bash
# Train several recipes side by side and score each one: held-out answer accuracy per task and
# decoding mode (with multi_register per register) and the layer-0 recurrent probe.
#
#   research/recipe_sweep.sh RECIPES OUT [DEVICE]
#
# RECIPES has one recipe per line, "NAME fbt-probe-train-arguments" ('#' lines are skipped):
#   more-mr  --set 'schedule.11.tasks={"delayed_memory":0.5,"done_tracking":3.0,"multi_register":1.5}'
#   lr-1e-3  --config my_recipe.toml --set optim.lr=1e-3
# Every recipe trains all its steps (no --max-minutes) into OUT/runs/NAME, in parallel;
# OUT/NAME.txt gets the eval table and the probe table as each recipe finishes; the run
# folders and training logs go to WORK/runs and WORK/logs (default WORK=OUT).
# DEVICE (default cpu) is passed to train, eval and fit; FBT overrides the command
# (default: fbt-probe). On a GPU the floating-point results differ slightly from a CPU run
# of the same recipe, so a recipe picked here is confirmed on the CPU before it ships.
set -uo pipefail
recipes=${1:?usage: recipe_sweep.sh RECIPES OUT [DEVICE]}
out=${2:?usage: recipe_sweep.sh RECIPES OUT [DEVICE]}
device=${3:-cpu}
fbt=${FBT:-fbt-probe}
[ -f "$recipes" ] || { echo "error: recipe file not found: $recipes" >&2; exit 1; }
work=${WORK:-$out}
mkdir -p "$out" "$work/runs" "$work/logs"

one() {
    local name=$1
    shift
    local run="$work/runs/$name" log="$work/logs/$name.log" txt="$out/$name.txt"
    {
        echo "# $name: $*"
        if $fbt train --out "$run" --device "$device" "$@" >"$log" 2>&1; then
            grep -o '"wall_seconds_this_call": [0-9.]*' "$run/metrics.json"
            $fbt eval --model "$run" --device "$device" 2>&1 | grep -v -e "^\s*$" -e "^eval: "
            $fbt fit --model "$run" --device "$device" --prefill recurrent --no-controls \
                --out "$run/probe" 2>&1 | tail -n 6
        else
            echo "training failed:"
            tail -c 600 "$log"
        fi
    } >"$txt.part" 2>&1
    mv "$txt.part" "$txt"
}

# The probe data sets are generated once, before the runs start (they would race otherwise).
for t in delayed_memory done_tracking multi_register; do
    [ -f "data/$t.parquet" ] || $fbt generate --task "$t" >/dev/null
done
pids=()
while IFS= read -r line; do
    [[ -z "${line// /}" || "$line" == \#* ]] && continue
    name=${line%% *}
    args=${line#"$name"}
    eval "set -- $args"
    one "$name" "$@" &
    pids+=($!)
done <"$recipes"
for p in "${pids[@]}"; do wait "$p"; done
cat "$out"/*.txt
