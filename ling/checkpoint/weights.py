"""Model weights and the run config of a training checkpoint, read without an engine or the optimizer.

A checkpoint (ling/checkpoint/store.py) is DeepSpeed's folder `<ckpt dir>/<tag>/`: under ZeRO 0-2 one
`mp_rank_00_model_states.pt` holds the whole module state (parameters in the training dtype + buffers such
as the expert bias); under ZeRO-3 the module is partitioned and DeepSpeed's `zero_to_fp32` rebuilds it from
the fp32 partitions. With expert parallelism (moe.ep_size > 1) the expert stacks are joined from the
checkpoint's `experts_ep{k}_of{P}.pt` files, so the state read is always the whole model's (ep_size 1). The
run's `resolved_config.yaml` (in its run dir) gives the model and data config.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from data.config import DataConfig
from data.tokenizer import Tokenizer, get_tokenizer
from ling.checkpoint.layout import MODEL_STATES, RESOLVED_CONFIG, RUN_TOKENIZER, ZERO3_MODEL_STATES
from ling.checkpoint.safe_load import check_folder, load_pt
from ling.checkpoint.store import newest_verified, read_expert_shards
from ling.config import model_config_from
from ling.files import atomic_write
from model.config import ModelConfig


@dataclass
class CheckpointRef:
    """A located checkpoint: its folder, step, run dir and the run's resolved config."""

    folder: Path  # <ckpt dir>/<tag>
    step: int | None
    run_dir: Path
    config: DictConfig

    @property
    def tag(self) -> str:
        return self.folder.name

    def model_config(self, state: dict[str, torch.Tensor] | None = None, precision: str | None = None) -> ModelConfig:
        """The run's ModelConfig, optionally in another precision; a null `model.vocab_size` is read from
        the embedding in `state` (the checkpoint's weights, read when not given)."""
        cfg = self.config.copy()
        vocab = OmegaConf.select(cfg, "model.vocab_size")
        if vocab is None:
            vocab = int((state or read_model_state(self.folder))["word_embeddings.weight"].shape[0])
        if precision is not None:
            OmegaConf.update(cfg, "precision.name", precision, force_add=True)
        return model_config_from(cfg, vocab).replace(ep_size=1)  # the weights read here hold every expert


def _is_checkpoint_folder(p: Path) -> bool:
    return (p / MODEL_STATES).is_file() or (p / ZERO3_MODEL_STATES).is_file()


def find_checkpoint(path: str | os.PathLike, tag: str | None = None) -> CheckpointRef:
    """Locate a checkpoint from a run dir (runs/NAME: its latest checkpoint), a checkpoints folder (its
    newest verified checkpoint, or `tag`) or one checkpoint folder (…/stepXXXXXXXX). Raises naming what is
    missing."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint {p}: no such folder")
    if _is_checkpoint_folder(p):
        folder = p
    else:
        ckpt_dir = p
        if (p / RESOLVED_CONFIG).is_file():  # a run dir
            conf = OmegaConf.load(p / RESOLVED_CONFIG)
            custom = OmegaConf.select(conf, "train.checkpoint_dir")
            ckpt_dir = Path(custom) if custom else p / "checkpoints"
        if tag is not None:
            folder = ckpt_dir / tag
        else:
            # weights only: a checkpoint of any world size will do
            newest, skipped = newest_verified(ckpt_dir, world_size=0) if ckpt_dir.is_dir() else (None, [])
            if newest is None:
                why = "; ".join(f"{name}: {reason}" for name, reason in skipped) or "none was saved"
                raise FileNotFoundError(f"checkpoint {p}: no verified checkpoint in {ckpt_dir} ({why}; "
                                        "train.save_final=true writes one at the end)")
            folder = newest
        if not _is_checkpoint_folder(folder):
            raise FileNotFoundError(f"checkpoint {folder}: no {MODEL_STATES} (not a DeepSpeed checkpoint folder)")
    run_dir = next((d for d in (folder.parent.parent, folder.parent, Path(path))
                    if (d / RESOLVED_CONFIG).is_file()), None)
    if run_dir is None:
        raise FileNotFoundError(f"checkpoint {folder}: no {RESOLVED_CONFIG} in its run dir "
                                f"({folder.parent.parent}); the model config comes from there")
    step = int(folder.name[4:]) if folder.name.startswith("step") and folder.name[4:].isdigit() else None
    return CheckpointRef(folder, step, run_dir, OmegaConf.load(run_dir / RESOLVED_CONFIG))


def read_model_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The module state_dict (parameters and persistent buffers, on CPU) of one DeepSpeed checkpoint folder."""
    folder = Path(folder)
    if (folder / MODEL_STATES).is_file():
        states = load_pt(folder / MODEL_STATES)
        if "module" not in states or states["module"] is None:
            raise ValueError(f"{folder / MODEL_STATES}: no 'module' entry (not a DeepSpeed model-states file)")
        # expert parallelism: the model-states file holds expert-parallel rank 0's experts; the shards hold all
        return {**states["module"], **read_expert_shards(folder)}
    if (folder / ZERO3_MODEL_STATES).is_file():
        # imported on use: DeepSpeed's import takes seconds, and only ZeRO-3 checkpoints need it
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        check_folder(folder)  # zero_to_fp32 unpickles with weights_only=False: nothing reaches it unchecked
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name))
    raise FileNotFoundError(f"checkpoint {folder}: neither {MODEL_STATES} nor {ZERO3_MODEL_STATES}")


def name_list(names: list[str], limit: int = 10) -> str:
    """'a, b, c ... and 7 more (10 in all)': a readable list of tensor names for an error message."""
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more + f" ({len(names)} in all)"


def config_changes(saved: ModelConfig, asked: ModelConfig) -> list[str]:
    """'model.hidden_size: 128 in the checkpoint's run, 256 asked' for each ModelConfig field that differs."""
    return [f"model.{f.name}: {getattr(saved, f.name)!r} in the checkpoint's run, {getattr(asked, f.name)!r} asked"
            for f in dataclasses.fields(ModelConfig) if getattr(saved, f.name) != getattr(asked, f.name)]


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
              changes: list[str] = ()) -> None:
    """Copy `state` into `model` exactly (cast to each tensor's dtype); a checkpoint of another model config
    raises naming every missing, unexpected and mis-shaped tensor (and the config `changes` that explain it)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {list(state[k].shape)}, model {list(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    problems = ([f"missing tensors: {name_list(missing)}"] if missing else []) \
        + ([f"unexpected tensors: {name_list(unexpected)}"] if unexpected else []) \
        + ([f"other shapes: {name_list(shapes, 6)}"] if shapes else [])
    if problems:
        raise ValueError(f"{source} holds the weights of another model config than the one asked for:\n  "
                         + "\n  ".join([*changes, *problems]))
    model.load_state_dict(state, strict=True)


# a tokenizer.json's companions: its special tokens are named there (data/tokenizer.py)
_TOKENIZER_JSON_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json")


def save_run_tokenizer(tokenizer: Tokenizer | None, run_dir: Path) -> None:
    """Copy the tokenizer a run trains with into its run dir (`tokenizer/`: the sentencepiece model as
    `tokenizer.model`, or a tokenizer.json with its config files), so that an export ships it without loading
    the corpus again. None (synthetic data) writes nothing."""
    if tokenizer is None:
        return
    src = Path(tokenizer.model_path)
    folder = run_dir / RUN_TOKENIZER
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer.kind == "hf":
        files = {src: "tokenizer.json"} | {src.parent / f: f for f in _TOKENIZER_JSON_SIBLINGS
                                            if (src.parent / f).is_file()}
    else:
        files = {src: "tokenizer.model"}
    for path, name in files.items():
        atomic_write(folder / name, lambda tmp, path=path: shutil.copyfile(path, tmp))


def run_tokenizer(run_dir: Path, cfg: DictConfig) -> str | None:
    """The tokenizer file a run trained with (None for synthetic data): the copy in its run dir, else (runs from
    before 2026-12) `data.tokenizer.model` when set, else the cached sentencepiece model trained on its corpus,
    found by loading the corpus (and trained again if the cache is gone)."""
    name = OmegaConf.select(cfg, "data.name")
    if name not in ("bundled", "files"):
        return None
    for file in ("tokenizer.json", "tokenizer.model"):
        if (run_dir / RUN_TOKENIZER / file).is_file():
            return str(run_dir / RUN_TOKENIZER / file)
    dcfg = DataConfig.from_mapping(cfg.data)
    if dcfg.tokenizer.model:
        return get_tokenizer(dcfg.tokenizer, None, "", dcfg.cache_path).model_path
    from data.corpus import fingerprint, load_corpus  # `datasets` (a second to import): only old run dirs need it

    corpus = load_corpus(dcfg)
    tok = get_tokenizer(dcfg.tokenizer, corpus["train"], fingerprint(corpus["train"]), dcfg.cache_path,
                        dcfg.split_seed)
    return tok.model_path
