"""Real-text data path: tokenizer round-trip, lossless packing across shards and ranks, exact resume,
document masks, source mixing, caches, and clear errors on bad input.

Corpora are small random documents written to tmp_path (fresh seed each run, printed so a failure can be
replayed), plus one test on a sample of the bundled corpus.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

import data.text_loader
from data.config import DataConfig, DataError
from data.corpus import load_corpus
from data.loader import build_loader, build_loaders
from data.pack import CacheError, open_packed, stream_of
from data.text_loader import PackedLoader, prepare
from data.tokenizer import get_tokenizer

WORDS_ALPHABET = list("abcdefghijklmnopqrstuvwxyz") + ["é", "ß", "中", "文", "😀", "Ω"]


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"test data seed: {seed}")  # shown by pytest on failure, to replay
    return np.random.default_rng(seed)


def random_doc(rng: np.random.Generator) -> str:
    """Prose-like or code-like text with rare unicode (byte fallback), tabs, runs of spaces and newlines."""
    lines = []
    for _ in range(int(rng.integers(1, 12))):
        indent = " " * int(rng.choice([0, 0, 4, 8])) + ("\t" if rng.random() < 0.1 else "")
        words = ["".join(rng.choice(WORDS_ALPHABET[:26] if rng.random() < 0.97 else WORDS_ALPHABET,
                                    size=int(rng.integers(1, 9)))) for _ in range(int(rng.integers(1, 14)))]
        sep = "  " if rng.random() < 0.1 else " "
        lines.append(indent + sep.join(words) + ("." if rng.random() < 0.5 else ""))
    return "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")


def write_jsonl(path, docs: list[str], column: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({column: d, "id": len(d)}) + "\n")
    return str(path)


def files_cfg(tmp_path, sources, **kw) -> DataConfig:
    raw = {"name": "files", "sources": sources, "cache_dir": str(tmp_path / "cache"), "num_proc": 1,
           "val_fraction": 0.1, "tokenizer": {"vocab_size": 400, "train_chars": 200_000}}
    for k, v in kw.items():
        if k == "tokenizer":
            raw["tokenizer"] = {**raw["tokenizer"], **v}
        else:
            raw[k] = v
    return DataConfig.from_mapping(raw)


@pytest.fixture
def corpus_file(tmp_path, rng):
    docs = [random_doc(rng) for _ in range(300)]
    return write_jsonl(tmp_path / "a.jsonl", docs), docs


def test_tokenizer_roundtrip_random(tmp_path, corpus_file):
    path, docs = corpus_file
    cfg = files_cfg(tmp_path, [path])
    corpus = load_corpus(cfg)
    tok = get_tokenizer(cfg.tokenizer, corpus["train"], "fp", cfg.cache_path)
    assert tok.vocab_size == 400
    ids = tok.encode(docs)
    assert all(max(i) < tok.vocab_size for i in ids)
    # exact: identity normalisation + byte fallback make encode/decode a bijection on text
    assert [tok.decode(i) for i in ids] == docs
    # unseen characters (never in training) come back through byte pieces
    odd = "ζ∂ ∫ x² dx\n\t  ↯ ☃"
    assert tok.decode(tok.encode([odd])[0]) == odd


def test_tokenizer_roundtrip_bundled(tmp_path, rng):
    """The bundled corpus (a seeded sample of each source) round-trips through a tokenizer trained on it."""
    cfg = DataConfig.from_mapping({
        "name": "bundled", "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0,
        "sources": ["bundled:kjv", "bundled:bbc", {"path": "bundled:sympy", "weight": 0.1}],
        "tokenizer": {"vocab_size": 2048, "train_chars": 1_000_000}})
    corpus = load_corpus(cfg)["train"]
    assert set(corpus["source"]) == {"kjv", "bbc", "sympy"}
    counts = {s: corpus["source"].count(s) for s in ("kjv", "bbc", "sympy")}
    assert counts["kjv"] == 1189 and counts["bbc"] == 2225, counts  # chapters, articles
    tok = get_tokenizer(cfg.tokenizer, corpus, "bundled-test", cfg.cache_path)
    sample = corpus.select(rng.choice(len(corpus), size=300, replace=False))["text"]
    assert [tok.decode(i) for i in tok.encode(list(sample))] == list(sample)


def _reference_stream(tok, texts) -> np.ndarray:
    return np.concatenate([np.array(i + [tok.eos_id], dtype=np.int64) for i in tok.encode(list(texts))])


def test_pack_loses_and_duplicates_nothing(tmp_path, corpus_file, rng):
    path, _ = corpus_file
    seq_len = int(rng.integers(16, 48))
    cfg = files_cfg(tmp_path, [path], shard_tokens=7 * (seq_len + 1) + 3)  # many shards, rows never split
    prep = prepare(cfg, seq_len)
    corpus = load_corpus(cfg)
    for split in ("train", "val"):
        data = prep.splits[split]
        assert len(data.maps) > 1 or split == "val"
        ref = _reference_stream(prep.tokenizer, corpus[split]["text"])
        got = stream_of(data)
        # exact: the stored stream is the EOS-joined encodings, in order, with nothing added or lost
        np.testing.assert_array_equal(got, ref)
        assert data.index["num_tokens"] == len(ref) and data.num_rows * (seq_len + 1) == len(ref) + \
            data.index["num_pad"] and data.index["num_pad"] < seq_len + 1
        assert data.maps[0].dtype == np.uint16

    # across ranks: one epoch of micro-steps covers every row exactly once (count and checksum)
    data = prep.splits["train"]
    world, b = 3, 2
    loaders = [PackedLoader(data, micro_batch_size=b, rank=r, world_size=world, seed=5) for r in range(world)]
    seen, labels_tokens = [], []
    steps = -(-data.num_rows // (world * b))
    for _ in range(steps):
        for ld in loaders:
            pos = ld.consumed + ld.rank * b + np.arange(b)
            batch = ld.next_batch()
            keep = pos < data.num_rows  # the last step runs into epoch 2: drop those for the count
            rows = torch.cat([batch["input_ids"][:, :1], torch.where(batch["labels"] == -100,
                             torch.tensor(data.index["pad_id"]), batch["labels"])], dim=1)[torch.from_numpy(keep)]
            seen.append(rows.numpy())
            labels_tokens.append(int((batch["labels"][torch.from_numpy(keep)] != -100).sum()))
    seen = np.concatenate(seen)
    all_rows = np.asarray(data.rows(np.arange(data.num_rows)), dtype=np.int64)
    assert len(seen) == data.num_rows

    def digest(rows):
        return hashlib.sha256(np.ascontiguousarray(rows[np.lexsort(rows.T[::-1])]).tobytes()).hexdigest()

    assert digest(seen) == digest(all_rows)
    assert seen.sum() == all_rows.sum()
    # every real token except each row's first is a label exactly once
    n_label = int((all_rows[:, 1:] != data.index["pad_id"]).sum())
    assert sum(labels_tokens) == n_label


def test_batches_are_shifted_stream_with_doc_ids(tmp_path, corpus_file):
    path, _ = corpus_file
    cfg = files_cfg(tmp_path, [path], document_mask=True, shuffle=False)
    ld = build_loader(cfg.__dict__ | {"tokenizer": cfg.tokenizer.__dict__,
                                      "sources": [s.__dict__ for s in cfg.sources]},
                      seq_len=32, micro_batch_size=4, seed=0)
    assert ld.vocab_size == 400
    stream = stream_of(ld.data)
    eos = ld.eos_id
    for step in range(3):
        batch = ld.next_batch()
        assert set(batch) == {"input_ids", "labels", "doc_ids"}
        assert all(v.dtype == torch.int64 and v.shape == (4, 32) for v in batch.values())
        for j in range(4):
            row = stream[(step * 4 + j) * 33:(step * 4 + j + 1) * 33]  # unshuffled: rows in stream order
            np.testing.assert_array_equal(batch["input_ids"][j].numpy(), row[:-1])
            np.testing.assert_array_equal(batch["labels"][j].numpy(), row[1:])
            ref_doc, d = [], 0
            for t in row[:-1]:
                ref_doc.append(d)
                d += int(t == eos)  # the EOS belongs to the document it ends
            np.testing.assert_array_equal(batch["doc_ids"][j].numpy(), ref_doc)


def test_pad_tail_is_ignored(tmp_path, rng):
    docs = [random_doc(rng) for _ in range(40)]
    cfg = files_cfg(tmp_path, [write_jsonl(tmp_path / "p.jsonl", docs)], val_fraction=0.0, shuffle=False)
    prep = prepare(cfg, 61)
    data = prep.splits["train"]
    if data.index["num_pad"] == 0:
        pytest.skip("the stream happened to fill the last row exactly")
    ld = PackedLoader(data, micro_batch_size=1, shuffle=False)
    ld.consumed = data.num_rows - 1
    labels = ld.next_batch()["labels"][0]
    assert int((labels == -100).sum()) == data.index["num_pad"]
    assert (labels[-data.index["num_pad"]:] == -100).all()


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_yields_the_next_batch(tmp_path, corpus_file, rng, shuffle):
    path, _ = corpus_file
    cfg = files_cfg(tmp_path, [path], shuffle=shuffle)
    data = prepare(cfg, 24).splits["train"]
    world, b = 2, 3
    k = int(rng.integers(1, 3 * data.num_rows // (world * b)))  # may stop in a later epoch

    def run(ld, n):
        return [ld.next_batch() for _ in range(n)]

    full = [PackedLoader(data, micro_batch_size=b, rank=r, world_size=world, seed=11, shuffle=shuffle)
            for r in range(world)]
    for ld in full:
        run(ld, k)
    states = [ld.state_dict() for ld in full]
    expected = [run(ld, 5) for ld in full]
    for r in range(world):
        fresh = PackedLoader(data, micro_batch_size=b, rank=r, world_size=world, seed=11, shuffle=shuffle)
        fresh.load_state_dict(json.loads(json.dumps(states[r])))  # the state survives serialisation
        for got, want in zip(run(fresh, 5), expected[r]):
            for key in want:
                assert torch.equal(got[key], want[key])
    # resume on one rank with the global batch: the same rows, concatenated in rank order
    single = PackedLoader(data, micro_batch_size=b * world, rank=0, world_size=1, seed=11, shuffle=shuffle)
    single.load_state_dict(states[0])
    got = single.next_batch()["input_ids"]
    assert torch.equal(got, torch.cat([expected[r][0]["input_ids"] for r in range(world)]))


def test_mixing_weights_and_split_by_document(tmp_path, rng):
    a = [f"alpha {i} " + random_doc(rng) for i in range(100)]
    b = [f"beta {i} " + random_doc(rng) for i in range(60)]
    pa, pb = write_jsonl(tmp_path / "a.jsonl", a), write_jsonl(tmp_path / "b.jsonl", b, column="content")
    cfg = files_cfg(tmp_path, [{"path": pa, "weight": 2.0}, {"path": pb, "weight": 0.5, "text_column": "content"}])
    corpus = load_corpus(cfg)
    train, val = corpus["train"], corpus["val"]
    assert len(val) == 10 + 6  # round(0.1 * n) held out per source
    assert train["source"].count("a.jsonl") == 2 * 90 and train["source"].count("b.jsonl") == round(0.5 * 54)
    assert not set(val["text"]) & set(train["text"])  # held out by document, never trained on
    assert set(val["text"]) | set(train["text"]) <= set(a) | set(b)
    again = load_corpus(cfg)
    assert again["train"]["text"] == train["text"]  # seeded: identical on every call / rank


def test_cache_reused_and_keyed(tmp_path, corpus_file, monkeypatch):
    path, _ = corpus_file
    cfg = files_cfg(tmp_path, [path])
    first = prepare(cfg, 32)

    def boom(*a, **k):
        raise AssertionError("rebuilt a valid cache")

    monkeypatch.setattr(data.text_loader, "build_packed", boom)
    monkeypatch.setattr("data.tokenizer.train_tokenizer", boom)  # the same model path alone would not show it
    again = prepare(cfg, 32)
    assert again.splits["train"].folder == first.splits["train"].folder
    assert again.tokenizer.model_path == first.tokenizer.model_path
    monkeypatch.undo()
    monkeypatch.setattr("data.tokenizer.train_tokenizer", boom)  # another seq_len reuses the tokenizer
    other = prepare(cfg, 40)  # another sequence length: another cache
    assert other.splits["train"].folder != first.splits["train"].folder
    assert other.tokenizer.model_path == first.tokenizer.model_path


@pytest.mark.parametrize("damage", ["truncate", "no_index", "flip"])
def test_partial_cache_is_rebuilt(tmp_path, corpus_file, damage):
    path, _ = corpus_file
    cfg = files_cfg(tmp_path, [path], shard_tokens=2000)
    good = prepare(cfg, 32).splits["train"]
    ref = stream_of(good).copy()
    folder = good.folder
    shard = os.path.join(folder, good.index["shards"][-1]["file"])
    del good
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif damage == "no_index":
        os.remove(os.path.join(folder, "index.json"))
    else:  # same size, different bytes: only the checksum sees it
        with open(shard, "r+b") as f:
            f.seek(4)
            byte = f.read(1)
            f.seek(4)
            f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CacheError, match="partial|index|checksum"):
        open_packed(folder)
    # a half-built temp folder of a killed run is never picked up
    os.makedirs(folder + ".tmp-999-dead", exist_ok=True)
    rebuilt = prepare(cfg, 32).splits["train"]
    assert rebuilt.folder == folder
    np.testing.assert_array_equal(stream_of(rebuilt), ref)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_corpus(files_cfg(tmp_path, [str(tmp_path / "nope.jsonl")]))
    with pytest.raises(DataError, match="matches no file"):
        load_corpus(files_cfg(tmp_path, [str(tmp_path / "*.parquet")]))
    with pytest.raises(FileNotFoundError, match="missing.model"):
        get_tokenizer(files_cfg(tmp_path, ["x"], tokenizer={"model": str(tmp_path / "missing.model")}).tokenizer,
                      None, "", str(tmp_path))


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        load_corpus(files_cfg(tmp_path, [str(empty)]))
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "   ", "\n"])
    with pytest.raises(DataError, match="blank.jsonl.*empty"):
        load_corpus(files_cfg(tmp_path, [blank]))
    with pytest.raises(DataError, match="sources is empty"):
        DataConfig.from_mapping({"name": "files", "sources": []})


def test_wrong_text_column(tmp_path, rng):
    path = write_jsonl(tmp_path / "c.jsonl", [random_doc(rng) for _ in range(5)], column="body")
    with pytest.raises(DataError, match=r"no text column 'text'.*\['body', 'id'\]"):
        load_corpus(files_cfg(tmp_path, [path]))
    with pytest.raises(DataError, match="column 'id' holds"):
        load_corpus(files_cfg(tmp_path, [{"path": path, "text_column": "id"}]))


def test_invalid_utf8(tmp_path, rng):
    good = random_doc(rng).encode()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(good + b"\xff\xfe latin \xe9" + good)
    with pytest.raises(DataError, match=rf"bad.txt.*invalid UTF-8 at byte {len(good)}"):
        load_corpus(files_cfg(tmp_path, [str(bad)]))
    jl = tmp_path / "bad.jsonl"
    jl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="bad.jsonl.*invalid UTF-8"):
        load_corpus(files_cfg(tmp_path, [str(jl)]))
    # opting in replaces the bad bytes (text files)
    corpus = load_corpus(files_cfg(tmp_path, [str(bad)], encoding_errors="replace", val_fraction=0.0))
    assert "\ufffd" in corpus["train"]["text"][0]


def test_vocab_larger_than_corpus_supports(tmp_path):
    path = write_jsonl(tmp_path / "tiny.jsonl", ["the cat sat on the mat"] * 3)
    cfg = files_cfg(tmp_path, [path], val_fraction=0.0, tokenizer={"vocab_size": 5000})
    with pytest.raises(DataError, match=r"vocab_size=5000 is larger than this corpus supports"):
        prepare(cfg, 16)


def test_unknown_config_key_and_bundled_name(tmp_path):
    with pytest.raises(DataError, match="unknown key.*vocab_sz"):
        DataConfig.from_mapping({"name": "files", "sources": ["a.jsonl"], "tokenizer": {"vocab_sz": 10}})
    with pytest.raises(DataError, match="bundled:nope"):
        load_corpus(files_cfg(tmp_path, ["bundled:nope"]))


def test_resume_rejects_other_data(tmp_path, corpus_file):
    path, _ = corpus_file
    cfg = files_cfg(tmp_path, [path])
    a = PackedLoader(prepare(cfg, 32).splits["train"], micro_batch_size=2)
    b = PackedLoader(prepare(cfg, 20).splits["train"], micro_batch_size=2)
    a.next_batch()
    with pytest.raises(DataError, match="refers to packed data"):
        b.load_state_dict(a.state_dict())


def _prepare_in_process(args) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """(packed folder, (inode, mtime ns) of its index.json, (inode, mtime ns) of the tokenizer model): a file
    built twice (written to a temporary name, then renamed into place) gets a new inode and mtime."""
    cfg_raw, seq_len = args
    prep = prepare(DataConfig.from_mapping(cfg_raw), seq_len)

    def ident(path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns

    return (prep.splits["train"].folder, ident(os.path.join(prep.splits["train"].folder, "index.json")),
            ident(prep.tokenizer.model_path))


@pytest.mark.slow
def test_concurrent_ranks_build_once(tmp_path, corpus_file):
    """Two processes prepare the same data at once: one builds under the lock, the other reuses it."""
    import multiprocessing as mp

    path, _ = corpus_file
    raw = {"name": "files", "sources": [path], "cache_dir": str(tmp_path / "cache"), "num_proc": 1,
           "tokenizer": {"vocab_size": 400, "train_chars": 200_000}}
    with mp.get_context("spawn").Pool(2) as pool:
        out = pool.map(_prepare_in_process, [(raw, 32), (raw, 32)])
    assert out[0] == out[1], "both ranks must open the very same build (same files, written once)"
    assert len([f for f in os.listdir(tmp_path / "cache" / "tokenizers") if f.endswith(".model")]) == 1
    assert not [f for f in os.listdir(tmp_path / "cache" / "packed") if ".tmp-" in f]


def test_local_formats_glob_dir_and_text_files(tmp_path, rng):
    """parquet (custom column), a directory of .txt files (one document each) and a jsonl glob, mixed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    par = [random_doc(rng) for _ in range(20)]
    pq.write_table(pa.table({"body": par, "n": list(range(20))}), tmp_path / "p.parquet")
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    txt = [random_doc(rng) + "\n\nsecond paragraph\n" for _ in range(7)]
    for i, t in enumerate(txt):
        (txt_dir / f"{i}.txt").write_text(t, encoding="utf-8")
    js = [[random_doc(rng) for _ in range(5)] for _ in range(2)]
    for i, docs in enumerate(js):
        write_jsonl(tmp_path / f"shard{i}.jsonl", docs)
    cfg = files_cfg(tmp_path, [{"path": str(tmp_path / "p.parquet"), "text_column": "body"}, str(txt_dir),
                               str(tmp_path / "shard*.jsonl")], val_fraction=0.0)
    train = load_corpus(cfg)["train"]
    assert sorted(train["text"]) == sorted(par + txt + js[0] + js[1])  # text files keep their line breaks
    assert set(train["source"]) == {"p.parquet", "txt", "shard*.jsonl"}


def test_val_split_loader(tmp_path, corpus_file):
    path, _ = corpus_file
    raw = {"name": "files", "sources": [path], "cache_dir": str(tmp_path / "cache"), "num_proc": 1,
           "val_fraction": 0.1, "tokenizer": {"vocab_size": 400, "train_chars": 200_000}}
    val = build_loader(raw, seq_len=16, micro_batch_size=2, split="val")
    first = val.next_batch()["input_ids"]
    np.testing.assert_array_equal(first.numpy(), stream_of(val.data)[:2 * 17].reshape(2, 17)[:, :-1])
    with pytest.raises(DataError, match="no 'val' split"):
        build_loader({**raw, "val_fraction": 0.0}, seq_len=16, micro_batch_size=2, split="val")
    synth = build_loader({"name": "synthetic", "vocab_size": 64, "seed": 0}, seq_len=16, micro_batch_size=2)
    assert synth.next_batch()["input_ids"].shape == (2, 16)  # the synthetic source is untouched


def test_the_train_and_val_loaders_share_one_reading_of_the_corpus(tmp_path, corpus_file, monkeypatch):
    """build_loaders (the trainer's): one `load_corpus` (and fingerprint pass) for both splits, the same batches
    as a loader built per split; a split the source lacks is absent, not an error."""
    path, _ = corpus_file
    raw = {"name": "files", "sources": [path], "cache_dir": str(tmp_path / "cache"), "num_proc": 1,
           "val_fraction": 0.1, "tokenizer": {"vocab_size": 400, "train_chars": 200_000}}
    args = {"seq_len": 16, "micro_batch_size": 2, "rank": 1, "world_size": 2, "seed": 3}
    single = {split: build_loader(raw, split=split, **args) for split in ("train", "val")}
    reads = []
    real_load = data.text_loader.load_corpus
    monkeypatch.setattr(data.text_loader, "load_corpus", lambda cfg: reads.append(cfg) or real_load(cfg))
    both = build_loaders(raw, ("train", "val"), **args)
    assert len(reads) == 1 and set(both) == {"train", "val"}
    for split, loader in both.items():
        for _ in range(3):
            want, got = single[split].next_batch(), loader.next_batch()
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), split
    assert set(build_loaders({**raw, "val_fraction": 0.0}, ("train", "val"), **args)) == {"train"}
    synth = build_loaders({"name": "synthetic", "vocab_size": 64, "seed": 0}, ("train", "val"), **args)
    assert set(synth) == {"train"}
