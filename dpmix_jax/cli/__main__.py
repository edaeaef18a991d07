"""`python -m dpmix_jax.cli ...` runs `dpmix ...`."""

import sys

from dpmix_jax.cli import main

sys.exit(main())
