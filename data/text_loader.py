"""Real-text preparation (corpus -> tokenizer -> packed shards) and the resumable, rank-sharded loader."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from data.config import DataConfig, DataError
from data.corpus import fingerprint, load_corpus
from data.pack import PackedData, build_packed, get_packed, pack_key
from data.tokenizer import Tokenizer, get_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What `prepare` returns: the tokenizer and the packed splits ("train"; "val" if val_fraction > 0)."""

    tokenizer: Tokenizer
    splits: dict[str, PackedData]
    seconds: float


def prepare(cfg: DataConfig | Mapping[str, Any], seq_len: int) -> Prepared:
    """Load the corpus, train (or load / reuse) the tokenizer and pack every split; cached at every stage.

    Safe to call from all ranks at once: each build runs under a file lock and is renamed into place.
    """
    if not isinstance(cfg, DataConfig):
        cfg = DataConfig.from_mapping(cfg)
    t0 = time.perf_counter()
    corpus = load_corpus(cfg)
    prints = {name: fingerprint(ds) for name, ds in corpus.items()}
    tok = get_tokenizer(cfg.tokenizer, corpus["train"], prints["train"], cfg.cache_path, cfg.split_seed)
    splits = {}
    for name, ds in corpus.items():
        key = pack_key(prints[name], tok.hash, seq_len, cfg.tokenizer.add_bos)
        folder = os.path.join(cfg.cache_path, "packed", f"{name}_T{seq_len}_{key}")
        meta = {"key": key, "split": name, "corpus": prints[name], "tokenizer": tok.hash,
                "tokenizer_model": tok.model_path, "sources": [s.path for s in cfg.sources]}

        def build(ds=ds, folder=folder, meta=meta) -> None:
            build_packed(ds, tok, seq_len, folder, num_proc=cfg.num_proc, shard_tokens=cfg.shard_tokens,
                         add_bos=cfg.tokenizer.add_bos, meta=meta)

        splits[name] = get_packed(folder, build, cfg.verify_checksums)
    return Prepared(tok, splits, time.perf_counter() - t0)


class PackedLoader:
    """Micro-batches of packed rows for one data-parallel rank; deterministic and resumable.

    Global row position p (counted over all ranks) maps to epoch p // N and row perm_epoch[p % N], with
    perm_epoch a seeded permutation of the N rows (identity when shuffle is off). Micro-step s of rank r
    of W takes positions (s * W + r) * B + [0, B): the ranks read disjoint rows, together every row once
    per epoch, and batches run on across epoch ends so no row is dropped. The state is the number of
    global positions consumed, so a resumed run (even with another world size, when it divides) yields
    exactly the batch that would have come next.

    Batch: input_ids int64 [B, T], labels int64 [B, T] (= next token; -100 on PAD), and with
    document_mask doc_ids int64 [B, T] (number of EOS before position t within the row).
    """

    def __init__(self, data: PackedData, *, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, document_mask: bool = False,
                 tokenizer: Tokenizer | None = None) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batch_size < 1:
            raise DataError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if data.num_rows == 0:
            raise DataError(f"packed data {data.folder!r} holds no row")
        self.data, self.tokenizer = data, tokenizer
        self.vocab_size = int(data.index["vocab_size"])
        self.seq_len = data.row_len - 1
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.seed, self.shuffle, self.document_mask = seed, shuffle, document_mask
        self.eos_id, self.pad_id = int(data.index["eos_id"]), int(data.index["pad_id"])
        self.consumed = 0  # global row positions consumed by all ranks together
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_rows(self) -> int:
        return self.data.num_rows

    @property
    def epoch(self) -> float:
        return self.consumed / self.num_rows

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            n = self.num_rows
            self._perms[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                                  else np.arange(n))
        return self._perms[epoch]

    def row_indices(self, consumed: int) -> np.ndarray:
        """The global row indices this rank reads at the micro-step that starts at `consumed`: int64 [B]."""
        pos = consumed + self.rank * self.micro_batch_size + np.arange(self.micro_batch_size)
        epochs, within = np.divmod(pos, self.num_rows)
        return np.array([self._perm(int(e))[i] for e, i in zip(epochs, within)], dtype=np.int64)

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows = self.data.rows(self.row_indices(self.consumed)).astype(np.int64)
        self.consumed += self.micro_batch_size * self.world_size
        tokens = torch.from_numpy(rows)
        input_ids = tokens[:, :-1].contiguous()
        labels = tokens[:, 1:].clone()
        labels[labels == self.pad_id] = -100
        batch = {"input_ids": input_ids, "labels": labels}
        if self.document_mask:
            is_eos = (input_ids == self.eos_id).long()
            batch["doc_ids"] = torch.cumsum(is_eos, dim=1) - is_eos  # exclusive: EOS ends its own document
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": self.num_rows, "data_key": self.data.key,
                "micro_batch_size": self.micro_batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "consumed" not in state:
            raise DataError(f"loader state has no 'consumed' position (keys: {sorted(state)}); was it "
                            "saved by another data source?")
        if state.get("data_key", self.data.key) != self.data.key:
            raise DataError(f"the checkpoint's data position refers to packed data {state['data_key']!r}, "
                            f"but this run packs {self.data.key!r} (corpus, tokenizer or seq_len changed)")
        if state.get("seed", self.seed) != self.seed or state.get("shuffle", self.shuffle) != self.shuffle:
            log.warning("data seed/shuffle differ from the checkpoint's: the row order after resume changes")
        consumed = int(state["consumed"])
        step = self.micro_batch_size * self.world_size
        if consumed % step:
            raise DataError(f"cannot resume at row position {consumed} with micro_batch_size x world_size = "
                            f"{step}: it is not a whole number of micro-steps")
        self.consumed = consumed


def _packed_loader(prep: Prepared, dcfg: DataConfig, split: str, micro_batch_size: int, rank: int, world_size: int,
                   seed: int) -> PackedLoader:
    return PackedLoader(prep.splits[split], micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
                        seed=dcfg.seed if dcfg.seed is not None else seed, shuffle=dcfg.shuffle and split == "train",
                        document_mask=dcfg.document_mask, tokenizer=prep.tokenizer)


def build_text_loaders(cfg: Mapping[str, Any], splits: Sequence[str], *, seq_len: int, micro_batch_size: int,
                       rank: int = 0, world_size: int = 1, seed: int = 0) -> dict[str, PackedLoader]:
    """A loader for each of `splits` that the prepared corpus has, from one `prepare`: the corpus is read and
    hashed once however many splits are asked for (each reading is a pass over every document). A
    split it lacks ("val" with data.val_fraction = 0) is absent from the result."""
    dcfg = cfg if isinstance(cfg, DataConfig) else DataConfig.from_mapping(cfg)
    prep = prepare(dcfg, seq_len)
    return {split: _packed_loader(prep, dcfg, split, micro_batch_size, rank, world_size, seed)
            for split in splits if split in prep.splits}


def build_text_loader(cfg: Mapping[str, Any], *, seq_len: int, micro_batch_size: int, rank: int = 0,
                      world_size: int = 1, seed: int = 0, split: str = "train") -> PackedLoader:
    dcfg = cfg if isinstance(cfg, DataConfig) else DataConfig.from_mapping(cfg)
    prep = prepare(dcfg, seq_len)
    if split not in prep.splits:
        raise DataError(f"no {split!r} split (have {sorted(prep.splits)}; val needs data.val_fraction > 0)")
    return _packed_loader(prep, dcfg, split, micro_batch_size, rank, world_size, seed)
