"""The power of the check before use (memory/verify.py), computed through its own decision
code: P(an item is ever admitted during a run) at a given true effect.

An item of true effect ``effect`` on a problem whose solve rate without it is ``base``: each
replay pair draws (with item correct, without item correct) with marginals ``base + effect``
and ``base``, coupled with probability ``coupling`` (the two arms share one uniform: paired
sampling keys whose arms stay on the same tokens) and independent otherwise. Each of the
item's ``tests`` tests adds ``replays`` such pairs through ``EvidenceStore.record`` (the rule
the trainer runs, with its z, max_pairs and statuses); the item counts as admitted if it is
ever admitted. ``exact_admission`` enumerates every outcome sequence (for checking the
simulation and for small budgets); ``admission_rate`` samples.

    python -m pmd_jax.memory.power [--rule=item_wilson|level_sequential] [--tests=N]
        [--replays=N] [--base=0.3 | --base=0.1,0.6] [--coupling=0,0.5]

prints the curve at effects 0, 0.1, 0.2, 0.3 and 0.5 for the check of ``memory.verify``
(``level_admission_rate`` samples the level rule; the item rule is enumerated exactly).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pmd_jax.memory.config import default_memory_config, freeze_memory_config
from pmd_jax.memory.verify import EvidenceStore

EFFECTS = (0.0, 0.1, 0.2, 0.3, 0.5)


def pair_probabilities(effect: float, base: float, coupling: float) -> tuple[float, float]:
    """(P(win), P(loss)) of one replay pair: only the with-item answer correct, only the
    without-item one. Under full coupling a positive effect has no losses."""
    if not (0.0 <= base <= 1.0 and 0.0 <= base + effect <= 1.0):
        raise ValueError(f"rates out of [0, 1]: base {base}, with item {base + effect}")
    if not 0.0 <= coupling <= 1.0:
        raise ValueError(f"coupling must be in [0, 1], got {coupling}")
    p1, p0 = base + effect, base
    indep_win, indep_loss = p1 * (1 - p0), p0 * (1 - p1)
    shared_win, shared_loss = max(0.0, p1 - p0), max(0.0, p0 - p1)
    return (coupling * shared_win + (1 - coupling) * indep_win,
            coupling * shared_loss + (1 - coupling) * indep_loss)


def _run(cfg: Any, tests: Sequence[Sequence[int]]) -> bool:
    """One item's life under the real rule: each test a list of pair codes (1 win, -1 loss,
    0 tie); True if it was admitted at some point."""
    store = EvidenceStore(cfg)
    admitted = False
    for t, pairs in enumerate(tests):
        ev = store.items.get("item")
        if ev is not None and not ev.open:
            break
        out = [(c == 1, c == -1, True, True) for c in pairs]
        admitted |= store.record("item", "insight", 4 * t, "p", out) == "admitted"
    return admitted


def exact_admission(cfg: Any, effect: float, base: float, coupling: float, tests: int,
                    replays: int) -> float:
    """P(ever admitted), enumerating each test's (wins, losses) counts (the rule reads only
    counts, so the order of pairs within a test does not matter)."""
    pw, pl = pair_probabilities(effect, base, coupling)
    pt = max(0.0, 1.0 - pw - pl)
    outcomes = []
    for w in range(replays + 1):
        for l_ in range(replays - w + 1):
            t = replays - w - l_
            prob = (math.factorial(replays) / (math.factorial(w) * math.factorial(l_)
                                               * math.factorial(t))
                    * pw ** w * pl ** l_ * pt ** t)
            if prob > 0:
                outcomes.append(([1] * w + [-1] * l_ + [0] * t, prob))
    total = 0.0
    for seq in itertools.product(outcomes, repeat=tests):
        prob = math.prod(p for _, p in seq)
        if prob > 0 and _run(cfg, [o for o, _ in seq]):
            total += prob
    return total


def admission_rate(cfg: Any, effect: float, base: float, coupling: float, tests: int,
                   replays: int, sims: int = 2000, seed: int = 0) -> float:
    """P(ever admitted) by simulation (``sims`` items)."""
    rng = np.random.default_rng(seed)
    pw, pl = pair_probabilities(effect, base, coupling)
    hits = 0
    for _ in range(sims):
        codes = rng.choice([1, -1, 0], size=(tests, replays),
                           p=[pw, pl, max(0.0, 1.0 - pw - pl)])
        hits += _run(cfg, codes.tolist())
    return hits / sims


def level_admission_rate(cfg: Any, effect: float, base: float | tuple[float, float],
                         coupling: float, tests: int, replays: int, sims: int = 2000,
                         seed: int = 0) -> float:
    """level_sequential: P(a level is ever admitted) when its joint arm has true effect
    ``effect`` on each of ``tests`` (problem, step) tests of ``replays`` pairs, through
    ``EvidenceStore.record_level``. ``base``: the solve rate without memory, or a (low, high)
    range each test's problem draws its rate from uniformly (the effect is capped at 1)."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(sims):
        store = EvidenceStore(cfg)
        for t in range(tests):
            b = float(rng.uniform(*base)) if isinstance(base, tuple) else float(base)
            pw, pl = pair_probabilities(min(effect, 1.0 - b), b, coupling)
            codes = rng.choice([1, -1, 0], size=replays, p=[pw, pl, max(0.0, 1.0 - pw - pl)])
            moved = store.record_level("insight", t, [(c == 1, c == -1, True, True)
                                                      for c in codes])
            if moved == "admitted":
                hits += 1
                break
            if moved:
                break
    return hits / sims


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    effect: float
    coupling: float
    p_admit: float


def power_curve(cfg: Any, *, base: float = 0.3, couplings: Sequence[float] = (0.0, 0.5),
                tests: int = 2, replays: int = 4, effects: Sequence[float] = EFFECTS
                ) -> list[CurvePoint]:
    """P(ever admitted) at each effect and coupling (exact enumeration)."""
    return [CurvePoint(e, c, exact_admission(cfg, e, base, c, tests, replays))
            for c in couplings for e in effects if base + e <= 1.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", default="item_wilson", choices=("item_wilson", "level_sequential"))
    ap.add_argument("--tests", type=int, default=None,
                    help="tests of the item (item_wilson, default 2) or (problem, step) joint "
                         "arms of the level (level_sequential, default 32)")
    ap.add_argument("--replays", type=int, default=None,
                    help="pairs per test (default: 4 item_wilson, 5 level_sequential)")
    ap.add_argument("--base", default="0.3", help="solve rate without memory, or lo,hi")
    ap.add_argument("--coupling", default="0,0.5")
    ap.add_argument("--z", type=float, default=None)
    ap.add_argument("--sims", type=int, default=2000)
    a = ap.parse_args()
    c = default_memory_config()
    c.verify.rule = a.rule
    if a.z is not None:
        c.verify.z = a.z
    cfg = freeze_memory_config(c).verify
    seq = a.rule == "level_sequential"
    tests = a.tests if a.tests is not None else (32 if seq else 2)
    replays = a.replays if a.replays is not None else (5 if seq else 4)
    lo_hi = [float(x) for x in a.base.split(",")]
    base: float | tuple[float, float] = lo_hi[0] if len(lo_hi) == 1 else (lo_hi[0], lo_hi[1])
    couplings = [float(x) for x in a.coupling.split(",")]
    how = (f"alpha={cfg.alpha}, betting e-process" if seq
           else f"z={cfg.z}, max_pairs={cfg.max_pairs}")
    print(f"check before use ({a.rule}: {how}); {tests} tests x {replays} replays, base "
          f"solve rate {a.base}; P(ever admitted)")
    print("coupling  " + "  ".join(f"+{e:.1f}" for e in EFFECTS))
    for cpl in couplings:
        if seq:
            ps = [level_admission_rate(cfg, e, base, cpl, tests, replays, sims=a.sims)
                  for e in EFFECTS]
        else:
            b = base if isinstance(base, float) else sum(base) / 2
            ps = [p.p_admit for p in power_curve(cfg, base=b, couplings=[cpl], tests=tests,
                                                 replays=replays)]
        print(f"{cpl:8.2f}  " + "  ".join(f"{p:.3f}" for p in ps))


if __name__ == "__main__":
    main()
