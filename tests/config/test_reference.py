"""docs/configuration.md is what pmd_jax.config.reference renders from the knobs' declarations."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from pmd_jax.config.reference import COMMAND, DOC_PATH, render
from pmd_jax.config.sections import RunConfig
from tests.tiny_runs import child_env

ROOT = Path(__file__).resolve().parents[2]
STALE = (f"{DOC_PATH} is out of date with the knobs' declarations: rerun the generator, "
         f"`{COMMAND}`, and commit the result")


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            yield from _keys(f.metadata["section"], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_configuration_md_is_generated():
    assert (ROOT / DOC_PATH).read_text(encoding="utf-8") == render(), STALE


def test_every_knob_is_listed_once():
    text = render()
    keys = list(_keys(RunConfig))
    assert len(keys) > 100
    for key in keys:
        assert text.count(f"\n- `{key}`") == 1, key


def test_the_documented_command_prints_it():
    out = subprocess.run([sys.executable, "-m", "pmd_jax.config.reference"], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, check=True).stdout
    assert out == render()
