"""The run's final weights as a Hugging Face checkpoint (``train.export_hf``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig
    from pmd_jax.distill.train import TrainBundle
    from pmd_jax.loop.build import ModelBundle


def export_hf(cfg: RunConfig, model: ModelBundle, bundle: TrainBundle, path: Path) -> Path | None:
    """Writes the current params as a HF checkpoint. Call it on every process: the params
    are gathered to host memory (a collective with several processes), process 0 writes."""
    from pmd_jax.distill.train import current_params
    from pmd_jax.loop.build import is_main_process
    from pmd_jax.models.hf_io import save_hf_checkpoint
    from pmd_jax.run import paths
    from pmd_jax.run.multihost import gather_tree

    params = gather_tree(current_params(cfg, bundle), keep=is_main_process())
    if params is None:
        return None
    # safetensors writes local files: a gs:// path is staged locally, then uploaded
    with paths.staged_dir(path) as d:
        save_hf_checkpoint(params, model.cfg, d, dtype="float32"
                           if model.cfg.param_dtype == "float32" else "bfloat16",
                           tokenizer=model.tokenizer)
    return path
