"""Publishing: hand the trainer's current weights to the sampler, as version ``step``.

The sampler says how it takes weights (``Sampler.share_weights()``, see ``base.py``):

* ``"in_process"``: the param arrays themselves, ``sampler.set_params(params, step)``;
* ``"store"``: a version of the tensorstore weight store (HF-named arrays, the layout of
  ``weight_store.py``) that the sampler then loads, ``sampler.set_weights(step)``.

One ``WeightStore`` is kept per store URL for the life of the process (it holds the open
kvstore and the transfer history).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pmd_jax.models.hf_io import iter_hf_tensors
from pmd_jax.sampling.base import WEIGHT_SHARING, Sampler, SamplerError
from pmd_jax.sampling.weight_store import WeightStore

# One store per URL, opened on first publish.
_STORES: dict[str, Any] = {}


def publish(sampler: Sampler, params: Any, *, step: int, model_cfg: Any,
            weight_store_url: str, copy: bool = False) -> None:
    """Hand ``params`` (the ``models.decoder`` param tree) to ``sampler`` as version ``step``.

    In process the sampler may get the train state's own arrays, which the next (donating)
    train step deletes; ``copy=True`` gives it a copy it keeps while training runs
    (rollout.overlap samples during the train step). ``model_cfg`` names the arrays for the
    store (HF names and layout); ``weight_store_url`` is the store's root. Both are unused
    by in-process samplers.
    """
    mode = sampler.share_weights()
    fn = _PUBLISHERS.get(mode)
    if fn is None:
        raise SamplerError(
            f"{type(sampler).__name__}.share_weights() returned {mode!r}; "
            f"expected one of {WEIGHT_SHARING}")
    fn(sampler, params, int(step), model_cfg, weight_store_url, copy)


def _in_process(sampler: Sampler, params: Any, step: int, model_cfg: Any,
                weight_store_url: str, copy: bool) -> None:
    sampler.set_params(params, version=step, copy=copy)


def _through_store(sampler: Sampler, params: Any, step: int, model_cfg: Any,
                   weight_store_url: str, copy: bool) -> None:
    url = weight_store_url
    store = _STORES.get(url) or _STORES.setdefault(url, WeightStore(url))
    store.publish(dict(iter_hf_tensors(params, model_cfg)), version=step, step=step)
    sampler.set_weights(step)


_PUBLISHERS: dict[str, Callable[[Sampler, Any, int, Any, str, bool], None]] = {
    "in_process": _in_process,
    "store": _through_store,
}
