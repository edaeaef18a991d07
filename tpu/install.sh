#!/usr/bin/env bash
# Copy this checkout's HEAD commit to every worker of TPU_NAME, install it there with JAX for TPU
# (tpu/setup_host.sh), mount BUCKET at SHARED on every worker (tpu/mount_bucket.sh), then check
# that every worker sees the slice's chips. Run it again after a new commit, while no run is going.
#
# Usage: PROJECT=... ZONE=... TPU_NAME=... BUCKET=... [SHARED=/mnt/dpmix] tpu/install.sh
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need PROJECT ZONE TPU_NAME BUCKET
shared=${SHARED:-/mnt/dpmix}
root=$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)
commit=$(git -C "$root" rev-parse --short HEAD)
git -C "$root" diff --quiet HEAD -- || echo "tpu/install.sh: uncommitted changes stay here; installing $commit" >&2

archive=$(mktemp --suffix=.tar.gz)
trap 'rm -f "$archive"' EXIT
git -C "$root" archive --format=tar.gz --prefix=dpmix_jax/ -o "$archive" HEAD
tpu_vm scp "$archive" "$TPU_NAME:dpmix_jax.tar.gz" --worker=all

# COMMIT names the code in every result (the workers' copy is not a git checkout).
printf -v remote '%s\n' 'set -euo pipefail' \
  'rm -rf dpmix_jax && tar xzf dpmix_jax.tar.gz && rm dpmix_jax.tar.gz' \
  "echo $(printf %q "$commit") > dpmix_jax/COMMIT" \
  'bash dpmix_jax/tpu/setup_host.sh tpu' \
  "BUCKET=$(printf %q "$BUCKET") SHARED=$(printf %q "$shared") bash dpmix_jax/tpu/mount_bucket.sh"
tpu_vm ssh "$TPU_NAME" --worker=all --command="$remote"

# All workers at once: on a pod slice the TPU runtime starts only when every host joins.
tpu_vm ssh "$TPU_NAME" --worker=all --command='JAX_PLATFORMS=tpu ~/dpmix-venv/bin/python -c "
import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())"'
