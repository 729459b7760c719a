"""In-process JAX sampler: batched prefill + KV-cache decode, jitted, no Python per token.

``JaxSampler.generate`` expands every prompt ``n`` times, sorts the rows by prompt length and
cuts them into *batches* of at most ``max_batch`` rows (``batching.plan_batches``). A batch
runs as:

1. prefill: its distinct prompts (a prompt's samples share one prefill) are cut into
   *groups* of similar length (``batching.plan_prefill_groups``); one jitted forward per
   group, left-padded to the group's own length, writes a KV cache exactly that long
   (positions are ``cumsum(mask) - 1``, padding keys are masked, as in HF ``generate`` with
   left padding);
2. assembly: ``decode.place_rows`` copies each group's cache and last logits into the batch
   rows that continue its prompts, shifted so every prompt ends at the batch's last prompt
   slot (slot distances, hence causality and sliding windows, are kept);
3. decode: a ``jax.lax.while_loop`` feeds one token per step through the cached forward and
   samples the next one; it exits early once every row has hit a stop token, or once at
   most half the batch's rows are still going: those rows then go on alone in a batch of
   the next smaller row bucket (cache and loop state cut to them, ``decode.take_rows``), so
   finished rows stop costing (down to ``min_decode_rows``, below which a step costs the
   weights' read whatever the batch).

So a prefill pays for each distinct prompt once, padded to its group's length rather than to
the batch's longest prompt. Randomness is folded from ``(seed, prompt index, sample index,
step)`` (see ``sample_ops.row_keys``), so the tokens do not depend on batch composition,
padding, splitting or sharding. Returned logprobs are ``log_softmax(logits / T)`` of the
sampled token in float32 (T = 1 for greedy), the same formula the trainer applies to the same
forward's logits.

Grammar-constrained requests (``SamplingParams.json_schema``, or ``generate(..., grammar=)``)
take a second, host-driven decode (the same prefill and assembly), since the grammar engine
(llguidance, see ``grammar.py``) runs in Python: per token one jitted decode step (the cached
forward, dispatched asynchronously) and one jitted sampling step that takes the rows'
``[B, V/32]`` token bitmask as an argument and masks the logits before temperature / top-k /
top-p and before the returned logprob, which is therefore that of the masked, renormalised
distribution actually sampled from (``log_softmax(masked logits / T)``). While the device runs
the forward of step t, the host feeds token t-1 to the matchers and computes the masks of step
t (one batched llguidance call each, not one per row). Shapes are those of the unconstrained
path (the bitmask is always ``[B, ceil(V/32)]``), so schemas and requests never trigger a
recompile.

The jitted programs are in ``decode.py``; this module plans the batches, runs them and
drives the constrained loop.

With a ``mesh``, params are placed per ``rules`` (``decoder.param_axes``), the batch is split
over the mesh axes the ``batch`` rule names, and the forward adds activation sharding
constraints; the result equals the unsharded one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pmd_jax.models import decoder, hf_io
from pmd_jax.models.config import ModelConfig
from pmd_jax.run import footprint
from pmd_jax.run.multihost import to_host
from pmd_jax.run.sharding import ShardingRules, shard_tree
from pmd_jax.sampling import constrained, decode, weight_store
from pmd_jax.sampling import grammar as grammar_lib
from pmd_jax.sampling.base import (
    Rollout,
    Rollouts,
    SamplerError,
    SamplingParams,
    WeightSharing,
)
from pmd_jax.sampling.batching import (
    batch_cost,
    bucket_length,
    plan_batches,
    plan_prefill_groups,
    row_bucket,
    shared_prefix_length,
)

Params = Any

def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass
class SamplerMetrics:
    """Timings of the last generate() call."""

    rows: int = 0
    batches: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    constrained: bool = False
    grammar_seconds: float = 0.0  # host time in the grammar engine (masks, token consumption)
    prefill_groups: int = 0  # prefill calls (groups of distinct prompts)
    prefill_positions: int = 0  # token positions prefilled, padding included

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class JaxSampler:
    """The embedded ``Sampler``: SmolLM2 / Llama / Qwen3 / OLMo-3 decoding in-process.

    Args:
      cfg: the model config (its ``dtype`` is the compute dtype).
      params: a param pytree (``decoder.param_axes`` layout), device or host arrays.
      mesh, rules: optional device mesh and sharding rules (default rules if only ``mesh``).
      max_len: context length; ``len(prompt) + max_tokens`` must fit in it
        (default: ``cfg.max_position_embeddings``).
      pad_id: token id used for left padding (never attended) and unused output slots.
      weight_source: a ``weight_store.WeightStore`` (or its URL) for ``set_weights``.
      max_batch: largest number of rows per compiled batch; bigger requests are split.
      max_cache_gib: KV cache budget of one batch (padded rows x cache slots), in GiB; the
        plan splits a batch that would hold more (one row alone is never split). None or 0:
        no budget.
      max_prefill_tokens: most padded token positions (rows x length) in one prefill call
        of several prompts; a prompt alone is never split. None or 0: no cap.
      cache_dtype: KV cache dtype (default: the compute dtype).
      prefill_matmul_dtype: 'bfloat16' / 'float16': the prefill's weight matmuls take
        operands of that dtype with float32 accumulation (``models.matmul``; compute-bound
        there, unlike the decode steps, which keep the model's dtype). None: the model's.
      unstack_layers: keep the weights as separate per-layer arrays and decode with a loop
        over layers (default; one extra copy of the layer weights). On a loaded 2-core CPU the
        decode step was 3.6x faster this way (161 vs 586 ms at B=16), on a quiet one about
        the same (125-163 vs 135-151 ms); False keeps the stacked arrays and the layer scan
        (smaller compile).
      min_decode_rows: an unconstrained decode batch is cut to its still-going rows (in the
        next row bucket) whenever at most half its rows are still going, down to this many
        rows: below it a decode step costs about one read of the weights whatever the batch
        (Qwen2.5-Coder-0.5B fp32 on the 2-core box: 137 ms a step at 8 rows, 260 at 32, 683
        at 96).
      tokenizer: the model's tokenizer (our ``models.tokenizer.Tokenizer``, a ``transformers``
        fast tokenizer, or an ``llguidance.LLTokenizer``), needed only for constrained requests
        (``SamplingParams.json_schema``); see :meth:`set_tokenizer`. Without one a
        constrained request raises SamplerError.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        mesh: Mesh | None = None,
        rules: ShardingRules | Mapping[str, Any] | None = None,
        max_len: int | None = None,
        pad_id: int = 0,
        weight_source: Any = None,
        *,
        max_batch: int = 64,
        max_cache_gib: float | None = None,
        max_prefill_tokens: int | None = None,
        cache_dtype: Any = None,
        prefill_matmul_dtype: str | None = None,
        unstack_layers: bool = True,
        tokenizer: Any = None,
        min_decode_rows: int = 8,
    ) -> None:
        self.cfg = cfg
        self.max_len = int(max_len if max_len is not None else cfg.max_position_embeddings)
        if self.max_len < 2:
            raise SamplerError(f"max_len must be >= 2, got {self.max_len}")
        if not 0 <= pad_id < cfg.vocab_size:
            raise SamplerError(f"pad_id {pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
        if max_batch < 1:
            raise SamplerError(f"max_batch must be >= 1, got {max_batch}")
        if max_cache_gib is not None and max_cache_gib < 0:
            raise SamplerError(f"max_cache_gib must be >= 0 (0 = no budget), got {max_cache_gib}")
        if min_decode_rows < 1:
            raise SamplerError(f"min_decode_rows must be >= 1, got {min_decode_rows}")
        self.min_decode_rows = int(min_decode_rows)
        if max_prefill_tokens is not None and max_prefill_tokens < 0:
            raise SamplerError(f"max_prefill_tokens must be >= 0 (0 = no cap), got "
                               f"{max_prefill_tokens}")
        self.max_prefill_tokens = int(max_prefill_tokens or 0) or None
        self.prefill_matmul_dtype = prefill_matmul_dtype
        self.pad_id = int(pad_id)
        self.mesh = mesh
        if rules is not None and not isinstance(rules, ShardingRules):
            rules = ShardingRules.from_mapping(rules)
        self.rules = rules if rules is not None else (
            ShardingRules.from_mapping() if mesh is not None else None)
        self.cache_dtype = jnp.dtype(cache_dtype) if cache_dtype is not None else jnp.dtype(
            cfg.dtype)
        self._batch_div = 1
        if mesh is not None:
            axes = self._mesh_rules().mesh_axes("batch")
            self._batch_div = math.prod(mesh.shape[a] for a in axes)
        self.max_batch = max(int(max_batch), self._batch_div)
        slot_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                      * self.cache_dtype.itemsize + 1)  # k and v of every layer, the key mask
        self.max_cache_slots = (int(max_cache_gib * 2**30 / slot_bytes) if max_cache_gib
                                else None)
        self._store = weight_source
        self.unstack_layers = bool(unstack_layers)
        self.params: Params = None
        self.weights_version: int | None = None
        self.last_metrics = SamplerMetrics()
        self.set_params(params)
        shard_ctx = None if mesh is None else (mesh, self.rules)
        self._fns = decode.compiled_programs(cfg, self.pad_id, shard_ctx, self.cache_dtype,
                                             prefill_matmul_dtype)
        self._tokenizer: Any = None
        self._eos_ids: tuple[int, ...] | None = None
        self._llg_tok: Any = None
        self._text_vocab = cfg.vocab_size
        self._grammars: dict[grammar_lib.Grammar, str] = {}
        self._executor: Any = None
        if tokenizer is not None:
            self.set_tokenizer(tokenizer)

    # ------------------------------------------------------------------ grammar
    def set_tokenizer(self, tokenizer: Any, eos_ids: Sequence[int] | None = None) -> None:
        """The tokenizer constrained requests are matched with (built into llguidance's on
        first use, ~1 s). ``eos_ids``: the tokens the tokenizer ends text with (default: our
        Tokenizer's ``stop_ids``, else the HF ``eos_token_id``)."""
        self._tokenizer = tokenizer
        self._eos_ids = None if eos_ids is None else tuple(int(i) for i in eos_ids)
        self._llg_tok = None
        self._grammars = {}
        hf = getattr(tokenizer, "hf", tokenizer)
        try:
            self._text_vocab = min(len(hf), self.cfg.vocab_size)
        except TypeError:  # an llguidance tokenizer: it masks ids it does not have itself
            self._text_vocab = self.cfg.vocab_size

    def _grammar_engine(self, grammar: grammar_lib.Grammar) -> tuple[Any, str]:
        """(llguidance tokenizer, checked grammar text); SamplerError if either fails."""
        if self._tokenizer is None:
            raise SamplerError(
                f"cannot constrain to {grammar.describe()}: this JaxSampler has no tokenizer "
                "(pass tokenizer= or call set_tokenizer)")
        if self._llg_tok is None:
            self._llg_tok = grammar_lib.llg_tokenizer_cached(self._tokenizer, self.cfg.vocab_size,
                                                  self._eos_ids)
        text = self._grammars.get(grammar)
        if text is None:
            text = self._grammars[grammar] = grammar_lib.compile_grammar(grammar, self._llg_tok)
            if len(self._grammars) > 256:
                self._grammars.pop(next(iter(self._grammars)))
        if self._executor is None:
            # lazy: llguidance only for grammar-constrained requests
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._llg_tok, text

    # ------------------------------------------------------------------ weights
    def _mesh_rules(self) -> ShardingRules:
        """The sharding rules of the mesh (``__init__`` sets default ones with a mesh)."""
        if self.rules is None:
            raise SamplerError("JaxSampler has a mesh but no sharding rules (rules is None)")
        return self.rules

    def share_weights(self) -> WeightSharing:
        """The ``Sampler`` contract: this sampler takes the param arrays in process
        (:meth:`set_params`)."""
        return "in_process"

    def set_params(self, params: Params, version: int | None = None, *,
                   copy: bool = False) -> None:
        """Use ``params`` from now on (no copy for device arrays already placed as needed).

        ``copy=True``: keep no reference to the caller's arrays (it is about to donate them
        to a train step). With ``unstack_layers`` the per-layer arrays are new anyway, so
        only the other leaves are copied."""
        if copy:
            skip = "layers" if self.unstack_layers else None
            params = {k: v if k == skip else jax.tree.map(jnp.copy, v)
                      for k, v in params.items()}
        try:
            decoder.check_params(params, self.cfg)
        except Exception as e:  # ParamError or a malformed tree
            raise SamplerError(f"set_params: {e}") from e
        if self.mesh is not None:
            placed = shard_tree(params, self.mesh, self._mesh_rules(),
                                decoder.param_axes(self.cfg))
        else:
            placed = jax.tree.map(jnp.asarray, params)
        # Per-layer arrays: the decode loop reads each layer's weights in place instead of
        # through a dynamic slice of the stacked arrays (a full copy per token on XLA:CPU).
        self.params = decoder.unstack_layers(placed) if self.unstack_layers else placed
        self.weights_version = version

    def release_params(self) -> None:
        """Drop this sampler's reference to its weights (the trainer does so while a train
        step computes the weights that replace them, so the per-layer copy is not resident
        during it); :meth:`generate` raises SamplerError until :meth:`set_params` (or
        :meth:`use_weights_of`, :meth:`set_weights`) gives it weights again."""
        self.params = None

    def use_weights_of(self, other: JaxSampler) -> None:
        """Use ``other``'s placed weights and version as they are (no copy): for a second
        sampler of the same model, e.g. one serving reflection calls on another thread.
        The tokenizer is not shared (each sampler keeps its own, see :meth:`set_tokenizer`)."""
        if other.cfg != self.cfg or other.mesh is not self.mesh:
            raise SamplerError("use_weights_of needs a sampler of the same model config and mesh")
        if other.unstack_layers != self.unstack_layers:
            raise SamplerError("use_weights_of needs samplers with the same unstack_layers")
        self.params = other.params
        self.weights_version = other.weights_version

    def set_weights(self, version: int) -> None:
        """Load committed ``version`` from the weight store (HF-named arrays) and use it."""
        if self._store is None:
            raise SamplerError("set_weights needs a weight_source (a WeightStore or its URL)")

        store = self._store
        if not isinstance(store, weight_store.WeightStore):
            store = self._store = weight_store.WeightStore(store)
        try:
            arrays, manifest = store.read(version)
        except weight_store.WeightStoreError as e:
            raise SamplerError(f"set_weights({version}): {e}") from e
        try:
            params = hf_io.load_params_from_source(
                hf_io.ArraySource(arrays), self.cfg, self.mesh, self.rules)
        except (hf_io.CheckpointError, ValueError) as e:
            raise SamplerError(
                f"set_weights({version}): arrays do not match the model config: {e}") from e
        self.set_params(params, version=manifest.version)

    # ------------------------------------------------------------------ generate
    def _validate(self, prompts: Sequence[Sequence[int]], sp: SamplingParams) -> list[np.ndarray]:
        if not isinstance(sp, SamplingParams):
            raise SamplerError(f"params must be SamplingParams, got {type(sp).__name__}")
        sp.validate(self.cfg.vocab_size)
        out = []
        v = self.cfg.vocab_size
        for i, p in enumerate(prompts):
            try:
                a = np.asarray(p)
            except Exception as e:
                raise SamplerError(f"prompt {i} is not a sequence of token ids: {e}") from e
            if a.ndim != 1:
                raise SamplerError(f"prompt {i} must be a flat list of token ids, shape {a.shape}")
            if a.size == 0:
                raise SamplerError(f"prompt {i} is empty (needs at least one token)")
            if not np.issubdtype(a.dtype, np.integer):
                raise SamplerError(f"prompt {i} has non-integer token ids (dtype {a.dtype})")
            if a.min() < 0 or a.max() >= v:
                bad = int(a[(a < 0) | (a >= v)][0])
                raise SamplerError(f"prompt {i} has token id {bad} outside the vocabulary [0, {v})")
            if a.size + sp.max_tokens > self.max_len:
                raise SamplerError(
                    f"prompt {i} has {a.size} tokens; with max_tokens={sp.max_tokens} that is "
                    f"{a.size + sp.max_tokens} > the context length max_len={self.max_len}"
                )
            out.append(a.astype(np.int32))
        return out

    def _shapes(self, prompt_len: int, max_tokens: int) -> tuple[int, int, int]:
        """(padded prompt length, cache length, output buffer length) for one batch."""
        out_len = bucket_length(max_tokens)
        p_len = bucket_length(prompt_len)
        cache_len = min(p_len + out_len, self.max_len)
        if p_len + max_tokens > cache_len:  # only near max_len: fall back to an exact fit
            p_len = cache_len - max_tokens
        return p_len, cache_len, out_len

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 grammar: grammar_lib.Grammar | None = None,
                 progress: Callable[[int], None] | None = None) -> Rollouts:
        """Sample ``params.n`` continuations of each prompt (see the module docstring).

        With ``params.json_schema`` (or ``grammar``, which takes precedence: a Lark grammar or
        regex, for tests and benchmarks), every token is one the grammar allows at that point;
        a row ends by sampling one of ``params.stop_token_ids`` (or, if none are given, the
        tokenizer's EOS tokens), which the grammar allows only where the text is complete, so
        a row that finishes with "stop" always parses and validates. The returned logprobs
        are then ``log_softmax(masked logits / T)`` of the sampled tokens: the masked,
        renormalised distribution (top-k / top-p only restrict the draw, as unconstrained).
        A grammar the engine cannot compile raises SamplerError naming it, before any
        generation.
        """
        t0 = time.perf_counter()
        if self.params is None:
            raise SamplerError("this JaxSampler holds no weights (released by release_params; "
                               "set_params gives it weights again)")
        arrays = self._validate(prompts, params)
        if grammar is None:
            grammar = grammar_lib.Grammar.from_params(params)
        engine = self._grammar_engine(grammar) if grammar is not None else None
        if not arrays:
            return Rollouts([], self.weights_version)
        n = params.n
        rows = [(p, s) for p in range(len(arrays)) for s in range(n)]
        order = sorted(range(len(rows)), key=lambda r: len(arrays[rows[r][0]]))
        stops = np.asarray(sorted(set(params.stop_token_ids)), np.int32)
        stop_pad = np.full((max(8, _next_pow2(len(stops))),), -1, np.int32)
        stop_pad[: len(stops)] = stops
        scalars = dict(
            seed=np.uint32(params.seed % (1 << 32)),
            temperature=np.float32(params.temperature),
            top_k=np.int32(params.top_k),
            top_p=np.float32(params.top_p),
            needs_filter=np.bool_(params.temperature > 0 and (
                params.top_k > 0 or params.top_p < 1.0)),
            max_tokens=np.int32(params.max_tokens),
            stop_ids=stop_pad,
        )
        items: list[Rollout | None] = [None] * len(rows)
        new_tokens = batches = 0
        grammar_s = [0.0]
        stats = [0, 0]  # prefill groups, prefill positions
        seen = _SHAPES_RUN.setdefault((id(self._fns), engine is None), set())
        lengths = [len(arrays[rows[r][0]]) for r in order]
        plan = plan_batches(
            lengths, self.max_batch,
            lambda b, plen: (b, *self._shapes(plen, params.max_tokens)),
            bucket_length(params.max_tokens), divisor=self._batch_div, compiled=seen,
            batch_cost=batch_cost([rows[r][0] for r in order], lengths, self.max_cache_slots))
        for start, end in plan:
            chunk = order[start:end]
            seen.add((row_bucket(end - start, self._batch_div),
                      *self._shapes(lengths[end - 1], params.max_tokens)))
            # one batch at a time, read back before the next is filled: its KV cache is
            # freed before the next one's exists
            if engine is None:
                result = self._launch(chunk, rows, arrays, params, scalars, stats)
            else:
                result = constrained.run_batch(self, chunk, rows, arrays, params, scalars,
                                               engine, grammar_s, stats)
            # what compiling the batch's programs freed goes back to the kernel instead of
            # staying resident beside the next batch's KV cache (pmd_jax.run.footprint)
            footprint.release_free_memory()
            batches += 1
            toks, lps, lens, stopped = result  # host arrays
            for j, r in enumerate(chunk):
                ln = int(lens[j])
                new_tokens += ln
                items[r] = Rollout(
                    prompt_index=rows[r][0], sample_index=rows[r][1],
                    tokens=toks[j, :ln].astype(np.int32), logprobs=lps[j, :ln].astype(np.float32),
                    finish_reason="stop" if bool(stopped[j]) else "length",
                )
            if progress is not None:
                progress(len(chunk))
        self.last_metrics = SamplerMetrics(
            rows=len(rows), batches=batches, new_tokens=new_tokens,
            seconds=time.perf_counter() - t0, constrained=engine is not None,
            grammar_seconds=grammar_s[0], prefill_groups=stats[0], prefill_positions=stats[1])
        return Rollouts(items, self.weights_version)  # type: ignore[arg-type]

    def _fill_batch(self, chunk, rows, arrays, sp: SamplingParams, stats: list[int],
                    reply_slots: int | None = None):
        """Prefill one batch's distinct prompts in groups and assemble its cache (steps 1-2;
        ``reply_slots`` after the prompts, default ``out_len``). Returns (cache, first-step
        logits, host arrays (prompt lengths, prompt and sample indices, valid), the prompt
        slots ``p_len`` (every prompt ends at slot ``p_len - 1``), out_len)."""
        b_real = len(chunk)
        b = row_bucket(b_real, self._batch_div)
        plen = max(len(arrays[rows[r][0]]) for r in chunk)
        p_max, cache_len, out_len = self._shapes(plen, sp.max_tokens)
        if reply_slots is not None:
            cache_len = min(cache_len, p_max + reply_slots)
        prompt_len = np.zeros((b,), np.int32)
        pidx = np.zeros((b,), np.int32)
        sidx = np.zeros((b,), np.int32)
        users: dict[int, list[int]] = {}  # prompt -> the batch rows that continue it
        for j, r in enumerate(chunk):
            pidx[j], sidx[j] = rows[r]
            prompt_len[j] = len(arrays[rows[r][0]])
            users.setdefault(rows[r][0], []).append(j)
        distinct = sorted(users, key=lambda q: len(arrays[q]))
        fns = self._fns
        shared = self._shared_prefix([arrays[q] for q in distinct], cache_len)
        prefix = None
        if shared:  # the prefix every prompt of the batch starts with, prefilled once
            rows_p = row_bucket(1, self._batch_div)
            prefix, _ = fns.prefill(
                self.params, *self._put(np.tile(arrays[distinct[0]][:shared], (rows_p, 1)),
                                        np.ones((rows_p, shared), bool)), cache_len=shared)
            stats[0] += 1
            stats[1] += rows_p * shared
        seen = _SHAPES_RUN.setdefault((id(self._fns), "prefill", shared), set())
        groups = plan_prefill_groups([len(arrays[q]) - shared for q in distinct],
                                     self.max_batch, divisor=self._batch_div,
                                     limit=p_max - shared, max_tokens=self.max_prefill_tokens,
                                     compiled=seen)
        p_len = shared + max(g_len for *_, g_len in groups)
        cache, logits = fns.empty(self.params, b=b, cache_len=cache_len)
        for start, end, g, g_len in groups:
            seen.add((g, g_len))
            tokens = np.full((g, g_len), self.pad_id, np.int32)
            mask = np.zeros((g, g_len), bool)
            src = np.zeros((g * sp.n,), np.int32)
            dst = np.full((g * sp.n,), b, np.int32)  # b: no row (dropped)
            k = 0
            for i in range(g):  # padding rows repeat the group's first prompt, then dropped
                q = distinct[start + i] if start + i < end else distinct[start]
                suffix = arrays[q][shared:]
                tokens[i, g_len - len(suffix):] = suffix
                mask[i, g_len - len(suffix):] = True
                for j in users[q] if start + i < end else ():
                    src[k], dst[k] = i, j
                    k += 1
            if prefix is None:
                g_cache, g_logits = fns.prefill(self.params, *self._put(tokens, mask),
                                                cache_len=g_len)
            else:
                g_cache, g_logits = fns.prefill_after(self.params, prefix,
                                                      *self._put(tokens, mask))
            cache, logits = fns.place(cache, logits, g_cache, g_logits, src, dst,
                                      np.int32(p_len - shared - g_len))
            stats[0] += 1
            stats[1] += g * g_len
        valid = np.arange(b) < b_real
        return cache, logits, (prompt_len, pidx, sidx, valid), p_len, out_len

    def _shared_prefix(self, prompts: Sequence[np.ndarray], cache_len: int) -> int:
        """Tokens of the prefix that every one of a batch's distinct ``prompts`` (two or
        more) starts with, to prefill once (``decode.prefill_after``), cut to a prefill length
        bucket (so its programs are shared across requests) and leaving every prompt at
        least one token of its own; 0 (no shared prefill) below ``MIN_SHARED_PREFIX`` tokens
        or when a sliding window is shorter than the cache (the padding between prefix and
        suffix would count in the window's slot distances)."""
        if self.cfg.windows_shorter_than(cache_len):
            return 0
        return shared_prefix_length(prompts, MIN_SHARED_PREFIX)

    def _put(self, *xs: np.ndarray) -> tuple[Any, ...]:
        """Host arrays whose first axis is the batch, placed on the mesh (as-is without one)."""
        if self.mesh is None:
            return xs
        rules = self._mesh_rules()
        shard1 = NamedSharding(self.mesh, rules.spec(("batch",)))
        shard2 = NamedSharding(self.mesh, rules.spec(("batch", None)))
        return tuple(jax.device_put(x, shard2 if x.ndim == 2 else shard1) for x in xs)

    def _launch(self, chunk, rows, arrays, sp: SamplingParams, scalars, stats: list[int]):
        """One batch through the unconstrained decode: (tokens, logprobs, lengths, stopped)
        of its rows, host arrays.

        Rows that finish stop costing: the decode loop exits once at most half the batch's
        rows are still going (``_shrink_target``), and those rows go on alone in a batch of
        the next row bucket (``decode.take_rows`` cuts the cache and the loop state); every
        row's tokens are those the full batch gives (the same per-row computation and
        sampling keys); batches of ``min_decode_rows`` rows or fewer are not cut."""
        cache, logits, host, p_len, out_len = self._fill_batch(chunk, rows, arrays, sp, stats)
        sample_kw = {k: scalars[k] for k in ("seed", "temperature", "top_k", "top_p",
                                             "needs_filter")}
        d_plen, d_pidx, d_sidx, d_valid = self._put(*host)
        fns = self._fns
        state = fns.start(logits, d_pidx, d_sidx, d_valid, **sample_kw,
                          stop_ids=scalars["stop_ids"], out_len=out_len)
        b_real = len(chunk)
        out = (np.full((b_real, out_len), self.pad_id, np.int32),
               np.zeros((b_real, out_len), np.float32), np.zeros((b_real,), np.int32),
               np.zeros((b_real,), bool))
        where = np.arange(len(host[3]))  # batch row -> row of the chunk (>= b_real: padding)
        plen, pidx, sidx = host[:3]
        while True:
            target = self._shrink_target(len(where))
            state, cache = fns.decode(self.params, cache, state, d_plen, np.int32(p_len),
                                      d_pidx, d_sidx, **sample_kw,
                                      max_tokens=scalars["max_tokens"],
                                      stop_ids=scalars["stop_ids"], min_active=np.int32(target))
            done = to_host(state.done)
            going = np.flatnonzero(~done)
            last = target == 0 or not going.size or int(to_host(state.step)) >= sp.max_tokens
            finished = np.flatnonzero((done | last) & (where < b_real))
            if finished.size:
                vals = (to_host(state.out_tok), to_host(state.out_lp), to_host(state.lengths),
                        to_host(state.stopped))
                for o, v in zip(out, vals, strict=True):
                    o[where[finished]] = v[finished]
            if last:
                return out
            nb = row_bucket(going.size, self._batch_div)
            keep = np.concatenate([going, np.full((nb - going.size,), np.flatnonzero(done)[0])])
            where = np.where(np.arange(nb) < going.size, where[keep], b_real)
            state = decode.take_rows(state, keep)
            cache = decode.take_rows(cache, keep)
            plen, pidx, sidx = plen[keep], pidx[keep], sidx[keep]
            d_plen, d_pidx, d_sidx = self._put(plen, pidx, sidx)

    def _shrink_target(self, b: int) -> int:
        """Still-going rows at which a decode batch of ``b`` rows stops to go on in a smaller
        one: half its rows (rounded down to the mesh's batch divisor), or 0 (run to the end)
        for a batch of ``min_decode_rows`` or fewer."""
        if b <= self.min_decode_rows:
            return 0
        return (b // 2) // self._batch_div * self._batch_div


# A batch's prompts sharing at least this many leading tokens prefill them once (chat system
# prompts, task instructions: 126 of HumanEval's 170-523 tokens for Qwen2.5-Coder).
MIN_SHARED_PREFIX = 32

# Shapes each compiled program family has run (the plans treat them as free), per
# (programs, decode path) and (programs, "prefill", shared prefix length).
_SHAPES_RUN: dict[tuple[Any, ...], set[tuple[int, ...]]] = {}
