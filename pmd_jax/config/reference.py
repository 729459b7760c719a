"""The configuration reference, ``docs/configuration.md``, generated from the knobs'
declarations so that it cannot drift from them.

    python -m pmd_jax.config.reference > docs/configuration.md

It renders the fields that ``python -m pmd_jax.config`` prints
(:func:`pmd_jax.config.__main__.describe`): every knob of
:class:`~pmd_jax.config.sections.RunConfig` with its default and help text, a Markdown
section per config section. ``tests/config/test_reference.py`` fails when the
committed file differs from :func:`render`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from typing import Any

from pmd_jax.config.schema import Section, field_help
from pmd_jax.config.sections import RunConfig

DOC_PATH = "docs/configuration.md"
COMMAND = f"python -m pmd_jax.config.reference > {DOC_PATH}"
TOP_LEVEL = "Top level"


@dataclasses.dataclass
class _Part:
    """One Markdown section: a config section (or the top-level knobs) and its own knobs."""

    key: str  # dotted name, '' for the top level
    help: str
    depth: int  # 0: top level, 1: a run section, 2+: nested
    module: str
    knobs: list[str] = dataclasses.field(default_factory=list)


def _code(text: str) -> str:
    """``text`` as an inline code span, fenced past any backticks it holds."""
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (run + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _prose(text: str) -> str:
    """Help text as Markdown: one line, with what Markdown would read as markup (an HTML-like
    ``<tag``, an emphasis ``*``) escaped outside the help's own code spans."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", parts[i]).replace("*", r"\*")
    return "`".join(parts)


def _default(f: dataclasses.Field, value: Any) -> str:
    """The default as ``python -m pmd_jax.config`` shows it."""
    shown = value.to_dict() if hasattr(value, "to_dict") else (
        list(value) if f.metadata.get("as_list") else value)
    return repr(shown)


def _module_path(cls: type) -> str:
    """The declaring module as a repository path (the same for an installed package)."""
    return cls.__module__.replace(".", "/") + ".py"


def _parts(obj: Section, key: str = "", help: str = "", depth: int = 0) -> Iterator[_Part]:
    part = _Part(key, help, depth, _module_path(type(obj)))
    nested: list[tuple[dataclasses.Field, Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{key}.{f.name}" if key else f.name
        if f.metadata.get("section"):
            nested.append((f, value))
            continue
        if f.metadata.get("derived"):
            part.knobs.append(
                f"- {_code(name)}: {_prose(field_help(f))} *Derived from "
                f"{_code(f.metadata['derived'])} when the run config is frozen; not a "
                "command-line key.*")
            continue
        part.knobs.append(f"- {_code(name)} (default {_code(_default(f, value))}): "
                          f"{_prose(field_help(f))}")
    yield part
    for f, value in nested:
        name = f"{key}.{f.name}" if key else f.name
        yield from _parts(value, name, field_help(f), depth + 1)


def _title(part: _Part) -> str:
    return _code(part.key) if part.key else TOP_LEVEL


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render(config: Section | None = None) -> str:
    """The Markdown reference of ``config`` (default: ``RunConfig()``)."""
    parts = list(_parts(config if config is not None else RunConfig()))
    n_knobs = sum(len(p.knobs) for p in parts)
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated file: do not edit. Regenerate with",
        f"     {COMMAND}",
        "     (tests/config/test_reference.py checks it). -->",
        "",
        f"Every knob of the run config ({n_knobs} of them), with its default and its help "
        "text, a section per config section. The file is generated from the knobs' "
        "declarations (each section's module is named under its heading) by",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        "so it cannot drift from the code: `tests/config/test_reference.py` fails when it is "
        "out of date. `python -m pmd_jax.config [prefix]` prints the same knobs in the "
        "terminal (e.g. `python -m pmd_jax.config distill.loss`).",
        "",
        "A run starts from a config file (`--config=configs/smollm2_sciq.py`), which starts "
        "from these defaults and changes some of them; any knob can then be overridden on "
        "the command line as `--config.section.key=value`, e.g. "
        "`--config.train.steps=4 --config.mode=sdpo`. `none` sets a knob that may be None "
        "(`--config.distill.loss.topk=none`); a list knob takes a Python list or "
        "comma-separated values (`--config.eval.seeds=0,1,2`). Unknown keys (with the "
        "closest valid names), "
        "values of the wrong type and impossible combinations are reported together, "
        "before anything is loaded. A derived knob is not a command-line key: its value "
        "comes from the key it names when the run config is frozen.",
        "",
        "Contents:",
        "",
    ]
    for part in parts:
        indent = "  " * max(part.depth - 1, 0)
        title = _title(part)
        out.append(f"{indent}- [{title}](#{_anchor(title)})")
    for part in parts:
        title = _title(part)
        out += ["", f"{'#' * (2 if part.depth <= 1 else 3)} {title}", ""]
        if part.help:
            out += [_prose(part.help), ""]
        out += [f"Declared in `{part.module}`.", ""]
        out += part.knobs or ["(No knobs of its own.)"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    del argv
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
