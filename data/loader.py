"""The loader protocol the train loop relies on, and the dispatch over data sources."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class BatchLoader(Protocol):
    """A deterministic, resumable source of micro-batches for one data-parallel rank.

    `next_batch()` returns {"input_ids": int64 [B, T], "labels": int64 [B, T]} where labels[:, t] is the
    token after input_ids[:, t] (-100 = ignored), and optionally "doc_ids": int64 [B, T] (document index
    within the row, for attention masking at EOS). `state_dict()` captures the position so that, after
    `load_state_dict`, the next batch is exactly the one that would have come next.
    """

    vocab_size: int

    def next_batch(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def batch_to_device(batch: Mapping[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A loader's micro-batch (CPU tensors) on `device`, without making the host wait for the GPU.

    CUDA may synchronise the stream before a copy from pageable host memory that it stages through its own pinned
    buffer (documented for `cudaMemcpyAsync`; when it does, the host waits for the previous micro-batch's backward
    before the next forward; what the H100 did: docs/benchmarks.md, twelfth session). Staged through page-locked
    memory of PyTorch's caching host allocator (which keeps the buffer until the copy has run) the copy is queued like
    a kernel whatever its size. On other devices: `tensor.to(device)`."""
    device = torch.device(device)
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) if not v.is_cuda else v.to(device)
            for k, v in batch.items()}  # fmt: skip


def build_loader(
    cfg: Mapping[str, Any], *, seq_len: int, micro_batch_size: int, rank: int = 0, world_size: int = 1,
    seed: int = 0, split: str = "train",
) -> BatchLoader:
    """Build the loader named by `cfg["name"]` for data-parallel rank `rank` of `world_size`.

    `bundled` and `files` prepare real text (tokenizer + packed shards, cached; see data/text_loader.py);
    `split="val"` gives their held-out documents. `synthetic` is seeded random tokens (no I/O).
    """
    name = cfg.get("name")
    if name in ("bundled", "files"):
        from data.text_loader import build_text_loader

        return build_text_loader(cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, rank=rank,
                                 world_size=world_size, seed=seed, split=split)
    if name == "synthetic":
        from data.synthetic import SyntheticLoader

        return SyntheticLoader(
            vocab_size=int(cfg["vocab_size"]), seq_len=seq_len, micro_batch_size=micro_batch_size,
            rank=rank, world_size=world_size, seed=int(cfg.get("seed", seed)),
            kind=str(cfg.get("kind", "uniform")), branching=int(cfg.get("branching", 4)),
        )
    raise ValueError(f"data.name={name!r} is not a known data source (known: bundled, files, synthetic)")


def build_loaders(
    cfg: Mapping[str, Any], splits: Sequence[str], *, seq_len: int, micro_batch_size: int, rank: int = 0,
    world_size: int = 1, seed: int = 0,
) -> dict[str, BatchLoader]:
    """`build_loader` for each of `splits` that the source has, sharing one preparation of a real-text corpus
    (read and hashed once, not once per split). Absent from the result: a split the source lacks ("val" of
    synthetic data, or of a corpus with data.val_fraction = 0)."""
    args = {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "rank": rank, "world_size": world_size,
            "seed": seed}
    if cfg.get("name") in ("bundled", "files"):
        from data.text_loader import build_text_loaders

        return build_text_loaders(cfg, splits, **args)
    loader = build_loader(cfg, **args)  # synthetic data (no held-out split), or the error naming data.name
    return {"train": loader} if "train" in splits else {}
