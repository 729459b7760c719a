"""``python -m pmd_jax.main --config=configs/X.py --dry_run``: full-size compile, no weights.

Two compiles on abstract arrays for a simulated mesh (``--dry_run_devices`` fake CPU devices):

1. ``dry_run.forward_backward.dry_run``: forward + backward + AdamW of the model (next-token
   loss), for the params / optimizer / activation bytes per device and FLOPs per token;
2. the real distillation step of the config (``distill.step.TrainStep``: student forward and
   backward, teacher forward(s) per the teacher rule, chunked top-K / full-vocab divergence,
   optimizer, EMA update) with student sequence = prompt + response and teacher sequence =
   teacher prompt + response, one sequence per data x fsdp device unless told otherwise.
   Its ``memory_analysis()`` shows whether per-device memory stays bounded at the config's
   response length (the logits are never materialised as [B, T, V]).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from pmd_jax.distill.registry import TEACHER_KEYS, get_loss
from pmd_jax.distill.step import TrainStep
from pmd_jax.loop.build import attention_options
from pmd_jax.models import gguf_io, hf_io
from pmd_jax.models.assets import EMBEDDED_MODELS, AssetError, embedded_gguf_path
from pmd_jax.models.config import ConfigError, from_hf_config, preset

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger("pmd_jax")
GiB = 1024**3


def mesh_shape(cfg: RunConfig, n_devices: int) -> dict[str, int]:
    shape = {"data": int(cfg.mesh.data), "fsdp": int(cfg.mesh.fsdp),
             "tensor": int(cfg.mesh.tensor)}
    known = 1
    for v in shape.values():
        if v != -1:
            known *= v
    for k, v in shape.items():
        if v == -1:
            shape[k] = n_devices // known
    return shape


def lesson_shape(cfg: RunConfig, row_multiple: int) -> tuple[int, int, int]:
    """(rows, sequence length, lesson length) of the largest lesson rows a ``mode=mel`` step
    gets: ``mel.max_pairs`` lessons (0 = every problem of the step can give one per allowed
    pair), rows rounded as ``mel.lessons.lesson_rows`` does (the mesh's batch axes x a power
    of two), each the prompt budget plus ``mel.lesson_max_tokens``."""
    m = cfg.mel
    pairs = int(m.max_pairs) or int(cfg.rollout.problems_per_step) * max(
        1, int(m.max_pairs_per_problem) or int(cfg.rollout.n) ** 2)
    rows = max(1, int(row_multiple))
    while rows < pairs:
        rows *= 2
    lesson = int(m.lesson_max_tokens)
    return rows, int(cfg.rollout.max_prompt_tokens) + lesson, lesson


def abstract_batch(step_fn: Any, batch: int, student_len: int, teacher_len: int,
                   response_len: int, lessons: tuple[int, int, int] | None = None
                   ) -> dict[str, Any]:
    """The step's batch as ShapeDtypeStructs with their shardings; ``lessons`` (rows,
    sequence length, lesson length; :func:`lesson_shape`) for a loss with lesson rows."""

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    b = {
        "student_tokens": sds((batch, student_len), jnp.int32),
        "student_positions": sds((batch, student_len), jnp.int32),
        "student_attn_mask": sds((batch, student_len), jnp.bool_),
        "student_index": sds((batch, response_len), jnp.int32),
        "teacher_tokens": sds((batch, teacher_len), jnp.int32),
        "teacher_positions": sds((batch, teacher_len), jnp.int32),
        "teacher_attn_mask": sds((batch, teacher_len), jnp.bool_),
        "teacher_index": sds((batch, response_len), jnp.int32),
        "responses": sds((batch, response_len), jnp.int32),
        "response_mask": sds((batch, response_len), jnp.float32),
        "sd_mask": sds((batch,), jnp.float32),
        "sampler_logp": sds((batch, response_len), jnp.float32),
        "old_logp": sds((batch, response_len), jnp.float32),
        "rewards": sds((batch,), jnp.float32),
    }

    spec = get_loss(step_fn.opts.loss_name)
    if not spec.needs_teacher:  # e.g. grpo: no teacher prompt (teacher_index is a base key)
        b = {k: v for k, v in b.items() if k not in TEACHER_KEYS}
    sh = step_fn.batch_shardings(b) or {}  # (None without a mesh)
    out = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh.get(k))
           for k, v in b.items()}
    if spec.lesson_nll:  # mode=mel: the lesson rows (laid out as distill.batch makes them)
        rows, seq, resp = lessons or (max(1, step_fn.batch_divisor()), student_len,
                                      response_len)
        ls = {"lesson_tokens": sds((rows, seq), jnp.int32),
              "lesson_positions": sds((rows, seq), jnp.int32),
              "lesson_attn_mask": sds((rows, seq), jnp.int32),
              "lesson_index": sds((rows, resp), jnp.int32),
              "lesson_targets": sds((rows, resp), jnp.int32),
              "lesson_mask": sds((rows, resp), jnp.float32)}
        lsh = step_fn.batch_shardings(ls) or {}
        out.update({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=lsh.get(k))
                    for k, v in ls.items()})
    return out


def distill_step_report(cfg: RunConfig, model_cfg: Any, mesh: Any, rules: Any, batch: int,
                        student_len: int, teacher_len: int, response_len: int) -> dict[str, Any]:
    # LoRA (lora.enabled): the state holds the adapters and their moments, the frozen base is
    # one more argument of the step, in lora.base_dtype, as the run's step takes it
    lora = cfg.lora.config() if cfg.lora.enabled else None
    ts = TrainStep(model_cfg, cfg.distill, mesh=mesh, rules=rules,
                   lesson_nll_weight=float(cfg.mel.nll_weight), lora=lora,
                   base_dtype=cfg.lora.base_dtype if lora is not None else "")
    state = ts.abstract_state()
    base = ts.abstract_base() if lora is not None else None
    unit = ts.microbatch_unit()  # GRPO-style losses: whole groups of rollout.n rows
    batch = -(-batch // unit) * unit
    ab = abstract_batch(ts, batch, student_len, teacher_len, response_len,
                        lesson_shape(cfg, ts.batch_divisor()))
    t0 = time.perf_counter()
    compiled = ts.lower(state, ab, base).compile()
    ma = compiled.memory_analysis()
    # Any array with two sequence-length axes ([.., T, S] scores or masks) in the optimised
    # program: with chunked attention there is none.
    seq_sq = seq_by_seq_shapes(compiled.as_text(), (student_len, teacher_len))
    out = {
        "what": "distillation step (TrainStep)",
        "batch": batch, "student_len": student_len, "teacher_len": teacher_len,
        "response_len": response_len, "vocab": model_cfg.vocab_size,
        "loss_name": cfg.distill.loss.name, "teacher_rule": cfg.distill.teacher.rule,
        "topk": cfg.distill.loss.topk, "chunk_size": cfg.distill.loss.chunk_size,
        "attention_impl": model_cfg.attention_impl,
        "attention_chunk": model_cfg.attention_chunk,
        "lora": str(lora) if lora is not None else None,
        "compile_seconds": round(time.perf_counter() - t0, 1),
        "seq_x_seq_shapes": seq_sq,
    }
    if ma is not None:
        out.update(memory_gib(ma))
        out["argument_bytes"] = int(getattr(ma, "argument_size_in_bytes", 0) or 0)
        full_logits = batch * response_len * model_cfg.vocab_size * 4 / mesh.size
        out["one_fp32_logits_tensor_per_device_gib"] = round(full_logits / GiB, 3)
    return out


def memory_gib(ma: Any) -> dict[str, float]:
    """``compiled.memory_analysis()`` in GiB (``argument_size_gib``, ...) and
    ``total_estimate_gib``: XLA:CPU reports no peak (0), so arguments + outputs -
    donated/aliased + temporaries bounds what the program's arrays need."""
    out = {}
    for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "peak_memory_in_bytes", "generated_code_size_in_bytes"):
        v = getattr(ma, k, None)
        if v is not None:
            out[k.replace("_in_bytes", "_gib")] = round(v / GiB, 3)
    if all(k in out for k in ("argument_size_gib", "output_size_gib", "temp_size_gib")):
        out["total_estimate_gib"] = round(
            out["argument_size_gib"] + out["output_size_gib"]
            - out.get("alias_size_gib", 0.0) + out["temp_size_gib"], 3)
    return out


def seq_by_seq_shapes(hlo_text: str, lengths: tuple[int, ...]) -> list[str]:
    """Distinct array shapes in an HLO text with at least two axes whose sizes are among
    ``lengths`` (sequence lengths): the signature of a materialised attention matrix."""
    lens = {int(n) for n in lengths}
    found = set()
    for m in re.finditer(r"\b([a-z]+[0-9]*)\[([0-9,]+)\]", hlo_text):
        dims = [int(d) for d in m.group(2).split(",") if d]
        if sum(d in lens for d in dims) >= 2:
            found.add(f"{m.group(1)}[{m.group(2)}]")
    return sorted(found)


def format_step_memory(r: dict[str, Any]) -> str:
    """One line: the distillation step's per-device memory from ``memory_analysis()``."""
    def g(k: str) -> str:
        v = r.get(k)
        return "n/a" if v is None else f"{v:.2f} GiB"

    return (f"distill step per device (attention={r.get('attention_impl')}, "
            f"student {r['student_len']} / teacher {r['teacher_len']} tokens, "
            f"response {r['response_len']}): temp {g('temp_size_gib')}, "
            f"arguments {g('argument_size_gib')}, outputs {g('output_size_gib')} "
            f"(aliased {g('alias_size_gib')}), total {g('total_estimate_gib')}"
            + (f", XLA peak {g('peak_memory_gib')}" if r.get("peak_memory_gib") else "")
            + f"; arrays with two sequence axes: {r.get('seq_x_seq_shapes') or 'none'}")


def model_config(cfg: RunConfig) -> Any:
    """The run's ModelConfig with its dtypes and attention options, no weights read: from
    ``model.preset``, else from ``model.source`` (an embedded model's GGUF metadata, or a
    folder's config.json). Raises ConfigError naming what is missing."""

    return _shapes(cfg).replace(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                                **attention_options(cfg))


def model_name(cfg: RunConfig) -> str:
    """What the reports call the model: its preset, else its source."""
    return str(cfg.model.preset or cfg.model.source)


def _shapes(cfg: RunConfig) -> Any:
    if cfg.model.preset:
        return preset(cfg.model.preset)
    src = cfg.model.source
    if src in EMBEDDED_MODELS:  # the GGUF's header: shapes without the weights
        try:
            header = gguf_io.read_gguf_header(embedded_gguf_path(src))
            return gguf_io.config_from_gguf(header.meta, set(header.tensor_shapes))
        except (AssetError, gguf_io.GGUFError) as e:
            raise ConfigError(f"--dry_run reads model.source={src!r}'s shapes from its GGUF: "
                              f"{e}") from None
    if src and (Path(src) / "config.json").exists():
        return from_hf_config(hf_io.read_hf_config(src))
    raise ConfigError(
        "--dry_run needs the model's shapes: model.preset (e.g. 'olmo3-7b', 'qwen3-8b'), or "
        f"model.source naming an embedded model ({', '.join(sorted(EMBEDDED_MODELS))}) or "
        f"a folder with a config.json (got model.source={src!r})")
