"""How a config section is declared once and used twice.

Each section is a frozen dataclass (:class:`Section`) whose fields are declared with
:func:`knob` (a value, its help text beside it) or :func:`section` (a nested section). From
that one declaration:

* :func:`to_config_dict` generates the ``ml_collections.ConfigDict`` that config files and
  ``--config.a.b=value`` overrides edit (same keys, same value types, nullable fields as
  ``FieldReference``\\ s so ``none`` can be given);
* :func:`freeze_section` builds the frozen, typed tree from that edited ConfigDict after
  validation, with the same attribute paths (``cfg.train.steps``).

A knob declared ``derived="a.b"`` is not on the command line: its value is copied from the
run's key ``a.b`` (or computed from it by ``derive``) when the run config is frozen (one home
per knob); the section's own
stand-alone ConfigDict (e.g. ``default_memory_config()``) still carries it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import ml_collections
from ml_collections import config_dict

S = TypeVar("S", bound="Section")


class FrozenDict(Mapping[str, Any]):
    """A read-only, hashable mapping (``mesh.rules``)."""

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._data.items())))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)


def knob(default: Any, help: str | Callable[[], str], *, nullable: type | None = None,
         as_list: bool = False, mapping: bool = False, derived: str = "",
         derive: Callable[[Any], Any] | None = None) -> Any:
    """A field with its default and help text (or a function that writes it when asked, for
    a help generated from a registry; read it with :func:`field_help`).

    nullable: the value type of a field that may also be None (a ``FieldReference`` of that
    type in the ConfigDict). as_list: a tuple here, a list in the ConfigDict (as config files
    write it). mapping: a free-form mapping (a ``FrozenDict`` here, an empty ConfigDict there).
    derived: the run key whose value this field takes when the run config is frozen; derive:
    the function of that value it takes instead (default: the value itself).
    """
    meta = {"help": help, "nullable": nullable, "as_list": as_list, "mapping": mapping,
            "derived": derived, "derive": derive}
    if mapping:
        return dataclasses.field(default_factory=lambda: FrozenDict(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def field_help(f: dataclasses.Field) -> str:
    """A knob's or section's help text (a generated help is written now)."""
    h = f.metadata["help"]
    return h() if callable(h) else str(h)


def section(cls: type[S], help: str, factory: Callable[[], S] | None = None) -> Any:
    """A nested section (its own frozen dataclass), default-built by ``factory``."""
    return dataclasses.field(default_factory=factory or cls,
                             metadata={"help": help, "section": cls})


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of every config section: frozen, with read-only dict views."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists for list knobs, dicts for sections), as ConfigDict.to_dict."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Section | FrozenDict):
                v = v.to_dict()
            elif f.metadata.get("as_list"):
                v = list(v)
            out[f.name] = v
        return out

    def replace(self: S, **changes: Any) -> S:
        return dataclasses.replace(self, **changes)

    def with_values(self: S, values: Mapping[str, Any]) -> S:
        """A copy with dotted ``values`` set (``{"context.extra_control_tokens": [...]}``),
        lists as tuples and mappings as FrozenDict, as :func:`freeze_section` stores them;
        this section is unchanged. A key the section does not declare raises KeyError."""
        for key in values:  # every path first, so the error names the whole key
            node: Any = self
            for part in key.split("."):
                if not isinstance(node, Section) or part not in {
                        f.name for f in dataclasses.fields(node)}:
                    raise KeyError(f"{type(self).__name__} has no knob {key!r}")
                node = getattr(node, part)
        fields = {f.name: f for f in dataclasses.fields(self)}
        nested: dict[str, dict[str, Any]] = {}
        flat: dict[str, Any] = {}
        for key, v in values.items():
            head, _, rest = key.partition(".")
            f = fields[head]
            if rest:
                nested.setdefault(head, {})[rest] = v
            elif f.metadata.get("as_list"):
                flat[key] = tuple(v)
            elif f.metadata.get("mapping"):
                flat[key] = FrozenDict(v)
            else:
                flat[key] = v
        for head, sub in nested.items():
            flat[head] = getattr(self, head).with_values(sub)
        return dataclasses.replace(self, **flat)

    def errors(self) -> list[str]:
        """The section's own problems, one line each (empty: none). Checks that span sections
        live in pmd_jax/config/validate.py."""
        return []


def item_fits(x: Any, item: type) -> bool:
    """Whether ``x`` is a value of a sequence knob's item type (an int for a float is fine; a
    bool is not an int)."""
    if item is float:
        return isinstance(x, int | float) and not isinstance(x, bool)
    return isinstance(x, item) and (item is bool or not isinstance(x, bool))


def item_type_errors(s: Section, prefix: str = "") -> list[str]:
    """Items of a sequence knob (``tuple[int, ...]``) that are not of the declared item type
    (an int for a float is fine; a bool is not an int), one line per knob."""
    out: list[str] = []
    hints = typing.get_type_hints(type(s))
    for f in dataclasses.fields(s):
        v = getattr(s, f.name)
        if isinstance(v, Section):
            out.extend(item_type_errors(v, f"{prefix}{f.name}."))
            continue
        args = typing.get_args(hints.get(f.name))
        if not isinstance(v, tuple) or len(args) != 2 or args[1] is not Ellipsis:
            continue
        item = args[0]
        if item not in (int, float, str, bool):
            continue
        bad = [x for x in v if not item_fits(x, item)]
        if bad:
            out.append(f"{prefix}{f.name} must hold {item.__name__} values, got {bad[0]!r} "
                       f"in {list(v)!r}")
    return out


def help_text(cls: type[Section], name: str) -> str:
    """The help text declared beside a field."""
    return {f.name: field_help(f) if "help" in f.metadata else ""
            for f in dataclasses.fields(cls)}[name]


def to_config_dict(obj: Section, *, derived: bool = True) -> ml_collections.ConfigDict:
    """The editable ConfigDict of a section instance (its values as defaults). With
    ``derived=False`` the derived knobs are left out (the run's command-line surface)."""
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(obj):
        meta, v = f.metadata, getattr(obj, f.name)
        if meta.get("derived") and not derived:
            continue
        if meta.get("section"):
            c[f.name] = to_config_dict(v, derived=derived)
        elif meta.get("nullable") is not None:
            c[f.name] = config_dict.FieldReference(v, field_type=meta["nullable"])
        elif meta.get("as_list"):
            c[f.name] = list(v)
        elif meta.get("mapping"):
            c[f.name] = ml_collections.ConfigDict(dict(v))
        else:
            c[f.name] = v
    return c


def schema_keys(cls: type[Section], prefix: str = "", *, derived: bool = False) -> list[str]:
    """Dotted names of every knob and section of a section class."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived") and not derived:
            continue
        out.append(prefix + f.name)
        if f.metadata.get("section"):
            out.extend(schema_keys(f.metadata["section"], f"{prefix}{f.name}.",
                                   derived=derived))
    return out


def unknown_keys(cls: type[Section], c: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a run ConfigDict that the section does not declare, derived knobs
    included (a config file may add keys to an unlocked ConfigDict; a free-form mapping's
    children are not checked)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: list[str] = []
    for k in c.keys():
        f = fields.get(k)
        if f is None or f.metadata.get("derived"):
            out.append(prefix + k)
        elif f.metadata.get("section") and isinstance(c[k], config_dict.ConfigDict):
            out.extend(unknown_keys(f.metadata["section"], c[k], f"{prefix}{k}."))
    return out


def _lookup(root: config_dict.ConfigDict, dotted: str) -> Any:
    for part in dotted.split("."):
        root = root[part]
    return root


def freeze_section(cls: type[S], c: config_dict.ConfigDict, *,
                   root: config_dict.ConfigDict | None = None, path: str = "") -> S:
    """The frozen ``cls`` holding the values of ConfigDict ``c`` (nullable references
    resolved, lists as tuples, mappings as FrozenDict). A derived knob takes the value of its
    run key in ``root`` when given, else the ConfigDict's own value (a stand-alone section);
    a knob the ConfigDict lacks keeps its declared default."""
    if not isinstance(c, config_dict.ConfigDict):
        raise TypeError(f"freezing {cls.__name__} needs an ml_collections ConfigDict, got "
                        f"{type(c).__name__}" + (" (already frozen)" if isinstance(c, cls)
                                                 else ""))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        key = path + f.name
        if meta.get("derived") and root is not None:
            v = _lookup(root, meta["derived"])
            if meta.get("derive") is not None:
                v = meta["derive"](v)
        elif f.name in c:
            v = c[f.name]
        else:
            continue
        if meta.get("section"):
            v = freeze_section(meta["section"], v, root=root, path=key + ".")
        elif meta.get("as_list"):
            v = tuple(v)
        elif meta.get("mapping"):
            v = FrozenDict(v.to_dict() if hasattr(v, "to_dict") else dict(v or {}))
        values[f.name] = v
    return cls(**values)
