"""File helpers every room of `ling/` uses: atomic writes, content hashes, and a file that hashes what is
written to it. Imports nothing of the project."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

WRITE_BUFFER = 1 << 23  # bytes buffered before a write reaches the file system


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """write(tmp) into a sibling temporary file, flush it to disk, rename it over `path`: readers see the old
    or the new content, never half. When writing fails (a full disk, say) the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256_file(path: Path, chunk: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class HashingFile:
    """A new binary file whose bytes are hashed (sha256) and counted as they are written: the checksum of a
    file is known when its last byte is written, without reading it back. Writes must be sequential (no seek:
    torch.save's zip writer writes that way). `close()` flushes and fsyncs.

    The first OSError of a write, flush or close (ENOSPC on a full disk, say) is kept in `error`: callers
    such as torch.save wrap it in an error of their own that no longer says what failed.
    `fail_after_bytes` (testing): raise ENOSPC once that many bytes were written, as a full disk would."""

    def __init__(self, path: Path, fail_after_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.fail_after_bytes = fail_after_bytes
        self.size = 0
        self.error: OSError | None = None
        self._sha = hashlib.sha256()
        self._file = open(self.path, "wb", buffering=WRITE_BUFFER)  # noqa: SIM115 (closed in close())

    def write(self, data) -> int:
        try:
            if self.fail_after_bytes is not None and self.size + len(data) > self.fail_after_bytes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            written = self._file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self._sha.update(data)
        self.size += written
        return written

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def close(self) -> None:
        """Flush, fsync and close (also after a failed write: the file is closed either way)."""
        try:
            if self.error is None:
                self._file.flush()
                os.fsync(self._file.fileno())
        except OSError as e:
            self.error = self.error or e
            raise
        finally:
            try:
                self._file.close()
            except OSError as e:  # the buffered tail could not be written
                self.error = self.error or e

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()
