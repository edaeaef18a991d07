#!/usr/bin/env bash
# Create the TPU VM or pod slice TPU_NAME.
#
# Usage: PROJECT=... ZONE=... TPU_NAME=... ACCELERATOR_TYPE=v4-32 tpu/create.sh [GCLOUD_FLAGS...]
#   e.g. ACCELERATOR_TYPE=v5litepod-16 ZONE=us-west4-a tpu/create.sh --spot
#
# RUNTIME_VERSION defaults to Google's base image for JAX on the accelerator's generation. All of
# them are Ubuntu 22.04 with Python 3.10, below the package's 3.11: tpu/setup_host.sh brings its
# own Python, so the image only has to run the TPU. The VM gets the cloud-platform scope so that
# its service account's roles decide what it may do, such as mounting BUCKET.
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need PROJECT ZONE TPU_NAME ACCELERATOR_TYPE

case "$ACCELERATOR_TYPE" in
  v6e-*) runtime=v2-alpha-tpuv6e ;;
  v5p-*) runtime=v2-alpha-tpuv5 ;;
  v5litepod-* | v5e-*) runtime=v2-alpha-tpuv5-lite ;;
  v2-* | v3-* | v4-*) runtime=tpu-ubuntu2204-base ;;
  *) runtime= ;;
esac
[[ -n ${RUNTIME_VERSION:=$runtime} ]] ||
  fail "no default runtime for ACCELERATOR_TYPE=$ACCELERATOR_TYPE: set RUNTIME_VERSION (gcloud compute tpus tpu-vm versions list)"

tpu_vm create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" \
  --scopes=https://www.googleapis.com/auth/cloud-platform "$@"
tpu_vm describe "$TPU_NAME" --format='value(state,acceleratorType,networkEndpoints[].ipAddress)'
