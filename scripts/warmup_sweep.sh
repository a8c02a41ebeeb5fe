#!/usr/bin/env bash
# Which warm-up makes the tiny model copy TextCraft's renamed recipe lines (docs/learning.md)?
# Builds several tiny models for configs/textcraft_renamed.yaml's environment (random-policy episodes of up to
# 20 turns), side by side, then plays each one's 200 held-out episodes (scripts/play_with_transformers.py: the
# run's evaluation without vLLM).
#
#   scripts/warmup_sweep.sh OUT_DIR [NAME:EPISODES:STEPS:LAYERS:HIDDEN ...]
#
# DEVICE (default cpu; cuda on a GPU machine) runs the warm-ups and the episodes; SCALE divides every step and
# episode count (a smoke run: SCALE=1000). Each model goes to OUT_DIR/NAME, its build log to OUT_DIR/NAME.log,
# its evaluation to OUT_DIR/NAME.eval; the summary lines to stdout. Variants run in parallel (on an H200 one
# 0.4M-parameter warm-up runs ~55 steps/s alone, ~45 beside three others). PYTHON: the interpreter (python).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/warmup_sweep.sh OUT_DIR [NAME:EPISODES:STEPS:LAYERS:HIDDEN ...]}
shift
VARIANTS=("$@")
# The defaults: the two 8,000-step models docs/learning.md compares, and the 2,000-step one beside them
# (~2.5 min on an H200 together; 20,000 steps took over 6 min each, four at a time).
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(short:10000:2000:2:128 long8:10000:8000:2:128 more8:40000:8000:2:128)
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cpu}
SCALE=${SCALE:-1}
CONFIG=configs/textcraft_renamed.yaml
SETTINGS='{"textcraft": {"max_depth": 1, "max_distractors": 2, "renamed_variants": 100, "rename": "items"}}'
mkdir -p "$OUT"

# Each variant is built, then played, in its own background job: a model that is ready is evaluated at once.
episodes=$((200 / SCALE > 0 ? 200 / SCALE : 1))
pids=()
for v in "${VARIANTS[@]}"; do
    IFS=: read -r name episodes_per_env steps layers hidden <<<"$v"
    (
        "$PY" -m horizonrl.apps.tiny_model "$OUT/$name" --envs textcraft --env-settings "$SETTINGS" \
            --episodes-per-env $((episodes_per_env / SCALE)) --steps $((steps / SCALE > 0 ? steps / SCALE : 1)) \
            --max-turns 20 --layers "$layers" --hidden "$hidden" --device "$DEVICE" >"$OUT/$name.log" 2>&1
        tail -n 1 "$OUT/$name.log"
        "$PY" scripts/play_with_transformers.py "$OUT/$name" --config "$CONFIG" --device "$DEVICE" \
            --episodes "$episodes" >"$OUT/$name.eval" 2>&1
        grep -h " success " "$OUT/$name.eval"
    ) &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ $failed = 0 ] || { echo "a build or an evaluation failed: see $OUT/*.log and $OUT/*.eval" >&2; exit 1; }
