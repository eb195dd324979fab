# Sourced by scripts/pretrain_gpt.sh and scripts/run_megatron_script.sh (not run by itself): the
# usage of the calling script (its header), the interpreter, then the plugin's launcher with the
# command `launch_command` (pretrain | script) and the script's arguments.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the usage: the calling script's header, the comment lines from line 2 to the first line that is not one
usage() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; }

launch() {
    local launch_command=$1
    shift
    if [[ $# -lt 1 ]]; then
        usage >&2
        exit 2
    fi
    if [[ $1 == -h || $1 == --help ]]; then
        usage
        exit 0
    fi
    if [[ -z ${PYTHON:-} ]]; then
        if [[ -z ${VIRTUAL_ENV:-} && -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python; fi
    fi
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    exec "$PYTHON" -m megatron_mesh.megatron.launch "$launch_command" "$@"
}
