"""Tokenizer: train a sentencepiece BPE model on the corpus (cached by a hash of its inputs), or load one
(a sentencepiece `.model` or a Hugging Face `tokenizer.json`).

Training keeps text exact so every document round-trips: identity normalisation, no whitespace collapsing,
whitespace-only pieces allowed (code indentation), "\\n" a piece of its own, digits split, and byte fallback
for any character outside the learned vocabulary.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import sentencepiece as spm
from filelock import FileLock
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from data.config import DataError, TokenizerConfig

if TYPE_CHECKING:  # annotations only: importing `datasets` costs about a second (pandas, pyarrow) at every start
    import datasets

TOKENIZER_FORMAT = 1


class Tokenizer:
    """A loaded tokenizer with the ids the packer and loader need: a sentencepiece `.model`, or a Hugging Face
    `tokenizer.json` (the `tokenizers` library, e.g. Ling's own tokenizer).

    For a tokenizer.json the special tokens come from `tokenizer_config.json` / `special_tokens_map.json`
    beside it (as Hugging Face ships them), else from the usual names (`<|endoftext|>`, `</s>`, ...); EOS is
    required. Without a distinct pad token, pad = EOS (the loader then ignores EOS targets too).
    """

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model {model_path!r}: no such file")
        self.model_path = os.path.abspath(model_path)
        self.kind = "hf" if model_path.endswith(".json") else "sentencepiece"
        if self.kind == "hf":
            self._load_hf()
        else:
            self._load_sentencepiece()
        if self.eos_id < 0:
            raise DataError(f"tokenizer model {model_path!r} has no EOS piece; documents need one")
        with open(self.model_path, "rb") as f:
            self.hash = hashlib.blake2b(f.read(), digest_size=16).hexdigest()

    def _load_sentencepiece(self) -> None:
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(self.model_path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer model {self.model_path!r} is not a sentencepiece model: {e}") from e
        self.vocab_size = int(self.sp.get_piece_size())
        self.eos_id = int(self.sp.eos_id())
        self.bos_id = int(self.sp.bos_id())
        self.pad_id = int(self.sp.pad_id())
        self.unk_id = int(self.sp.unk_id())

    def _load_hf(self) -> None:
        try:
            self.hf = HFTokenizer.from_file(self.model_path)
        except Exception as e:  # the Rust library raises its own exception type
            raise DataError(f"tokenizer {self.model_path!r} is not a Hugging Face tokenizer.json: {e}") from e
        self.vocab_size = int(self.hf.get_vocab_size(with_added_tokens=True))
        named = _hf_special_tokens(os.path.dirname(self.model_path))

        def token_id(kind: str, fallbacks: tuple[str, ...]) -> int:
            for token in ([named[kind]] if kind in named else []) + list(fallbacks):
                tid = self.hf.token_to_id(token)
                if tid is not None:
                    return int(tid)
            return -1

        self.eos_id = token_id("eos", ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>"))
        self.bos_id = token_id("bos", ("<|startoftext|>", "<s>", "<bos>", "<|begin_of_text|>"))
        self.unk_id = token_id("unk", ("<unk>", "[UNK]"))
        self.pad_id = token_id("pad", ("<pad>", "[PAD]", "<|pad|>"))
        if self.pad_id < 0:
            self.pad_id = self.eos_id

    def encode(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        if self.kind == "hf":
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        return self.sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        if self.kind == "hf":
            return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)
        return self.sp.decode([int(i) for i in ids])

    def id_to_token(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id) if self.kind == "hf" else self.sp.id_to_piece(token_id)


def _hf_special_tokens(folder: str) -> dict[str, str]:
    """{"eos": "<|endoftext|>", ...} from tokenizer_config.json / special_tokens_map.json in `folder`."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            conf = json.load(f)
        for kind in ("eos", "bos", "unk", "pad"):
            tok = conf.get(f"{kind}_token")
            if isinstance(tok, dict):  # {"content": "...", "lstrip": ...}
                tok = tok.get("content")
            if isinstance(tok, str):
                out.setdefault(kind, tok)
    return out


SPIECE = "\u2581"  # sentencepiece's whitespace symbol


def tokenizer_json_from_sentencepiece(model_path: str) -> str:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) that encodes exactly as the sentencepiece BPE
    model at `model_path` does, ids and pieces, for the models this project trains (identity normalisation,
    whitespace kept, dummy prefix, single-character user symbols such as "\\n", byte fallback).

    The same steps as sentencepiece: spaces become ▁ and one ▁ is put in front of the text; the text is cut into
    words where sentencepiece cuts (before each run of ▁); each word is merged pair by pair, the pair whose merge
    has the best score first (sentencepiece's scores rank the merges); characters outside the vocabulary fall
    back to their UTF-8 bytes. Control pieces (<s>, </s>, <pad>) are never produced from text, as in
    sentencepiece: literal "<s>" in a text is encoded as characters. Raises DataError for a model it cannot
    reproduce exactly (another model type or normalisation, multi-character user symbols)."""
    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    kinds = sentencepiece_model_pb2.ModelProto.SentencePiece
    unsupported = [what for what, bad in (
        # unigram: tokenizers' lattice would also weigh the control pieces, which sentencepiece never considers
        (f"model_type {sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)} (BPE only)",
         trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE),
        (f"normalization {norm.name!r} (identity only)", bool(norm.precompiled_charsmap)),
        ("remove_extra_whitespaces", norm.remove_extra_whitespaces),
        ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix),
        ("escape_whitespaces=false", not norm.escape_whitespaces),
        ("multi-character user_defined_symbols", any(p.type == kinds.USER_DEFINED and len(p.piece) > 1
                                                     for p in proto.pieces)),
    ) if bad]
    if unsupported:
        raise DataError(f"tokenizer {model_path!r}: no exact tokenizer.json for a sentencepiece model with "
                        + ", ".join(unsupported))
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    mergeable = {p.piece for p in proto.pieces if p.type in (kinds.NORMAL, kinds.USER_DEFINED)}
    merges = []
    for i, p in enumerate(proto.pieces):
        if p.type != kinds.NORMAL or len(p.piece) < 2:
            continue
        splits = [(p.piece[:k], p.piece[k:]) for k in range(1, len(p.piece))]
        splits = [(a, b) for a, b in splits if a in mergeable and b in mergeable]
        merges += [(-p.score, i, vocab[a], vocab[b], a, b) for a, b in splits]
    merges.sort()
    unk = next((p.piece for p in proto.pieces if p.type == kinds.UNKNOWN), None)
    tok = HFTokenizer(BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                          byte_fallback=trainer.byte_fallback, fuse_unk=True))
    steps = [normalizers.Replace(" ", SPIECE)]
    if norm.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE))
    tok.normalizer = normalizers.Sequence(steps)
    # sentencepiece's words: each starts at a ▁ (at the first ▁ of a run, when whitespace-only pieces are allowed)
    word = f"{SPIECE}+[^{SPIECE}]*|[^{SPIECE}]+" if trainer.allow_whitespace_only_pieces \
        else f"{SPIECE}[^{SPIECE}]*|[^{SPIECE}]+"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(word), behavior="isolated")
    strip = [decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok.to_str(pretty=True)


def _training_sentences(ds: datasets.Dataset, cfg: TokenizerConfig, seed: int) -> list[str]:
    """A seeded sample of the corpus, as blocks of whole lines (newlines kept), about cfg.train_chars long.

    Sentencepiece trains on "sentences"; feeding blocks of lines rather than single lines lets it learn
    "\\n" and indentation pieces. Lines longer than max_sentence_chars are cut.
    """
    order = np.random.default_rng([seed, 7]).permutation(len(ds))
    out: list[str] = []
    total, limit = 0, cfg.max_sentence_chars
    for start in range(0, len(order), 256):
        for text in ds.select(np.sort(order[start:start + 256]))["text"]:
            cur, n = [], 0
            for line in text.split("\n"):
                while len(line) > limit:
                    out.append(line[:limit])
                    total += limit
                    line = line[limit:]
                if n + len(line) + 1 > limit and cur:
                    out.append("\n".join(cur))
                    cur, n = [], 0
                cur.append(line)
                n += len(line) + 1
            if cur and n > 1:
                out.append("\n".join(cur))
            total += len(text)
        if total >= cfg.train_chars:
            break
    return out


def tokenizer_key(cfg: TokenizerConfig, corpus_fingerprint: str, seed: int) -> str:
    spec = {k: v for k, v in asdict(cfg).items() if k not in ("model", "num_threads", "add_bos")}
    spec.update(corpus=corpus_fingerprint, seed=seed, spm=spm.__version__, format=TOKENIZER_FORMAT)
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=12).hexdigest()


def train_tokenizer(ds: datasets.Dataset, cfg: TokenizerConfig, out_path: str, seed: int = 0) -> None:
    """Train a sentencepiece model on `ds["text"]` and write it atomically to `out_path`."""
    sentences = _training_sentences(ds, cfg, seed)
    if not sentences:
        raise DataError("cannot train a tokenizer on an empty corpus")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=buf, model_type=cfg.model_type,
            vocab_size=cfg.vocab_size, byte_fallback=cfg.byte_fallback,
            character_coverage=cfg.character_coverage, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
            user_defined_symbols=["\n"], pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id,
            unk_id=cfg.unk_id, max_sentence_length=4 * cfg.max_sentence_chars + 16,
            num_threads=cfg.num_threads or os.cpu_count() or 1, minloglevel=2,
        )
    except RuntimeError as e:
        msg = str(e)
        m = re.search(r"<= (\d+)", msg)
        if "Vocabulary size" in msg or "vocab_size" in msg:
            limit = f" (at most {m.group(1)})" if m else ""
            raise DataError(f"data.tokenizer.vocab_size={cfg.vocab_size} is larger than this corpus supports"
                            f"{limit}: lower it or add text (sentencepiece: {msg.strip()})") from e
        raise DataError(f"sentencepiece training failed: {msg}") from e
    tmp = f"{out_path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, out_path)


def get_tokenizer(cfg: TokenizerConfig, train_ds: datasets.Dataset | None, corpus_fingerprint: str,
                  cache_dir: str, seed: int = 0) -> Tokenizer:
    """Load `cfg.model` (a sentencepiece `.model`, a `tokenizer.json`, or a folder holding one), or the cached
    model trained on this corpus with this config (training it once).

    Concurrent processes are safe: one trains under a file lock, the others wait and then load it.
    """
    if cfg.model:
        path = os.path.expanduser(cfg.model)
        if os.path.isdir(path):  # a Hugging Face model folder: its tokenizer.json, else its tokenizer.model
            found = [os.path.join(path, f) for f in ("tokenizer.json", "tokenizer.model")
                     if os.path.isfile(os.path.join(path, f))]
            if not found:
                raise FileNotFoundError(f"data.tokenizer.model={cfg.model!r}: folder without tokenizer.json "
                                        "or tokenizer.model")
            path = found[0]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.tokenizer.model={cfg.model!r}: no such file")
        return Tokenizer(path)
    key = tokenizer_key(cfg, corpus_fingerprint, seed)
    folder = os.path.join(cache_dir, "tokenizers")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"spm_{cfg.model_type}{cfg.vocab_size}_{key}.model")
    with FileLock(path + ".lock"):
        if os.path.isfile(path):
            try:
                return Tokenizer(path)
            except DataError:  # a damaged cached model (writes are atomic, so only outside hands): retrain
                os.remove(path)
        if train_ds is None:
            raise DataError("no cached tokenizer and no corpus to train one on")
        train_tokenizer(train_ds, cfg, path, seed)
        meta: dict[str, Any] = {**asdict(cfg), "corpus": corpus_fingerprint, "seed": seed}
        with open(path[: -len(".model")] + ".json", "w") as f:
            json.dump(meta, f, indent=1)
    return Tokenizer(path)
