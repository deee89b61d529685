"""ling/train/deepspeed_compat.py against the installed DeepSpeed (one process, gloo, CPU; DeepSpeed runs bf16 on
CPU): one test per override, each failing when DeepSpeed's behaviour under it changes, plus the start-up check and
the class substitution."""

from __future__ import annotations

import types
import warnings

import deepspeed
import pytest
import torch
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime import engine as ds_engine_module
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import groups as ds_groups
from omegaconf import OmegaConf
from torch import nn

from ling.ranks import init_distributed
from ling.train.deepspeed_compat import (
    OVERRIDDEN,
    TESTED_DEEPSPEED,
    DeepSpeedIncompatible,
    ExpertParallelEngine,
    LeanBF16Optimizer,
    UntestedDeepSpeedWarning,
    check_deepspeed,
    compat_problems,
    create_expert_groups,
    expert_group_name,
    initialize_engine,
    project_classes,
    substituted,
)
from ling.train.engine import deepspeed_config

MICRO_BATCHES = 4


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


class RecordGradient(torch.optim.Optimizer):
    """Keeps the gradients it is handed (the wrapper's flat fp32 partitions) and changes nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[torch.Tensor] = []

    def step(self, closure=None):
        self.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def ds_config(stage: int, extra: dict | None = None) -> dict:
    """The trainer's DeepSpeed config for bf16 with fp32 accumulation over MICRO_BATCHES micro-batches (ZeRO-1:
    DeepSpeed's BF16_Optimizer, fp32 communication, immediate_grad_update)."""
    cfg = OmegaConf.create({"train": {"micro_batch_size": 1, "grad_accum": MICRO_BATCHES},
                            "optim": {"grad_clip": 0.0},
                            "deepspeed": {"zero_stage": stage, "grad_accum_dtype": "fp32",
                                          "zero_extra": {"reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6},
                                          "extra": extra or {}}})
    return deepspeed_config(cfg, use_bf16=True)


# ------------------------------------------------------------------------------------------ the check
def test_the_installed_deepspeed_is_a_tested_one_with_every_overridden_member():
    assert deepspeed.__version__ in TESTED_DEEPSPEED, (
        f"DeepSpeed {deepspeed.__version__} is installed, ling/train/deepspeed_compat.py names {TESTED_DEEPSPEED}: "
        "if this file's other tests pass, add it to TESTED_DEEPSPEED")
    assert compat_problems() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_deepspeed()  # silent


def test_every_override_is_in_the_checked_table():
    """Each method our subclasses override is listed in OVERRIDDEN (so check_deepspeed looks at its signature)."""
    listed = {(owner, name) for owner, name, _ in OVERRIDDEN}
    for cls, base in ((LeanBF16Optimizer, BF16_Optimizer), (ExpertParallelEngine, DeepSpeedEngine)):
        overridden = [n for n, v in vars(cls).items() if callable(v) and hasattr(base, n) and not n.startswith("__")]
        assert overridden, cls
        for name in overridden:
            assert (base, name) in listed, f"{cls.__name__}.{name} overrides DeepSpeed's but is not in OVERRIDDEN"


def test_an_untested_version_warns_and_a_changed_member_refuses():
    with pytest.warns(UntestedDeepSpeedWarning, match=r"DeepSpeed 0\.0\.1 is installed; .* tested on DeepSpeed "
                                                      + TESTED_DEEPSPEED[0].replace(".", r"\.")):
        check_deepspeed("0.0.1")
    renamed = ((DeepSpeedEngine, "_configure_zero_optimizer", ("self", "client_optimizer")),)
    with pytest.raises(DeepSpeedIncompatible, match=r"DeepSpeed 9\.9 does not work .*tested on DeepSpeed .*"
                                                    r"_configure_zero_optimizer takes \(self, optimizer\), the "
                                                    r"override expects \(self, client_optimizer\)"):
        check_deepspeed("9.9", overridden=renamed)
    with pytest.raises(DeepSpeedIncompatible, match=r"BF16_Optimizer\._gone is gone"):
        check_deepspeed(overridden=((BF16_Optimizer, "_gone", ()),))
    with pytest.raises(DeepSpeedIncompatible, match=r"deepspeed\.DeepSpeedEngine is not .*BF16_Optimizer"):
        check_deepspeed(swapped=((deepspeed, "DeepSpeedEngine", BF16_Optimizer),))


# ------------------------------------------------------------------------------------- the substitution
def test_substituted_restores_the_name_however_the_block_ends_and_refuses_a_foreign_one():
    owner = types.SimpleNamespace(name="original")
    with substituted(owner, "name", "original", "replacement"):
        assert owner.name == "replacement"
    assert owner.name == "original"
    with pytest.raises(KeyError), substituted(owner, "name", "original", "replacement"):
        raise KeyError
    assert owner.name == "original"
    owner.name = "someone else's"
    with pytest.raises(DeepSpeedIncompatible, match="expected 'original'"):
        with substituted(owner, "name", "original", types.SimpleNamespace):
            pass
    assert owner.name == "someone else's"


def test_project_classes_swap_the_two_names_deepspeed_builds_and_put_them_back():
    with project_classes():
        assert ds_engine_module.BF16_Optimizer is LeanBF16Optimizer and deepspeed.DeepSpeedEngine is DeepSpeedEngine
    with project_classes(ExpertParallelEngine):
        assert ds_engine_module.BF16_Optimizer is LeanBF16Optimizer
        assert deepspeed.DeepSpeedEngine is ExpertParallelEngine
    assert ds_engine_module.BF16_Optimizer is BF16_Optimizer and deepspeed.DeepSpeedEngine is DeepSpeedEngine


# ---------------------------------------------------------------------------------- LeanBF16Optimizer
def accumulated_gradient(stock: bool, immediate: bool) -> tuple[type, torch.Tensor]:
    """(the optimizer wrapper's class, the fp32 gradient it hands the optimizer) after MICRO_BATCHES bf16
    micro-batches of inputs of very different scale (a bf16 sum would lose the small ones' low bits)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    opt = RecordGradient(model.parameters())
    conf = ds_config(1)
    conf["bf16"]["immediate_grad_update"] = immediate
    if stock:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    else:
        engine, *_ = initialize_engine(model, opt, conf)
    torch.manual_seed(1)
    for i in range(MICRO_BATCHES):
        x = (torch.randn(32, 256) * 4.0 ** (i % 4)).to(torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return type(engine.optimizer), torch.cat([g.flatten() for g in opt.seen])


@pytest.mark.parametrize("immediate", [True, False], ids=["immediate_grad_update", "at_backward_end"])
def test_lean_bf16_hook_sums_the_same_bits_as_deepspeeds(immediate):
    """LeanBF16Optimizer._update_hp_grad (a mixed-dtype in-place add) against DeepSpeed's own (cast, then add):
    the same fp32 gradient bit for bit, in both of DeepSpeed's accumulation modes (the trainer's: immediate)."""
    lean_cls, lean = accumulated_gradient(stock=False, immediate=immediate)
    stock_cls, stock = accumulated_gradient(stock=True, immediate=immediate)
    assert lean_cls is LeanBF16Optimizer and stock_cls is BF16_Optimizer
    assert lean.dtype == stock.dtype == torch.float32 and lean.abs().sum() > 0
    assert torch.equal(lean, stock)


# ------------------------------------------------------------------------- the private groups API
def test_create_expert_groups_makes_both_groups_once():
    group = create_expert_groups(1)
    name = expert_group_name(1)
    assert name == "ep_size_1"
    assert group is ds_groups._get_expert_parallel_group(name)
    assert list(ds_groups._get_expert_parallel_group_ranks(name)) == [0]
    assert list(ds_groups._get_expert_data_parallel_group_ranks(name)) == [0]
    data_group = ds_groups._get_expert_data_parallel_group(name)
    assert create_expert_groups(1) is group and ds_groups._get_expert_data_parallel_group(name) is data_group


# -------------------------------------------------------------------------------- ExpertParallelEngine
class TinyExperts(nn.Module):
    """A dense matrix and a stack of 2 experts, the stack marked as DeepSpeed MoE parameters of ep_size 1 (the
    way ling.train.engine.moe_param_groups marks the model's), without DeepSpeed's MoE modules."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(32, 32, bias=False)
        self.experts = nn.Parameter(torch.randn(2, 32, 32) * 0.1)
        self.experts.allreduce = False
        self.experts.group_name = expert_group_name(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eij->bej", self.dense(x), self.experts).float().pow(2).mean()


class RecordExpertReduction(ExpertParallelEngine):
    """ExpertParallelEngine that notes each call of DeepSpeed's expert-gradient reduction: the flag, the groups."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expert_reductions: list[tuple[bool, list[str]]] = []

    def _reduce_expert_gradients(self, expert_grads, elements_per_buffer):
        self.expert_reductions.append((self.has_moe_layers, sorted(k for k, v in expert_grads.items() if v)))
        return super()._reduce_expert_gradients(expert_grads, elements_per_buffer)


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1_bf16_optimizer", "zero2"])
def test_expert_parallel_engine_hands_the_optimizer_the_expert_groups_and_lowers_its_flag(stage):
    create_expert_groups(1)
    name = expert_group_name(1)
    torch.manual_seed(0)
    model = TinyExperts().to(torch.bfloat16)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "decay", "weight_decay": 0.0}])
    assert [g.get("moe", False) for g in groups] == [False, True]
    with project_classes(RecordExpertReduction):
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3),
                                          config=ds_config(stage))
    assert type(engine) is RecordExpertReduction
    assert engine.has_moe_layers is False  # down after init: DeepSpeed's plain checkpoint layout
    wrapper = engine.optimizer
    assert wrapper.has_moe_layers is True
    expert_dp = ds_groups._get_expert_data_parallel_group(name)
    assert expert_dp is not ds_groups._get_data_parallel_group()
    assert wrapper.real_dp_process_group[1] is expert_dp  # the MoE group is reduced over its expert-data group
    assert wrapper.real_dp_process_group[0] is not expert_dp
    if stage == 1:
        assert type(wrapper) is LeanBF16Optimizer
        assert [len(v) for v in wrapper.expert_gradients.values()] == [1] and name in wrapper.expert_gradients
    else:
        assert isinstance(wrapper, DeepSpeedZeroOptimizer) and not isinstance(wrapper, BF16_Optimizer)
        assert wrapper.expert_dp_process_group[name] is expert_dp
    for _ in range(MICRO_BATCHES):
        engine.backward(engine(torch.randn(8, 32).to(torch.bfloat16)))
        engine.step()
    assert engine.has_moe_layers is False
    # BF16_Optimizer leaves the boundary all-reduce to the engine, which reduces the experts only under the flag;
    # ZeRO-2 reduces in its own hooks
    assert engine.expert_reductions == ([(True, [name])] if stage == 1 else [])
