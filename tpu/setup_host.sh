#!/usr/bin/env bash
# Install this checkout with JAX for one accelerator into a Python 3.11 virtual environment on the
# host it runs on (tpu/install.sh runs it on every TPU worker; run it yourself on a GPU host).
#
# Usage: [VENV=~/dpmix-venv] tpu/setup_host.sh tpu|cuda12|cuda13|cpu
#
# The package needs Python >= 3.11, while the TPU VM images are Ubuntu 22.04 with Python 3.10 and
# may lack python3-venv. uv (from the system pip, into ~/.local) installs a standalone CPython 3.11
# in the home folder, without root or apt, and makes the environment with pip in it; pip then
# installs the repository's pinned versions (constraints.txt), as the README's set-up does.
set -euo pipefail
# shellcheck source=tpu/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
case "${1:-}" in
  tpu | cuda12 | cuda13) requirement="jax[$1]" ;;
  cpu) requirement=jax ;;
  *) fail "give the accelerator to install JAX for: tpu, cuda12, cuda13 or cpu" ;;
esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$HOME/dpmix-venv}

export PATH="$HOME/.local/bin:$PATH"
command -v uv >/dev/null || python3 -m pip install --quiet --user uv
uv python install 3.11
uv venv --clear --seed --python 3.11 "$venv"
"$venv/bin/pip" install --quiet -c "$root/constraints.txt" "$requirement" -e "$root"
"$venv/bin/python" -c '
import sys
import jax, dpmix_jax
assert sys.version_info >= (3, 11), sys.version
print(f"{sys.prefix}: Python {sys.version.split()[0]}, jax {jax.__version__}")'
