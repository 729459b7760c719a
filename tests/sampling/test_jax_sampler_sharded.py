"""JaxSampler on 8 fake CPU devices (batch over data/fsdp, params per rules) == unsharded."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from pmd_jax.models import decoder
from pmd_jax.run import sharding as sh
from pmd_jax.sampling.base import SamplingParams
from pmd_jax.sampling.jax_sampler import JaxSampler
from tests.fakes import tiny_model_config
from tests.host import need_devices

pytestmark = pytest.mark.devices(8)  # every mesh below has 8 devices (tests/host.py)

CFG = tiny_model_config("sampler")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [11],
           [30, 31, 32, 33, 34]]
SAMPLING = [
    SamplingParams(n=2, temperature=0.0, max_tokens=12),
    SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, seed=4,
                   stop_token_ids=(7, 9)),
]


@pytest.fixture(scope="module")
def reference():
    params = decoder.init_params(CFG, jax.random.PRNGKey(0))
    s = JaxSampler(CFG, params, max_len=128)
    return params, [s.generate(PROMPTS, sp) for sp in SAMPLING]


@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 8}])
def test_sharded_equals_unsharded(reference, shape):
    params, ref = reference
    mesh = sh.make_mesh(shape, devices=need_devices(8))
    rules = sh.ShardingRules.from_mapping()
    s = JaxSampler(CFG, params, mesh=mesh, rules=rules, max_len=128)
    # params really are laid out per the rules
    q = s.params["layers"][1]["q"]  # per-layer arrays (unstack_layers), layers axis dropped
    want = NamedSharding(mesh, rules.spec(decoder.param_axes(CFG)["layers"]["q"][1:]))
    assert q.sharding.is_equivalent_to(want, q.ndim)
    assert len(q.addressable_shards) == 8
    assert q.addressable_shards[0].data.shape != q.shape
    for sp, want in zip(SAMPLING, ref):
        got = s.generate(PROMPTS, sp)
        assert len(got) == len(want) == 8
        for g, w in zip(got, want):
            assert (g.prompt_index, g.sample_index) == (w.prompt_index, w.sample_index)
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
            assert g.finish_reason == w.finish_reason


@pytest.mark.parametrize("unstack", [False, True])
def test_set_params_with_sharded_arrays_does_not_copy(reference, unstack):
    params, ref = reference
    mesh = sh.make_mesh({"fsdp": 8}, devices=need_devices(8))
    rules = sh.ShardingRules.from_mapping()
    placed = sh.shard_tree(params, mesh, rules, decoder.param_axes(CFG))
    s = JaxSampler(CFG, placed, mesh=mesh, rules=rules, max_len=128, unstack_layers=unstack)
    assert s.params["embed"] is placed["embed"]
    if unstack:  # per-layer copies of the stacked arrays, the rest used as placed
        assert len(s.params["layers"]) == CFG.num_layers
    else:
        assert s.params["layers"]["gate"] is placed["layers"]["gate"]
    got = s.generate(PROMPTS, SAMPLING[0])
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in ref[0]]
