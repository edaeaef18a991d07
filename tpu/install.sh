#!/usr/bin/env bash
# Copy this checkout to every worker of a TPU VM / pod slice and install it with JAX for TPU.
#
# Usage: tpu/install.sh NAME [ZONE]
set -euo pipefail
name=${1:?usage: tpu/install.sh NAME [ZONE]}
zone=${2:-us-central2-b}
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)

archive=$(mktemp --suffix=.tar.gz)
git -C "$root" archive --format=tar.gz --prefix=dpmix_jax/ -o "$archive" HEAD
gcloud compute tpus tpu-vm scp "$archive" "$name":dpmix_jax.tar.gz --zone="$zone" --worker=all
rm -f "$archive"

gcloud compute tpus tpu-vm ssh "$name" --zone="$zone" --worker=all --command='
  set -euo pipefail
  rm -rf dpmix_jax && tar xzf dpmix_jax.tar.gz
  python3 -m venv ~/dpmix-venv
  ~/dpmix-venv/bin/pip install -q -U pip
  ~/dpmix-venv/bin/pip install -q "jax[tpu]" -e ./dpmix_jax
  ~/dpmix-venv/bin/python -c "import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())"
'
