#!/usr/bin/env bash
# Run any Megatron training script -- e.g. Megatron-LM's own pretrain_gpt.py, unmodified -- under
# torchrun with megatron_mesh's flags accepted (and checked) on the same command line.
#
#   [NPROC=4] [CP=4] [CP_COMM_TYPE="mesh"] scripts/run_megatron_script.sh SCRIPT.py [CONFIG.yaml] \
#       --spec megatron_mesh.megatron.spec gpt_layer_spec [more Megatron and plugin flags]
#
# CONFIG.yaml (optional): as for scripts/pretrain_gpt.sh; its flags come first. Flag order, later
# ones winning: the config's < --distributed-backend gloo (CPU only) < CP / CP_COMM_TYPE < the
# flags given here. Each worker runs `python -m megatron_mesh.megatron.run_script SCRIPT.py ...`:
# it dies with its launcher, applies the typing.override polyfill (Python 3.11), the prebuilt
# dataset helpers and, on a CPU only, the CPU workarounds -- also in the processes the script
# spawns (the torch_dist checkpoint writer's) -- adds the plugin's flags and start-up checks to
# Megatron's argument parsing, and with --reset-attention-mask hands the plugin layers each sample's
# documents (from its position ids or EOD tokens) and splits the batch by its CP layout (--cp-layout;
# megatron_mesh/megatron/batch_layout.py; on GPUs too). Nothing else.
#
# Environment: NPROC, CP, CP_COMM_TYPE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, BACKEND,
# PYTHON; start-up checks and exit status -- as for scripts/pretrain_gpt.sh (a missing SCRIPT.py is
# refused before torchrun starts). -h, --help: this text.
source "$(dirname "${BASH_SOURCE[0]}")/_launch.sh"
launch script "$@"
