#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one go, for a lent GPU machine with little time on it:
# the CUDA test tier, then the kernel and packed-documents benchmarks. Each step has its own time
# limit, so a hang in one still leaves the others' results; logs and JSON go to the folder given
# (default: $OUT where the device tool sets it, else ./gpu_results). Exits 1 if any step failed.
#
#   scripts/gpu_check.sh [DIR]          # on the GPU machine, from anywhere
#
# The limits (seconds; TIER_LIMIT, KERNELS_LIMIT, KERNELS8_LIMIT, MASKS_LIMIT, TARGETS_LIMIT) add up to
# 530, plus 10 s of grace per step: give the command that runs it 590 s (a device call allows 600).
# On 2026-11-28 it took 196 s on an H200, before the P = 8 kernels step, the busiest rank alone and
# the CUDA graphs (issue 52) were added.
# The last step checks issue 52's targets (scripts/gpu_targets.py: a rank alone, replayed as CUDA
# graphs, >= 0.90 of the fused kernel at 4K tokens per rank and >= 0.75 at 2K, P = 4 and 8, ring
# and Mesh; packed documents at P = 8 on the balanced layout >= 0.95) and writes host_cost.json (the
# host's us per torch op measured here; copy it to megatron_mesh/plan/host_cost.json).
# Uses the machine's own python3 (its torch has CUDA); megatron-core is not needed (those tests skip).
set -uo pipefail
dir=${1:-${OUT:-gpu_results}}
mkdir -p "$dir" && dir=$(cd "$dir" && pwd)  # relative to the caller, before the cd below
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${TEST_PYTHON:-python3}
failed=0

step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to DIR/NAME.log, report its status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # SIGINT first: pytest then prints where it was and its summary; SIGKILL 10 s later
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "== $name: rc $rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-15}" "$dir/$name.log"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$dir/device.txt" 2>&1
cat "$dir/device.txt"

TAIL=25 step tier "${TIER_LIMIT:-150}" "$py" -m pytest -q -ra -p no:cacheprovider tests -m gpu
# P = 4 at 2K, 4K (the host's pace) and 8K (the kernel's, and the planner's FLOP/s), eager and as CUDA graphs
step kernels "${KERNELS_LIMIT:-100}" "$py" scripts/bench_kernels.py --seq-local 2048 4096 8192 --graphs \
  --json "$dir/kernels.json"
# P = 8 at 2K and 4K tokens per rank: where the host's work per step shows (the "host ms" column)
step kernels8 "${KERNELS8_LIMIT:-60}" "$py" scripts/bench_kernels.py --world 8 --tiles 1x8 2x4 --seq-local 2048 4096 \
  --iters 4 --warmup 1 --graphs --json "$dir/kernels8.json"
TAIL=20 step masks4 "${MASKS_LIMIT:-100}" "$py" scripts/bench_masks.py --world 4 --json "$dir/masks4.json"
# P = 8 also under the profiler (each row once more): its device-time columns are what
# docs/performance.md compares from run to run
TAIL=20 step masks8 "${MASKS_LIMIT:-100}" "$py" scripts/bench_masks.py --world 8 \
  --modes ring mesh:2x4 tasp a2a+ring:2 --json "$dir/masks8.json" --profile "$dir/profile8.txt"
TAIL=40 step targets "${TARGETS_LIMIT:-20}" "$py" scripts/gpu_targets.py "$dir"
exit "$failed"
