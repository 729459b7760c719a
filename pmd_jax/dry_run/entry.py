"""``python -m pmd_jax.main --dry_run``: the dry run of a run config, on a target's simulated
hardware (``target.py``) or on the devices jax has (``distill_step.py``)."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import jax

from pmd_jax.dry_run.distill_step import (
    distill_step_report,
    format_step_memory,
    mesh_shape,
    model_config,
    model_name,
)
from pmd_jax.dry_run.forward_backward import dry_run
from pmd_jax.dry_run.target import target_report
from pmd_jax.run.sharding import ShardingRules, make_mesh

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger("pmd_jax")


def dry_run_from_config(cfg: RunConfig) -> dict[str, Any]:
    """The dry run of a frozen run config (``config.freeze`` gives the derived knobs, e.g.
    the loss's group size from the rollout section)."""
    target = cfg.dry_run.target
    if target:
        return target_report(cfg, target, count_cost=bool(cfg.dry_run.roofline))

    mc = model_config(cfg)
    n = jax.device_count()
    shape = mesh_shape(cfg, n)
    rules_map = cfg.mesh.rules.to_dict() if cfg.mesh.rules else None
    rows = int(cfg.rollout.problems_per_step) * int(cfg.rollout.n)
    seq = int(cfg.rollout.max_prompt_tokens) + int(cfg.rollout.max_tokens)
    per_dev = max(1, shape["data"] * shape["fsdp"])
    log.info("dry run: %s on %d simulated devices %s", model_name(cfg), n, shape)
    report: dict[str, Any] = {"model": model_name(cfg), "mesh": shape,
                              "params": mc.num_params(),
                              "flops_per_token_fwd": mc.flops_per_token(seq)}
    t0 = time.perf_counter()
    report["forward_backward"] = dry_run(mc, shape, per_dev, seq, rules=rules_map)
    log.info("forward+backward compiled in %.0fs", time.perf_counter() - t0)
    mesh = make_mesh(shape)
    rules = ShardingRules.from_mapping(rules_map)
    response = int(cfg.rollout.max_tokens)
    report["distill_step"] = distill_step_report(
        cfg, mc, mesh, rules, per_dev, seq,
        int(cfg.teacher_prompt.max_tokens) + response, response,
    )
    report["rollout_rows_per_step"] = rows
    print(json.dumps(report, indent=2, default=str))
    print(format_step_memory(report["distill_step"]))
    return report
