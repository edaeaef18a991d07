#!/usr/bin/env bash
# Mount the Cloud Storage bucket BUCKET at SHARED (default /mnt/dpmix) with gcsfuse on the host it
# runs on; tpu/install.sh runs it on every worker, so all of them see one folder at one path.
# Leaves a SHARED that is already mounted (the bucket, or a Filestore/NFS share) as it is.
#
# Usage: BUCKET=my-bucket [SHARED=/mnt/dpmix] tpu/mount_bucket.sh
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
shared=${SHARED:-/mnt/dpmix}
if mountpoint -q "$shared"; then
  echo "$(hostname): $shared is mounted"
  exit 0
fi
need BUCKET
# shellcheck disable=SC2153 # BUCKET is a setting, checked by need
bucket=${BUCKET#gs://}

if ! command -v gcsfuse >/dev/null; then # from Google's apt repository
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg |
    sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -cs) main" |
    sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  sudo apt-get update -qq
  sudo apt-get install -y -qq gcsfuse
fi
sudo mkdir -p "$shared"
sudo chown "$(id -u):$(id -g)" "$shared"
# Owner-only files (the stage store is as sensitive as the data). No metadata caching, so that
# what one host writes the others see at once; directory renames for orbax's checkpoint commits.
gcsfuse --implicit-dirs --file-mode=600 --dir-mode=700 --rename-dir-limit=1000000 \
  --metadata-cache-ttl-secs=0 --metadata-cache-negative-ttl-secs=0 "$bucket" "$shared"
echo "$(hostname): gs://$bucket mounted at $shared"
