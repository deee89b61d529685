"""Seeded random tokens: a data source with no I/O, for throughput benchmarks and tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class SyntheticLoader:
    """Seeded random tokens: `kind="uniform"` (i.i.d., nothing to learn; throughput runs) or `"markov"`
    (each token has `branching` fixed random successors, so a model can learn it down to ln(branching)).
    Step `i` draws one *global* batch of micro_batch_size·world_size rows from (seed, i) and rank r takes its
    rows, so N ranks see exactly the batch one rank would see with an N× larger
    micro-batch (what the data-parallel equivalence tests rely on); resumable from `step`."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, kind: str = "uniform", branching: int = 4) -> None:
        if vocab_size < 2:
            raise ValueError(f"data.vocab_size must be >= 2, got {vocab_size}")
        if kind not in ("uniform", "markov"):
            raise ValueError(f"data.kind={kind!r} is unknown (known: uniform, markov)")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"data.branching must be in [1, vocab_size], got {branching}")
        self.kind = kind
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching),
                                        generator=torch.Generator().manual_seed(seed + 7919))
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        rows = self.micro_batch_size * self.world_size
        if self.kind == "uniform":
            tokens = torch.randint(0, self.vocab_size, (rows, self.seq_len + 1), generator=gen)
        else:
            choice = torch.randint(0, self.successors.shape[1], (rows, self.seq_len + 1), generator=gen)
            tokens = torch.empty(rows, self.seq_len + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(0, self.vocab_size, (rows,), generator=gen)
            for t in range(1, self.seq_len + 1):
                tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t]]
        tokens = tokens[self.rank * self.micro_batch_size:(self.rank + 1) * self.micro_batch_size]
        self.step += 1
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
