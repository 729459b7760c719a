"""Writes the XLA:GPU HLO fixtures of tests/dry_run/test_gpu_facts.py: small programs compiled
by XLA:GPU for an H100 without a device (the CUDA PJRT plugin, see
pmd_jax/dry_run/gpu_compile.py), as ``compiled.as_text()`` prints them. Run from the
repository root with a python that has the plugin::

    JAX_PLATFORMS=cpu PYTHONPATH=. /tmp/cudavenv/bin/python \\
        tests/dry_run/gpu_fixtures/make_fixtures.py

* ``topk100.hlo``: a bf16 x bf16 -> f32 head over a 32768 vocabulary, lax.top_k k=100 of
  it, and its gradient (the head's backward through the f32 logits);
* ``topk16.hlo``: the same with k=16 (XLA:GPU's TopK kernel range);
* ``topk_fallback.hlo``: top-16 per block of 1024, and top-100 of the whole axis only in a
  ``lax.cond`` branch;
* ``attn_mask.hlo`` / ``attn_seqlen.hlo``: the gradient of cuDNN attention (bf16, causal)
  with the key padding as a boolean mask, and as sequence lengths.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from pmd_jax.dry_run import gpu_compile as gc

HERE = Path(__file__).parent
VOCAB = 32768


def head_topk(k: int):
    def f(x, w):
        y = jnp.einsum("bd,dv->bv", x, w, preferred_element_type=jnp.float32)
        return jax.lax.top_k(y, k)[0].sum() + jax.nn.logsumexp(y, axis=-1).sum()

    return jax.grad(f, argnums=(0, 1))


def topk_fallback(x):
    """top_k k=16 per block of 1024 in every run; top_k k=100 over the whole axis only in a
    lax.cond branch (as an exact fallback)."""
    blocks = jax.lax.top_k(x.reshape(x.shape[0], -1, 1024), 16)[0].reshape(x.shape[0], -1)
    fast = jax.lax.top_k(blocks, 100)[0]
    unsure = jnp.any(blocks[:, 15::16] >= fast[:, -1:])
    return jax.lax.cond(unsure, lambda: jax.lax.top_k(x, 100)[0], lambda: fast)


def attention(mask: bool):
    def f(q, k, v, m):
        if mask:
            bias_mask = jnp.broadcast_to(m[:, None, None, :], (2, 1, 256, 256))
            o = jax.nn.dot_product_attention(q, k, v, mask=bias_mask, is_causal=True,
                                              implementation="cudnn")
        else:
            o = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=m,
                                             key_value_seq_lengths=m, is_causal=True,
                                             implementation="cudnn")
        return o.astype(jnp.float32).sum()

    return jax.grad(f, argnums=(0, 1, 2))


def main() -> None:
    model = gc.GPU_MODELS["8xH100"]
    with gc.gpu_tracing(model):
        dev = gc.compile_only_devices(model, 1)[0]
        s = NamedSharding(jax.sharding.Mesh([dev], ("d",)), PartitionSpec())

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=s)

        x, w = sds((8, 64), jnp.bfloat16), sds((64, VOCAB), jnp.bfloat16)
        q = sds((2, 256, 4, 64), jnp.bfloat16)
        programs = {
            "topk100.hlo": (head_topk(100), (x, w)),
            "topk16.hlo": (head_topk(16), (x, w)),
            "topk_fallback.hlo": (topk_fallback, (sds((8, VOCAB), jnp.float32),)),
            "attn_mask.hlo": (attention(True), (q, q, q, sds((2, 256), jnp.bool_))),
            "attn_seqlen.hlo": (attention(False), (q, q, q, sds((2,), jnp.int32))),
        }
        for name, (fn, args) in programs.items():
            text = jax.jit(fn).lower(*args).compile().as_text()
            (HERE / name).write_text(text)
            print(name, len(text))


if __name__ == "__main__":
    main()
