"""HF interchange (ling/checkpoint/hf.py): the BailingMoeV2 layout, exact round trips, FP8 export, bad checkpoints,
tokenizer."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ling.checkpoint import hf
from model.config import ModelConfig
from model.ling import LingForCausalLM, shift_left
from model.loss import IGNORE_INDEX
from tests.fork_server import run_script
from tests.helpers import ROOT

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
@pytest.mark.parametrize("mtp", [0, 1, 2])
def test_export_loads_in_the_reference_modeling_code_with_equal_logits(tmp_path, mtp):
    transformers = pytest.importorskip("transformers")
    config = SMALL.replace(num_mtp_layers=mtp)
    model = random_model(config)
    out = hf.save_hf(model.state_dict(), config, tmp_path / "hf", dtype=torch.float32, max_shard_size="300KB",
                     modeling_code=_reference_dir())
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), trust_remote_code=True, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert ref.mtp_loss_scaling_factor * max(mtp, 1) == pytest.approx(config.mtp_loss_weight)
    ref.eval()
    ids = torch.randint(0, config.vocab_size, (2, 20))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids, use_cache=False)
        # each depth's logits from the decoder's MTP hidden states: with 2+ depths the reference's CausalLM forward
        # re-binds its list of them to depth 1's tensor and indexes that (modeling_bailing_moe_v2.py)
        depths = [ref.lm_head(h).float() for h in ref.model(ids, use_cache=False).mtp_hidden_states or []]
    # fp32; different op order (eager softmax vs SDPA, expert loop order): rounding-level differences only
    torch.testing.assert_close(theirs.logits, ours.logits, rtol=1e-5, atol=1e-5)
    assert len(depths) == len(ours.mtp_logits or []) == mtp
    for a, b in zip(depths, ours.mtp_logits or []):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ train.py
def _train(run_dir: Path, *overrides: str, nproc: int = 1) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = ["train.py", "+exp=tiny_cpu", "data=synthetic", "data.vocab_size=512",
           "logging.wandb.mode=disabled", "logging.progress_bar=false", "train.seq_len=32", "train.micro_batch_size=2",
           "model.num_layers=2", f"hydra.run.dir={run_dir}", *overrides]
    # children of the fork server: `python train.py`, or torchrun's nproc workers (the launcher is not tested here)
    proc = run_script(cmd, ROOT, env, timeout=600, nproc=nproc if nproc > 1 else None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step run of train.py, the source of both init_from tests below (neither changes it)."""
    run = tmp_path_factory.mktemp("trained") / "a"
    _train(run, "train.steps=2")
    return run


@pytest.mark.slow
def test_cli_export_and_train_init_from(trained, tmp_path):
    """train 2 steps → `python -m ling.checkpoint.hf export` → train.init_from with lr 0: the new run's weights are
    exactly the exported ones (so init_from loaded every tensor)."""
    from ling.checkpoint.weights import find_checkpoint, read_model_state

    proc = _cli("export", str(trained), str(tmp_path / "hf"), "--dtype", "fp32", "--max-shard-size", "1MB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no tokenizer: synthetic data" in proc.stdout
    check = _cli("check", str(tmp_path / "hf"))
    assert check.returncode == 0 and "all present with the expected shapes" in check.stdout, check.stderr[-2000:]

    _train(tmp_path / "b", "train.steps=1", "optim.lr=0", "train.bias_update=false",
           f"train.init_from={tmp_path / 'hf'}")
    a = read_model_state(find_checkpoint(trained).folder)
    b = read_model_state(find_checkpoint(tmp_path / "b").folder)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_train_init_from_under_zero3_two_ranks(trained, tmp_path):
    """ZeRO-3 partitions the parameters at construction; init_from gathers each one, writes it on rank 0 and
    re-partitions. Read back through zero_to_fp32 (the ZeRO-3 checkpoint path of ling.weights)."""
    from ling.checkpoint.weights import find_checkpoint, read_model_state

    state = read_model_state(find_checkpoint(trained).folder)
    hf.save_hf(state, hf.model_config_from_hf(hf.hf_config(find_checkpoint(trained).model_config(state))),
               tmp_path / "hf", dtype=torch.float32)
    _train(tmp_path / "z3", "train.steps=1", "optim.lr=0", "train.bias_update=false", "deepspeed=zero3",
           f"train.init_from={tmp_path / 'hf'}", nproc=2)
    z3 = read_model_state(find_checkpoint(tmp_path / "z3").folder)
    assert z3.keys() == state.keys()
    for k in state:
        assert torch.equal(z3[k], state[k]), k


# ------------------------------------------------------------------------------------------------ config reading
# BailingMoeV2Config.__init__'s defaults as written in the reference, inclusionAI/Ling-V2
# models/configuration_bailing_moe_v2.py (what it takes for a field its config.json lacks), and
# partial_rotary_factor's fallback in models/modeling_bailing_moe_v2.py (BailingMoeV2Attention: 1.0).
REFERENCE_CONFIG_DEFAULTS = {
    "vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "use_qkv_bias": False,
    "use_bias": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "embedding_dropout": 0.0,
    "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 32768,
    "rope_theta": 600000.0, "use_cache": True, "max_window_layers": 20, "rope_scaling": None, "pad_token_id": 156892,
    "eos_token_id": 156892, "num_experts": 256, "num_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "moe_intermediate_size": 512, "first_k_dense_replace": 1, "head_dim": 128,
    "output_router_logits": False, "use_qk_norm": True, "num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": 0,
    "moe_router_enable_expert_bias": True, "routed_scaling_factor": 1.0,
}


@pytest.mark.parametrize("field", sorted(REFERENCE_CONFIG_DEFAULTS))
def test_reference_defaults_table_field_by_field(field):
    assert field in hf.REFERENCE_DEFAULTS and hf.REFERENCE_DEFAULTS[field] == REFERENCE_CONFIG_DEFAULTS[field]
    assert type(hf.REFERENCE_DEFAULTS[field]) is type(REFERENCE_CONFIG_DEFAULTS[field])


def test_partial_rotary_factor_defaults_to_the_modeling_codes_1():
    assert set(hf.REFERENCE_DEFAULTS) == set(REFERENCE_CONFIG_DEFAULTS) | {"partial_rotary_factor"}
    assert hf.REFERENCE_DEFAULTS["partial_rotary_factor"] == 1.0


def trimmed(conf: dict) -> dict:
    """`conf` without the fields at the reference's defaults, and without model_type (as the reference writes)."""
    return {k: v for k, v in conf.items() if k != "model_type" and not (
        k in REFERENCE_CONFIG_DEFAULTS and v == REFERENCE_CONFIG_DEFAULTS[k] and type(v) is type(
            REFERENCE_CONFIG_DEFAULTS[k]))}


def test_absent_fields_take_the_reference_defaults_not_ours():
    """Issue #26 point 2: partial_rotary_factor absent is 1.0 for the reference (ours 0.5), routed_scaling_factor
    absent 1.0 (ours 2.5); every other absent field likewise."""
    conf = {k: v for k, v in hf.hf_config(SMALL).items() if k not in ("partial_rotary_factor", "rotary_dim",
                                                                     "routed_scaling_factor", hf.OWN_KEY)}
    got = hf.model_config_from_hf(conf)
    assert got.rotary_fraction == 1.0 and got.rotary_dim == SMALL.head_dim and got.routed_scaling_factor == 1.0
    assert hf.config_differences(conf, SMALL)  # a model of our defaults is not this checkpoint's
    # Ling-mini-2.0's own values equal most reference defaults: all of those left out, the config is unchanged
    mini = ModelConfig.preset("ling_mini_2_0", mtp_loss_weight=0.0)
    saved = trimmed({k: v for k, v in hf.hf_config(mini).items() if k != hf.OWN_KEY})
    assert {"num_experts", "hidden_size", "rope_theta", "n_group", "head_dim"}.isdisjoint(saved)
    got = hf.model_config_from_hf(saved)
    fields = {**hf._SHAPE_FIELDS, **hf._MATH_FIELDS}.values()
    assert {f: getattr(got, f) for f in fields} == {f: getattr(mini, f) for f in fields}
    assert hf.config_differences(saved, mini) == []


def test_a_reference_saved_folder_without_model_type_is_accepted_everywhere(tmp_path):
    """Issue #26 point 3: `check`, eval's read_hf_config and train.init_from read it alike."""
    model = random_model()
    out = hf.save_hf(model.state_dict(), SMALL, tmp_path / "hf", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    del conf["model_type"]
    (out / "config.json").write_text(json.dumps(conf))
    hf.main(["check", str(out)])
    assert hf.read_hf_config(out) == SMALL
    again = LingForCausalLM(SMALL)
    hf.load_hf_checkpoint(again, out)
    assert_same_state(model, again)
    del conf["architectures"]
    with pytest.raises(hf.HFCheckpointError, match="neither model_type nor architectures"):
        hf.check_hf_config(conf)


def _refusals(tmp_path: Path, edit, config: ModelConfig = SMALL) -> list[str]:
    """The errors of `check`, eval (read_hf_config) and train.init_from (load_hf_checkpoint) for an export whose
    config.json `edit` changed."""
    out = tmp_path / f"hf{len(list(tmp_path.iterdir()))}"
    hf.save_hf(random_model(config).state_dict(), config, out)
    conf = json.loads((out / "config.json").read_text())
    edit(conf)
    (out / "config.json").write_text(json.dumps(conf))
    errors = []
    with pytest.raises(SystemExit) as e:
        hf.main(["check", str(out)])
    errors.append(str(e.value))
    with pytest.raises(hf.HFCheckpointError) as e:
        hf.read_hf_config(out)
    errors.append(str(e.value))
    with pytest.raises(hf.HFCheckpointError) as e:
        hf.load_hf_checkpoint(LingForCausalLM(config), out)
    errors.append(str(e.value))
    return errors


@pytest.mark.parametrize("mtp", [0, 1])
def test_other_architectures_and_unsupported_settings_are_refused_by_check_eval_and_init_from(tmp_path, mtp):
    """Issue #26 point 4: one check, naming the field, for `check`, eval and train.init_from (with and without MTP:
    with MTP it used to be refused only for the missing MTP layer)."""
    config = SMALL.replace(num_mtp_layers=mtp)
    llama = _refusals(tmp_path, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), config)
    assert all("architectures=['LlamaForCausalLM'] is not BailingMoeV2" in e for e in llama), llama
    rope = _refusals(tmp_path, lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0}), config)
    assert all("rope_scaling={'type': 'linear', 'factor': 4.0}" in e for e in rope), rope
    gelu = _refusals(tmp_path, lambda c: c.update(hidden_act="gelu"), config)
    assert all("hidden_act='gelu'" in e for e in gelu), gelu
    dense = _refusals(tmp_path, lambda c: c.update(num_experts=None), config)  # used to be a TypeError
    assert all("num_experts=None" in e for e in dense), dense


def test_mtp_loss_factor_is_written_in_the_references_sum_convention():
    """Issue #26 point 6: the reference adds factor × each depth's loss, we add weight × their mean."""
    config = SMALL.replace(num_mtp_layers=2, mtp_loss_weight=0.3)
    conf = hf.hf_config(config)
    assert conf["mtp_loss_scaling_factor"] == pytest.approx(0.15)
    assert hf.model_config_from_hf(conf) == config  # ours, exactly, from the ling_fp8 entry
    reference = {k: v for k, v in conf.items() if k != hf.OWN_KEY}
    assert hf.model_config_from_hf(reference).mtp_loss_weight == pytest.approx(0.3)
    # the loss our model computes with weight w is the reference's (each depth's loss × factor, summed)
    model = random_model(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = shift_left(ids, 1, IGNORE_INDEX)
    with torch.no_grad():
        out = model(ids, labels=labels, return_logits=True)
    depth_losses = [F.cross_entropy(logits.float().flatten(0, 1), shift_left(labels, d, IGNORE_INDEX).flatten(),
                                    ignore_index=IGNORE_INDEX) for d, logits in enumerate(out.mtp_logits, start=1)]
    reference_loss = out.lm_loss + out.z_loss + out.aux_loss + conf["mtp_loss_scaling_factor"] * sum(depth_losses)
    torch.testing.assert_close(out.loss, reference_loss)


def test_config_uses_dtype_not_the_deprecated_torch_dtype_and_no_auto_map_by_default(tmp_path):
    out = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf")
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and "torch_dtype" not in conf
    assert "auto_map" not in conf and not any(f.suffix == ".py" for f in out.iterdir())
    code = tmp_path / "code"
    code.mkdir()
    (code / hf.REFERENCE_CODE_FILES[0]).write_text("# stand-in\n")
    with pytest.raises(FileNotFoundError, match=hf.REFERENCE_CODE_FILES[1]):
        hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf2", modeling_code=code)
    (code / hf.REFERENCE_CODE_FILES[1]).write_text("# stand-in\n")
    out = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf2", modeling_code=code)
    conf = json.loads((out / "config.json").read_text())
    assert conf["auto_map"] == hf.AUTO_MAP and all((out / f).is_file() for f in hf.REFERENCE_CODE_FILES)
    assert {v.split(".")[0] + ".py" for v in conf["auto_map"].values()} == set(hf.REFERENCE_CODE_FILES)


def test_a_bin_checkpoint_is_refused_as_unsupported(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf.hf_config(SMALL)))
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(hf.HFCheckpointError, match=r"pytorch_model\.bin\): unsupported.*safetensors"):
        hf.HFReader(folder)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m ling.checkpoint.hf ARGS`, a child of the fork server (the environment of `_train`'s runs, whose
    server has imported torch: the CLI's own imports and start-up run in the child)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return run_script(["-m", "ling.checkpoint.hf", *args], ROOT, env, timeout=300)


def test_cli_errors_are_one_message_not_a_traceback(tmp_path):
    """Issue #26 point 6 and #28 item 7: a missing folder, a bad config, an export into an existing folder."""
    proc = _cli("check", str(tmp_path / "nope"))
    assert proc.returncode != 0 and "check: error: " in proc.stderr and "no such folder" in proc.stderr
    out = hf.save_hf(random_model().state_dict(), SMALL, tmp_path / "hf")
    conf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**conf, "num_experts": None}))
    proc2 = _cli("check", str(out))
    assert proc2.returncode != 0 and "num_experts=None" in proc2.stderr
    (tmp_path / "run").mkdir()
    proc3 = _cli("export", str(tmp_path / "run"), str(out))
    assert proc3.returncode != 0 and "error:" in proc3.stderr
    for p in (proc, proc2, proc3):
        assert "Traceback" not in p.stderr, p.stderr


# ------------------------------------------------------------------------------------------------ tokenizer files
# unicode, whitespace runs, tabs, newlines (leading, trailing, blank lines), digits, code, literal special tokens
TOKENIZER_TEXTS = [
    "In the beginning God created the heaven and the earth.", "  two leading spaces and   runs of    spaces",
    "tabs\tand\t\ttabs", "lines\nand\n\nblank lines\n  indented\n", "\nstarts with a newline", "ends in spaces   ",
    "digits 0123456789 3.14159 2026-12-02 1e-6", "ünïcödé café naïve — “quotes” 😀 中文字符 日本語 Ελληνικά",
    "literal <s> and </s> and <pad> and <unk> in the text", "<s>", "</s>", "<pad>", "def f(x):\n    return x + 1\n",
    "▁ the sentencepiece space symbol itself ▁▁", "", " ", "\n", "\r\n windows line ends\r\n", "x" * 40,
]


def tokenizer_corpus() -> list[str]:
    rng = random.Random(0)
    alphabet = list("abcdefgh ijk\n\t▁<>/s0123456789éü😀中")
    return TOKENIZER_TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(300)]


def trained_sentencepiece(folder: Path) -> Path:
    """A sentencepiece BPE model trained the way the project trains one (data/tokenizer.py), on a small corpus."""
    import datasets

    from data.config import TokenizerConfig
    from data.tokenizer import train_tokenizer

    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    docs = [("\n" + "    " * rng.randint(0, 2)).join(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
                                                    for _ in range(rng.randint(1, 6))) for _ in range(400)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sp.model"
    train_tokenizer(datasets.Dataset.from_dict({"text": docs + TOKENIZER_TEXTS * 5}),
                    TokenizerConfig(vocab_size=600, num_threads=1), str(path))
    return path


@pytest.fixture(scope="module")
def exported_tokenizer(tmp_path_factory) -> tuple[Path, Path]:
    """(the sentencepiece model, an export shipping it)."""
    root = tmp_path_factory.mktemp("tok")
    model_file = trained_sentencepiece(root / "sp")
    return model_file, hf.save_hf(random_model().state_dict(), SMALL, root / "hf", tokenizer=str(model_file))


def test_export_writes_a_tokenizer_json_that_encodes_as_our_sentencepiece_model(exported_tokenizer):
    """Issue #26 point 5, without transformers (CI): the tokenizers library and our data pipeline, both reading the
    exported tokenizer.json, give the sentencepiece model's ids on every text."""
    import sentencepiece as spm
    from tokenizers import Tokenizer as HFTokenizer

    from data.config import TokenizerConfig
    from data.tokenizer import get_tokenizer

    model_file, out = exported_tokenizer
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    fast = HFTokenizer.from_file(str(out / "tokenizer.json"))
    ours = get_tokenizer(TokenizerConfig(model=str(out)), None, "", str(out))  # a folder: its tokenizer.json
    assert ours.kind == "hf" and (ours.eos_id, ours.bos_id, ours.pad_id) == (sp.eos_id(), sp.bos_id(), sp.pad_id())
    texts = tokenizer_corpus()
    want = sp.encode(texts)
    assert [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)] == want
    assert ours.encode(texts) == want
    assert [ours.decode(ids) for ids in want[:len(TOKENIZER_TEXTS)]] == sp.decode(want[:len(TOKENIZER_TEXTS)])
    conf = json.loads((out / "tokenizer_config.json").read_text())
    assert "vocab_file" not in conf and "add_prefix_space" not in conf and conf["split_special_tokens"] is True


@pytest.mark.parametrize("use_fast", [True, False])
def test_the_exported_tokenizer_loads_in_transformers_from_any_directory(exported_tokenizer, tmp_path, monkeypatch,
                                                                         use_fast):
    """Issue #26 point 5: AutoTokenizer.from_pretrained(export) from another working directory, fast and slow, gives
    exactly our ids (no BOS/EOS added, the dummy prefix kept after newlines, literal "<s>" encoded as text)."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    model_file, out = exported_tokenizer
    monkeypatch.chdir(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), use_fast=use_fast)
    assert type(tok).__name__ == ("LlamaTokenizerFast" if use_fast else "LlamaTokenizer")
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    texts = tokenizer_corpus()
    assert [tok(t)["input_ids"] for t in texts] == sp.encode(texts)
    assert tok.eos_token_id == sp.eos_id() and tok.bos_token_id == sp.bos_id() and tok.pad_token_id == sp.pad_id()


def test_a_sentencepiece_model_it_cannot_reproduce_is_refused_by_name(tmp_path):
    import sentencepiece as spm

    from data.config import DataError
    from data.tokenizer import tokenizer_json_from_sentencepiece

    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of some text to learn pieces from" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "uni"), vocab_size=60,
                                   model_type="unigram", minloglevel=2)
    with pytest.raises(DataError, match="model_type UNIGRAM"):
        tokenizer_json_from_sentencepiece(str(tmp_path / "uni.model"))


@pytest.mark.skipif(_reference_dir() is None, reason="set LING_REFERENCE_DIR (see above)")
def test_reference_defaults_equal_what_the_reference_config_class_reads(tmp_path):
    """Against the reference's own BailingMoeV2Config: for each field dropped from an export's config.json, the
    value the reference reads is the value ours fills in; its save_pretrained writes no model_type and no
    partial_rotary_factor, and that file (as a model's save_pretrained writes it, with architectures) reads back
    as the reference's defaults."""
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference_config", _reference_dir() / hf.REFERENCE_CODE_FILES[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    conf = {k: v for k, v in hf.hf_config(SMALL).items() if k != hf.OWN_KEY}
    for field in REFERENCE_CONFIG_DEFAULTS:
        dropped = {k: v for k, v in conf.items() if k != field}
        theirs = module.BailingMoeV2Config(**dropped)
        assert getattr(theirs, field) == hf.reference_config(dropped)[field] == REFERENCE_CONFIG_DEFAULTS[field], field
    module.BailingMoeV2Config(architectures=[hf.ARCHITECTURE]).save_pretrained(tmp_path)  # as a model's would
    written = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in written and "partial_rotary_factor" not in written
    filled = hf.reference_config(written)
    assert all(filled[k] == v for k, v in REFERENCE_CONFIG_DEFAULTS.items())
    assert hf.model_config_from_hf(written).rotary_fraction == 1.0


def test_export_ships_the_runs_tokenizer_without_loading_its_corpus(tmp_path):
    """Issue #28 item 7: the run keeps a copy of its tokenizer; the export takes it from there (the corpus and the
    data cache are gone here: loading the corpus again would fail)."""
    from tests.runtime.test_train_loop import write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    data = ["data=files", f"data.sources=[{{path: {corpus}}}]", "data.tokenizer.vocab_size=320",
            "data.tokenizer.train_chars=200000", f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1",
            "data.val_fraction=0.1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = ["train.py", "+exp=tiny_cpu", *data, "logging.wandb.mode=disabled",
           "logging.progress_bar=false", "train.seq_len=32", "train.micro_batch_size=2", "model.num_layers=2",
           "train.steps=1", "train.eval_every=0", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_script(cmd, ROOT, env, timeout=600)  # `python train.py`, a child of the fork server
    assert proc.returncode == 0, proc.stderr[-4000:]
    kept = tmp_path / "run" / "tokenizer" / "tokenizer.model"
    assert kept.is_file()
    corpus.unlink()
    shutil.rmtree(tmp_path / "cache")
    export = _cli("export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == kept.read_bytes()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
