"""Moved to ``tests/local_vllm.py`` (test and benchmark support, not part of the package)."""

from tests.local_vllm import LocalVllmServer  # noqa: F401  # moved: pmd_jax.sampling.local_vllm -> tests.local_vllm (issue 16)
