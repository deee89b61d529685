"""HF interchange (ling/checkpoint/hf.py): the BailingMoeV2 layout, exact round trips, FP8 export, bad checkpoints,
tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ling.checkpoint import hf
from model.config import ModelConfig
from model.ling import LingForCausalLM

ROOT = Path(__file__).resolve().parents[2]
# small, but every mechanism: a dense layer, MoE layers, a shared expert, MTP; dims not all multiples of 128
SMALL = ModelConfig.preset("tiny", vocab_size=320, num_layers=3, num_experts=8, num_expert_groups=4,
                           topk_groups=2, num_experts_per_tok=2, expert_intermediate_size=96,
                           dense_intermediate_size=160)


def random_model(config: ModelConfig = SMALL, seed: int = 0) -> LingForCausalLM:
    torch.manual_seed(seed)
    model = LingForCausalLM(config)
    with torch.no_grad():  # non-trivial norm gains and expert biases, so a swapped tensor cannot go unseen
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        for r in model.routers():
            r.expert_bias.uniform_(-0.1, 0.1)
    return model.eval()


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_import_round_trip_is_exact(tmp_path, dtype):
    model = random_model().to(dtype)
    out = hf.save_hf(model.state_dict(), SMALL, tmp_path / "hf", dtype=None, max_shard_size="200KB")
    files = sorted(p.name for p in out.iterdir())
    assert hf.INDEX_FILE in files and sum(f.startswith("model-000") for f in files) > 2  # sharded
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert all((out / f).is_file() for f in index["weight_map"].values())

    again = LingForCausalLM(hf.read_hf_config(out)).to(dtype).eval()
    hf.load_hf_checkpoint(again, out)
    assert_same_state(model, again)
    ids = torch.randint(0, SMALL.vocab_size, (2, 24))
    with torch.no_grad():
        a, b = model(ids), again(ids)
    assert torch.equal(a.logits, b.logits) and all(torch.equal(x, y) for x, y in zip(a.mtp_logits, b.mtp_logits))


def test_single_file_export_and_bf16_weights_into_an_fp32_model(tmp_path):
    model = random_model()
    out = hf.save_hf(model.state_dict(), SMALL, tmp_path / "hf")  # default: bf16, one file
    assert (out / hf.SINGLE_FILE).is_file() and not (out / hf.INDEX_FILE).exists()
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and conf["model_type"] == "bailing_moe"
    with hf.HFReader(out) as r:
        assert r.dtype("model.layers.1.mlp.experts.0.gate_proj.weight") == "BF16"
        assert r.dtype("model.layers.1.mlp.gate.expert_bias") == "F32"  # the bias buffer stays fp32
    again = LingForCausalLM(SMALL)
    hf.load_hf_checkpoint(again, out)
    for k, v in model.state_dict().items():
        want = v if k.endswith("expert_bias") else v.to(torch.bfloat16).float()
        assert torch.equal(again.state_dict()[k], want), k


def test_config_json_round_trip():
    conf = hf.hf_config(SMALL)
    assert hf.model_config_from_hf(json.loads(json.dumps(conf))) == SMALL
    mini = ModelConfig.preset("ling_mini_2_0")
    assert hf.model_config_from_hf(hf.hf_config(mini)) == mini


# The published Ling-mini-2.0 checkpoint (inclusionAI/Ling-mini-2.0, BailingMoeV2): written down from the model
# card's layout and the reference modeling code, independently of ling/checkpoint/hf.py.
def published_ling_mini_parameters() -> dict[str, tuple[int, ...]]:
    H, V, L, E, I_MOE, I_DENSE, HEAD, Q, KV = 2048, 157184, 20, 256, 512, 5120, 128, 16, 4
    out = {"model.word_embeddings.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}

    def attention_and_norms(p: str) -> None:
        out.update({f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                    f"{p}.attention.query_key_value.weight": ((Q + 2 * KV) * HEAD, H),
                    f"{p}.attention.dense.weight": (H, Q * HEAD),
                    f"{p}.attention.query_layernorm.weight": (HEAD,), f"{p}.attention.key_layernorm.weight": (HEAD,)})

    def moe(p: str) -> None:
        out.update({f"{p}.mlp.gate.weight": (E, H), f"{p}.mlp.gate.expert_bias": (E,),
                    f"{p}.mlp.shared_experts.gate_proj.weight": (I_MOE, H),
                    f"{p}.mlp.shared_experts.up_proj.weight": (I_MOE, H),
                    f"{p}.mlp.shared_experts.down_proj.weight": (H, I_MOE)})
        for e in range(E):
            out.update({f"{p}.mlp.experts.{e}.gate_proj.weight": (I_MOE, H),
                        f"{p}.mlp.experts.{e}.up_proj.weight": (I_MOE, H),
                        f"{p}.mlp.experts.{e}.down_proj.weight": (H, I_MOE)})

    for i in range(L):
        p = f"model.layers.{i}"
        attention_and_norms(p)
        if i == 0:  # first_k_dense_replace = 1
            out.update({f"{p}.mlp.gate_proj.weight": (I_DENSE, H), f"{p}.mlp.up_proj.weight": (I_DENSE, H),
                        f"{p}.mlp.down_proj.weight": (H, I_DENSE)})
        else:
            moe(p)
    p = f"model.layers.{L}"  # the MTP layer (num_nextn_predict_layers = 1)
    attention_and_norms(p)
    moe(p)
    out.update({f"{p}.enorm.weight": (H,), f"{p}.hnorm.weight": (H,), f"{p}.eh_proj.weight": (H, 2 * H),
                f"{p}.final_layernorm.weight": (H,)})
    return out


def test_export_names_and_shapes_equal_the_published_ling_mini_2_0():
    config = ModelConfig.preset("ling_mini_2_0")
    with torch.device("meta"):
        state = LingForCausalLM(config).state_dict()
    exported = {k: tuple(v.shape) for k, v in hf.to_hf_state_dict(state, config).items()}
    expected = published_ling_mini_parameters()
    assert sorted(set(expected) - set(exported)) == [] and sorted(set(exported) - set(expected)) == []
    assert exported == expected
    # 16.26B (published) + the MTP layer
    main = sum(torch.Size(s).numel() for k, s in expected.items() if not k.startswith("model.layers.20."))
    assert round(main / 1e9, 2) == 16.26


def test_fp8_export_quantizes_the_linears_with_128x128_scales(tmp_path):
    config = SMALL.replace(hidden_size=256, num_heads=4, head_dim=64)  # K = 256: two 128-blocks
    model = random_model(config)
    out = hf.save_hf(model.state_dict(), config, tmp_path / "fp8", fp8=True)
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization_config"]["weight_block_size"] == [128, 128]
    assert "lm_head" in conf["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.3.eh_proj" in conf["quantization_config"]["modules_to_not_convert"]
    reference = hf.to_hf_state_dict(model.state_dict(), config)
    with hf.HFReader(out) as r:
        assert r.is_fp8
        quantized = [k for k in reference if r.dtype(k) == "F8_E4M3"]
        kept = {k for k in reference if k not in quantized}
        assert set(r.keys()) == set(reference) | {k + hf.SCALE_SUFFIX for k in quantized}
        for name in ("model.layers.0.attention.query_key_value.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                     "model.layers.0.mlp.gate_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight"):
            assert name in quantized
        assert {"model.word_embeddings.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight"} <= kept
        assert len(quantized) == sum(hf.is_fp8_linear(k) for k in reference)
        for name in quantized:
            w = reference[name].float()
            q, s = r.get(name), r.get(name + hf.SCALE_SUFFIX)
            assert s.dtype == torch.float32 and list(s.shape) == [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]
            # E4M3: 3 mantissa bits → relative error <= 2^-4 for normals, plus the subnormal step 2^-9 · scale
            step = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
            err = (hf._dequantize(q, s) - w).abs()
            assert (err <= w.abs() * 2**-4 + step * 2**-9 + 1e-12).all(), name

    # an FP8 export where bf16 weights are expected: a clear error; explicit dequantization works
    target = LingForCausalLM(config)
    with pytest.raises(hf.HFCheckpointError, match="blockwise-FP8 export"):
        hf.load_hf_checkpoint(target, out)
    hf.load_hf_checkpoint(target, out, dequantize_fp8=True)
    got = hf.to_hf_state_dict(target.state_dict(), config)
    with hf.HFReader(out) as r:
        name = "model.layers.2.attention.dense.weight"
        assert torch.equal(got[name], hf._dequantize(r.get(name), r.get(name + hf.SCALE_SUFFIX)))


def _rewrite_single_file(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / hf.SINGLE_FILE))
    edit(tensors)
    save_file(tensors, str(folder / hf.SINGLE_FILE))


def test_missing_unexpected_and_misshaped_tensors_are_listed(tmp_path):
    source = random_model()
    out = hf.save_hf(source.state_dict(), SMALL, tmp_path / "hf", dtype=None)

    def drop_and_add(t):
        del t["model.layers.2.mlp.experts.5.up_proj.weight"]
        del t["model.layers.3.hnorm.weight"]
        t["model.layers.9.mlp.gate.weight"] = torch.zeros(3)

    _rewrite_single_file(out, drop_and_add)
    with pytest.raises(hf.HFCheckpointError) as e:
        hf.load_hf_checkpoint(LingForCausalLM(SMALL), out)
    msg = str(e.value)
    assert "missing tensors: model.layers.2.mlp.experts.5.up_proj.weight, model.layers.3.hnorm.weight (2 in all)" in msg
    assert "unexpected tensors: model.layers.9.mlp.gate.weight (1 in all)" in msg
    # strict=False loads what is there and leaves the rest
    partial = LingForCausalLM(SMALL)
    before = partial.layers[2].mlp.experts.gate_up_proj.detach().clone()
    hf.load_hf_checkpoint(partial, out, strict=False)
    assert torch.equal(partial.layers[2].mlp.experts.gate_up_proj, before)
    assert torch.equal(partial.layers[1].mlp.experts.gate_up_proj, source.layers[1].mlp.experts.gate_up_proj)

    out2 = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf2")
    _rewrite_single_file(out2, lambda t: t.update({"model.norm.weight": torch.ones(7, dtype=torch.bfloat16)}))
    with pytest.raises(hf.HFCheckpointError, match=r"wrong shapes: model.norm.weight: \[7\] \(expected \[128\]\)"):
        hf.load_hf_checkpoint(LingForCausalLM(SMALL), out2)


def test_checkpoint_of_another_model_config_names_the_fields(tmp_path):
    out = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf")
    other = SMALL.replace(num_experts=16, num_expert_groups=4, expert_intermediate_size=64)
    with pytest.raises(hf.HFCheckpointError, match="another model config") as e:
        hf.load_hf_checkpoint(LingForCausalLM(other), out)
    assert "model.num_experts: checkpoint num_experts=8, model 16" in str(e.value)
    assert "model.expert_intermediate_size: checkpoint moe_intermediate_size=96, model 64" in str(e.value)


def test_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        hf.HFReader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.HFReader(tmp_path / "empty")
    out = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf", max_shard_size="300KB")
    os.remove(out / "model-00002-of-00003.safetensors" if (out / "model-00002-of-00003.safetensors").exists()
              else sorted(out.glob("model-0*.safetensors"))[1])
    with pytest.raises(FileNotFoundError, match="which is missing"):
        hf.HFReader(out)
    with pytest.raises(FileExistsError, match="exists"):
        hf.save_hf(random_model().state_dict(), SMALL, out)
    conf = hf.hf_config(SMALL)
    with pytest.raises(hf.HFCheckpointError, match="model_type='llama'"):
        hf.model_config_from_hf({**conf, "model_type": "llama"})
    with pytest.raises(hf.HFCheckpointError, match="use_qkv_bias"):
        hf.model_config_from_hf({**conf, "use_qkv_bias": True})


def test_failed_export_leaves_no_folder(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_file", boom)  # the name hf.py calls
    with pytest.raises(OSError, match="disk full"):
        hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ tokenizer
def make_hf_tokenizer(folder: Path) -> Path:
    """A small byte-level BPE tokenizer.json with Ling's special-token names and config files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|startoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["In the beginning was the word.", "def f(x):\n    return x + 1\n", "Numbers 12345 and ünïcode."] * 50
    tok.train_from_iterator(text, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": {"content": "<|startoftext|>"}}))
    return folder / "tokenizer.json"


def test_hf_tokenizer_json_is_a_data_pipeline_tokenizer(tmp_path):
    from data.config import TokenizerConfig
    from data.tokenizer import Tokenizer, get_tokenizer

    path = make_hf_tokenizer(tmp_path / "tok")
    tok = Tokenizer(str(path))
    assert tok.kind == "hf" and tok.eos_id == 0 and tok.bos_id == 1 and tok.pad_id == tok.eos_id
    text = "def g(y):\n    return y * 2  # ünïcode"
    ids = tok.encode([text])[0]
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size
    # a folder holding tokenizer.json is accepted as data.tokenizer.model
    assert get_tokenizer(TokenizerConfig(model=str(tmp_path / "tok")), None, "", str(tmp_path)).model_path == str(path)


def test_packing_and_loading_with_a_tokenizer_json(tmp_path):
    from data import build_loader

    path = make_hf_tokenizer(tmp_path / "tok")
    docs = [{"text": f"Document {i}: the quick brown fox jumps over {i} lazy dogs.\n" * 3} for i in range(40)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = {"name": "files", "sources": [{"path": str(corpus)}], "tokenizer": {"model": str(path)},
           "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.1, "num_proc": 1}
    loader = build_loader(cfg, seq_len=32, micro_batch_size=2)
    batch = loader.next_batch()
    assert loader.vocab_size == loader.tokenizer.vocab_size
    assert batch["input_ids"].shape == (2, 32) and int(batch["input_ids"].max()) < loader.vocab_size
    # every row decodes to pieces of the documents, separated by EOS
    for row in batch["input_ids"]:
        pieces = loader.tokenizer.decode(row.tolist()).split("<|endoftext|>")
        assert all(any(p in d["text"] for d in docs) for p in pieces), pieces


def test_export_ships_the_tokenizer(tmp_path):
    import sentencepiece as spm

    from data.tokenizer import Tokenizer

    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of some text to learn pieces from" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
    model_file = tmp_path / "sp.model"
    out = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf", tokenizer=str(model_file))
    assert (out / "tokenizer.model").read_bytes() == model_file.read_bytes()
    conf = json.loads((out / "config.json").read_text())
    assert (conf["eos_token_id"], conf["pad_token_id"], conf["bos_token_id"]) == (1, 0, 2)
    tok_conf = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_conf["eos_token"] == Tokenizer(str(model_file)).id_to_token(1) == "</s>"
    # an HF tokenizer.json travels with its config files
    hf_tok = make_hf_tokenizer(tmp_path / "hftok")
    out2 = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf2", tokenizer=str(hf_tok))
    assert (out2 / "tokenizer.json").read_bytes() == hf_tok.read_bytes()
    assert json.loads((out2 / "config.json").read_text())["eos_token_id"] == 0
    assert (out2 / "tokenizer_config.json").is_file()


# ------------------------------------------------------------------------------------------------ reference
def _reference_dir() -> Path | None:
    """The reference modeling code (inclusionAI/Ling-V2 models/*.py), if the environment points at it."""
    ref = os.environ.get("LING_REFERENCE_DIR")
    if not ref or not (Path(ref) / "modeling_bailing_moe_v2.py").is_file():
        return None
    return Path(ref)


@pytest.mark.skipif(_reference_dir() is None, reason="set LING_REFERENCE_DIR to a folder with the reference "
                    "modeling_bailing_moe_v2.py + configuration_bailing_moe_v2.py (inclusionAI/Ling-V2 models/)")
def test_export_loads_in_the_reference_modeling_code_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = random_model()
    out = hf.save_hf(model.state_dict(), SMALL, tmp_path / "hf", dtype=torch.float32, max_shard_size="300KB",
                     modeling_code=_reference_dir())
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), trust_remote_code=True, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref.eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 20))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids, use_cache=False)
    # fp32; different op order (eager softmax vs SDPA, expert loop order): rounding-level differences only
    torch.testing.assert_close(theirs.logits, ours.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs.mtp_logits[0], ours.mtp_logits[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ train.py
def _train(run_dir: Path, *overrides: str, nproc: int = 1) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    from tests.runtime.test_train_loop import free_port

    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"] \
        if nproc > 1 else []
    cmd = [sys.executable, *launch, "train.py", "+exp=tiny_cpu", "data=synthetic", "data.vocab_size=512",
           "logging.wandb.mode=disabled", "logging.progress_bar=false", "train.seq_len=32", "train.micro_batch_size=2",
           "model.num_layers=2", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_cli_export_and_train_init_from(tmp_path):
    """train 2 steps → `python -m ling.checkpoint.hf export` → train.init_from with lr 0: the new run's weights are
    exactly the exported ones (so init_from loaded every tensor)."""
    from ling.checkpoint.weights import find_checkpoint, read_model_state

    _train(tmp_path / "a", "train.steps=2")
    proc = subprocess.run([sys.executable, "-m", "ling.checkpoint.hf", "export", str(tmp_path / "a"),
                           str(tmp_path / "hf"), "--dtype", "fp32", "--max-shard-size", "1MB"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no tokenizer: synthetic data" in proc.stdout
    check = subprocess.run([sys.executable, "-m", "ling.checkpoint.hf", "check", str(tmp_path / "hf")], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 0 and "all present with the expected shapes" in check.stdout, check.stderr[-2000:]

    _train(tmp_path / "b", "train.steps=1", "optim.lr=0", "train.bias_update=false",
           f"train.init_from={tmp_path / 'hf'}")
    a = read_model_state(find_checkpoint(tmp_path / "a").folder)
    b = read_model_state(find_checkpoint(tmp_path / "b").folder)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_train_init_from_under_zero3_two_ranks(tmp_path):
    """ZeRO-3 partitions the parameters at construction; init_from gathers each one, writes it on rank 0 and
    re-partitions. Read back through zero_to_fp32 (the ZeRO-3 checkpoint path of ling.weights)."""
    from ling.checkpoint.weights import find_checkpoint, read_model_state

    _train(tmp_path / "a", "train.steps=1")
    state = read_model_state(find_checkpoint(tmp_path / "a").folder)
    hf.save_hf(state, hf.model_config_from_hf(hf.hf_config(find_checkpoint(tmp_path / "a").model_config(state))),
               tmp_path / "hf", dtype=torch.float32)
    _train(tmp_path / "z3", "train.steps=1", "optim.lr=0", "train.bias_update=false", "deepspeed=zero3",
           f"train.init_from={tmp_path / 'hf'}", nproc=2)
    z3 = read_model_state(find_checkpoint(tmp_path / "z3").folder)
    assert z3.keys() == state.keys()
    for k in state:
        assert torch.equal(z3[k], state[k]), k
