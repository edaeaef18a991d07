#!/usr/bin/env bash
# Launch an experiment on GPUs: one host with several GPUs, or several hosts.
#
# Single host (all local GPUs form the `data` axis of the mesh):
#   tpu/gpu_launch.sh enron --preset paper --out runs/enron
# Several hosts (run the same line on every host, with its own process id):
#   COORDINATOR=10.0.0.1:1234 NUM_PROCESSES=2 PROCESS_ID=0 tpu/gpu_launch.sh enron --preset paper
# With COORDINATOR set, `--distributed` calls jax.distributed.initialize(coordinator_address,
# num_processes, process_id) from these variables.
set -euo pipefail
experiment=${1:?usage: tpu/gpu_launch.sh EXPERIMENT [ARGS...]}
shift
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
if [[ -n "${COORDINATOR:-}" ]]; then
  export JAX_COORDINATOR_ADDRESS=$COORDINATOR
  export JAX_NUM_PROCESSES=${NUM_PROCESSES:?set NUM_PROCESSES}
  export JAX_PROCESS_ID=${PROCESS_ID:?set PROCESS_ID}
  exec dpmix run "$experiment" --distributed "$@"
fi
exec dpmix run "$experiment" "$@"
