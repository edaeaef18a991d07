#!/usr/bin/env bash
# Launch an experiment on GPUs: one host with several GPUs, or several hosts.
#
# Single host (one process; MESH default data=-1: all local GPUs on the data axis):
#   tpu/gpu_launch.sh enron --preset paper --out runs/enron
# Several hosts (the same line on every host, each with its own PROCESS_ID, the same --out on a
# file system all hosts share):
#   COORDINATOR=10.0.0.1:1234 NUM_PROCESSES=2 PROCESS_ID=0 tpu/gpu_launch.sh enron --out /shared/e
# With COORDINATOR set, the variables are exported as JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
# and JAX_PROCESS_ID and `--distributed` makes the program call jax.distributed.initialize() with
# them; MESH=data=D,model=M sets the mesh over the GPUs of all hosts.
set -euo pipefail
experiment=${1:?usage: tpu/gpu_launch.sh EXPERIMENT [ARGS...]}
shift
mesh=${MESH:-data=-1}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
if [[ -n "${COORDINATOR:-}" ]]; then
  export JAX_COORDINATOR_ADDRESS=$COORDINATOR
  export JAX_NUM_PROCESSES=${NUM_PROCESSES:?set NUM_PROCESSES}
  export JAX_PROCESS_ID=${PROCESS_ID:?set PROCESS_ID}
  exec dpmix run "$experiment" --distributed --mesh "$mesh" "$@"
fi
exec dpmix run "$experiment" --mesh "$mesh" "$@"
