"""Data path benchmark: first-run preparation of the bundled corpus (stage by stage, tokenize + pack
throughput in tokens/s for 1 and N processes), the cached start-up, and the loader's share of a training
step. CPU only.

    python train.py +exp=tiny_cpu train.steps=20 run_name=bench_tiny      # gives runs/bench_tiny/metrics.jsonl
    python bench/bench_data.py --metrics runs/bench_tiny/metrics.jsonl

Everything is built in a fresh temporary cache, so the numbers are first-run numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from data.config import DataConfig  # noqa: E402
from data.corpus import fingerprint, load_corpus  # noqa: E402
from data.pack import build_packed, open_packed  # noqa: E402
from data.text_loader import PackedLoader, prepare  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="conf/data/bundled.yaml")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--loader-steps", type=int, default=2000)
    ap.add_argument("--metrics", default=None, help="metrics.jsonl of a train run: its step time")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench_data_")
    raw = OmegaConf.to_container(OmegaConf.load(args.config), resolve=False)
    raw["cache_dir"] = tmp
    cfg = DataConfig.from_mapping(raw)
    rows: list[tuple[str, str]] = [("cores (os.cpu_count)", str(os.cpu_count())),
                                   ("load average at start", f"{os.getloadavg()[0]:.2f}")]
    try:
        corpus, t_load = timed(lambda: load_corpus(cfg))
        train = corpus["train"]
        chars = sum(len(t) for t in train["text"])
        rows.append(("corpus load + split (train docs / chars)", f"{t_load:.2f} s ({len(train)} / {chars:,})"))
        fp, t_fp = timed(lambda: fingerprint(train))
        rows.append(("content fingerprint", f"{t_fp:.2f} s"))
        tok, t_tok = timed(lambda: get_tokenizer(cfg.tokenizer, train, fp, cfg.cache_path, cfg.split_seed))
        rows.append((f"tokenizer training (vocab {tok.vocab_size}, {cfg.tokenizer.train_chars:,} chars)",
                     f"{t_tok:.2f} s"))
        for n in args.num_proc:
            folder = os.path.join(tmp, f"pack_np{n}")
            index, t_pack = timed(lambda n=n, folder=folder: build_packed(
                train, tok, args.seq_len, folder, num_proc=n, shard_tokens=cfg.shard_tokens))
            rows.append((f"tokenize + pack, num_proc={n} ({index['num_tokens']:,} tokens)",
                         f"{t_pack:.2f} s = {index['num_tokens'] / t_pack / 1e6:.2f} M tokens/s"))
        # a fresh cache folder: the first run trains its own tokenizer and packs both splits
        first_cfg = DataConfig.from_mapping({**raw, "cache_dir": os.path.join(tmp, "first_run")})
        _, t_first = timed(lambda: prepare(first_cfg, args.seq_len))
        rows.append(("first run: prepare() end to end (tokenizer + train + val)", f"{t_first:.2f} s"))
        prep = prepare(cfg, args.seq_len)  # the tokenizer trained above is reused: packs both splits
        _, t_cached = timed(lambda: prepare(first_cfg, args.seq_len))
        rows.append(("cached start-up: prepare() again (load + hash + verify)", f"{t_cached:.2f} s"))
        data = open_packed(prep.splits["train"].folder)

        results = {}
        for mask in (False, True):
            ld = PackedLoader(data, micro_batch_size=args.micro_batch_size, seed=0, document_mask=mask)
            ld.next_batch()
            t0 = time.perf_counter()
            for _ in range(args.loader_steps):
                ld.next_batch()
            per = (time.perf_counter() - t0) / args.loader_steps
            results[mask] = per
            rows.append((f"loader.next_batch B={args.micro_batch_size} T={args.seq_len}"
                         f"{' +doc_ids' if mask else ''}", f"{per * 1e6:.0f} µs"))
        if args.metrics:
            with open(args.metrics) as f:
                recs = [json.loads(line) for line in f if line.strip()]
            times = [r["step_time_s"] for r in recs if "step_time_s" in r][2:]  # skip warm-up steps
            step = float(np.median(times))
            rows.append((f"train step time (median of {len(times)}, {args.metrics})", f"{step:.3f} s"))
            rows.append(("loader share of the step time", f"{100 * results[False] / step:.4f} %"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    width = max(len(k) for k, _ in rows)
    print(f"\n| {'measure'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")


if __name__ == "__main__":
    main()
