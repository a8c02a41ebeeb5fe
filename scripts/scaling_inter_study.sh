#!/usr/bin/env bash
# ScalingInter-RL in miniature (docs/learning.md): fixed short vs fixed long vs stepwise short -> long turn
# budget, same BabyAI setting and the same number of learner steps, several seeds per arm.
#
#   scripts/scaling_inter_study.sh [--smollm2] [OUT_DIR] [ARM:SEED ...]
#
# OUT_DIR (default runs/scaling-inter) gets the tiny model (built once: warm-up on random-policy episodes
# only), one training run per ARM:SEED (default: fixed_short, fixed_long and scaling, seeds 0, 1 and 2), a
# 200-episode held-out evaluation of the starting model and of each run's last checkpoint at 8, 4 and 2
# turns (eval-*.json; its episodes in episodes-*, which scripts/babyai_in_view.py reads), and the report
# (report/learning.png, learning.md). Runs one process tree at a time; a run whose directory already holds a
# checkpoint at its last step is not trained again. ARM is the suffix of configs/babyai_budget_ARM.yaml. Set
# PYTHON to choose the interpreter (default: python).
#
# --smollm2: the same study with SmolLM2-135M-Instruct (configs/smollm2_budget_ARM.yaml: budgets 1, 4 and
# 1 -> 2 -> 4; default OUT_DIR runs/scaling-inter-smollm2, default runs seeds 0 and 1). The starting model is
# built once at the arms' model.path from the scaling arm's model.pretrained (the import, then the format
# warm-up on random-policy episodes of 4 turns) and shared by every arm; held-out evaluations are 150
# episodes at 4 and 1 turns, the engine in bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILY=tiny
if [ "${1:-}" = "--smollm2" ]; then FAMILY=smollm2; shift; fi
PY=${PYTHON:-python}
HRL=("$PY" -m horizonrl)
LEVELS='["BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0"]'
SETTINGS="{\"levels\": $LEVELS, \"high_level_actions\": true, \"observation\": \"compact\"}"
if [ $FAMILY = tiny ]; then
    OUT=${1:-runs/scaling-inter}
    DEFAULT_RUNS=(fixed_short:0 fixed_long:0 scaling:0 fixed_short:1 fixed_long:1 scaling:1
                  fixed_short:2 fixed_long:2 scaling:2)
    CONFIGS=configs/babyai_budget
    MODEL=$OUT/tiny-babyai-budget
    EVAL_TURNS=(8 4 2)
    EVAL_ARGS=(--episodes 200)
    ARM_NAMES=("fixed 2" "fixed 8" "2→4→8")
else
    OUT=${1:-runs/scaling-inter-smollm2}
    DEFAULT_RUNS=(fixed_short:0 fixed_long:0 scaling:0 fixed_short:1 fixed_long:1 scaling:1)
    CONFIGS=configs/smollm2_budget
    MODEL=runs/smollm2-budget-model  # the arms' model.path
    EVAL_TURNS=(4 1)
    EVAL_ARGS=(--episodes 150 --dtype bfloat16)
    ARM_NAMES=("fixed 1" "fixed 4" "1→2→4")
fi
shift || true
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=("${DEFAULT_RUNS[@]}")
mkdir -p "$OUT"

if [ $FAMILY = tiny ]; then
    "${HRL[@]}" make-tiny-model "$MODEL" --reuse --envs babyai --env-settings "{\"babyai\": $SETTINGS}" \
        --episodes-per-env 1500 --steps 200 --max-turns 8 2>&1 | tail -n 1
else  # import + format warm-up, skipped when MODEL already holds this recipe's result (ensure_pretrained)
    "$PY" -c "import sys; from horizonrl.core.config import load_config; \
from horizonrl.apps.warmup_data import ensure_pretrained; \
print('starting model:', ensure_pretrained(load_config(sys.argv[1], [])))" "${CONFIGS}_scaling.yaml" \
        > "$OUT/model.log" 2>&1 || { tail -n 20 "$OUT/model.log"; exit 1; }
    tail -n 1 "$OUT/model.log"
fi

evaluate() {  # MODEL_DIR NAME: held-out success on the same first test-split tasks at each budget
    for turns in "${EVAL_TURNS[@]}"; do
        local out="$OUT/eval-$2-T$turns.json"
        [ -s "$out" ] && continue
        "${HRL[@]}" eval --model "$1" --env babyai --env-settings "$SETTINGS" "${EVAL_ARGS[@]}" \
            --max-turns "$turns" --max-tokens-per-turn 24 --max-context-tokens 1024 --json "$out" \
            --record "$OUT/episodes-$2-T$turns" > "$OUT/eval-$2-T$turns.log" 2>&1
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
    config=${CONFIGS}_$arm.yaml
    last=$(printf 'step_%06d' "$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['learner']['total_steps'])" "$config")")
    if [ ! -d "$run/checkpoints/$last" ]; then
        rm -rf "$run"
        echo "training $arm seed $seed -> $run"
        "${HRL[@]}" train "$config" model.path="$MODEL" run.output_dir="$run" run.seed="$seed" \
            run.name="$(basename "$CONFIGS" | tr _ -)-$arm-s$seed" > "$OUT/$arm-s$seed.out" 2>&1
    fi
    evaluate "$run/checkpoints/$last" "$arm-s$seed"
done
for arm in fixed_short fixed_long scaling; do  # the report's runs grouped by arm, whatever order they ran in
    case $arm in fixed_short) name=${ARM_NAMES[0]};; fixed_long) name=${ARM_NAMES[1]};; scaling) name=${ARM_NAMES[2]};; esac
    for spec in "${RUNS[@]}"; do
        [ "${spec%%:*}" = "$arm" ] || continue
        labels+=(--label "$name, s${spec##*:}")
        dirs+=("$OUT/$arm-s${spec##*:}")
    done
done
"${HRL[@]}" report "${dirs[@]}" "${labels[@]}" --smooth 5 --out "$OUT/report" > /dev/null
echo "report: $OUT/report/learning.png, $OUT/report/learning.md"
