"""Run-directory file I/O that works the same on a local folder and on ``gs://`` (or s3/az).

Every writer of the run directory (metrics, evaluation results, the memory's JSONL / HTML,
plots, checkpoints' own files, the HF export) goes through these helpers, so a ``gs://``
run dir stays a URL all the way: it is never handed to ``open``, ``os`` or ``pathlib``
(which would make a local folder literally named ``gs:``).

Paths are :class:`etils.epath.Path` (orbax uses the same class): local paths are made
absolute, remote URLs are kept as they are. On remote paths epath talks to the bucket through
fsspec (``gcsfs`` for gs://, installed by launch/tpu_pod.sh and launch/gpu.sh when the run dir
is remote) or through TensorFlow's gfile when TensorFlow is installed.

Appending: objects on GCS/S3 cannot be appended to. :class:`JsonlWriter` therefore keeps
the file's lines in memory on a remote path and rewrites the whole object on every
``write`` (a single object write, which is atomic on GCS: a reader sees the old or the new
file, never a torn line). That costs O(file size) per record, fine for metrics.jsonl
(a few KB per step, a few MB per run); on a local path it is a real append.

Whole-file writes (:func:`write_bytes` / :func:`write_text`) are atomic both ways: locally a
temporary file in the same folder, fsync'ed, then ``os.replace``; remotely one object write.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from etils import epath

REMOTE_PREFIXES: tuple[str, ...] = ("gs://", "s3://", "az://")

PathLike = str | os.PathLike


def is_remote(path: PathLike) -> bool:
    """True for a ``gs://`` / ``s3://`` / ``az://`` URL (or an epath.Path holding one)."""
    return os.fspath(path).startswith(REMOTE_PREFIXES)


def run_path(path: PathLike) -> epath.Path:
    """``path`` as an :class:`epath.Path`: a remote URL unchanged, a local path expanded
    (``~``) and made absolute. Raises ValueError for another ``scheme://`` URL (epath would
    treat it as a relative local path)."""
    s = os.fspath(path)
    if not isinstance(s, str) or not s.strip():
        raise ValueError(f"not a path: {path!r}")
    if is_remote(s):
        return epath.Path(s)
    if "://" in s:
        raise ValueError(f"{s!r}: unsupported URL scheme (supported: local paths, "
                         f"{', '.join(REMOTE_PREFIXES)})")
    return epath.Path(os.path.abspath(os.path.expanduser(s)))


def makedirs(path: PathLike) -> epath.Path:
    """Creates the folder and its parents (on buckets a no-op unless the backend keeps
    folder markers); returns it as an epath.Path."""
    p = run_path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_bytes(path: PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Writes ``data`` atomically (see the module docstring); creates missing parents."""
    p = run_path(path)
    if is_remote(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("wb") as f:
            f.write(data)
        return
    d = os.path.dirname(os.fspath(p))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, os.fspath(p))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path: PathLike, text: str, *, fsync: bool = True) -> None:
    write_bytes(path, text.encode("utf-8"), fsync=fsync)


def read_bytes(path: PathLike) -> bytes:
    return run_path(path).read_bytes()


def read_text(path: PathLike) -> str:
    return run_path(path).read_bytes().decode("utf-8")


def exists(path: PathLike) -> bool:
    return run_path(path).exists()


def size(path: PathLike) -> int:
    """File size in bytes (epath's stat has ``length``, pathlib's ``st_size``)."""
    p = run_path(path)
    if is_remote(p):
        return int(p.stat().length)
    return os.stat(os.fspath(p)).st_size


def mtime(path: PathLike) -> float:
    """Modification time (seconds; remote backends may report whole seconds or 0)."""
    p = run_path(path)
    if is_remote(p):
        return float(p.stat().mtime or 0)
    return os.stat(os.fspath(p)).st_mtime


def walk_files(root: PathLike) -> Iterator[epath.Path]:
    """Every file under ``root``, recursively (epath refuses ``rglob`` on gs://)."""
    stack = [run_path(root)]
    while stack:
        d = stack.pop()
        for child in sorted(d.iterdir(), key=lambda q: q.name):
            if child.is_dir():
                stack.append(child)
            else:
                yield child


def rmtree(path: PathLike, *, ignore_errors: bool = False) -> None:
    p = run_path(path)
    if not is_remote(p):
        shutil.rmtree(os.fspath(p), ignore_errors=ignore_errors)
        return
    try:
        p.rmtree()
    except Exception:  # noqa: BLE001 - mirrors shutil.rmtree(ignore_errors=True)
        if not ignore_errors:
            raise


def copytree(src: PathLike, dst: PathLike) -> None:
    """Copies folder ``src`` to ``dst`` (either may be remote); ``dst`` must not exist."""
    s, d = run_path(src), run_path(dst)
    if not is_remote(s) and not is_remote(d):
        shutil.copytree(os.fspath(s), os.fspath(d))
        return
    if d.exists():
        raise FileExistsError(f"copytree: {d} exists")
    d.mkdir(parents=True, exist_ok=True)
    for f in walk_files(s):
        rel = os.path.relpath(os.fspath(f), os.fspath(s)) if not is_remote(s) else \
            os.fspath(f)[len(os.fspath(s)):].lstrip("/")
        target = d / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with f.open("rb") as fi, target.open("wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 22)


def move(src: PathLike, dst: PathLike) -> None:
    """Moves a file or folder; across file systems (local -> bucket) it copies, then removes
    the source. On a bucket a folder move is not atomic (objects are copied one by one)."""
    s, d = run_path(src), run_path(dst)
    if not is_remote(s) and not is_remote(d):
        shutil.move(os.fspath(s), os.fspath(d))
        return
    if s.is_dir():
        copytree(s, d)
        rmtree(s)
    elif is_remote(s) and is_remote(d):
        s.replace(d)
    else:
        write_bytes(d, s.read_bytes())
        if is_remote(s):
            s.unlink()
        else:
            os.unlink(os.fspath(s))


def replace(src: PathLike, dst: PathLike) -> None:
    """``os.replace`` locally (atomic); on a bucket a copy + delete of one object."""
    s, d = run_path(src), run_path(dst)
    if not is_remote(s) and not is_remote(d):
        os.replace(os.fspath(s), os.fspath(d))
        return
    write_bytes(d, s.read_bytes())
    s.unlink()


@contextlib.contextmanager
def staged_dir(path: PathLike) -> Iterator[str]:
    """A local folder for a writer that only writes local files (e.g. safetensors in the HF
    export): ``path`` itself (created) when it is local; for a remote ``path`` a temporary
    local folder, copied to ``path`` when the block ends without an error, then removed.

        with paths.staged_dir(run_dir / "final_hf") as d:
            save_hf_checkpoint(params, cfg, d)
    """
    if not is_remote(path):
        p = makedirs(path)
        yield os.fspath(p)
        return
    tmp = tempfile.mkdtemp(prefix="pmd-stage-")
    try:
        yield tmp
        dst = run_path(path)
        if dst.exists():
            rmtree(dst)
        copytree(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_figure(fig: Any, path: PathLike, **kw: Any) -> None:
    """A matplotlib figure rendered to PNG bytes, then written through :func:`write_bytes`."""
    buf = io.BytesIO()
    fig.savefig(buf, format=kw.pop("format", "png"), **kw)
    write_bytes(path, buf.getvalue(), fsync=False)


class JsonlWriter:
    """One JSON object (or pre-serialised line) per ``write``: a real append locally, a
    whole-object rewrite on a remote path (see the module docstring). Existing lines are kept
    (a remote file is read once, at open)."""

    def __init__(self, path: PathLike) -> None:
        self.path = run_path(path)
        self.remote = is_remote(self.path)
        self._lines: list[str] = []
        self._fh: Any = None
        if self.remote:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._lines = self.path.read_bytes().decode("utf-8").splitlines(keepends=True)
                if self._lines and not self._lines[-1].endswith("\n"):
                    self._lines.pop()  # a torn last line (crash mid-write), as read_metrics
        else:
            os.makedirs(os.path.dirname(os.fspath(self.path)), exist_ok=True)
            self._fh = open(os.fspath(self.path), "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: Mapping[str, Any] | str) -> None:
        line = record if isinstance(record, str) else json.dumps(record, default=str)
        line = line.rstrip("\n") + "\n"
        if self.remote:
            self._lines.append(line)
            write_text(self.path, "".join(self._lines))
        else:
            self._fh.write(line)
            self._fh.flush()

    def rewrite(self, records: Iterable[Mapping[str, Any] | str]) -> None:
        """Replaces the file's content with ``records`` (then appends continue after them)."""
        lines = [(r if isinstance(r, str) else json.dumps(r, default=str)).rstrip("\n") + "\n"
                 for r in records]
        if self.remote:
            self._lines = lines
            write_text(self.path, "".join(lines))
            return
        self._fh.close()
        write_text(self.path, "".join(lines))
        self._fh = open(os.fspath(self.path), "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_jsonl(path: PathLike, records: Iterable[Mapping[str, Any]], **dumps_kw: Any) -> int:
    """Writes every record as one JSON line, atomically; returns how many."""
    lines = [json.dumps(r, **dumps_kw) + "\n" for r in records]
    write_text(path, "".join(lines))
    return len(lines)


def read_lines(path: PathLike) -> list[str]:
    """The file's lines ([] when it does not exist)."""
    p = run_path(path)
    if not p.exists():
        return []
    return p.read_bytes().decode("utf-8").splitlines()
