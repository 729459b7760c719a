"""The comparison grid (``python -m pmd_jax.experiments``): its cells and its report."""
