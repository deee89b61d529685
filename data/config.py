"""Dataclass configs for the real-text data path (`data=bundled`, `data=files`).

`DataConfig.from_mapping` accepts the Hydra `data` group (an OmegaConf DictConfig or any Mapping) and
checks every value, so a typo fails at start-up with the key's name rather than deep inside a build.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_CACHE_DIR = "~/.cache/ling_fp8"
_SYNTHETIC_ONLY = ("vocab_size", "kind", "branching")  # keys of conf/data/synthetic.yaml, ignored here


class DataError(ValueError):
    """Bad data input (a missing file, an empty corpus, a wrong column, ...): the message names it."""


def _plain(obj: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists (resolving interpolations); anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency of the app, not of data/
        pass
    return obj


def _build(cls: type, raw: Mapping[str, Any], where: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise DataError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(names)}")
    return cls(**raw)


@dataclass
class TokenizerConfig:
    """A sentencepiece model: trained on the corpus (cached by a hash of its inputs) unless `model` is given.

    Ids: pad/eos/bos/unk are fixed special pieces; `vocab_size` counts them and the 256 byte pieces.
    """

    model: str | None = None  # path to an existing sentencepiece `.model`: load it, train nothing
    vocab_size: int = 8192
    model_type: str = "bpe"  # bpe | unigram
    byte_fallback: bool = True  # unknown characters become UTF-8 byte pieces: every text round-trips
    character_coverage: float = 0.9995
    train_chars: int = 20_000_000  # seeded subsample of the train split fed to the trainer (characters)
    max_sentence_chars: int = 2000  # training "sentences" are blocks of whole lines up to this length
    pad_id: int = 0
    eos_id: int = 1
    bos_id: int = 2
    unk_id: int = 3
    add_bos: bool = False  # prepend BOS to each document (EOS is always appended)
    num_threads: int | None = None  # trainer threads; None = all cores

    def __post_init__(self) -> None:
        if self.model is None and self.vocab_size < 300:
            raise DataError(f"data.tokenizer.vocab_size={self.vocab_size} is too small: byte fallback alone "
                            "needs 256 byte pieces plus the special ids; use >= 300")
        if self.model_type not in ("bpe", "unigram"):
            raise DataError(f"data.tokenizer.model_type={self.model_type!r}: expected 'bpe' or 'unigram'")
        ids = {"pad_id": self.pad_id, "eos_id": self.eos_id, "bos_id": self.bos_id, "unk_id": self.unk_id}
        if len(set(ids.values())) != 4 or min(ids.values()) < 0:
            raise DataError(f"data.tokenizer special ids must be distinct and >= 0, got {ids}")
        if self.train_chars <= 0 or self.max_sentence_chars <= 0:
            raise DataError("data.tokenizer.train_chars and max_sentence_chars must be > 0")


@dataclass
class SourceConfig:
    """One corpus source.

    path: `bundled:kjv` | `bundled:bbc` | `bundled:sympy`, a local file / glob / directory
    (jsonl, json, parquet, txt, csv), or a Hugging Face hub dataset name (needs network).
    weight: passes over this source's training documents (2.0 = every document twice, 0.5 = a seeded half).
    """

    path: str
    type: str | None = None  # bundled | json | parquet | text | csv | hub; None = inferred from the path
    text_column: str | None = None  # None = DataConfig.text_column
    weight: float = 1.0
    split: str = "train"  # the split to read from a hub dataset / local files
    subset: str | None = None  # hub dataset configuration name
    sample_by: str = "document"  # text files: one document per file | paragraph | line

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise DataError(f"data.sources: every source needs a non-empty `path`, got {self.path!r}")
        if self.weight < 0:
            raise DataError(f"data source {self.path!r}: weight must be >= 0, got {self.weight}")
        if self.sample_by not in ("document", "paragraph", "line"):
            raise DataError(f"data source {self.path!r}: sample_by must be document|paragraph|line")


@dataclass
class DataConfig:
    """The `data` config group for real text (see conf/data/bundled.yaml and files.yaml)."""

    name: str = "bundled"
    sources: list[SourceConfig] = field(default_factory=list)
    text_column: str = "text"
    val_fraction: float = 0.005  # held-out documents per source (by document, seeded by split_seed)
    split_seed: int = 0  # document split + packing order; independent of train.seed so caches survive it
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    num_proc: int | None = None  # tokenize processes; None = all cores
    shard_tokens: int = 1 << 26  # tokens per memmap shard (rounded down to whole rows)
    cache_dir: str = DEFAULT_CACHE_DIR
    shuffle: bool = True  # shuffle packed rows each epoch (seeded by `seed`, else train.seed)
    document_mask: bool = False  # also return doc_ids so attention stops at EOS
    verify_checksums: bool = True  # check every shard's blake2b against the index when opening a cache
    encoding_errors: str = "strict"  # strict: invalid UTF-8 is an error; replace: U+FFFD (text files only)
    seed: int | None = None  # row-shuffle seed; None = the train seed passed to build_loader

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.encoding_errors not in ("strict", "replace"):
            raise DataError(f"data.encoding_errors must be 'strict' or 'replace', "
                            f"got {self.encoding_errors!r}")
        if self.shard_tokens <= 0:
            raise DataError(f"data.shard_tokens must be > 0, got {self.shard_tokens}")

    @property
    def cache_path(self) -> str:
        return os.path.abspath(os.path.expanduser(os.path.expandvars(self.cache_dir)))

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> DataConfig:
        raw = dict(_plain(cfg))
        for key in _SYNTHETIC_ONLY:  # exp configs may tune the synthetic source; the tokenizer decides here
            raw.pop(key, None)
        sources = raw.pop("sources", None) or []
        if isinstance(sources, (str, Mapping)) or not isinstance(sources, Sequence):
            sources = [sources]
        parsed = [SourceConfig(path=s) if isinstance(s, str)
                  else _build(SourceConfig, dict(s), "data.sources[]") for s in sources]
        tok = _build(TokenizerConfig, dict(raw.pop("tokenizer", None) or {}), "data.tokenizer")
        if raw.get("cache_dir") is None:
            raw["cache_dir"] = os.environ.get("LING_CACHE", DEFAULT_CACHE_DIR)
        out = _build(cls, {**raw, "sources": parsed, "tokenizer": tok}, "data")
        if not out.sources:
            raise DataError("data.sources is empty: list at least one source (a file, a glob, a hub name or "
                            "bundled:kjv / bundled:bbc / bundled:sympy)")
        return out
