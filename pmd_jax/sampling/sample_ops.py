"""Pure sampling math: temperature, top-k / top-p filtering, seeded per-row sampling.

Everything here is a pure, jit-able function over arrays. Per-row settings (temperature, top_k,
top_p) are arrays broadcastable to ``[batch]`` so one compiled program serves every setting.

Conventions (shared with the trainer):

* ``temperature == 0`` means greedy (argmax of the raw logits); the returned log-probability
  is then ``log_softmax(logits)`` (T = 1), as ``SamplingParams`` documents.
* Returned log-probabilities are those of the *unfiltered* distribution at the sampling
  temperature, ``log_softmax(logits / T)[token]`` in float32: exactly what the trainer's
  forward computes for the same token. top-k / top-p only restrict which tokens can be drawn.
* Randomness is per row and depends only on ``(seed, prompt index, sample index, step)``, never
  on the batch layout, so padding, splitting a batch or sharding it gives the same draws.
* Grammar-constrained sampling masks the logits first (:func:`apply_token_bitmask`: forbidden
  tokens get ``-inf``), then samples as above: the returned log-probability is then that of
  the masked, renormalised distribution at the sampling temperature, and greedy is the argmax
  over the allowed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def safe_temperature(temperature: jax.Array) -> jax.Array:
    """Temperature used to scale logits: T, or 1 where T == 0 (greedy)."""
    t = jnp.asarray(temperature, jnp.float32)
    return jnp.where(t > 0, t, 1.0)


def scaled_log_probs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """``log_softmax(logits / T)`` in float32 over the last axis (T = 1 where T == 0).

    ``temperature`` broadcasts against ``logits.shape[:-1]``.
    """
    t = safe_temperature(temperature)
    x = logits.astype(jnp.float32) / t[..., None]
    return jax.nn.log_softmax(x, axis=-1)


def top_k_filter(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """Set to -inf every logit strictly below the row's k-th largest; ``k <= 0`` keeps all.

    Ties with the k-th largest value are kept (as HF's ``TopKLogitsWarper`` does).
    ``logits``: ``[..., V]``; ``top_k``: int broadcastable to ``logits.shape[:-1]``.
    """
    v = logits.shape[-1]
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), logits.shape[:-1])
    sorted_desc = -jnp.sort(-logits, axis=-1)
    idx = jnp.clip(k - 1, 0, v - 1)
    kth = jnp.take_along_axis(sorted_desc, idx[..., None], axis=-1)
    keep = (logits >= kth) | (k[..., None] <= 0) | (k[..., None] >= v)
    return jnp.where(keep, logits, NEG_INF)


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    A token is kept iff the total probability of the tokens ranked strictly before it (in
    descending order) is ``< top_p``; the most likely token is always kept and ties with the
    cut-off value are kept. ``top_p >= 1`` keeps all. Probabilities are ``softmax(logits)``
    of the logits given (apply temperature and top-k first).
    """
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), logits.shape[:-1])
    x = logits.astype(jnp.float32)
    sorted_desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < p[..., None]
    # the cut-off is the smallest kept logit; everything >= it is kept
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    cutoff = jnp.take_along_axis(sorted_desc, (n_keep - 1)[..., None], axis=-1)
    keep = (x >= cutoff) | (p[..., None] >= 1.0)
    return jnp.where(keep, logits, NEG_INF)


# filter_logits looks at the FAST_FILTER_K largest logits of each row (jax.lax.top_k) instead
# of sorting the vocabulary. On this project's 2-core CPU box, [64, 49152] float32 rows: the
# two sorts of top_k_filter + top_p_filter took 777 ms per decode step, lax.top_k(256) 12.5 ms.
FAST_FILTER_K = 256
# A batch where some row's nucleus does not end within its FAST_FILTER_K largest logits tries
# WIDE_FILTER_FACTOR times as many (lax.top_k(2048): 68 ms at 64 rows) before sorting: in a
# 64-row evaluation batch of the embedded default (T=0.6, top-p 0.95) most decode steps had
# such a row, and the sort took ~780 ms a step.
WIDE_FILTER_FACTOR = 8


def fast_filter(x: jax.Array, top_k: jax.Array, top_p: jax.Array,
                fast_k: int = FAST_FILTER_K) -> tuple[jax.Array, jax.Array]:
    """top-k then top-p of ``x`` [B, V] from the ``fast_k`` largest logits of each row.

    Returns ``(filtered, exact)``: ``exact`` [B] says the row's result is the one of
    :func:`top_k_filter` + :func:`top_p_filter` (up to float32 rounding of the mass sums):
    its k is off or <= ``fast_k``, and its nucleus ends within the ``fast_k`` largest (the
    mass before some of them reaches ``top_p``), or top-p is off, or no more than ``fast_k``
    tokens are left after top-k. Rows that are not exact must take the sorting path.
    """
    v = x.shape[-1]
    kk = min(int(fast_k), v)
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), x.shape[:-1])
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), x.shape[:-1])
    vals = jax.lax.top_k(x, kk)[0]  # descending
    k_on = (k > 0) & (k < v)
    kth = jnp.take_along_axis(vals, jnp.clip(k - 1, 0, kk - 1)[..., None], axis=-1)
    xf = jnp.where(k_on[..., None] & (x < kth), NEG_INF, x)  # top_k_filter's result
    vf = jnp.where(k_on[..., None] & (vals < kth), NEG_INF, vals)  # its fast_k largest
    # top_p_filter on xf, with the probabilities of its fast_k largest only
    z = jnp.sum(jnp.exp(xf - vf[..., :1]), axis=-1, keepdims=True)
    probs = jnp.exp(vf - vf[..., :1]) / z
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < p[..., None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    cutoff = jnp.take_along_axis(vf, (n_keep - 1)[..., None], axis=-1)
    keep = (xf >= cutoff) | (p[..., None] >= 1.0)
    left = jnp.sum(jnp.isfinite(xf), axis=-1)
    exact = (~k_on | (k <= kk)) & ((p >= 1.0) | ~jnp.all(keep_sorted, axis=-1) | (left <= kk))
    return jnp.where(keep, xf, NEG_INF), exact


def filter_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
    *, fast_k: int | None = None,
) -> jax.Array:
    """Temperature-scaled logits with top-k then top-p applied (vLLM / HF order).

    :func:`fast_filter` (``fast_k``: None = FAST_FILTER_K, read when traced) when it is exact
    for every row, else the same from ``WIDE_FILTER_FACTOR * fast_k`` logits when that is,
    else the two sorting filters."""
    fast_k = FAST_FILTER_K if fast_k is None else int(fast_k)
    x = logits.astype(jnp.float32) / safe_temperature(temperature)[..., None]
    if x.ndim != 2 or fast_k >= x.shape[-1]:
        return top_p_filter(top_k_filter(x, top_k), top_p)
    fast, exact = fast_filter(x, top_k, top_p, fast_k)

    def sort_path() -> jax.Array:
        return top_p_filter(top_k_filter(x, top_k), top_p)

    wide_k = WIDE_FILTER_FACTOR * fast_k
    if wide_k >= x.shape[-1]:
        return jax.lax.cond(jnp.all(exact), lambda: fast, sort_path)

    def wide() -> jax.Array:
        wider, wide_exact = fast_filter(x, top_k, top_p, wide_k)
        return jax.lax.cond(jnp.all(wide_exact), lambda: wider, sort_path)

    return jax.lax.cond(jnp.all(exact), lambda: fast, wide)


def row_keys(seed: jax.Array, prompt_idx: jax.Array, sample_idx: jax.Array,
             step: jax.Array) -> jax.Array:
    """One PRNG key per row, folded from ``(seed, prompt index, sample index, step)``."""

    def one(s, p, n):
        k = jax.random.fold_in(jax.random.PRNGKey(s), p)
        k = jax.random.fold_in(k, n)
        return jax.random.fold_in(k, step)

    seed = jnp.broadcast_to(jnp.asarray(seed, jnp.uint32), jnp.shape(prompt_idx))
    return jax.vmap(one)(seed, jnp.asarray(prompt_idx, jnp.uint32),
                         jnp.asarray(sample_idx, jnp.uint32))


def inverse_cdf_sample(logp: jax.Array, u: jax.Array, block: int = 256) -> jax.Array:
    """Draw one index per row from ``softmax(logp)`` by inverting its CDF in two levels.

    ``logp``: ``[B, V]`` (``-inf`` marks excluded tokens, never drawn); ``u``: ``[B, 2]``
    uniforms in [0, 1). ``u[:, 0]`` picks a block of ``block`` tokens by its mass
    (``P(block) = block sum / total``), ``u[:, 1]`` a token inside it (``P(token | block) =
    p / block sum``): the product is ``softmax(logp)``. A draw costs one exp and a few sums
    over the vocabulary, instead of the ``V`` random numbers per row that Gumbel-max
    (``jax.random.categorical``) needs: on a 49k vocabulary that is 2 ms instead of ~20 ms
    per decode step on CPU. An index whose probability is 0 is never returned.

    Why two uniforms, not one ``u`` against the whole CDF: float32 resolves ``u * total``
    only to ~6e-8 of the total, while one token of a near-uniform 49k vocabulary holds ~2e-5
    of it, so a 1-ulp change in the logits (another summation order: a sharded or
    multi-process run, another CPU's kernels) moved the draw to a neighbouring token about
    once per 1,000 tokens. Each level compares within its own scale (the block sums; the
    ``block`` masses inside one block), and the same perturbation flips at most ~6e-5 of the draws
    (16,384 rows of 49,152 logits, std 0.2-3, logits scaled by 1 + 1e-7 noise: 15-39 flips
    with one uniform, 0-1 with two).
    """
    b, v = logp.shape
    nb = -(-v // block)
    u = jnp.asarray(u, jnp.float32)
    x = logp.astype(jnp.float32)
    mx = jnp.max(x, axis=-1, keepdims=True)
    p = jnp.where(jnp.isneginf(x), 0.0, jnp.exp(x - mx))
    p = jnp.pad(p, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)

    def last_positive(a: jax.Array) -> jax.Array:
        n = a.shape[-1]
        return n - 1 - jnp.argmax(a[:, ::-1] > 0, axis=-1)

    def invert(cdf: jax.Array, mass: jax.Array, uu: jax.Array) -> jax.Array:
        # first index whose cumulative mass exceeds uu * total, never a massless one
        t = uu * cdf[:, -1]
        return jnp.minimum(jnp.sum(cdf <= t[:, None], axis=-1), last_positive(mass))

    bsum = jnp.sum(p, axis=-1)
    blk = invert(jnp.cumsum(bsum, axis=-1), bsum, u[:, 0])
    inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]
    j = invert(jnp.cumsum(inner, axis=-1), inner, u[:, 1])
    return (blk * block + j).astype(jnp.int32)


def unpack_token_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """``[B, W]`` int32 token bitmask -> ``[B, vocab_size]`` bool (True = allowed).

    Token ``i`` is bit ``i % 32`` of word ``i // 32`` (llguidance's layout). Ids beyond
    ``32 * W`` are not allowed.
    """
    b, w = bitmask.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (jnp.asarray(bitmask, jnp.int32)[:, :, None] >> shifts) & 1
    bits = bits.reshape(b, w * 32).astype(jnp.bool_)
    if w * 32 >= vocab_size:
        return bits[:, :vocab_size]
    return jnp.pad(bits, ((0, 0), (0, vocab_size - w * 32)))


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """float32 logits with every token the ``[B, W]`` bitmask forbids set to ``-inf``."""
    allowed = unpack_token_bitmask(bitmask, logits.shape[-1])
    return jnp.where(allowed, logits.astype(jnp.float32), NEG_INF)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    needs_filter: jax.Array | bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; return ``(tokens int32 [B], logprobs float32 [B])``.

    ``logits``: ``[B, V]``; ``keys``: ``[B]`` PRNG keys (see :func:`row_keys`); settings are
    broadcastable to ``[B]``. Rows with ``temperature == 0`` take the argmax. ``needs_filter``
    (a traced or static bool) lets callers skip the sort when top-k and top-p are both off.
    The logprob is ``log_softmax(logits / T)[token]`` of the unfiltered distribution; for
    logits masked by :func:`apply_token_bitmask` that is the masked, renormalised one.
    """
    b = logits.shape[0]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    logp = scaled_log_probs(logits, temperature)

    def filtered(_):
        return jnp.where(jnp.isneginf(filter_logits(logits, temperature, top_k, top_p)),
                         NEG_INF, logp)

    if isinstance(needs_filter, bool):
        masked = filtered(None) if needs_filter else logp
    else:
        masked = jax.lax.cond(needs_filter, filtered, lambda _: logp, None)
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)
    drawn = inverse_cdf_sample(masked, u)
    greedy = jnp.argmax(logits, axis=-1)
    tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    token_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_logp
