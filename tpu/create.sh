#!/usr/bin/env bash
# Create a TPU VM or pod slice for dpmix_jax.
#
# Usage: tpu/create.sh NAME [ACCELERATOR_TYPE] [ZONE] [RUNTIME_VERSION]
#   e.g. tpu/create.sh dpmix-v4 v4-32 us-central2-b tpu-ubuntu2204-base
#        tpu/create.sh dpmix-v5e v5litepod-8 us-west4-a v2-alpha-tpuv5-lite
set -euo pipefail
name=${1:?usage: tpu/create.sh NAME [ACCELERATOR_TYPE] [ZONE] [RUNTIME_VERSION]}
accelerator=${2:-v4-8}
zone=${3:-us-central2-b}
runtime=${4:-tpu-ubuntu2204-base}

gcloud compute tpus tpu-vm create "$name" \
  --zone="$zone" \
  --accelerator-type="$accelerator" \
  --version="$runtime"
gcloud compute tpus tpu-vm describe "$name" --zone="$zone" \
  --format='value(state,acceleratorType,networkEndpoints[].ipAddress)'
