#!/usr/bin/env bash
# Launch one experiment on every host of a TPU VM / pod slice at once.
#
# Usage: tpu/launch.sh NAME ZONE EXPERIMENT [ARGS...]
#   e.g. tpu/launch.sh dpmix-v4 us-central2-b enron --preset paper --out gs://BUCKET/enron
#
# Every host runs the same command; `--distributed` makes the program call
# jax.distributed.initialize(), which on Cloud TPU discovers the coordinator and the process ids
# itself. The mesh comes from the experiment's config (a `data` axis over all chips, plus a
# `model` axis for FSDP-style sharding of GPT-2 medium). Each host reads its own shard of every
# index batch; the noise is generated once from a replicated key, identical on all devices.
set -euo pipefail
name=${1:?usage: tpu/launch.sh NAME ZONE EXPERIMENT [ARGS...]}
zone=${2:?zone}
experiment=${3:?experiment}
shift 3
args=$(printf ' %q' "$@")

gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command="
  cd dpmix_jax && PYTHONUNBUFFERED=1 nohup ~/dpmix-venv/bin/dpmix run $experiment --distributed$args \
    > ~/dpmix-$experiment.log 2>&1 &
  echo started on \$(hostname)
"
echo "logs: gcloud compute tpus tpu-vm ssh $name --zone=$zone --worker=0 --command='tail -f ~/dpmix-$experiment.log'"
