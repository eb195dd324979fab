#!/usr/bin/env bash
# Pretrain a GPT with Megatron's training loop and megatron_mesh's context-parallel modes.
#
#   [NPROC=4] [CP=4] [CP_COMM_TYPE="mesh"] scripts/pretrain_gpt.sh CONFIG.yaml [more Megatron flags]
#
# CONFIG.yaml: Megatron functional-test shape (ENV_VARS, MODEL_ARGS with literal `--flag: value`
# keys; see megatron_mesh/tools/yaml_args.py). Flags come in this order, later ones winning:
#   the config's MODEL_ARGS < --distributed-backend < CP / CP_COMM_TYPE < the extra flags given here.
#
# Environment:
#   NPROC         processes on this node (default: CP, else 1)
#   CP            --context-parallel-size (default: the config's)
#   CP_COMM_TYPE  --cp-comm-type: one mode, or a space-separated list with one mode per layer;
#                 mesh | tasp | ring | a2a+mesh | a2a+tasp | a2a+ring (megatron_mesh; the a2a+ hybrids
#                 with --hierarchical-context-parallel-sizes U M), p2p | a2a | all_gather | a2a+p2p (TE)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   torchrun's multi-node settings
#   BACKEND       nccl | gloo (default: nccl when CUDA is available, else gloo)
#   PYTHON        the interpreter (default: the active virtual environment's, else the repo's .venv,
#                 else python)
# A thin wrapper: `python -m megatron_mesh.megatron.launch pretrain` builds the command and runs torchrun in
# its own process (killing it kills every rank). It refuses, in one line and before any rank starts, a
# world size NPROC x NNODES that is not a multiple of TP x PP x CP (as the flags give them).
#
# Exit status: 0 done; 2 a bad command line or setting (one message, before training starts), or
# another node of the job stopped (one message naming it and its error); the failed ranks' status
# when they agree, else 1; 128 + N when signal N stopped it (Ctrl-C: 130, with
# one line "interrupted (SIGINT): stopped torchrun and its N rank(s)"). -h, --help: this text.
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
launch pretrain "$@"
