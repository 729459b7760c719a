"""Dedicated unprivileged uids for sandboxed programs (root host only): one per concurrent run."""

from __future__ import annotations

import os
import threading

from pmd_jax.tasks.sandbox.base import SandboxError

# Dedicated uids for sandboxed programs (root host only). One per concurrent run, from a
# range chosen by the host pid (re-chosen after a fork), so two host processes rarely share.
_UID_SLOTS = 32
_uid_lock = threading.Lock()
_uid_owner = -1
_uid_free: list[int] = []


def _uid_base(pid: int) -> int:
    return 200_000 + (pid % 40_000) * _UID_SLOTS


def acquire_uid() -> int:
    global _uid_owner, _uid_free
    with _uid_lock:
        if _uid_owner != os.getpid():  # first use, or we are a forked child
            _uid_owner = os.getpid()
            base = _uid_base(_uid_owner)
            _uid_free = list(range(base, base + _UID_SLOTS))
        if not _uid_free:
            raise SandboxError(f"more than {_UID_SLOTS} concurrent sandbox runs in one process")
        return _uid_free.pop()


def release_uid(uid: int) -> None:
    with _uid_lock:
        if _uid_owner == os.getpid() and uid not in _uid_free:
            _uid_free.append(uid)
