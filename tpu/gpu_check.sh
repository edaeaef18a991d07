#!/usr/bin/env bash
# The prepared accelerator run: on one GPU, the throughput benchmark's gpu preset (ResNet-18,
# GPT-2 small and the SmolLM2-135M architecture: non-private, every DP path, the Trainer, LoRA,
# and Opacus on the same card) and the adversarial clipping harness on the GPU backend; the
# results are stored under OUT with the card's name. About 8 minutes on one H100.
#
# Usage: [VENV=DIR] [WHEELS=DIR] [OUT=DIR] tpu/gpu_check.sh
#
# Run from the checkout. The environment is VENV (default .venv-gpu); when it has no Python yet it
# is made here, from WHEELS when set (a folder of wheels made on a machine with network by
#   pip download -d wheels -c constraints.txt "jax[cuda12]" ".[test,compare]" "setuptools>=68"
# so that a machine without network brings its own), else from the package index. Outputs go to
# OUT (default runs/gpu_check): card.txt (nvidia-smi), bench_gpu/bench.json, clipping.xml (the
# harness's JUnit report) and status.txt (each part's exit status). A part that fails does not
# stop the others; the script exits with the first non-zero status.
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
[[ -f pyproject.toml && -d dpmix_jax ]] || fail "run it from the checkout (pyproject.toml, dpmix_jax/)"
venv=${VENV:-.venv-gpu}
out=${OUT:-runs/gpu_check}
python=$venv/bin/python
if [[ ! -x $python ]]; then
  source_args=()
  if [[ -n ${WHEELS:-} ]]; then
    [[ -d $WHEELS ]] || fail "WHEELS=$WHEELS is not a folder"
    source_args=(--no-index --find-links "$WHEELS")
  fi
  python3 -m venv "$venv"
  "$python" -m pip install -q "${source_args[@]}" -c constraints.txt "jax[cuda12]" -e ".[test,compare]"
fi
mkdir -p "$out"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} # stop at once instead of measuring the CPU
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.8}
export HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/card.txt"
"$python" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices()" ||
  fail "JAX sees no GPU in $venv (jax[cuda12] installed? an NVIDIA driver >= 525?)"
status=0
: >"$out/status.txt"
part() {
  local name=$1 code=0
  shift
  "$@" || code=$?
  echo "$name $code" >>"$out/status.txt"
  ((status != 0)) || status=$code
}
part bench timeout 420 "$python" -m experiments.bench_grads --preset gpu --out "$out/bench_gpu"
part clipping timeout 180 "$python" -m pytest -q -p no:cacheprovider \
  tests/privacy/test_adversarial_clipping.py tests/models/test_llama_training.py \
  -k "adversarial or harness or sound" --junitxml "$out/clipping.xml"
exit "$status"
