"""Grammar-engine glue for constrained sampling in the JAX sampler (host side).

Engine: ``llguidance`` -- a small Rust wheel with no torch dependency, a numpy bitmask API and
a batch executor, and the default structured-output backend of vLLM, so both samplers accept
the same schemas (xgrammar would pull torch into the embedded default).

What this module does:

* :func:`llg_tokenizer` builds llguidance's tokenizer from the model's HF fast tokenizer (our
  :class:`~pmd_jax.models.tokenizer.Tokenizer` or a ``transformers`` one), sized to the
  *model's* vocabulary: ids the tokenizer does not have (a model vocab padded to a multiple of
  64 or 128) are never allowed.
* :class:`Grammar` is what a request constrains to: a JSON schema (from
  ``SamplingParams.json_schema``), or, internally, a Lark grammar or a regex.
  :func:`compile_grammar` turns it into an llguidance grammar and checks it against the
  tokenizer, raising :class:`~pmd_jax.sampling.base.SamplerError` that names the schema and
  quotes the engine's message -- before anything is generated.
* :class:`BatchMatcher` keeps one matcher per batch row and, once per decode step, consumes
  the rows' sampled tokens and writes every row's next-token bitmask (``[B, ceil(V / 32)]``
  int32, bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed) with llguidance's
  parallel executor (one call per step for the whole batch, not one per row).

End of a constrained row: the grammar decides when the text may end; the request decides
with which token. A row's *end tokens* are the request's ``stop_token_ids`` (or, if it gives
none, the tokenizer's EOS tokens). They are allowed exactly when the row's matcher is in an
accepting state, and are the only tokens allowed once the grammar can take no more text, so
a row ends by sampling an end token (kept in the response, finish reason "stop", as in an
unconstrained rollout) and never stops inside the grammar. Sampling an end token is the
stop; it is not fed to the matcher.

JSON schemas are compiled with fixed separators (``", "`` and ``": "``, the layout of
``json.dumps``) and no free whitespace: a small model given free whitespace can spend its
whole budget on newlines, which is the "length" failure this exists to avoid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from pmd_jax.sampling.base import SamplerError, SamplingParams

GrammarKind = Literal["json_schema", "lark", "regex"]

# llguidance JSON compile options (see the module docstring).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def _llg() -> Any:
    try:
        # lazy: llguidance only for grammar-constrained requests
        import llguidance
    except ImportError as e:  # pragma: no cover - a pinned dependency
        raise SamplerError(
            "constrained sampling needs the llguidance package (pip install llguidance)") from e
    return llguidance


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words of one row's token bitmask."""
    return (int(vocab_size) + 31) // 32


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a constrained request must follow: a JSON schema (a JSON string), Lark or a regex.

    Only ``json_schema`` travels through :class:`SamplingParams`; ``lark`` and ``regex`` are
    for callers of :meth:`JaxSampler.generate`'s ``grammar=`` argument (tests, benchmarks).
    """

    kind: GrammarKind
    source: str

    @classmethod
    def from_params(cls, params: SamplingParams) -> Grammar | None:
        return None if params.json_schema is None else cls("json_schema", params.json_schema)

    @classmethod
    def any_token(cls, vocab_size: int) -> Grammar:
        """A grammar that allows every token id of the tokenizer, special tokens included, at
        every step, and may end anywhere: constrained decoding with it is unconstrained."""
        return cls("lark", f"start: <[0-{int(vocab_size) - 1}]>*")

    def describe(self, limit: int = 300) -> str:
        """``JSON schema {...}`` (cut to ``limit`` characters), for error messages."""
        name = {"json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regex"}[self.kind]
        s = self.source if len(self.source) <= limit else self.source[:limit] + "..."
        return f"{name} {s}"

    def to_llguidance(self) -> str:
        """The llguidance grammar text (not yet checked; see :func:`compile_grammar`)."""
        llg = _llg()
        if self.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(self.source)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        raise SamplerError(f"unknown grammar kind {self.kind!r}")


def _hf_fast(tokenizer: Any) -> Any:
    """The ``transformers`` fast tokenizer inside ``tokenizer`` (ours wraps it as ``.hf``)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if not hasattr(hf, "backend_tokenizer"):
        raise SamplerError(
            f"constrained sampling needs a HF fast tokenizer (with a backend_tokenizer), "
            f"got {type(hf).__name__}")
    return hf


def llg_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] | None = None) -> Any:
    """llguidance's tokenizer for a model with ``vocab_size`` logits (takes ~1 s: cache it).

    ``tokenizer``: our ``Tokenizer`` (its ``stop_ids`` are the EOS tokens unless ``eos_ids``
    is given), a ``transformers`` fast tokenizer, or an ``llguidance.LLTokenizer`` (returned
    as it is if its vocabulary has ``vocab_size`` entries).
    """
    llg = _llg()
    if isinstance(tokenizer, llg.LLTokenizer):
        if tokenizer.vocab_size != vocab_size:
            raise SamplerError(f"the llguidance tokenizer has {tokenizer.vocab_size} tokens, "
                               f"the model {vocab_size}; build it with n_vocab={vocab_size}")
        return tokenizer
    hf = _hf_fast(tokenizer)
    n_tok = len(hf)
    if n_tok > vocab_size:
        raise SamplerError(f"the tokenizer has {n_tok} tokens but the model only {vocab_size} "
                           "logits: wrong tokenizer for this model")
    if eos_ids is None:
        eos_ids = list(getattr(tokenizer, "stop_ids", None) or [hf.eos_token_id])
    eos = [int(i) for i in eos_ids if i is not None]
    if not eos:
        raise SamplerError("constrained sampling needs the model's EOS token id; the tokenizer "
                           "has none (pass eos_ids)")
    # lazy: llguidance only for grammar-constrained requests
    from llguidance.hf import from_tokenizer

    try:
        return from_tokenizer(hf, n_vocab=int(vocab_size), eos_token=eos)
    except Exception as e:
        raise SamplerError(f"llguidance cannot use this tokenizer: {e}") from e


_LLG_TOKENIZERS: dict[tuple[int, int, Any], tuple[Any, Any]] = {}


def llg_tokenizer_cached(tokenizer: Any, vocab_size: int, eos_ids: Any) -> Any:
    """``llg_tokenizer``, built once per (tokenizer object, vocab, EOS ids)."""
    key = (id(tokenizer), int(vocab_size), eos_ids)
    hit = _LLG_TOKENIZERS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    llt = llg_tokenizer(tokenizer, vocab_size, eos_ids)
    if len(_LLG_TOKENIZERS) >= 8:
        _LLG_TOKENIZERS.pop(next(iter(_LLG_TOKENIZERS)))
    _LLG_TOKENIZERS[key] = (tokenizer, llt)
    return llt


def compile_grammar(grammar: Grammar, tok: Any) -> str:
    """The checked llguidance grammar text of ``grammar`` for tokenizer ``tok``.

    Raises SamplerError naming the grammar (``JSON schema {...}``) with the engine's message.
    Cheap (well under a millisecond for a reflection-sized schema); callers may cache it.
    """
    llg = _llg()
    try:
        text = grammar.to_llguidance()
    except (ValueError, TypeError) as e:
        raise SamplerError(f"cannot compile {grammar.describe()}: {e}") from None
    err = llg.LLMatcher.validate_grammar(text, tok)
    if err and not err.startswith("WARNING"):
        raise SamplerError(f"cannot compile {grammar.describe()}: {err.strip()}")
    return text


class BatchMatcher:
    """Per-row grammar state of one decode batch, and its next-token bitmasks.

    Args:
      tok: the llguidance tokenizer (see :func:`llg_tokenizer`); its ``vocab_size`` is the
        model's vocabulary ``V``.
      grammar: checked llguidance grammar text (:func:`compile_grammar`).
      rows: batch rows ``B`` (padding rows included).
      active: ``[B]`` bool, the rows that are constrained (padding rows are not).
      end_ids: the tokens that end a row (allowed only where the grammar accepts).
      text_vocab: the tokenizer's own vocabulary size; ids at or above it are never allowed.
      executor: an ``llguidance.LLExecutor`` (the batch API's thread pool).
    """

    def __init__(self, tok: Any, grammar: str, rows: int, active: np.ndarray,
                 end_ids: Sequence[int], text_vocab: int, executor: Any) -> None:
        llg = _llg()
        v = int(tok.vocab_size)
        self.vocab_size = v
        self.executor = executor
        first = llg.LLMatcher(tok, grammar, log_level=0)
        if first.is_error():
            raise SamplerError(f"grammar engine error: {first.get_error()}")
        self.active = np.asarray(active, bool).copy()
        self.matchers: list[Any] = [
            (first if j == 0 else first.deep_copy()) if self.active[j] else None
            for j in range(rows)]
        self.bitmask = np.full((rows, bitmask_words(v)), -1, np.int32)
        self.done = ~self.active
        # Bits that only this module sets: every EOS llguidance knows and every end token.
        self.end_ids = np.asarray(sorted({int(i) for i in end_ids}), np.int64)
        special = np.asarray(sorted(set(int(i) for i in tok.eos_tokens) | set(
            self.end_ids.tolist())), np.int64)
        self._clear = _bits(special, v)
        self._end = _bits(self.end_ids, v)
        self._valid = _bits(np.arange(min(int(text_vocab), v)), v)
        self._end_set = frozenset(self.end_ids.tolist())

    def is_end(self, tokens: np.ndarray) -> np.ndarray:
        """``[B]`` bool: which sampled tokens are end tokens."""
        return np.isin(np.asarray(tokens), self.end_ids)

    def fill_next(self) -> np.ndarray:
        """Write and return the ``[B, W]`` int32 bitmask of the next token of every row.

        Rows that are done or inactive allow everything (their tokens are dropped). Raises
        SamplerError if a live row allows no token at all (an engine error mid-stream).
        """
        bm = self.bitmask
        live = [j for j in range(len(self.matchers)) if not self.done[j]]
        bm[self.done] = -1
        if not live:
            return bm
        # lazy: llguidance only for grammar-constrained requests
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(self.matchers[j], j) for j in live], bm)
        u = bm.view(np.uint32)
        idx = np.asarray(live)
        accepting = np.asarray([self.matchers[j].is_accepting() for j in live], bool)
        u[idx] &= self._valid & ~self._clear
        u[idx[accepting]] |= self._end
        empty = ~u[idx].any(axis=1)
        if empty.any():
            j = int(idx[np.flatnonzero(empty)[0]])
            m = self.matchers[j]
            raise SamplerError(f"grammar engine: row {j} allows no token "
                               f"({m.get_error() or m.stop_reason()})")
        return bm

    def consume(self, tokens: np.ndarray) -> np.ndarray:
        """Advance every live row by its sampled token; returns ``[B]`` bool, rows that ended
        now (sampled an end token). Ended rows are marked done."""
        tokens = np.asarray(tokens)
        ended = self.is_end(tokens) & ~self.done
        self.done |= ended
        live = [j for j in range(len(self.matchers)) if not self.done[j]]
        if live:
            # lazy: llguidance only for grammar-constrained requests
            from llguidance.numpy import consume_token_par

            ok = consume_token_par(self.executor,
                                   [(self.matchers[j], int(tokens[j])) for j in live])
            if not all(ok):
                j = live[ok.index(False)]
                raise SamplerError(f"grammar engine rejected token {int(tokens[j])} in row {j}: "
                                   f"{self.matchers[j].get_error()}")
        return ended

    def finish(self, rows: np.ndarray) -> None:
        """Mark ``rows`` (bool ``[B]``) done, e.g. when they ran out of tokens."""
        self.done |= np.asarray(rows, bool)


def _bits(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """A ``[W]`` uint32 bitmask with the bits of ``ids`` set."""
    out = np.zeros((bitmask_words(vocab_size),), np.uint32)
    ids = np.asarray(ids, np.int64)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    np.bitwise_or.at(out, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return out


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[B, W]`` int32 bitmask -> ``[B, vocab_size]`` bool (numpy; for tests and checks)."""
    b = np.asarray(bitmask, np.int32).view(np.uint8).reshape(bitmask.shape[0], -1)
    return np.unpackbits(b, axis=1, bitorder="little")[:, :vocab_size].astype(bool)
