#!/usr/bin/env bash
# Launch one experiment on every host of a TPU VM / pod slice at once.
#
# Usage: [MESH=data=D,model=M] tpu/launch.sh NAME ZONE EXPERIMENT [ARGS...]
#   e.g. tpu/launch.sh dpmix-v4 us-central2-b enron --preset paper --out /mnt/shared/enron
#        MESH=data=4,model=4 tpu/launch.sh dpmix-v4 us-central2-b openwebmath --out /mnt/shared/owm
#
# Every host runs `dpmix run EXPERIMENT --distributed --mesh $MESH ARGS...`: --distributed calls
# jax.distributed.initialize(), which on Cloud TPU discovers the coordinator and the process ids
# itself; MESH (default data=-1: every chip on the data axis) is the device mesh over all chips of
# the slice. Each host reads its own rows of every index batch; process 0 writes the results;
# --out must be a folder every host sees at the same path (checkpoints are written by all hosts).
set -euo pipefail
name=${1:?usage: tpu/launch.sh NAME ZONE EXPERIMENT [ARGS...]}
zone=${2:?zone}
experiment=${3:?experiment}
shift 3
mesh=${MESH:-data=-1}
args=$(printf ' %q' "$@")

gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="
  cd dpmix_jax && PYTHONUNBUFFERED=1 nohup ~/dpmix-venv/bin/dpmix run $experiment --distributed \
    --mesh $mesh$args > ~/dpmix-$experiment.log 2>&1 &
  echo started on \$(hostname)
"
echo "logs: gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 --command='tail -f ~/dpmix-$experiment.log'"
