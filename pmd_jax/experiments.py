"""``python -m pmd_jax.experiments``: the grid command (``pmd_jax/grid/command.py``, also
``python -m pmd_jax.grid``) under the name the docs and the committed results' commands use."""

from pmd_jax.grid.command import run

if __name__ == "__main__":
    run()
