"""sampling.publish: the weights reach the sampler the way it says (share_weights()), in
process (set_params, with or without a copy) or through a tensorstore version (set_weights)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pmd_jax.models import decoder, hf_io
from pmd_jax.sampling import publish as publish_mod
from pmd_jax.sampling.base import Sampler, SamplerError, SamplingParams
from pmd_jax.sampling.jax_sampler import JaxSampler
from pmd_jax.sampling.publish import publish
from pmd_jax.sampling.vllm_client import VLLMSampler
from pmd_jax.sampling.weight_store import WeightStore
from tests.fakes import FakeSampler, tiny_model_config

TINY = tiny_model_config("sampler")


@pytest.fixture(autouse=True)
def fresh_stores(monkeypatch):
    monkeypatch.setattr(publish_mod, "_STORES", {})


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(TINY, jax.random.PRNGKey(0))


def test_fake_sampler_is_a_sampler():
    assert isinstance(FakeSampler("in_process"), Sampler)


@pytest.mark.parametrize("copy", [False, True])
def test_in_process_hands_the_arrays_over(tmp_path, params, copy):
    s = FakeSampler("in_process")
    url = str(tmp_path / "never")
    publish(s, params, step=np.int64(4), model_cfg=TINY, weight_store_url=url, copy=copy)
    assert len(s.calls) == 1
    name, (got, version, got_copy) = s.calls[0]
    assert name == "set_params" and got is params and got_copy is copy
    assert version == 4 and type(version) is int
    assert not (tmp_path / "never").exists() and publish_mod._STORES == {}


def test_store_publishes_a_version_then_loads_it(tmp_path, params):
    s = FakeSampler("store")
    url = str(tmp_path / "w")
    publish(s, params, step=3, model_cfg=TINY, weight_store_url=url)
    assert s.calls == [("set_weights", 3)]
    arrays, manifest = WeightStore(url).read(3)
    assert manifest.version == 3 and manifest.step == 3
    want = {k: np.asarray(v) for k, v in hf_io.iter_hf_tensors(params, TINY)}
    assert sorted(arrays) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(arrays[k], v)
    # the store is opened once per URL; garbage collection keeps the newest two versions
    store = publish_mod._STORES[url]
    for step in (4, 5):
        publish(s, params, step=step, model_cfg=TINY, weight_store_url=url)
    assert publish_mod._STORES == {url: store}
    assert store.list_versions() == [4, 5]
    assert s.calls[1:] == [("set_weights", 4), ("set_weights", 5)]


def test_unknown_sharing_is_refused(tmp_path, params):
    with pytest.raises(SamplerError, match="share_weights.*'shm'"):
        publish(FakeSampler("shm"), params, step=1, model_cfg=TINY,
                weight_store_url=str(tmp_path))


@pytest.mark.parametrize("unstack", [True, False])
def test_jax_sampler_copy_keeps_no_reference(params, unstack):
    """copy=True: the sampler owns its arrays (the caller donates its own next);
    copy=False: device arrays are used as they are."""
    s = JaxSampler(TINY, params, max_len=64, unstack_layers=unstack)
    assert s.share_weights() == "in_process"
    other = decoder.init_params(TINY, jax.random.PRNGKey(1))
    publish(s, other, step=2, model_cfg=TINY, weight_store_url="unused")
    assert s.weights_version == 2 and s.params["embed"] is other["embed"]
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    ref = [r.tokens.tolist() for r in s.generate([[1, 2, 3]], sp)]
    own = jax.tree.map(lambda x: x + 0, other)  # arrays this test may delete
    publish(s, own, step=3, model_cfg=TINY, weight_store_url="unused", copy=True)
    assert s.weights_version == 3
    assert not {id(x) for x in jax.tree.leaves(own)} & {id(x) for x in jax.tree.leaves(s.params)}
    for x in jax.tree.leaves(own):
        x.delete()
    assert [r.tokens.tolist() for r in s.generate([[1, 2, 3]], sp)] == ref


def test_vllm_sampler_takes_weights_through_the_store():
    s = VLLMSampler("http://127.0.0.1:9")
    assert s.share_weights() == "store"
    with pytest.raises(SamplerError, match="weight store"):
        s.set_params({}, 1)
