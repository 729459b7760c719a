"""Procedural memory for PMD: experience, insight and behavior levels (memory/level.py's
interface, registered in memory/memory.py's ``LEVELS``); ScaNN retrieval."""

from pmd_jax.memory.config import (
    MemoryConfig,
    default_memory_config,
    freeze_memory_config,
    validate_memory_config,
)
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.embedder import SentenceEmbedder
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.level import MemoryLevel
from pmd_jax.memory.memory import ProceduralMemory
from pmd_jax.memory.types import (
    Behavior,
    ExperienceItem,
    InsightItem,
    MemoryUpdateStats,
    Provenance,
    RolloutRecord,
)

__all__ = [
    "Behavior",
    "ExperienceItem",
    "InsightItem",
    "MemoryConfig",
    "MemoryLevel",
    "MemoryUpdateStats",
    "ProceduralMemory",
    "Provenance",
    "RolloutRecord",
    "ScannIndex",
    "SentenceEmbedder",
    "TeacherContext",
    "default_memory_config",
    "freeze_memory_config",
    "validate_memory_config",
]
