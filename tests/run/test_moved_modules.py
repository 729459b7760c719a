"""Checkpoints written before the root modules moved into folders (issue 38) still load: their
pickles name classes by the old module paths (``pmd_jax.rollout.StepBatch`` in the prefetch
slot), which ``run.slots.load_pickle`` maps to the new ones."""

import io
import pickle
import pickletools

import numpy as np

from pmd_jax.loop.rollout import StepBatch
from pmd_jax.run.slots import MOVED_MODULES, load_pickle


def test_an_old_pickle_of_a_step_batch_loads():
    sb = StepBatch([{"id": 1}], [[1, 2]], None, ["t"], np.zeros((1, 1)), [], step=3)
    # protocol 2 names a class in a GLOBAL opcode ("module\nname\n", no frame lengths), so
    # the old module path can be written in as an older checkpoint has it
    data = pickle.dumps(sb, protocol=2)
    assert b"pmd_jax.loop.rollout\nStepBatch" in data
    old = data.replace(b"pmd_jax.loop.rollout\n", b"pmd_jax.rollout\n")
    assert b"pmd_jax.loop" not in old
    pickletools.dis(old, out=io.StringIO())  # a well-formed pickle
    back = load_pickle(old)
    assert type(back) is StepBatch and back.step == 3 and back.texts == ["t"]


def test_every_moved_module_exists_where_it_went():
    import importlib

    for new in MOVED_MODULES.values():
        importlib.import_module(new)
