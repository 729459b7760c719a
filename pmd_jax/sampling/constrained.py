"""The JAX sampler's grammar-constrained decode: a host-driven loop, one token a step.

The grammar engine (llguidance, ``grammar.py``) runs in Python, so each step is one jitted
cached forward (``decode.decode_logits``, dispatched asynchronously) and one jitted sampling
step that masks the logits by the rows' ``[B, V/32]`` token bitmask; the batch's prefill and
assembly are the unconstrained path's (``JaxSampler._fill_batch``). See ``jax_sampler``'s
module docstring.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pmd_jax.run import footprint
from pmd_jax.run.multihost import to_host
from pmd_jax.sampling import decode
from pmd_jax.sampling import grammar as grammar_lib
from pmd_jax.sampling.base import SamplingParams

# The constrained loop hands the C heap's free pages back every this many tokens: what the
# batch's prefill groups (caches, temporaries, compiles) freed stays resident under the token
# loop otherwise (pmd_jax.run.footprint). On a behavior-round-shaped call (8 prompts of 831-1,437
# tokens, max_tokens 1536): RSS during the decode 3.17 -> 2.57 GiB, the peak (at the
# prefill) unchanged. A trim walks the heap (tens of ms), about 1% of 32 decode steps.
TRIM_EVERY = 32

# Reply slots the constrained loop's cache starts with, doubled while rows go on
# (decode.grow_cache): behavior rounds ask for 1,536 tokens; their replies took 79-513.
CONSTRAINED_FIRST_REPLY = 512


def run_batch(sampler: Any, chunk, rows, arrays, sp: SamplingParams, scalars,
              engine: tuple[Any, str], grammar_s: list[float], stats: list[int]):
    """One batch of ``sampler`` (a ``JaxSampler``) through the host-driven constrained loop;
    the same outputs as its unconstrained ``_launch``.

    Per token: read the sampled tokens (a small device->host copy), dispatch the next
    forward (async), feed the tokens to the matchers and compute the next bitmasks while
    it runs, then dispatch the masked sampling step with them.
    """
    llg_tok, grammar_text = engine
    p_max, full_len, _ = sampler._shapes(max(len(arrays[rows[r][0]]) for r in chunk),
                                         sp.max_tokens)
    cache, logits, (prompt_len, pidx, sidx, valid), p_len, out_len = sampler._fill_batch(
        chunk, rows, arrays, sp, stats, reply_slots=CONSTRAINED_FIRST_REPLY)
    b, b_real = len(valid), len(chunk)
    end_ids = sp.stop_token_ids or tuple(int(i) for i in llg_tok.eos_tokens)
    tg = time.perf_counter()
    matcher = grammar_lib.BatchMatcher(llg_tok, grammar_text, b, valid, end_ids,
                                       sampler._text_vocab, sampler._executor)
    grammar_s[0] += time.perf_counter() - tg
    fns = sampler._fns
    d_pidx, d_sidx = sampler._put(pidx, sidx)
    sample_kw = dict(seed=scalars["seed"], temperature=scalars["temperature"],
                     top_k=scalars["top_k"], top_p=scalars["top_p"],
                     needs_filter=scalars["needs_filter"])

    def sample(logits, step: int):
        tg = time.perf_counter()
        (bm,) = sampler._put(matcher.fill_next())
        grammar_s[0] += time.perf_counter() - tg
        return fns.sample(logits, bm, d_pidx, d_sidx, np.int32(step), **sample_kw)

    tok, lp = sample(logits, 0)
    max_tokens = sp.max_tokens
    out_tok = np.full((b, out_len), sampler.pad_id, np.int32)
    out_lp = np.zeros((b, out_len), np.float32)
    lengths = np.zeros((b,), np.int32)
    stopped = np.zeros((b,), bool)
    for step in range(max_tokens):
        t_host, lp_host = to_host(tok), to_host(lp)
        live = ~matcher.done
        out_tok[live, step] = t_host[live]
        out_lp[live, step] = lp_host[live]
        lengths[live] = step + 1
        last = step + 1 >= max_tokens or bool(np.all(matcher.done | matcher.is_end(t_host)))
        if not last:  # the next forward runs while the host works on the grammar
            slots = cache["mask"].shape[1]
            if p_len + step >= slots:  # rows go on past the cache: twice its reply part
                cache = decode.grow_cache(cache, min(full_len, 2 * slots - p_max))
            (pos,) = sampler._put((prompt_len + step)[:, None])
            cache, logits = fns.step(sampler.params, cache, tok, pos,
                                     np.int32(p_len + step))
        tg = time.perf_counter()
        stopped |= matcher.consume(t_host)
        grammar_s[0] += time.perf_counter() - tg
        if last:
            break
        if (step + 1) % TRIM_EVERY == 0:  # the per-token host buffers' freed heap
            footprint.release_free_memory()
        tok, lp = sample(logits, step + 1)
    sl = slice(0, b_real)
    return out_tok[sl], out_lp[sl], lengths[sl], stopped[sl]
