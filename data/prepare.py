"""Prepare (train the tokenizer, tokenize and pack) ahead of training, with the same overrides as train.py.

    python -m data.prepare                                   # conf/config.yaml defaults
    python -m data.prepare +exp=tiny_cpu                     # what the demo trains on
    python -m data.prepare data=files 'data.sources=[corpus/*.jsonl]' train.seq_len=2048

Prints the cache folders and the token counts. Safe to run while training jobs start: builds are locked.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose(overrides: list[str]) -> DictConfig:
    """The app's config (conf/config.yaml + overrides) via Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def summary(cfg: DictConfig) -> dict[str, Any]:
    from data.text_loader import prepare

    if cfg.data.get("name") == "synthetic":
        raise SystemExit("data=synthetic needs no preparation; choose data=bundled or data=files")
    prep = prepare(cfg.data, int(cfg.train.seq_len))
    out: dict[str, Any] = {"tokenizer": prep.tokenizer.model_path, "vocab_size": prep.tokenizer.vocab_size,
                           "seconds": round(prep.seconds, 2)}
    for name, data in prep.splits.items():
        idx = data.index
        out[name] = {"folder": data.folder, "docs": idx["num_docs"], "tokens": idx["num_tokens"],
                     "rows": data.num_rows, "seq_len": idx["seq_len"], "shards": len(idx["shards"]),
                     "dtype": idx["dtype"]}
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    cfg = compose(argv)
    print(OmegaConf.to_yaml(cfg.data, resolve=True))
    print(json.dumps(summary(cfg), indent=1))


if __name__ == "__main__":
    main()
