"""Tokenize and pack a corpus into fixed-length rows stored as `np.memmap` shards plus an index.

The token stream is doc_0 + [EOS] + doc_1 + [EOS] + ... (optionally BOS before each document), in the
corpus's (seeded, shuffled) order. It is cut into rows of seq_len + 1 tokens (inputs = row[:-1],
labels = row[1:]); the final partial row is filled with PAD, which the loader turns into ignored labels,
so no token is dropped. Rows are grouped into shards of `shard_tokens // (seq_len + 1)` rows.

Layout of a packed cache folder:
    index.json       format, seq_len, row_len, dtype, ids, counts, and per shard {file, rows, bytes, blake2b}
    shard_00000.bin  uint16 when the vocab fits in 16 bits, else uint32; rows * row_len tokens, row-major
A folder is built under a temporary name and renamed into place after index.json is written, so a
half-written cache never carries the final name; `open_packed` still checks sizes (and checksums) and
`get_packed` rebuilds anything that fails the check.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
from filelock import FileLock
from tqdm.auto import tqdm

from data.config import DataError
from data.tokenizer import Tokenizer

PACK_FORMAT = 1
log = logging.getLogger(__name__)

# One Tokenizer per model file in each `datasets.map` worker process, loaded on its first batch and reused for the
# rest (loading it per batch would cost more than encoding). A build uses one tokenizer; a few entries suffice.
@functools.lru_cache(maxsize=4)
def _worker_tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer(model_path)


def _encode_batch(batch: dict[str, list], model_path: str, eos_id: int, bos_id: int,
                  add_bos: bool) -> dict[str, list]:
    """datasets.map worker: a batch of texts -> ONE row holding their ids back to back, each document
    followed by EOS (and preceded by BOS if asked), as int32. One row per batch keeps Arrow's per-row cost
    off the hot path; `n_docs` counts the documents in it."""
    out = []
    for ids in _worker_tokenizer(model_path).encode(batch["text"]):
        arr = np.empty(len(ids) + 1 + add_bos, dtype=np.int32)
        if add_bos:
            arr[0] = bos_id
        arr[int(add_bos):-1] = ids
        arr[-1] = eos_id
        out.append(arr)
    return {"ids": [np.concatenate(out)], "n_docs": [len(out)]}


def pack_key(corpus_fingerprint: str, tokenizer_hash: str, seq_len: int, add_bos: bool) -> str:
    spec = {"corpus": corpus_fingerprint, "tokenizer": tokenizer_hash, "seq_len": seq_len, "add_bos": add_bos,
            "format": PACK_FORMAT}
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=12).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class _ShardWriter:
    """Appends tokens to shard files of `rows_per_shard * row_len` tokens, hashing as it writes."""

    def __init__(self, folder: str, row_len: int, rows_per_shard: int, dtype: np.dtype) -> None:
        self.folder, self.row_len, self.dtype = folder, row_len, dtype
        self.shard_tokens = rows_per_shard * row_len
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._hash = None
        self._filled = 0

    def _open(self) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        self._file = open(os.path.join(self.folder, name), "wb")
        self._hash = hashlib.blake2b(digest_size=16)
        self._filled = 0
        self.shards.append({"file": name})

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1].update(rows=self._filled // self.row_len, bytes=self._filled * self.dtype.itemsize,
                               blake2b=self._hash.hexdigest())
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None or self._filled == self.shard_tokens:
                self._close()
                self._open()
            take = min(len(tokens), self.shard_tokens - self._filled)
            buf = tokens[:take].tobytes()
            self._file.write(buf)
            self._hash.update(buf)
            self._filled += take
            tokens = tokens[take:]

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards


def build_packed(ds: datasets.Dataset, tok: Tokenizer, seq_len: int, folder: str, *, num_proc: int | None,
                 shard_tokens: int, add_bos: bool = False,
                 meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenize `ds["text"]` and write the packed cache to `folder` (atomically). Returns the index."""
    if len(ds) == 0:
        raise DataError("cannot pack an empty corpus")
    if seq_len < 1:
        raise DataError(f"train.seq_len must be >= 1, got {seq_len}")
    row_len = seq_len + 1
    dtype = token_dtype(tok.vocab_size)
    num_proc = max(1, min(num_proc or os.cpu_count() or 1, len(ds)))
    t0 = time.perf_counter()
    tokenized = ds.map(
        _encode_batch, batched=True, batch_size=256, num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names, load_from_cache_file=False,
        fn_kwargs={"model_path": tok.model_path, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                   "add_bos": add_bos},
        desc=f"tokenize ({num_proc} proc)",
    )
    t_tok = time.perf_counter() - t0
    tmp = f"{folder}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        writer = _ShardWriter(tmp, row_len, max(1, shard_tokens // row_len), dtype)
        column = tokenized.data.table.column("ids")
        n_tokens = 0
        with tqdm(total=len(tokenized), desc="pack", unit="batch") as bar:
            for chunk in column.chunks:
                flat = chunk.flatten().to_numpy(zero_copy_only=False) if len(chunk) else np.empty(0, np.int32)
                if len(flat) and int(flat.max()) >= tok.vocab_size:
                    raise DataError(f"token id {int(flat.max())} >= vocab size {tok.vocab_size}")
                writer.write(flat)
                n_tokens += len(flat)
                bar.update(len(chunk))
        n_pad = -n_tokens % row_len
        if n_pad:
            writer.write(np.full(n_pad, tok.pad_id, dtype=dtype))
        shards = writer.finish()
        index = {
            "format": PACK_FORMAT, "seq_len": seq_len, "row_len": row_len, "dtype": dtype.name,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "pad_id": tok.pad_id, "bos_id": tok.bos_id,
            "num_docs": len(ds), "num_tokens": n_tokens, "num_pad": n_pad,
            "num_rows": (n_tokens + n_pad) // row_len, "shards": shards,
            "tokenize_seconds": t_tok, "pack_seconds": time.perf_counter() - t0, "num_proc": num_proc,
            **(meta or {}),
        }
        with open(os.path.join(tmp, "index.json"), "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        del tokenized
    return index


class CacheError(DataError):
    """A packed cache folder that is incomplete or damaged."""


@dataclass
class PackedData:
    """Read access to a packed cache: `rows(idx)` -> [len(idx), row_len] tokens."""

    folder: str
    index: dict[str, Any]
    maps: list[np.memmap]
    starts: np.ndarray  # first global row of each shard, plus the total: [num_shards + 1]

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    @property
    def row_len(self) -> int:
        return int(self.index["row_len"])

    @property
    def key(self) -> str:
        return str(self.index.get("key", os.path.basename(self.folder)))

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Gather rows by global index: idx int [n] -> tokens [n, row_len] in the shard dtype."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.empty((len(idx), self.row_len), dtype=self.maps[0].dtype if self.maps else np.uint16)
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        for j, (s, i) in enumerate(zip(shard, idx)):
            out[j] = self.maps[s][i - self.starts[s]]
        return out


def open_packed(folder: str, verify_checksums: bool = True) -> PackedData:
    """Open a packed cache, raising CacheError when anything is missing, short or fails its checksum."""
    path = os.path.join(folder, "index.json")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise CacheError(f"packed cache {folder!r}: no readable index.json ({e})") from None
    if index.get("format") != PACK_FORMAT:
        raise CacheError(f"packed cache {folder!r}: format {index.get('format')} != {PACK_FORMAT}")
    dtype, row_len = np.dtype(index["dtype"]), int(index["row_len"])
    maps, starts = [], [0]
    for shard in index["shards"]:
        file = os.path.join(folder, shard["file"])
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        if size != shard["bytes"] or shard["bytes"] != shard["rows"] * row_len * dtype.itemsize:
            raise CacheError(f"packed cache {folder!r}: {shard['file']} has {size} bytes, index says "
                             f"{shard['bytes']} (a partial or damaged write)")
        if verify_checksums:
            h = hashlib.blake2b(digest_size=16)
            with open(file, "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
            if h.hexdigest() != shard["blake2b"]:
                raise CacheError(f"packed cache {folder!r}: {shard['file']} fails its checksum")
        maps.append(np.memmap(file, dtype=dtype, mode="r", shape=(shard["rows"], row_len)))
        starts.append(starts[-1] + shard["rows"])
    if starts[-1] != index["num_rows"]:
        raise CacheError(f"packed cache {folder!r}: shards hold {starts[-1]} rows, "
                         f"index says {index['num_rows']}")
    return PackedData(folder, index, maps, np.asarray(starts, dtype=np.int64))


def get_packed(folder: str, build: Any, verify_checksums: bool = True) -> PackedData:
    """Open the cache at `folder`, or (under a file lock, so one process builds) call `build()` to make it.

    A folder that fails `open_packed` is logged, deleted and rebuilt, never used.
    """
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with FileLock(folder + ".lock"):
        if os.path.isdir(folder):
            try:
                return open_packed(folder, verify_checksums)
            except CacheError as e:
                log.warning("%s; rebuilding it", e)
                shutil.rmtree(folder)
        build()
        return open_packed(folder, verify_checksums)


def stream_of(data: PackedData) -> np.ndarray:
    """The whole packed token stream (without tail padding) as one int64 array: for tests and tools."""
    rows = [np.asarray(m, dtype=np.int64).reshape(-1) for m in data.maps]
    flat = np.concatenate(rows) if rows else np.empty(0, np.int64)
    return flat[: data.index["num_tokens"]]


__all__ = ["PackedData", "CacheError", "build_packed", "open_packed", "get_packed", "pack_key", "stream_of",
           "token_dtype"]
