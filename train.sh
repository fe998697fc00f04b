#!/usr/bin/env bash
# PPO training, like RAGEN's `bash ./train.sh`: settings come from RAGEN's exported variables (defaults below) and
# from KEY=value arguments, which win. `bash ./train.sh --help` lists every setting.
#   bash ./train.sh                                        # the README run: SmolLM2-135M, 6x6 rooms, one box
#   BASE_MODEL=Qwen/Qwen2.5-0.5B-Instruct LOG_MODE="['console','wandb']" bash ./train.sh TOTAL_STEPS=100
set -euo pipefail
cd "$(dirname "$0")"

export DATA_DIR=${DATA_DIR:-data/sokoban}
export DIM_X=${DIM_X:-6}
export DIM_Y=${DIM_Y:-6}
export NUM_BOXES=${NUM_BOXES:-1}
export MAX_STEPS=${MAX_STEPS:-5}
export SEARCH_DEPTH=${SEARCH_DEPTH:-30}
export BASE_MODEL=${BASE_MODEL:-smollm2-135m}
export EXPERIMENT_NAME=${EXPERIMENT_NAME:-test-smollm2-135m}
export MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
export TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
export PPO_BATCH_SIZE=${PPO_BATCH_SIZE:-64}
export MAX_START_LENGTH=${MAX_START_LENGTH:-400}
export MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-100}
export MAX_OBS_LENGTH=${MAX_OBS_LENGTH:-120}
export MAX_TURNS=${MAX_TURNS:-5}
export NUM_UPDATE_PER_ROLL=${NUM_UPDATE_PER_ROLL:-1}
export LOG_MODE=${LOG_MODE:-console}
export GCP=${GCP:-True}
export N_GPUS=${N_GPUS:-1}
export ROLLOUT_TP_SIZE=${ROLLOUT_TP_SIZE:-1}

# the project's virtual environment (made by .ci/setup) when there is one
if [ -z "${PYTHON:-}" ]; then if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi; fi
exec "$PYTHON" -m ragen_nb.cli train "$@"
