"""Shim: the held-out checks moved to pmd_jax/tasks/heldout.py (issue 16); the lead removes
this once config validation imports the new path."""

from pmd_jax.tasks.heldout import *  # noqa: F403  # moved: heldout -> tasks.heldout (issue 16)
from pmd_jax.tasks.heldout import heldout_config_errors  # noqa: F401  # moved (issue 16)
