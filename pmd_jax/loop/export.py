"""The run's final weights as a Hugging Face checkpoint (``train.export_hf``), and, for a
LoRA run, its adapters as a PEFT adapter folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import jax.numpy as jnp

from pmd_jax.distill.train import current_params
from pmd_jax.loop.build import is_main_process
from pmd_jax.models.hf_io import save_hf_checkpoint
from pmd_jax.models.lora import save_peft_adapter
from pmd_jax.run import paths
from pmd_jax.run.multihost import gather_tree

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig
    from pmd_jax.distill.train import TrainBundle
    from pmd_jax.loop.build import ModelBundle


def export_hf(cfg: RunConfig, model: ModelBundle, bundle: TrainBundle, path: Path) -> Path | None:
    """Writes the current params as a HF checkpoint (LoRA: the adapters merged into the
    base). Call it on every process: the params are gathered to host memory (a collective
    with several processes), process 0 writes."""

    params = gather_tree(current_params(cfg, bundle), keep=is_main_process())
    if params is None:
        return None
    # safetensors writes local files: a gs:// path is staged locally, then uploaded
    with paths.staged_dir(path) as d:
        save_hf_checkpoint(params, model.cfg, d, dtype="float32"
                           if model.cfg.param_dtype == "float32" else "bfloat16",
                           tokenizer=model.tokenizer)
    return path


def export_peft(cfg: RunConfig, model: ModelBundle, bundle: TrainBundle, path: Path
                ) -> Path | None:
    """Writes a LoRA run's adapters as a PEFT adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``; ``peft.PeftModel.from_pretrained(base, path)`` loads it),
    in the compute dtype ``distill.precision.param_dtype``: the adapters exactly as the merged
    export folded them in. ``base_model_name_or_path`` is ``model.source`` (None for random
    weights). Call it on every process, as :func:`export_hf`."""

    if bundle.lora is None:
        raise ValueError("export_peft: the run trains no LoRA adapters (lora.enabled=False)")
    dtype = str(cfg.distill.precision.param_dtype)
    adapters = gather_tree(
        {"layers": {k: v.astype(jnp.dtype(dtype))
                    for k, v in bundle.state.params["layers"].items()}},
        keep=is_main_process())
    if adapters is None:
        return None
    src = str(cfg.model.source)
    base_name = None if cfg.model.random_init else (
        os.path.abspath(src) if os.path.isdir(src) else src)
    with paths.staged_dir(path) as d:
        save_peft_adapter(adapters, model.cfg, bundle.lora, d, base_model_name_or_path=base_name,
                          dtype=dtype)
    return path
