"""Every knob of the run config with its default and help text, from the declarations.

    python -m pmd_jax.config                 # all knobs
    python -m pmd_jax.config distill.loss    # the knobs under a prefix
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from collections.abc import Iterator

from pmd_jax.config.schema import Section, field_help
from pmd_jax.config.sections import RunConfig


def describe(obj: Section, prefix: str = "") -> Iterator[str]:
    """``key = default`` lines, each followed by its help text (derived knobs say where
    their value comes from)."""
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if f.metadata.get("section"):
            yield f"[{key}] {field_help(f)}"
            yield from describe(value, key + ".")
            continue
        if f.metadata.get("derived"):
            continue  # not a run key: its value is the named key's
        shown = value.to_dict() if hasattr(value, "to_dict") else (
            list(value) if f.metadata.get("as_list") else value)
        yield f"{key} = {shown!r}"
        yield textwrap.fill(field_help(f), 96, initial_indent="    ",
                            subsequent_indent="    ")


def main(argv: list[str]) -> int:
    prefix = argv[1] if len(argv) > 1 else ""
    lines = list(describe(RunConfig()))
    keep, shown = False, 0
    for line in lines:
        if not line.startswith(" "):
            key = line[1:].split("]")[0] if line.startswith("[") else line.split(" = ")[0]
            keep = key == prefix or key.startswith(prefix + ".") or not prefix
            shown += keep
        if keep:
            print(line)
    if not shown:
        print(f"no config key {prefix!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
