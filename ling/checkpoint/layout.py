"""The names of what a run writes: a checkpoint folder's files and the run dir's config. Imports nothing.

<ckpt dir>/step00000123/ holds DeepSpeed's model and optimizer shards (`MODEL_STATES`, ...), each rank's
`TRAINER_STATE`, with expert parallelism one `EXPERT_SHARD` per expert-parallel rank, and `MANIFEST`, written
last; a save in progress lives in step00000123`PARTIAL`/.
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TRAINER_STATE = "trainer_state_rank{rank}.pt"
PARTIAL = ".partial"
TAG_RE = re.compile(r"^step(\d{8})$")
EXPERT_SHARD = "experts_ep{ep_rank}_of{ep_size}.pt"
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's module state under ZeRO 0-2
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
ZERO_OPTIM_STATES = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # DeepSpeed prefixes "bf16_" with bf16
RESOLVED_CONFIG = "resolved_config.yaml"  # in the run dir: the run's whole config, resolved
METRICS = "metrics.jsonl"  # in the run dir: one line per step
SUMMARY = "summary.json"  # in the run dir: the closing summary
RUN_TOKENIZER = "tokenizer"  # in the run dir: a copy of the tokenizer the run trained with (text data only)


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int | None:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def expert_shard_names(ep_size: int) -> list[str]:
    """The expert shard files a checkpoint written with moe.ep_size=`ep_size` holds (none for 1)."""
    return [EXPERT_SHARD.format(ep_rank=k, ep_size=ep_size) for k in range(ep_size)] if ep_size > 1 else []
