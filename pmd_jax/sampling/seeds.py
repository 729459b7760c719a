"""The one recipe for every sampling seed the loop makes.

A seed is derived from a purpose name (a constant of the calling code, e.g. ``"rollout"`` or
``"verify"``) and integers (the run seed, the step, a knob's own seed, ...; a problem id may
be given as its string) by BLAKE2b over a fixed byte encoding. Nothing here depends on the
process: Python's ``hash()`` salts strings per interpreter (``PYTHONHASHSEED``), so
``hash((seed, step, "verify"))`` gave a different replay stream in every launch and in every
resumed leg of a run (a resumed run could not end where a straight one does). The same
recipe gives the same seed in every process, on every platform and Python version, and
different purposes (or any differing integer) give unrelated seeds, so the streams of a step
(rollouts, replays, extra demonstrations, memory calls) never share their noise by accident.

Use :func:`derive_seed` wherever a ``SamplingParams.seed`` (or any other seed of a random
draw made by the loop) is made; ``tests/sampling/test_seeds.py`` holds the recipe to its
published values so a change of it is a visible decision (every committed result was drawn
with the recipe of its own commit).
"""

from __future__ import annotations

import hashlib
import re

SEED_BITS = 31  # SamplingParams.seed and numpy / jax seeds all take a non-negative int32
_PURPOSE = re.compile(r"[a-z][a-z0-9_.]*")


def derive_seed(purpose: str, *parts: int | str) -> int:
    """A non-negative 31-bit seed from ``purpose`` and ``parts``.

    ``purpose``: lower-case letters, digits, ``_`` and ``.``; names the stream. ``parts``:
    Python ints (numpy integers are accepted) or strings (a problem id); bools and floats
    are refused, so a temperature or a flag cannot slip in as a seed by mistake. Each part is
    encoded exactly with a type tag and a fixed width or length prefix (ints signed, 16
    bytes), so ``(1, 23)`` and ``(12, 3)``, or ``1`` and ``"1"``, give different seeds."""
    if not isinstance(purpose, str) or not _PURPOSE.fullmatch(purpose):
        raise ValueError(f"derive_seed: purpose must match {_PURPOSE.pattern}, got {purpose!r}")
    h = hashlib.blake2b(digest_size=8, person=b"pmd_jax.seed")
    h.update(purpose.encode("ascii") + b"\x00")
    for p in parts:
        if isinstance(p, str):
            b = p.encode("utf-8")
            h.update(b"s" + len(b).to_bytes(8, "little") + b)
            continue
        if isinstance(p, bool) or not hasattr(p, "__index__"):
            raise TypeError(f"derive_seed({purpose!r}): parts must be integers or strings, "
                            f"got {p!r}")
        v = int(p.__index__())
        try:
            h.update(b"i" + v.to_bytes(16, "little", signed=True))
        except OverflowError as e:
            raise ValueError(f"derive_seed({purpose!r}): {v} does not fit in 128 bits") from e
    return int.from_bytes(h.digest(), "little") & ((1 << SEED_BITS) - 1)
