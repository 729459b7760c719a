"""The RoPE parameters of one layer type (HF ``rope_parameters`` semantics), below both the
model config (:mod:`pmd_jax.models.config`, which re-exports :class:`RopeConfig`) and the
family table (:mod:`pmd_jax.models.families`, which writes it back as HF keys)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters for one layer type (HF ``rope_parameters`` semantics)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "yarn" | "linear"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (None -> HF default formula)
    truncate: bool = True  # yarn
