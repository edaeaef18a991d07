# shellcheck shell=bash
# Sourced by the scripts in tpu/: one-line errors, settings from the environment, the gcloud call.

# fail MESSAGE: the script stops with one line on stderr.
fail() {
  echo "tpu/${0##*/}: $*" >&2
  exit 2
}

# need NAME...: stops with one line naming every setting that is not set.
need() {
  local name missing=()
  for name in "$@"; do
    [[ -n ${!name:-} ]] || missing+=("$name")
  done
  ((${#missing[@]} == 0)) || fail "set ${missing[*]} (tpu/README.md describes each setting)"
}

# tpu_vm COMMAND ARGS...: `gcloud compute tpus tpu-vm COMMAND` in PROJECT and ZONE.
tpu_vm() {
  gcloud compute tpus tpu-vm "$@" --project="$PROJECT" --zone="$ZONE"
}

# root_options EXPERIMENT SHARED: sets `roots` to the options that point the experiment's paper
# preset at SHARED/data and SHARED/weights (the experiments' defaults are the relative data/...
# and weights). per_task's public folder follows its preset (data/chexpert or data/mimic), so the
# launchers run from SHARED.
# shellcheck disable=SC2034 # the scripts that source this file read roots
root_options() {
  local data=$2/data weights=$2/weights
  case "$1" in
    enron | openwebmath) roots=(--data-root "$data" --weights-root "$weights") ;;
    small_eps)
      roots=(--data-root "$data" --weights-root "$weights" --nih-root "$data/nih"
        --public-root "$data/chexpert")
      ;;
    nih_chexpert | gsd | ablations) roots=(--nih-root "$data/nih" --public-root "$data/chexpert") ;;
    nih_mimic) roots=(--nih-root "$data/nih" --public-root "$data/mimic") ;;
    per_task) roots=(--nih-root "$data/nih") ;;
    *) roots=() ;;
  esac
}
