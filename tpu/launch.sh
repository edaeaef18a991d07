#!/usr/bin/env bash
# Start one experiment on every worker of TPU_NAME at once, in the background: the same command on
# each, `dpmix run EXPERIMENT --distributed` (jax.distributed finds the coordinator and the
# process ids itself on Cloud TPU), from the shared folder SHARED that tpu/install.sh mounted.
#
# Usage: PROJECT=... ZONE=... TPU_NAME=... [SHARED=/mnt/dpmix] [MESH=data=-1] [OUT=DIR] \
#          tpu/launch.sh EXPERIMENT [ARGS...]
#   e.g. tpu/launch.sh enron --preset paper
#        MESH=data=4,model=4 tpu/launch.sh openwebmath --preset paper
#
# The paper presets read SHARED/data and SHARED/weights; outputs go to OUT (default
# SHARED/runs/EXPERIMENT), where process 0 writes the results and every process its part of the
# orbax checkpoints. ARGS come last, so they override these. Each worker logs to
# ~/dpmix-EXPERIMENT.log and writes the run's process id to ~/dpmix-EXPERIMENT.pid.
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need PROJECT ZONE TPU_NAME
(($# >= 1)) || fail "give the experiment: tpu/launch.sh EXPERIMENT [ARGS...] (dpmix experiments lists them)"
experiment=$1
shift
shared=${SHARED:-/mnt/dpmix}
root_options "$experiment" "$shared"

printf -v run '%q ' run "$experiment" --distributed --mesh "${MESH:-data=-1}" \
  --out "${OUT:-$shared/runs/$experiment}" "${roots[@]}" "$@"
printf -v shared_q %q "$shared"
printf -v log %q "dpmix-$experiment"
printf -v remote '%s\n' 'set -eu' \
  "mountpoint -q $shared_q || { echo \"\$(hostname): $shared_q is not mounted; run tpu/install.sh\" >&2; exit 1; }" \
  "cd $shared_q" \
  "DPMIX_RUN_COMMIT=\$(cat ~/dpmix_jax/COMMIT) PYTHONUNBUFFERED=1 nohup ~/dpmix-venv/bin/dpmix $run>~/$log.log 2>&1 </dev/null &" \
  "echo \$! >~/$log.pid" \
  "echo \"\$(hostname): started $experiment, log ~/$log.log\""
tpu_vm ssh "$TPU_NAME" --worker=all --command="$remote"
echo "worker 0's log: gcloud compute tpus tpu-vm ssh $TPU_NAME --project=$PROJECT --zone=$ZONE --worker=0 --command='tail -f ~/$log.log'"
