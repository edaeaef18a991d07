#!/usr/bin/env bash
# Run one experiment on the GPUs of this host, in the foreground.
#
# Usage: [SHARED=DIR] [MESH=data=-1] [OUT=DIR] tpu/gpu_launch.sh EXPERIMENT [ARGS...]
#   e.g. tpu/gpu_launch.sh enron --preset paper
#
# One host: one process sees every local GPU and MESH (default data=-1: all of them on the data
# axis) spreads the run over them; no --distributed, which needs a coordinator. Several hosts: set
# COORDINATOR (host:port of process 0), NUM_PROCESSES and PROCESS_ID (0 on that host) and run the
# same line on every host; each process drives its host's GPUs, and SHARED must then be a folder
# every host sees at the same path. The paper presets read SHARED/data and SHARED/weights
# (SHARED defaults to the current folder); outputs go to OUT (default SHARED/runs/EXPERIMENT);
# ARGS come last, so they override these. The environment is VENV (default ~/dpmix-venv), made by
# `tpu/setup_host.sh cuda12`.
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
(($# >= 1)) || fail "give the experiment: tpu/gpu_launch.sh EXPERIMENT [ARGS...] (dpmix experiments lists them)"
experiment=$1
shift
dpmix=${VENV:-$HOME/dpmix-venv}/bin/dpmix
[[ -x $dpmix ]] || fail "$dpmix is missing: run tpu/setup_host.sh cuda12 (or set VENV)"
distributed=()
if [[ -n ${COORDINATOR:-}${NUM_PROCESSES:-}${PROCESS_ID:-} ]]; then
  need COORDINATOR NUM_PROCESSES PROCESS_ID SHARED
  export JAX_COORDINATOR_ADDRESS=$COORDINATOR JAX_NUM_PROCESSES=$NUM_PROCESSES
  export JAX_PROCESS_ID=$PROCESS_ID
  distributed=(--distributed)
fi
shared=${SHARED:-$PWD}
[[ -d $shared ]] || fail "SHARED=$shared is not a folder"
root_options "$experiment" "$shared"

export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} # stop at once instead of running on the CPU
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
cd "$shared"
exec "$dpmix" run "$experiment" "${distributed[@]}" --mesh "${MESH:-data=-1}" \
  --out "${OUT:-$shared/runs/$experiment}" "${roots[@]}" "$@"
