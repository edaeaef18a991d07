#!/usr/bin/env bash
# Delete the TPU VM or pod slice TPU_NAME (this stops the billing; the bucket stays).
#
# Usage: PROJECT=... ZONE=... TPU_NAME=... tpu/delete.sh
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need PROJECT ZONE TPU_NAME
tpu_vm delete "$TPU_NAME" --quiet
