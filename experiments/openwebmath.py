"""OpenWebMath (example level): DP-MixMin against Uniform on text. See
`experiments/configs/openwebmath.py`; the runner is shared with `experiments.enron`.

    python -m experiments.openwebmath --preset cpu --out DIR
"""

from __future__ import annotations

from experiments.common_args import experiment_main
from experiments.configs import openwebmath as configs
from experiments.enron import cli, main

__all__ = ["main"]

if __name__ == "__main__":
    with experiment_main("openwebmath"):
        cli(configs)
