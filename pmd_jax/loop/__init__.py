"""The loop's phases (trainer.py reads them in order)."""
