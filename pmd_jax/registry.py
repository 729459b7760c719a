"""A registry by name: what the package's extension points share (sampler backends in
``sampling/backends.py``, chat formats in ``models/chat.py``): one registration per entry, a
second one refused, a lookup that names the known entries when it fails."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one ``kind`` by name. ``unknown(name, known)`` makes the error a failed
    lookup raises (each registry words its own, naming the knob a user set)."""

    def __init__(self, kind: str, unknown: Callable[[str, tuple[str, ...]], Exception]) -> None:
        self.kind = kind
        self._unknown = unknown
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        if name not in self._items:
            raise self._unknown(name, self.names())
        return self._items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def values(self) -> Iterator[T]:
        return iter(tuple(self._items.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._items
