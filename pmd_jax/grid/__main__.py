"""``python -m pmd_jax.grid``: the modes x seeds grid (``pmd_jax/grid/command.py``)."""

from pmd_jax.grid.command import run

if __name__ == "__main__":
    run()
