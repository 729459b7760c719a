"""attention_impl="auto" per backend (pmd_jax.models.attention_select): the rules, the
explicit values, and on CPU the very same program as before (same jaxpr, same bits)."""

from __future__ import annotations

import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import attend, decoder
from pmd_jax.models import attention_select as sel
from pmd_jax.models.config import ATTENTION_IMPLS, ConfigError, ModelConfig
from tests.models.test_attention_fused import OLMO

H100 = "9.0"
A100 = "8.0"


def call(backend="gpu", T=1024, S=None, dtype="bfloat16", head_dim=128, cc=H100, **kw):
    return sel.AttentionCall(backend=backend, T=T, S=T if S is None else S, dtype=dtype,
                             head_dim=head_dim, gpu_compute_capability=cc, **kw)


FLAGS = dict(has_cache=(False, True), key_padding=(False, True), segments=(False, True),
             shared_prefix=(False, True))


def test_cpu_auto_is_the_rule_of_before_for_every_call():
    for T, S in [(1, 100_000), (64, 64), (1024, 1024), (1024, 1025), (4096, 4096), (37, 37)]:
        for vals in itertools.product(*FLAGS.values()):
            for dtype in ("float32", "bfloat16"):
                c = call("cpu", T, S, dtype, cc=None, **dict(zip(FLAGS, vals)))
                got = sel.select("auto", c)
                assert got.impl == ("chunked" if T * S > 1024 ** 2 else "dense"), (T, S, vals)
                assert got.impl == sel.legacy_rule(T, S)


def test_gpu_rules():
    assert sel.select("auto", call()).impl == "cudnn"
    assert sel.select("auto", call(backend="cuda")).impl == "cudnn"
    assert sel.select("auto", call(key_padding=True, segments=True, shared_prefix=True)
                      ).impl == "cudnn"
    for c, why in [
        (call(dtype="float32"), "bf16/fp16"),
        (call(head_dim=60), "multiple of 8"),
        (call(head_dim=192, cc=A100), "<= 128"),
        (call(T=1026, S=1026, cc=None), "CUDA GPU"),
        (call(T=1025, key_padding=True), "even lengths"),
        (call(T=100), "T=100 < 128"),
        (call(has_cache=True), "KV cache"),
    ]:
        got = sel.select("auto", c)
        assert got.impl == sel.legacy_rule(c.T, c.S), (c, got)
        assert why in got.reason, (why, got.reason)
    assert sel.select("auto", call(head_dim=192, cc=H100)).impl == "cudnn"  # Hopper: <= 256
    assert sel.select("auto", call(T=1025)).impl == "cudnn"  # odd length without a mask
    assert sel.select("auto", call(T=4096, dtype="float32")).impl == "chunked"


def test_tpu_rules():
    tpu = dict(backend="tpu", cc=None, dtype="float32")
    assert sel.select("auto", call(**tpu)).impl == "splash"  # fp32 is fine on TPU
    got = sel.select("auto", call(key_padding=True, segments=True, **tpu))
    assert got.impl == "splash" and "packed segments" in got.reason
    got = sel.select("auto", call(T=4096, segments=True, shared_prefix=True, **tpu))
    assert got.impl == "chunked" and "shared-prefix" in got.reason
    assert sel.select("auto", call(T=64, **tpu)).impl == "dense"
    assert sel.select("auto", call(has_cache=True, T=1, S=8192, **tpu)).impl == "dense"


def test_explicit_values():
    assert set(sel.FUSED_IMPLS) < set(ATTENTION_IMPLS)
    for impl in ("dense", "chunked"):
        assert sel.select(impl, call(backend="tpu", has_cache=True)).impl == impl
    assert sel.select("cudnn", call(T=16)).impl == "cudnn"  # below auto's 128 queries
    assert sel.select("cudnn_xla", call("cpu", dtype="float32", cc=None)).impl == "cudnn_xla"
    # a cache turns every implementation into the rule of before (the sampler's passes)
    for impl in sel.FUSED_IMPLS:
        assert sel.select(impl, call(has_cache=True, T=1, S=512)).impl == "dense"
    with pytest.raises(ConfigError, match="cuDNN needs a CUDA GPU"):
        sel.select("cudnn", call("cpu", cc=None))
    with pytest.raises(ConfigError, match="bf16/fp16"):
        sel.select("cudnn", call(dtype="float32"))
    with pytest.raises(ConfigError, match="shared-prefix"):
        sel.select("splash", call(backend="tpu", segments=True, shared_prefix=True))
    assert "interpret" in sel.select("splash", call("cpu", cc=None)).reason
    with pytest.raises(ConfigError, match="attention_impl='flash'"):
        sel.select("flash", call())
    base = dict(family="llama", vocab_size=11, hidden_size=8, intermediate_size=8,
                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    for impl in ATTENTION_IMPLS:
        assert ModelConfig(**base, attention_impl=impl).attention_impl == impl


def test_cudnn_head_dim_limit_by_compute_capability():
    assert sel.cudnn_max_head_dim("8.0") == 128
    assert sel.cudnn_max_head_dim("9.0") == 256
    assert sel.cudnn_max_head_dim("10.0") == 256
    assert sel.cudnn_max_head_dim(None) == 128


# ------------------------------------------------------------------ CPU: the same program
# the fused-attention tests' model: OLMo-3 layers with a sliding window and GQA
CFG = OLMO


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path of auto")
@pytest.mark.parametrize("case", ["short_padded", "long_chunked", "segments", "cache"])
def test_cpu_auto_is_the_same_program_and_bits(case):
    """On CPU, auto traces to the jaxpr of the implementation the rule of before picks, and
    gives the same bits."""
    cfg = CFG.replace(attention_chunk=256)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    T = 1040 if case == "long_chunked" else 24  # 1040^2 > 1024^2: chunked
    B = 2
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3]]))
    pos = decoder.positions_from_mask(mask)
    kw: dict = {"attn_mask": mask}
    if case == "segments":
        kw["segment_ids"] = jnp.asarray(np.arange(T)[None] >= np.array([[10], [15]]),
                                        jnp.int32)
    if case == "cache":
        kw["cache"] = decoder.init_cache(cfg, B, 40, jnp.float32)
    S = 40 if case == "cache" else T
    before = sel.legacy_rule(T, S)

    def fwd(impl):
        return lambda p, t, q: decoder.forward(p, t, q, cfg, attention_impl=impl, **kw)[0]

    j_auto = jax.make_jaxpr(fwd("auto"))(params, tokens, pos)
    j_before = jax.make_jaxpr(fwd(before))(params, tokens, pos)
    assert str(j_auto) == str(j_before)
    got = attend.choose(cfg, "auto", T=T, S=S, has_cache=case == "cache", key_padding=True,
                        segments=case == "segments", shared_prefix=False)
    assert got.impl == before
    a = np.asarray(jax.jit(fwd("auto"))(params, tokens, pos))
    b = np.asarray(jax.jit(fwd(before))(params, tokens, pos))
    np.testing.assert_array_equal(a, b)


def test_choice_is_logged_once(caplog):
    attend._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="pmd_jax.models.attend"):
        for _ in range(3):
            attend.choose(CFG, "auto", T=16, S=16, has_cache=False, key_padding=True,
                          segments=False, shared_prefix=False, backend=("cpu", None))
        attend.choose(CFG.replace(dtype="bfloat16"), "auto", T=512, S=512, has_cache=False,
                      key_padding=True, segments=False, shared_prefix=False,
                      backend=("gpu", H100))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("attention: dense (auto on cpu")
    assert lines[1].startswith("attention: cudnn (auto on gpu")


def test_plan_lines_for_the_start_up_log():
    lines = attend.plan_lines(CFG, train_len=2048, shared_prefix=True)
    assert len(lines) == 2
    assert "train step at 2048 slots: chunked" in lines[0]
    assert "sampler (KV cache)" in lines[1]


def test_start_up_log_from_the_run_config(caplog):
    from pmd_jax.config import base_config, freeze
    from pmd_jax.loop.build import log_attention_plan

    c = base_config()
    c.rollout.max_prompt_tokens, c.rollout.max_tokens = 256, 768
    with caplog.at_level(logging.INFO, logger="pmd_jax"):
        log_attention_plan(freeze(c), CFG)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "train step at 1024 slots: dense" in lines[0], lines
