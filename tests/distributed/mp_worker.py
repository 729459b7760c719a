"""One process of the multi-process CPU test (launched by tests/distributed/test_multiprocess.py).

Usage: ``python tests/distributed/mp_worker.py OUT_DIR STORE_DIR``. With ``PMD_COORDINATOR``,
``PMD_NUM_PROCESSES`` and ``PMD_PROCESS_ID`` set it joins a ``jax.distributed`` job through
:func:`pmd_jax.run.distributed.maybe_initialize`; without them it runs alone. Either way it builds a
``(data=1, fsdp=2, tensor=2)`` mesh over *all* global devices (``XLA_FLAGS`` in the caller's
environment sets the fake CPU device count), initialises the ``tiny-llama`` preset from a fixed
seed, runs two SDPO train steps of :class:`pmd_jax.distill.step.TrainStep` on a fixed global
batch, publishes a few trained parameters to a :class:`WeightStore` (every process writes its
own shards) and writes ``OUT_DIR/result_p<process index>.npz`` with the per-step metrics, the
gathered (full) trained parameters, the read-back store arrays and the mesh layout.

This is a script, not a test module: nothing here is collected by pytest.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

from pmd_jax.distill import align
from pmd_jax.distill import step as st
from pmd_jax.distill.batch import make_batch
from pmd_jax.distill.config import default_distill_config, freeze_distill_config
from pmd_jax.models import decoder
from pmd_jax.models.config import preset
from pmd_jax.run import distributed
from pmd_jax.run import sharding as shd

BATCH = 4
STEPS = 2
MESH_SHAPE = {"data": 1, "fsdp": 2, "tensor": 2}
# Trained parameters published to the weight store: sharded over fsdp (which spans the two
# processes) and/or tensor, so each process owns part of every array.
PUBLISH = {
    "embed": ("embed",),
    "layers.q": ("layers", "q"),
    "layers.down": ("layers", "down"),
    "final_norm": ("final_norm",),
}


def global_batch(vocab: int) -> dict[str, np.ndarray]:
    """The same global batch on every process (fixed numpy seed)."""
    r = np.random.default_rng(1234)
    sp = [r.integers(1, vocab, r.integers(3, 7)) for _ in range(BATCH)]
    tp = [r.integers(1, vocab, r.integers(5, 11)) for _ in range(BATCH)]
    rs = [r.integers(1, vocab, r.integers(3, 8)) for _ in range(BATCH)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=0, pad_to_multiple=4)
    return make_batch(
        db,
        sd_mask=np.array([1, 1, 0, 1], np.float32),
        sampler_logp=r.uniform(-12.0, -8.0, db.responses.shape).astype(np.float32),
    )


def _get(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


def main(out_dir: str, store_dir: str) -> None:
    t0 = time.time()
    multi = distributed.maybe_initialize()
    pid, nproc = jax.process_index(), jax.process_count()
    from jax.experimental import multihost_utils

    from pmd_jax.sampling.weight_store import WeightStore

    mesh = shd.make_mesh(MESH_SHAPE)
    rules = shd.ShardingRules.from_mapping()
    mcfg = preset("tiny-llama")
    dcfg = default_distill_config()
    dcfg.optim.lr = 1e-3
    dcfg.optim.warmup_steps = 0
    dcfg.loss.topk = 16
    dcfg.loss.chunk_size = 4
    trainer = st.TrainStep(mcfg, freeze_distill_config(dcfg), mesh=mesh, rules=rules)

    # Host (numpy) params from a fixed key: identical on every process.
    params = jax.tree.map(np.asarray, decoder.init_params(mcfg, jax.random.PRNGKey(0)))
    state = trainer.init(params, 0)

    host_batch = global_batch(mcfg.vocab_size)
    shardings = trainer.batch_shardings(host_batch)
    batch = {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
        for k, v in host_batch.items()
    }
    metrics = []
    for _ in range(STEPS):
        state, m = trainer.step(state, batch)
        metrics.append({k: np.asarray(v) for k, v in m.items()})

    full = multihost_utils.process_allgather(state.params, tiled=True)
    out: dict[str, np.ndarray] = {}
    for i, m in enumerate(metrics):
        for k, v in m.items():
            out[f"metric/{i}/{k}"] = v
    for (path, leaf), init in zip(jax.tree_util.tree_leaves_with_path(full),
                                  jax.tree.leaves(params), strict=True):
        key = "/".join(str(getattr(p, "key", p)) for p in path)
        out["param/" + key] = np.asarray(leaf)
        # how far training moved this tensor (the comparison is not between two no-ops)
        out["update_max/" + key] = np.max(np.abs(np.asarray(leaf, np.float64) - init))
    out["mesh_process"] = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(
        mesh.devices
    )
    out["num_processes"] = np.int64(nproc)
    out["num_devices"] = np.int64(jax.device_count())

    # Weight store: every process writes the shards it owns (replica 0); process 0 commits.
    arrays = {name: _get(state.params, path) for name, path in PUBLISH.items()}
    for name, a in arrays.items():
        owned = sum(1 for s in a.addressable_shards if s.replica_id == 0)
        out[f"owned_shards/{name}"] = np.int64(owned)
    store = WeightStore(store_dir, timeout_s=120.0)
    store.publish(arrays, version=STEPS, step=STEPS)
    if multi:
        multihost_utils.sync_global_devices("pmd_mp_worker_published")
    read, manifest = store.read(STEPS)
    for name, a in read.items():
        out[f"store/{name}"] = a
    out["store_processes"] = np.int64(manifest.extra.get("processes", 0))

    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".result_p{pid}.npz")
    np.savez(tmp, **out)
    os.replace(tmp, os.path.join(out_dir, f"result_p{pid}.npz"))
    print(f"[mp_worker p{pid}/{nproc}] done in {time.time() - t0:.1f}s", flush=True)
    if multi:
        # Nobody leaves before everybody wrote its result (the coordinator lives in process 0).
        multihost_utils.sync_global_devices("pmd_mp_worker_done")
        jax.distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python tests/distributed/mp_worker.py OUT_DIR STORE_DIR")
    main(sys.argv[1], sys.argv[2])
