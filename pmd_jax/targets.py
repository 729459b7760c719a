"""Shim: the hardware targets moved to pmd_jax/dry_run/hardware.py (issue 16); the lead
removes this once config validation imports the new path."""

from pmd_jax.dry_run.hardware import *  # noqa: F403  # moved: targets -> dry_run.hardware (issue 16)
from pmd_jax.dry_run.hardware import TARGETS, get_target  # noqa: F401  # moved (issue 16)
