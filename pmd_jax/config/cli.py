"""The command line of a run, checked before absl parses it.

``check_command_line`` looks at the ``--config=`` / ``--config.a.b=value`` arguments: a missing
or broken config file, unknown keys (with the closest valid names) and values that do not
parse as the field's type are reported as one-line problems instead of tracebacks, and
``none`` sets a nullable field (e.g. ``distill.loss.topk``) to None, which ml_collections' own
parsers cannot do. ``main`` reports those together with ``config.config_errors``' problems.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_dict

from pmd_jax.config.schema import item_fits
from pmd_jax.config.validate import format_errors, moved_key_message
from pmd_jax.models.config import ConfigError

_HELP_FLAGS = ("-h", "--h", "-help", "--help", "-helpshort", "--helpshort", "-helpfull",
               "--helpfull", "-helpxml", "--helpxml", "-?")


@dataclasses.dataclass
class CommandLine:
    """What ``check_command_line`` found in argv."""

    argv: list[str]  # argv for absl: the overrides reported in ``errors`` or ``none_keys`` out
    errors: list[str]  # one line per problem
    fatal: bool = False  # no config to run with (missing / broken file): report and stop
    none_keys: list[str] = dataclasses.field(default_factory=list)  # set these to None
    # list and tuple knobs, parsed here (absl cannot set a list field and reads a tuple's
    # text character by character): set these values
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def config_keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of every field and section (sections can be set whole from a dict)."""
    out: list[str] = []
    for k in c.keys():
        v = c._fields[k]  # noqa: SLF001 - the raw field (FieldReference kept)
        out.append(prefix + k)
        if isinstance(v, config_dict.ConfigDict):
            out.extend(config_keys(v, f"{prefix}{k}."))
    return out


def _lookup(c: Any, key: str) -> tuple[ml_collections.ConfigDict, str] | None:
    """(holder, field name) of a dotted key, or None when some part does not exist."""
    parts = key.split(".")
    holder = c
    for part in parts[:-1]:
        if not isinstance(holder, config_dict.ConfigDict) or part not in holder:
            return None
        holder = holder._fields[part]  # noqa: SLF001
    if not isinstance(holder, config_dict.ConfigDict) or parts[-1] not in holder:
        return None
    return holder, parts[-1]


def is_nullable(c: ml_collections.ConfigDict, key: str) -> bool:
    """Whether a field may hold None: a FieldReference (``_nullable`` in distill.config) or a
    field whose value is None."""
    found = _lookup(c, key)
    if found is None:
        return False
    holder, name = found
    raw = holder._fields[name]  # noqa: SLF001
    return isinstance(raw, config_dict.FieldReference) or raw is None


def unknown_key_message(c: ml_collections.ConfigDict, key: str) -> str:
    """"unknown config key 'x'; did you mean 'y'?" with the closest valid dotted names; a key
    that moved (``pmd_jax.config.MOVED_KEYS``) names its new home."""

    moved = moved_key_message(key)
    if moved is not None:
        return moved
    keys = config_keys(c)
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):  # a child of an empty section (mesh.rules)
        found = _lookup(c, ".".join(parts[:i]))
        if found is not None:
            sect = found[0]._fields[found[1]]  # noqa: SLF001
            if isinstance(sect, config_dict.ConfigDict) and not sect.keys():
                name = ".".join(parts[:i])
                return (f"unknown config key {key!r}: {name} has no fields; set it whole, "
                        f"e.g. --config.{name}=\"{{'{parts[i]}': ...}}\"")
            break
    leaf = parts[-1]
    cands = {k for k in keys if k.rsplit(".", 1)[-1] == leaf}
    cands.update(difflib.get_close_matches(key, keys, n=3, cutoff=0.6))
    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in cands),
                    reverse=True)
    hints = [k for r, k in scored if r >= scored[0][0] - 0.1][:3] if scored else []
    if not hints:
        top = sorted(k for k in keys if "." not in k)
        return f"unknown config key {key!r}; valid top-level keys: {', '.join(top)}"
    return f"unknown config key {key!r}; did you mean " + " or ".join(
        repr(h) for h in hints) + "?"


def _parse_value(ftype: Any, value: str) -> str | None:
    """None when absl's parser for the field's type accepts ``value``, else what it needs."""

    parsers: dict[Any, tuple[Any, str]] = {
        int: (flags.IntegerParser(), "an int"), float: (flags.FloatParser(), "a number"),
        bool: (flags.BooleanParser(), "true or false"),
    }
    if ftype not in parsers:
        return None
    parser, what = parsers[ftype]
    try:
        parser.parse(value)
    except ValueError:
        return what
    return None


def _missing_config_file(path: str) -> str | None:
    if os.path.isfile(path):
        return None
    folder = os.path.dirname(path) or "."
    names = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(
        folder) else []
    if not names and os.path.isdir("configs"):
        folder, names = "configs", sorted(f for f in os.listdir("configs") if f.endswith(".py"))
    msg = f"config file {path!r} (--config) not found"
    if names:
        cands = [os.path.join(folder, n) for n in names]
        close = difflib.get_close_matches(path, cands, n=1)
        msg += (f"; did you mean {close[0]!r}?" if close else "") + (
            f" config files in {folder}/: {', '.join(names)}")
    return msg


def load_config_file(spec: str) -> Any:
    """``get_config()`` of a config file (``path`` or ``path:arg`` as ml_collections takes
    it); raises ConfigError with one line when the file is missing or fails."""
    path, *arg = spec.split(":", 1)
    if not path:
        raise ConfigError("--config is empty: give a config file, e.g. configs/smollm2_sciq.py")
    missing = _missing_config_file(path)
    if missing:
        raise ConfigError(missing)
    try:
        mspec = importlib.util.spec_from_file_location("pmd_jax_user_config", path)
        if mspec is None or mspec.loader is None:
            raise ImportError(f"cannot import {path}")
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
        return mod.get_config(*arg)
    except Exception as e:  # noqa: BLE001 - any error in the user's file is reported, once
        raise ConfigError(f"config file {path!r} failed to load: {type(e).__name__}: {e}"
                          ) from None


def _parse_sequence(current: Any, value: str) -> tuple[list[Any] | None, str | None]:
    """(the items, None) of a list or tuple knob's command-line value (``[1, 2]``, ``1,2``,
    ``(1,)``, bare words ``q_proj,v_proj`` or one bare value), or (None, what it needs) when
    an item is not of the type of the knob's current items."""
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        # bare words: one string item, or comma-separated items
        parsed = [w.strip() for w in value.split(",")] if "," in value else value
    items = list(parsed) if isinstance(parsed, list | tuple) else [parsed]
    if not current:
        return items, None
    elem = type(current[0])
    if not all(item_fits(x, elem) for x in items):
        return None, f"a list of {elem.__name__}"
    return [float(x) for x in items] if elem is float else items, None


def _is_dict_literal(value: str) -> bool:
    """Whether ``value`` reads as a Python dict literal (how a whole section is given)."""
    try:
        return isinstance(ast.literal_eval(value.strip()), dict)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False


def check_command_line(argv: Sequence[str], flag: str = "config") -> CommandLine:
    """Checks the config file and the ``--config.*`` overrides in ``argv`` (absl syntax:
    ``--config.k=v``, ``--config.k v``, ``--config.flag`` / ``--noconfig.flag``, the last
    occurrence wins, ``--`` ends the flags). Unknown keys and values that do not parse are
    reported and left out of the returned argv (so absl parses the rest and ``main`` can
    report them with the config's own problems); ``none`` / ``None`` given to a nullable
    field is left out too and listed in ``none_keys`` (ml_collections' parsers reject it)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    if any(a in _HELP_FLAGS for a in argv[1:end]):
        return CommandLine(argv, [])
    spec = None
    for i, a in enumerate(argv[1:end], 1):
        if a in (f"-{flag}", f"--{flag}"):
            spec = argv[i + 1] if i + 1 < end else ""
        elif a.startswith((f"-{flag}=", f"--{flag}=")):
            spec = a.split("=", 1)[1]
    if spec is None:
        return CommandLine(argv, [f"--{flag}=configs/<name>.py is required"], fatal=True)
    try:
        cfg = load_config_file(spec)
    except ConfigError as e:
        return CommandLine(argv, [str(e)], fatal=True)
    if not isinstance(cfg, config_dict.ConfigDict):
        return CommandLine(argv, [])
    errs: dict[str, str] = {}  # last word on each key
    none_keys: dict[str, None] = {}
    values: dict[str, Any] = {}
    out = argv[:1]
    i = 1
    while i < end:
        a = argv[i]
        m = None
        for pre in (f"--{flag}.", f"-{flag}.", f"--no{flag}.", f"-no{flag}."):
            if a.startswith(pre):
                m = pre
                break
        if m is None:
            out.append(a)
            i += 1
            continue
        negated = m.lstrip("-").startswith("no")
        key, eq, value = a[len(m):].partition("=")
        found = _lookup(cfg, key)
        ftype = None
        if found is not None and not isinstance(found[0]._fields[found[1]],  # noqa: SLF001
                                                config_dict.ConfigDict):
            ftype = found[0].get_type(found[1])
        takes_next = (not eq and not negated and ftype is not bool and i + 1 < end
                      and not (found is None and argv[i + 1].startswith("-")))
        if takes_next:
            value = argv[i + 1]
        span = argv[i:i + 1 + int(takes_next)]
        i += len(span)
        if found is None:
            errs[key] = unknown_key_message(cfg, key)
            continue
        errs.pop(key, None)
        none_keys.pop(key, None)
        values.pop(key, None)
        if ftype is None and (eq or takes_next) and not _is_dict_literal(value):
            sect = found[0]._fields[found[1]]  # noqa: SLF001
            knobs = ", ".join(sect.keys())
            errs[key] = (f"{key} is a section, not a value (got {value!r}); set one of its "
                         f"knobs ({knobs}), e.g. --{flag}.{key}.{next(iter(sect.keys()), 'x')}"
                         "=..." if knobs else
                         f"{key} is a section: set it whole from a dict, e.g. "
                         f"--{flag}.{key}=\"{{'name': ...}}\" (got {value!r})")
            continue
        if ftype is None or negated or not (eq or takes_next):
            out.extend(span)  # a section (dict literal) or a bare boolean
            continue
        if ftype in (list, tuple):
            items, need = _parse_sequence(found[0][found[1]], value)
            if items is None:
                errs[key] = f"{key} needs {need}, got {value!r} (--{flag}.{key})"
            else:
                values[key] = items if ftype is list else tuple(items)
            continue
        if value.strip().lower() == "none" and ftype is not str and is_nullable(cfg, key):
            none_keys[key] = None
            continue
        need = _parse_value(ftype, value)
        if need is not None:
            if is_nullable(cfg, key):
                need += " or none"
            elif value.strip().lower() == "none":
                need += " (it cannot be None)"
            errs[key] = f"{key} needs {need}, got {value!r} (--{flag}.{key})"
            continue
        out.extend(span)
    out.extend(argv[end:])
    return CommandLine(out, list(errs.values()), none_keys=list(none_keys), values=values)


def apply_taken(c: ml_collections.ConfigDict, line: CommandLine) -> None:
    """Sets what ``check_command_line`` took out of argv for absl: ``none`` values and the
    list and tuple knobs it parsed itself."""
    set_none(c, line.none_keys)
    for key, value in line.values.items():
        found = _lookup(c, key)
        if found is None:
            raise ConfigError(f"unknown config key {key!r}")
        holder, name = found
        holder[name] = value


def set_none(c: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    """Sets each dotted key to None (the ``none`` values ``check_command_line`` took out)."""
    for key in keys:
        found = _lookup(c, key)
        if found is None:
            raise ConfigError(f"unknown config key {key!r}")
        holder, name = found
        holder[name] = None




# ----------------------------------------------------------------------------- front doors
CONFIG_ERROR_EXIT = 2


def setup_logging() -> None:
    """The commands' log format on stderr (pmd_jax.main, pmd_jax.probe); noisy libraries at
    WARNING."""

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("absl", "jax._src", "orbax", "urllib3", "httpx", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def report_errors(errs: list[str]) -> int:
    """Prints every problem, one line each, on stderr; returns the exit status 2."""

    print(format_errors(errs), file=sys.stderr, flush=True)
    return CONFIG_ERROR_EXIT


def run_command(main: Any, lines: list[CommandLine]) -> None:
    """An absl command's entry (pmd_jax.main, pmd_jax.probe): flag files read, the config
    file and its ``--config.*`` overrides checked (the checked line appended to ``lines`` for
    ``main`` to apply), then ``main(argv)``'s return value is the exit status."""

    try:
        argv = flags.FLAGS.read_flags_from_files(sys.argv, force_gnu=False)
    except flags.Error as e:  # e.g. a missing --flagfile
        sys.exit(report_errors([str(e)]))
    line = check_command_line(argv)
    if line.fatal:
        sys.exit(report_errors(line.errors))
    # ml_collections reads the overrides from sys.argv itself: hand it the checked ones.
    sys.argv = line.argv
    lines.append(line)
    app.run(lambda argv: sys.exit(main(argv)), argv=line.argv)
