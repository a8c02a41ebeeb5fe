#!/usr/bin/env bash
# ScalingInter-RL in miniature (docs/learning.md): fixed short vs fixed long vs stepwise short -> long turn
# budget, same BabyAI setting and the same number of learner steps, several seeds per arm.
#
#   scripts/scaling_inter_study.sh [OUT_DIR] [ARM:SEED ...]
#
# OUT_DIR (default runs/scaling-inter) gets the tiny model (built once: warm-up on random-policy episodes
# only), one training run per ARM:SEED (default: fixed_short, fixed_long and scaling, seeds 0, 1 and 2), a
# 200-episode held-out evaluation of the starting model and of each run's last checkpoint at 8, 4 and 2
# turns (eval-*.json), and the report (report/learning.png, learning.md). Runs one process tree at a time;
# a run whose directory already holds a checkpoint at its last step is not trained again. ARM is the
# suffix of configs/babyai_budget_ARM.yaml. Set PYTHON to choose the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/scaling-inter}
shift || true
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(fixed_short:0 fixed_long:0 scaling:0 fixed_short:1 fixed_long:1 scaling:1
                              fixed_short:2 fixed_long:2 scaling:2)
PY=${PYTHON:-python}
HRL=("$PY" -m horizonrl)
LEVELS='["BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0"]'
SETTINGS="{\"levels\": $LEVELS, \"high_level_actions\": true, \"observation\": \"compact\"}"
MODEL=$OUT/tiny-babyai-budget
EVAL_TURNS=(8 4 2)
mkdir -p "$OUT"

"${HRL[@]}" make-tiny-model "$MODEL" --reuse --envs babyai --env-settings "{\"babyai\": $SETTINGS}" \
    --episodes-per-env 1500 --steps 200 --max-turns 8 2>&1 | tail -n 1

evaluate() {  # MODEL_DIR NAME: held-out success on the first 200 test-split tasks at each budget
    for turns in "${EVAL_TURNS[@]}"; do
        local out="$OUT/eval-$2-T$turns.json"
        [ -s "$out" ] && continue
        "${HRL[@]}" eval --model "$1" --env babyai --env-settings "$SETTINGS" --episodes 200 \
            --max-turns "$turns" --max-tokens-per-turn 24 --max-context-tokens 1024 --json "$out" \
            > "$OUT/eval-$2-T$turns.log" 2>&1
        echo "eval $2 at $turns turns: $("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['success_rate'])" "$out")"
    done
}

evaluate "$MODEL" start
labels=()
dirs=()
for spec in "${RUNS[@]}"; do
    arm=${spec%%:*}
    seed=${spec##*:}
    run=$OUT/$arm-s$seed
    config=configs/babyai_budget_$arm.yaml
    last=$(printf 'step_%06d' "$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['learner']['total_steps'])" "$config")")
    if [ ! -d "$run/checkpoints/$last" ]; then
        rm -rf "$run"
        echo "training $arm seed $seed -> $run"
        "${HRL[@]}" train "$config" model.path="$MODEL" run.output_dir="$run" run.seed="$seed" \
            run.name="babyai-budget-$arm-s$seed" > "$OUT/$arm-s$seed.out" 2>&1
    fi
    evaluate "$run/checkpoints/$last" "$arm-s$seed"
done
for arm in fixed_short fixed_long scaling; do  # the report's runs grouped by arm, whatever order they ran in
    case $arm in fixed_short) name="fixed 2";; fixed_long) name="fixed 8";; scaling) name="2→4→8";; esac
    for spec in "${RUNS[@]}"; do
        [ "${spec%%:*}" = "$arm" ] || continue
        labels+=(--label "$name, s${spec##*:}")
        dirs+=("$OUT/$arm-s${spec##*:}")
    done
done
"${HRL[@]}" report "${dirs[@]}" "${labels[@]}" --smooth 5 --out "$OUT/report" > /dev/null
echo "report: $OUT/report/learning.png, $OUT/report/learning.md"
