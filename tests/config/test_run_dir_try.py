"""run_dir is tried during validation (issue 38, item 5): created with its parents and a
marker file, then only what the check made is removed; the error names the folder and the
OS's reason."""

from __future__ import annotations

import errno
import os
import tempfile

from pmd_jax.config.validate import _run_dir_try_errors


def test_creates_then_removes_only_what_it_made(tmp_path):
    keep = tmp_path / "have"
    keep.mkdir()
    (keep / "old.txt").write_text("x")
    assert _run_dir_try_errors(str(keep / "a" / "b" / "run")) == []
    assert sorted(p.name for p in keep.iterdir()) == ["old.txt"]  # a/b/run made and removed
    assert _run_dir_try_errors(str(keep)) == []  # an existing folder: only the marker
    assert sorted(p.name for p in keep.iterdir()) == ["old.txt"]
    for remote in ("gs://bucket/run", "s3://b/r", ""):
        assert _run_dir_try_errors(remote) == []


def test_an_os_refusal_names_the_folder_and_the_reason(tmp_path, monkeypatch):
    real_mkdir = os.mkdir

    def mkdir(p, *a, **k):
        if os.fspath(p).endswith("/b"):
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(p))
        return real_mkdir(p, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    run = tmp_path / "a" / "b" / "run"
    assert _run_dir_try_errors(str(run)) == [
        f"run_dir='{run}' cannot be used: creating {tmp_path / 'a' / 'b'} failed: No such file "
        "or directory (errno 2)"]
    assert not (tmp_path / "a").exists()  # the parent it had made is removed again
    monkeypatch.setattr(os, "mkdir", real_mkdir)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkstemp", full)
    assert _run_dir_try_errors(str(run)) == [
        f"run_dir='{run}' cannot be used: writing a file in {run} failed: No space left on "
        "device (errno 28)"]
    assert not (tmp_path / "a").exists()
