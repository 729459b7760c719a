"""ScaNN retrieval keyed by string docids, updated in place between training steps.

- Below ``brute_force_below`` items the searcher scores exactly (``score_brute_force``); at or
  above it the index is rebuilt as tree + asymmetric hashing + exact reorder.
- ``upsert`` / ``delete`` go through ScaNN's own docid-aware ``upsert`` / ``delete``.
- In tree mode, after each update we read ``get_health_stats()``; when the partition imbalance
  grows by more than ``rebalance_imbalance`` or the quantisation error grows by
  ``rebalance_qerror_ratio`` over its value at the last (re)build, we call ``rebalance()``
  (a retrain of the partitioner).
- ``state_dict`` holds the vectors, the docids in ScaNN's internal order and the serialised
  ScaNN artifacts (``serialize(relative_path=True)``) as bytes; docids travel as a list (never
  a pickle), so ``load_state_dict`` restores the identical searcher.

Vectors are assumed unit-norm; scores are dot products (= cosine).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pmd_jax.memory.config import MemoryIndex

_DOCIDS_PICKLE = "scann_docids.pkl"
# Asymmetric hashing trains 16 centers per block, and a tree needs points per leaf: below this
# many items the index stays brute force whatever brute_force_below says.
MIN_TREE_SIZE = 256


def _scann():
    # lazy: scann (optional, the scann extra) only when a ScaNN searcher is built
    from scann.scann_ops.py import scann_ops_pybind

    return scann_ops_pybind


def exact_search(
    db: np.ndarray, queries: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Reference: top-k rows of ``db`` by dot product, (indices [q,k], scores [q,k])."""
    k = min(k, db.shape[0])
    scores = queries @ db.T
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    ps = np.take_along_axis(scores, part, 1)
    order = np.argsort(-ps, axis=1, kind="stable")
    return np.take_along_axis(part, order, 1), np.take_along_axis(ps, order, 1)


class ScannIndex:
    def __init__(self, dim: int, cfg: MemoryIndex) -> None:
        if dim < 1:
            raise ValueError(f"ScannIndex dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.cfg = cfg
        self._vectors: dict[str, np.ndarray] = {}
        self._searcher: Any = None  # scann's searcher once built
        self.mode = "empty"  # "empty" | "brute" | "tree"
        self._baseline: dict[str, float] | None = None
        self.rebalances = 0
        self.rebuilds = 0

    # ---------------------------------------------------------------- bookkeeping --
    def __len__(self) -> int:
        return len(self._vectors)

    def __contains__(self, docid: str) -> bool:
        return docid in self._vectors

    def docids(self) -> list[str]:
        return list(self._vectors)

    def vector(self, docid: str) -> np.ndarray:
        return self._vectors[docid]

    def matrix(self, docids: Sequence[str]) -> np.ndarray:
        if not docids:
            return np.zeros((0, self.dim), np.float32)
        return np.stack([self._vectors[d] for d in docids])

    def _check(self, docids: Sequence[str], vecs: np.ndarray) -> np.ndarray:
        vecs = np.asarray(vecs, np.float32)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise ValueError(f"expected vectors [n, {self.dim}], got {vecs.shape}")
        if len(docids) != vecs.shape[0]:
            raise ValueError(f"{len(docids)} docids for {vecs.shape[0]} vectors")
        if len(set(docids)) != len(docids):
            raise ValueError("duplicate docids in one upsert")
        if not all(isinstance(d, str) and d for d in docids):
            raise ValueError("docids must be non-empty strings")
        if not np.all(np.isfinite(vecs)):
            raise ValueError("vectors contain NaN or inf")
        return vecs

    # -------------------------------------------------------------------- building --
    def _want_tree(self, n: int) -> bool:
        return n >= max(self.cfg.brute_force_below, MIN_TREE_SIZE)

    def _build(self) -> None:
        """(Re)builds the searcher from the authoritative vectors."""
        self.rebuilds += 1
        self._baseline = None
        ids = list(self._vectors)
        if not ids:
            self._searcher, self.mode = None, "empty"
            return
        db = self.matrix(ids)
        n = len(ids)
        b = _scann().builder(db, min(10, n), "dot_product")
        if self._want_tree(n):
            leaves = max(2, int(self.cfg.num_leaves_per_sqrt * math.sqrt(n)))
            search = max(1, int(round(self.cfg.leaves_to_search_frac * leaves)))
            soar = self.cfg.soar_lambda if self.cfg.soar_lambda > 0 else None
            b = b.tree(num_leaves=leaves, num_leaves_to_search=search,
                       training_sample_size=min(n, self.cfg.training_sample_size),
                       min_partition_size=self.cfg.min_partition_size,
                       spherical=self.cfg.spherical, soar_lambda=soar)
            b = b.score_ah(self.cfg.ah_dims_per_block,
                           anisotropic_quantization_threshold=self.cfg.ah_threshold)
            b = b.reorder(self.cfg.reorder)
            self.mode = "tree"
        else:
            b = b.score_brute_force()
            self.mode = "brute"
        self._searcher = b.build(docids=ids)
        if self.cfg.num_threads:
            self._searcher.set_num_threads(int(self.cfg.num_threads))
        if self.mode == "tree":
            self._searcher.initialize_health_stats()
            self._baseline = dict(self._searcher.get_health_stats())

    def health_stats(self) -> dict[str, float]:
        if self._searcher is None or self.mode != "tree":
            return {}
        return dict(self._searcher.get_health_stats())

    def _maybe_rebalance(self) -> bool:
        if self.mode != "tree" or self._baseline is None:
            return False
        hs = self.health_stats()
        key = "partition_weighted_avg_relative_imbalance"
        imb = hs.get(key, 0.0) - self._baseline.get(key, 0.0)
        qe, q0 = hs.get("avg_quantization_error", 0.0), self._baseline.get(
            "avg_quantization_error", 0.0)
        drift = imb > self.cfg.rebalance_imbalance or (
            q0 > 0 and qe > self.cfg.rebalance_qerror_ratio * q0)
        if not drift:
            return False
        self._searcher.rebalance()
        self.rebalances += 1
        self._searcher.initialize_health_stats()
        self._baseline = dict(self._searcher.get_health_stats())
        return True

    # ---------------------------------------------------------------------- updates --
    def upsert(self, docids: Sequence[str], vecs: np.ndarray) -> None:
        docids = list(docids)
        if not docids:
            return
        vecs = self._check(docids, vecs)
        for d, v in zip(docids, vecs):
            self._vectors[d] = v.copy()
        n = len(self._vectors)
        if self._searcher is None or self._want_tree(n) != (self.mode == "tree"):
            self._build()
            return
        self._searcher.upsert(docids, vecs, batch_size=max(1, min(256, len(docids))))
        self._maybe_rebalance()

    def delete(self, docids: Sequence[str]) -> None:
        docids = [d for d in dict.fromkeys(docids) if d in self._vectors]
        if not docids:
            return
        for d in docids:
            del self._vectors[d]
        n = len(self._vectors)
        soar = self.mode == "tree" and self.cfg.soar_lambda > 0  # SOAR delete segfaults (1.4.2)
        if (n == 0 or self._searcher is None or soar
                or self._want_tree(n) != (self.mode == "tree")):
            self._build()
            return
        self._searcher.delete(docids)
        self._maybe_rebalance()

    # ----------------------------------------------------------------------- search --
    def search(
        self, queries: np.ndarray, k: int, *, leaves_to_search: int | None = None,
        pre_reorder: int | None = None,
    ) -> tuple[list[list[str]], list[list[float]]]:
        """Top-k docids and scores per query (fewer when the index holds fewer items)."""
        queries = np.asarray(queries, np.float32)
        if queries.ndim == 1:
            queries = queries[None]
        if queries.shape[1:] != (self.dim,):
            raise ValueError(f"queries must be [q, {self.dim}], got {queries.shape}")
        k = min(int(k), len(self._vectors))
        if k <= 0 or self._searcher is None:
            return [[] for _ in range(len(queries))], [[] for _ in range(len(queries))]
        kw: dict[str, int] = {"final_num_neighbors": k}
        if self.mode == "tree":
            kw["pre_reorder_num_neighbors"] = max(k, pre_reorder or self.cfg.reorder)
            if leaves_to_search is not None:
                kw["leaves_to_search"] = leaves_to_search
        if len(queries) > 1:
            ids, scores = self._searcher.search_batched_parallel(queries, **kw)
        else:
            ids, scores = self._searcher.search_batched(queries, **kw)
        return [list(r) for r in ids], [list(map(float, r)) for r in np.asarray(scores)]

    def exact(self, queries: np.ndarray, k: int) -> tuple[list[list[str]], list[list[float]]]:
        """Exact numpy search over the same items (the reference for recall)."""
        ids = list(self._vectors)
        if not ids or k <= 0:
            return [[] for _ in range(len(queries))], [[] for _ in range(len(queries))]
        idx, sc = exact_search(self.matrix(ids), np.asarray(queries, np.float32), k)
        return [[ids[j] for j in r] for r in idx], sc.tolist()

    # ------------------------------------------------------------------ persistence --
    def state_dict(self) -> dict[str, Any]:
        files: dict[str, bytes] = {}
        order: list[str] = []
        if self._searcher is not None:
            order = list(self._searcher.docids)
            with tempfile.TemporaryDirectory() as tmp:
                self._searcher.serialize(tmp, relative_path=True)
                for name in sorted(os.listdir(tmp)):
                    if name != _DOCIDS_PICKLE:
                        with open(os.path.join(tmp, name), "rb") as f:
                            files[name] = f.read()
        return dict(
            dim=self.dim, mode=self.mode, docids=list(self._vectors),
            vectors=self.matrix(list(self._vectors)), scann_docids=order, scann_files=files,
            baseline=self._baseline, rebalances=self.rebalances, rebuilds=self.rebuilds,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dim"]) != self.dim:
            raise ValueError(f"index state has dim {state['dim']}, this index {self.dim}")
        vecs = np.asarray(state["vectors"], np.float32).reshape(-1, self.dim)
        ids = [str(d) for d in state["docids"]]
        if len(ids) != len(vecs):
            raise ValueError("index state: docids and vectors differ in length")
        self._vectors = {d: v.copy() for d, v in zip(ids, vecs)}
        self.mode = str(state["mode"])
        self._baseline = state.get("baseline")
        self.rebalances = int(state.get("rebalances", 0))
        self.rebuilds = int(state.get("rebuilds", 0))
        files: dict[str, bytes] = state.get("scann_files") or {}
        if not files:
            self._searcher = None
            if self._vectors:
                self._build()
            return
        order = [str(d) for d in state["scann_docids"]]
        if set(order) != set(ids):
            raise ValueError("index state: ScaNN docids differ from the stored vectors")
        scann = _scann()
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in files.items():
                if os.path.basename(name) != name:
                    raise ValueError(f"index state: bad artifact name {name!r}")
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            loaded = scann.load_searcher(tmp)
        self._searcher = scann.ScannSearcher(loaded.searcher, docids=order)
        if self.cfg.num_threads:
            self._searcher.set_num_threads(int(self.cfg.num_threads))
