"""``python -m pmd_jax.dry_run``: the forward + backward dry run of a model preset."""

import sys

from pmd_jax.dry_run.forward_backward import main

sys.exit(main())
