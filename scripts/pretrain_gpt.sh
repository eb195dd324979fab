#!/usr/bin/env bash
# Pretrain a GPT with Megatron's training loop and megatron_mesh's context-parallel modes.
#
#   [NPROC=4] [CP=4] [CP_COMM_TYPE="mesh"] scripts/pretrain_gpt.sh CONFIG.yaml [more Megatron flags]
#
# CONFIG.yaml: Megatron functional-test shape (ENV_VARS, MODEL_ARGS with literal `--flag: value`
# keys; see scripts/yaml_to_args.py). Flags come in this order, later ones winning:
#   the config's MODEL_ARGS < CP / CP_COMM_TYPE from the environment < the extra flags given here.
#
# Environment:
#   NPROC         processes on this node (default: CP, else 1)
#   CP            --context-parallel-size (default: the config's)
#   CP_COMM_TYPE  --cp-comm-type: one mode, or a space-separated list with one mode per layer;
#                 mesh | tasp | ring (megatron_mesh), p2p | a2a | all_gather | a2a+p2p (Transformer Engine)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   torchrun's multi-node settings
#   BACKEND       nccl | gloo (default: nccl when nvidia-smi lists a GPU, else gloo)
#   PYTHON        the interpreter (default: the active virtual environment's, else the repo's .venv,
#                 else python)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
if [[ $# -lt 1 ]]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
CONFIG=$1
shift
if [[ -z ${PYTHON:-} ]]; then
    if [[ -z ${VIRTUAL_ENV:-} && -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" "$HERE/yaml_to_args.py" --env "$CONFIG" > "$TMP/env"
while IFS= read -r -d '' kv; do export "${kv?}"; done < "$TMP/env"
"$PYTHON" "$HERE/yaml_to_args.py" --args "$CONFIG" > "$TMP/args"
mapfile -d '' -t CONFIG_ARGS < "$TMP/args"

RUN_ARGS=()
if [[ -n ${CP:-} ]]; then RUN_ARGS+=(--context-parallel-size "$CP"); fi
# shellcheck disable=SC2206  # split the per-layer list into words on purpose
if [[ -n ${CP_COMM_TYPE:-} ]]; then RUN_ARGS+=(--cp-comm-type $CP_COMM_TYPE); fi
if [[ -z ${BACKEND:-} ]]; then
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then BACKEND=nccl; else BACKEND=gloo; fi
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron requires it with TP/CP > 1

NPROC=${NPROC:-${CP:-1}}
echo "pretrain_gpt.sh: $NPROC process(es) per node x ${NNODES:-1} node(s), backend $BACKEND," \
     "CP=${CP:-from config} CP_COMM_TYPE=${CP_COMM_TYPE:-from config}" >&2
exec "$PYTHON" -m torch.distributed.run \
    --nproc-per-node "$NPROC" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    -m megatron_mesh.megatron.pretrain_gpt \
    "${CONFIG_ARGS[@]}" --distributed-backend "$BACKEND" "${RUN_ARGS[@]}" "$@"
