"""File helpers every room of `ling/` uses: atomic writes and content hashes. Imports nothing of the project."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """write(tmp) into a sibling temporary file, flush it to disk, rename it over `path`: readers see the old
    or the new content, never half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path: Path, chunk: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
