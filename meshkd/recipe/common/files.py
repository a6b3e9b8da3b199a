"""Files that are whole or absent: content hashes, fsync, atomic writes (teacher caches, checkpoints)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while block := source.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    """meshkd's own cache directory: $MESHKD_CACHE, else ~/.cache/meshkd (converted GGUF models, token stores)."""
    return Path(os.environ.get("MESHKD_CACHE") or Path.home() / ".cache" / "meshkd")


def fsync(path: Path) -> None:
    """Flush a file or a directory (its entries) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, data: bytes) -> None:
    """`data` at `path` or nothing: written to PATH.partial, fsynced, renamed; an OSError names `path`."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as sink:
            sink.write(data)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(partial, path)
        fsync(path.parent)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise OSError(error.errno, f"{path}: could not be written ({error.strerror or error})") from None
