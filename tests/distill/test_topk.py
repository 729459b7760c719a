"""The two-stage top-K (pmd_jax/distill/topk.py): the same values and indices as lax.top_k,
ties and clustered winners included, and a program whose per-row top-Ks are on blocks and
candidates (the full-vocabulary one only in the fallback branch)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

from pmd_jax.distill import losses
from pmd_jax.distill import topk as T
from pmd_jax.distill.config import (
    DistillConfigError,
    default_distill_config,
    freeze_distill_config,
    loss_config,
    validate_distill_config,
)


def _same(x: jax.Array, k: int, **kw) -> tuple[jax.Array, jax.Array]:
    """Asserts two_stage_top_k(x, k) == lax.top_k(x, k) bit for bit; returns the result."""
    v0, i0 = lax.top_k(x, k)
    v1, i1 = jax.jit(lambda a: T.two_stage_top_k(a, k, **kw))(x)
    assert v1.dtype == v0.dtype and v1.shape == v0.shape
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i0))
    # bitwise values (signed zeros, NaN payloads)
    np.testing.assert_array_equal(np.asarray(v1).view(np.uint32), np.asarray(v0).view(np.uint32))
    return v1, i1


def _unsure(x: jax.Array, k: int, block: int, per_block: int = T.PER_BLOCK) -> bool:
    """Whether the two-stage program takes its lax.top_k fallback for x (read from the
    candidates the same way, so a test can say which branch it exercised)."""
    parts = T._two_stage_check(x, k, block, per_block)
    assert parts is not None, "a shape the two stages do not run on"
    return bool(parts[2])


def _logits(seed: int, shape: tuple[int, ...], scale: float = 3.0) -> jax.Array:
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("k", [1, 5, 16, 17, 40, 100])
@pytest.mark.parametrize("vocab", [3000, 4096])  # not / a multiple of the block
def test_random_logits_equal_lax_top_k(k, vocab):
    x = _logits(k + vocab, (3, 4, vocab))
    _same(x, k, block=128)  # 23 / 32 blocks
    assert not _unsure(x, k, 128)  # the two-stage answer itself, no fallback


def test_default_block_at_a_real_vocab_size():
    x = jax.nn.log_softmax(_logits(0, (2, 3, 49152)))  # SmolLM2's vocabulary, 48 blocks
    _same(x, 100)
    assert not _unsure(x, 100, T.BLOCK)


@pytest.mark.parametrize("k", [3, 16, 20, 100])
def test_ties_many_equal_values_and_all_equal_rows(k):
    r = np.random.default_rng(1)
    few = jnp.asarray(r.integers(0, 4, (4, 2000)), jnp.float32)  # ~500 copies of each value
    _same(few, k, block=128)
    _same(jnp.zeros((3, 2000), jnp.float32), k, block=128)
    _same(jnp.full((2, 2000), -jnp.inf, jnp.float32), k, block=128)
    assert _unsure(jnp.zeros((3, 2000), jnp.float32), k, 128) == (k > T.PER_BLOCK)


def test_tie_at_the_boundary_takes_the_fallback():
    # winners spread out, but the k-th value is also a block's 16th candidate: a lower index
    # of equal value may have been cut, so the fallback must run (">=", not ">")
    x = np.zeros((1, 4096), np.float32)
    nb = T.block_layout(4096, 256)[0]  # 16 strided blocks
    x[0, np.arange(0, 40 * nb, nb)] = 1.0  # 40 ones in block 0 (indices 0, nb, 2nb, ...)
    _same(jnp.asarray(x), 40, block=256)
    assert _unsure(jnp.asarray(x), 40, 256)


def test_clustered_winners_take_the_fallback():
    vocab, k = 4096, 100
    nb = T.block_layout(vocab, 256)[0]
    x = np.array(_logits(2, (2, vocab)))
    x[0, 5 + nb * np.arange(k)] += 100.0  # all k winners in one strided block
    x[1, 7 + nb * np.arange(20)] += 100.0  # 20 in one block, more than its 16 candidates
    x = jnp.asarray(x)
    _same(x, k, block=256)
    assert _unsure(x, k, 256)
    _same(x, 16, block=256)  # k <= 16: a block cannot hold more winners than it gives
    assert not _unsure(x, 16, 256)


def test_contiguous_runs_of_winners_stay_on_the_two_stage_path():
    # BPE puts frequent tokens at low ids: winners in a contiguous run spread over the strided
    # blocks (at most ceil(100 / nb) per block), so no fallback
    x = np.array(_logits(3, (2, 8192)))
    x[:, :100] += 50.0
    _same(jnp.asarray(x), 100, block=256)
    assert not _unsure(jnp.asarray(x), 100, 256)


def test_nan_and_signed_zeros_equal_lax_top_k():
    x = np.array(_logits(4, (4, 3000)))
    x[0, 17] = np.nan
    x[1, :] = -np.float32(np.nan)  # x86's default NaN is negative: lax.top_k puts it last
    x[2, ::2] = -0.0
    x[2, 1::2] = 0.0
    x[3, 2990:] = -np.inf
    for k in (4, 50):
        _same(jnp.asarray(x), k, block=256)


def test_shapes_too_small_to_gain_are_lax_top_k():
    x = _logits(5, (2, 300))
    _same(x, 10)  # one block
    _same(x, 100, block=64)  # 5 blocks x 16 candidates < k
    with pytest.raises(ValueError, match="k=0"):
        T.two_stage_top_k(x, 0)


def test_top_k_dispatch_and_indices_fn():
    x = _logits(6, (3, 5000))
    for impl in T.TOP_K_IMPLS:
        v, i = T.top_k(x, 30, impl)
        v0, i0 = lax.top_k(x, 30)
        np.testing.assert_array_equal(np.asarray(i), np.asarray(i0))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v0))
        got = T.topk_indices_fn(impl)(x, 30)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(i0))
    with pytest.raises(ValueError, match="top-K implementation"):
        T.top_k(x, 3, "heap")


# ------------------------------------------------------------------ the program's structure
def _top_k_ops(text: str) -> list[tuple[str, int]]:
    """(operand type, k) of every chlo.top_k in a StableHLO text (plain or composite)."""
    ops = [(m.group(2), int(m.group(1))) for m in re.finditer(
        r"chlo\.top_k\(%[\w#:]+, k = (\d+)\) : tensor<([\dx]+)xf32>", text)]
    ops += [(m.group(2), int(m.group(1))) for m in re.finditer(
        r'composite "chlo\.top_k" %[\w#:]+ \{composite_attributes = \{k = (\d+) : i64\}.*?'
        r": \(tensor<([\dx]+)xf32>", text)]
    return ops


def _case_regions(text: str) -> list[str]:
    """The text of every stablehlo.case op (its regions), by brace depth."""
    out = []
    for m in re.finditer(r'"stablehlo\.case"', text):
        depth, i = 0, text.index("({", m.end())
        start = i
        while True:
            c = text[i]
            depth += c in "({"
            depth -= c in ")}"
            i += 1
            if depth == 0:
                break
        out.append(text[start:i])
    return out


SHAPE = jax.ShapeDtypeStruct((2, 48, 128256), jnp.float32)  # Llama-3's vocabulary


def test_two_stage_program_takes_top_k_of_blocks_and_candidates():
    text = jax.jit(lambda x: T.top_k(x, 100, "two_stage")).lower(SHAPE).as_text()
    nb, length = T.block_layout(128256)  # 126 blocks of 1,018
    ops = _top_k_ops(text)
    assert sorted(ops) == sorted([(f"2x48x{nb}x{length}", 16), (f"2x48x{nb * 16}", 100),
                                  ("2x48x128256", 100)]), ops
    cases = _case_regions(text)
    assert len(cases) == 1
    # the full-vocabulary top-K is only the fallback branch's; nothing else sorts the vocab
    assert _top_k_ops(cases[0]) == [("2x48x128256", 100)]
    for m in re.finditer(r'"stablehlo\.sort".*?: \((tensor<[^)]*)\)', text):
        assert "128256" not in m.group(1) and f"{nb * 16}" in m.group(1)


def test_auto_is_two_stage_when_lowered_for_gpu_and_lax_top_k_on_cpu():
    f = jax.jit(lambda x: T.top_k(x, 100, "auto"))
    cuda = export.export(f, platforms=["cuda"])(SHAPE).mlir_module()
    nb, length = T.block_layout(128256)
    assert (f"2x48x{nb}x{length}", 16) in _top_k_ops(cuda)
    cpu = f.lower(SHAPE).as_text()
    assert _top_k_ops(cpu) == [("2x48x128256", 100)]
    small = export.export(jax.jit(lambda x: T.top_k(x, 16, "auto")), platforms=["cuda"])(SHAPE)
    assert _top_k_ops(small.mlir_module()) == [("2x48x128256", 16)]  # XLA:GPU's own kernel


def _computations(hlo: str) -> dict[str, str]:
    """Name -> body of every computation of a compiled HLO module's text."""
    out = {}
    for m in re.finditer(r"^(?:ENTRY )?%([\w.\-]+) .*?\{\n(.*?)^\}", hlo, re.M | re.S):
        out["ENTRY" if hlo[m.start():].startswith("ENTRY") else m.group(1)] = m.group(2)
    return out


def _sorted_lengths(body: str) -> list[int]:
    """The row length of every sort and TopK custom call of a computation body (a TopK's
    operand is looked up by name in the body; its own shape is the result's)."""
    shapes = dict(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]", body, re.M))
    params = re.findall(r"%([\w.\-]+): \w+\[([\d,]*)\]", body)
    shapes.update(params)
    out = []
    for line in body.splitlines():
        if " sort(" in line:
            m = re.search(r"= \(\w+\[([\d,]+)\]", line)
            assert m is not None, line
            out.append(int(m.group(1).split(",")[-1]))
        elif 'custom_call_target="TopK"' in line:
            m = re.search(r"custom-call\(%([\w.\-]+)\)", line)
            assert m is not None, line
            out.append(int(shapes[m.group(1)].split(",")[-1]))
    return out


def test_compiled_cpu_program_sorts_blocks_and_candidates_outside_the_fallback():
    hlo = jax.jit(lambda x: T.top_k(x, 100, "two_stage")).lower(SHAPE).compile().as_text()
    comps = _computations(hlo)
    nb, length = T.block_layout(128256)
    entry = comps["ENTRY"]
    assert sorted(set(_sorted_lengths(entry))) == sorted({length, nb * 16})
    assert 'custom_call_target="TopK"' in entry  # the block top-16 is XLA:CPU's TopK
    branches = re.search(r"conditional\(.*branch_computations=\{([^}]*)\}", entry).group(1)
    names = [b.strip().lstrip("%") for b in branches.split(",")]
    # the one computation that sorts (or TopKs) with the vocabulary in it: a fallback branch
    full = [n for n, body in comps.items() if n != "ENTRY" and _sorted_lengths(body)
            and ",128256]" in body]
    assert len(full) == 1 and full[0] in names


# ------------------------------------------------------------------ wiring
def test_config_knob_validated_and_passed_to_the_loss():
    c = default_distill_config()
    assert c.loss.top_k_impl == "auto"
    c.loss.top_k_impl = "two_stage"
    assert loss_config(freeze_distill_config(c)).top_k_impl == "two_stage"
    c.loss.top_k_impl = "heap"
    with pytest.raises(DistillConfigError, match="loss.top_k_impl"):
        validate_distill_config(freeze_distill_config(c))
    with pytest.raises(ValueError, match="top-K implementation"):
        losses.DistillLossConfig(top_k_impl="heap").validate()


def test_student_argmax_is_the_top_k_first_index():
    r = np.random.default_rng(7)
    s = jnp.asarray(r.integers(0, 3, (3, 5, 500)), jnp.float32)  # many ties for the max
    t = jnp.asarray(r.integers(0, 3, (3, 5, 500)), jnp.float32)
    tok = jnp.asarray(r.integers(0, 500, (3, 5)), jnp.int32)
    cfg = losses.DistillLossConfig(topk=20)
    st = losses.token_distill_stats(s, t, tok, cfg)
    want = (jnp.argmax(s, -1) == jnp.argmax(t, -1)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(st["top1_agree"]), np.asarray(want))


@pytest.mark.parametrize("k", [5, 64])
def test_vocab_sharded_top_k_with_two_stage_slices(k, monkeypatch):
    from pmd_jax.distill.sharded_topk import make_topk_indices
    from pmd_jax.run import sharding as shd
    from tests.host import need_devices

    monkeypatch.setattr(T, "BLOCK", 128)  # a slice of 1,024: 8 strided blocks
    mesh = shd.make_mesh({"data": 2, "fsdp": 1, "tensor": 4}, devices=need_devices(8))
    fn = jax.jit(make_topk_indices(mesh, shd.ShardingRules.from_mapping(), impl="two_stage"),
                 static_argnums=1)
    x = _logits(k, (8, 3, 4096))
    x = x.at[:2, :, :200].add(10.0)  # winners clustered in the first shard's low ids
    text = fn.lower(x, k).as_text()
    assert "x8x128xf32" in text  # each shard's [.., 8, 128] blocks
    np.testing.assert_array_equal(np.asarray(fn(x, k)), np.asarray(lax.top_k(x, k)[1]))
    with pytest.raises(ValueError, match="top-K implementation"):
        make_topk_indices(mesh, shd.ShardingRules.from_mapping(), impl="heap")


def test_bench_topk_runs_on_a_tiny_shape(capsys):
    from benchmarks import bench_topk

    bench_topk.timing(rows=4, vocab=5000, k=20, repeats=1)
    bench_topk.clustering(np.asarray(_logits(8, (6, 5000))), block=1024)
    out = capsys.readouterr().out
    assert "equal: True" in out and "fallback taken: False" in out
    assert "K=100 strided" in out and "contiguous" in out
