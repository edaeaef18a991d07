#!/usr/bin/env bash
# Delete a TPU VM / pod slice (stops the billing).
#
# Usage: tpu/delete.sh NAME [ZONE]
set -euo pipefail
name=${1:?usage: tpu/delete.sh NAME [ZONE]}
zone=${2:-us-central2-b}
gcloud compute tpus tpu-vm delete "$name" --zone="$zone" --quiet
