"""The GPU program's facts (:mod:`pmd_jax.dry_run.gpu_facts`) as the dry run reports them:
a JSON-able summary and the printed lines."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable
from typing import Any

from pmd_jax.dry_run.gpu_facts import Array, Facts


# -------------------------------------------------------------------------------- reporting
def summary(f: Facts, vocab: Collection[int]) -> dict[str, Any]:
    """The facts as plain data (JSON)."""
    def arr(a: Array | None) -> str | None:
        return None if a is None else str(a)

    head = f.gemms_touching(vocab)
    return {
        "program": f.program,
        "vocab_sorts": [{"operand": str(s.operand), "size": s.size, "via": s.via,
                         "conditional": s.conditional} for s in f.vocab_sorts],
        "unconditional_vocab_sorts": len(f.unconditional_vocab_sorts),
        "sorts": len(f.sorts),
        "topk": [{"k": t.k, "size": t.size, "via": t.via} for t in f.topks],
        "cudnn_attention": [{"target": a.target, "mask_type": a.mask_type, "query": arr(a.query),
                             "bias": arr(a.bias), "dbias": arr(a.dbias), "seqlens": a.seqlens}
                            for a in f.attention],
        "gemm_dtypes": {k: {"count": n, "gflops": round(fl / 1e9, 3)}
                        for k, (n, fl) in f.gemm_signatures().items()},
        "vocab_gemm_dtypes": sorted({g.signature for g in head}),
        "gemm_kinds": dict(Counter(g.kind for g in f.gemms)),
        "stacked_per_layer": [str(a) for a in f.stacked],
    }


def format_facts(f: Facts, vocab: Collection[int]) -> list[str]:
    """Readable lines: one per fact."""
    out = []
    vs, always = f.vocab_sorts, f.unconditional_vocab_sorts
    if always:
        out.append("  (a) vocabulary sort: YES, " + "; ".join(
            f"{s.via} over {s.operand}" for s in _uniq(always))
            + ("" if len(always) == len(vs) else "; and in a conditional branch"))
    elif vs:
        out.append("  (a) vocabulary sort: only in a conditional branch (runs when taken: a "
                   "fallback), " + "; ".join(f"{s.via} over {s.operand}" for s in _uniq(vs)))
    else:
        out.append("  (a) vocabulary sort: none"
                   + (f" ({len(f.sorts)} other sort(s), largest axis "
                      f"{max(s.size for s in f.sorts)})" if f.sorts else ""))
    if f.topks:
        out.append("      top-k: " + "; ".join(
            f"{t.via} k={t.k} of {t.size}" for t in _uniq(f.topks)))
    fw, bw = f.cudnn_forward, f.cudnn_backward
    if not f.attention:
        out.append("  (b) cuDNN attention: none (attention runs as XLA ops)")
    else:
        kinds = Counter(a.target for a in f.attention)
        masks = sorted({a.mask_type or "?" for a in f.attention})
        bias = _uniq([str(a.bias) for a in f.attention if a.bias is not None])
        db = _uniq([str(a.dbias) for a in f.dbias])
        out.append(f"  (b) cuDNN attention: {len(fw)} forward / {len(bw)} backward call(s) ("
                   + ", ".join(f"{n} x {k}" for k, n in kinds.items()) + f"); mask types "
                   f"{', '.join(masks)}; bias operand: {', '.join(bias) or 'none'}; "
                   f"dbias output: {'YES ' + ', '.join(db) if db else 'none'}; sequence "
                   f"lengths: {'yes' if any(a.seqlens for a in f.attention) else 'no'}")
    sig = f.gemm_signatures()
    total = sum(fl for _, fl in sig.values()) or 1.0
    out.append("  (c) GEMM dtypes (count, share of GEMM FLOPs): " + ("; ".join(
        f"{k}: {n}, {100 * fl / total:.1f}%" for k, (n, fl) in sig.items()) or "no GEMM"))
    head = f.gemms_touching(vocab)
    if head:
        hs = Counter(g.signature for g in head)
        out.append("      GEMMs with a vocabulary axis (LM head): " + "; ".join(
            f"{n} x {k}" for k, n in hs.items()))
    kinds = Counter(g.kind for g in f.gemms)
    if f.program == "xla_gpu_hlo" and kinds:
        out.append("      GEMM kinds: " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    if f.stacked:
        out.append("  (d) per-layer stacked arrays in the layer loops (remat's saved tensors): "
                   + ", ".join(map(str, f.stacked[:8]))
                   + (f" (+{len(f.stacked) - 8} more)" if len(f.stacked) > 8 else ""))
    else:
        out.append("  (d) per-layer stacked arrays in the layer loops: none seen")
    return out


def _uniq(xs: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(xs))


def dumps(f: Facts, vocab: Collection[int]) -> str:
    return json.dumps(summary(f, vocab))
