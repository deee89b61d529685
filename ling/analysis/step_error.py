"""FP8's error on one training step with the weights held fixed: `python eval.py checkpoint=RUN mode=step_error`.

A parity run compares whole trajectories, and training amplifies any perturbation (kernel nondeterminism
included) into loss differences of ~0.5 % after a few hundred steps (README "FP8 vs BF16"), so it resolves
FP8's own error only with very many seeds. This measures the error where it arises instead. The same checkpoint
weights go into three copies of the model:
- `fp32`: nn.Linear, fp32 weights and activations (the reference);
- `bf16`: nn.Linear in bf16, the BF16 recipe's numerics;
- `fp8`: the FP8 recipe (blockwise FP8 linears and experts) with bf16 weights, the FP8 recipe's numerics.
Each computes the training loss and its gradient on the same held-out batches. Reported per batch and
averaged: the relative loss difference of `bf16` and `fp8` against `fp32` (mean and 95 % t-interval over
batches), and the gradient's relative error ‖g − g_fp32‖ / ‖g_fp32‖ and cosine similarity, overall and per
parameter group, and the share of token→expert assignments that differ from the fp32 model's (a perturbation that
flips a routing decision moves a whole token between experts). BF16's own error is the yardstick: an FP8 error
of the same order per step is the most a BF16 run could hope to match.

Ablation copies (`fp8-no-...`, FP8 with some components in high precision) are each compared with a baseline copy
(`baselines`), paired over the batches: the change of the loss relative to fp32's and of the overall gradient
error, with 95 % t-intervals, and the change of the changed routing assignments.

Memory: three models and their gradients, plus one fp32 gradient copy (fine for the parity model; a
5B-parameter model needs ~70 GB).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ling.analysis.compare import spread  # mean, std and the mean's 95 % t-interval
from model.moe import Router

REFERENCE = "fp32"
CANDIDATES = ("bf16", "fp8")


def parameter_group(name: str) -> str:
    """A parameter's group in the report: routed experts, router, attention, dense MLP / shared experts,
    embedding, LM head, MTP projection, norms."""
    if ".experts." in name:
        return "routed experts"
    if ".router." in name:
        return "router"
    if "norm" in name:
        return "norms"
    if ".attention." in name:
        return "attention"
    if ".mlp." in name:
        return "dense MLP + shared experts"
    if name.startswith("word_embeddings"):
        return "embedding"
    if name.startswith("lm_head"):
        return "LM head"
    return "MTP projection" if "eh_proj" in name else "other"


@dataclass
class _Sums:
    """Per candidate and group, over all batches: float64 [4] = (Σ‖g − g_ref‖², Σ‖g_ref‖², Σ⟨g, g_ref⟩, Σ‖g‖²),
    kept on the device (no host sync per parameter) until read; `per_batch` holds each batch's totals over all
    groups (the same four sums)."""

    by_group: dict[str, torch.Tensor] = field(default_factory=dict)
    per_batch: list[torch.Tensor] = field(default_factory=list)

    def start_batch(self, device: torch.device | str) -> None:
        self.per_batch.append(torch.zeros(4, dtype=torch.float64, device=device))

    def add(self, group: str, g: torch.Tensor, g_ref: torch.Tensor) -> None:
        g, g_ref = g.double(), g_ref.double()
        terms = torch.stack([(g - g_ref).square().sum(), g_ref.square().sum(), (g * g_ref).sum(), g.square().sum()])
        self.by_group[group] = self.by_group[group] + terms if group in self.by_group else terms
        self.per_batch[-1] += terms

    def _totals(self, group: str | None) -> list[float]:
        if group is not None:
            return self.by_group[group].tolist()
        return torch.stack(list(self.by_group.values())).sum(0).tolist()

    def rel_err(self, group: str | None = None) -> float:
        diff, ref, _, _ = self._totals(group)
        return math.sqrt(diff / max(ref, 1e-300))

    def cosine(self, group: str | None = None) -> float:
        _, ref, dot, own = self._totals(group)
        return dot / max(math.sqrt(own * ref), 1e-300)

    def batch_rel_errs(self) -> list[float]:
        """‖g − g_ref‖ / ‖g_ref‖ over all parameters, one per batch."""
        return [math.sqrt(d / max(r, 1e-300)) for d, r, _, _ in torch.stack(self.per_batch).tolist()]


def _loss_and_grads(model: nn.Module, batch: Mapping[str, torch.Tensor]
                    ) -> tuple[float, dict[str, torch.Tensor], list[torch.Tensor]]:
    """→ (loss, gradients by parameter name, each router's chosen experts int64 [N, k] in forward order)."""
    routes: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: routes.append(out.topk_idx.detach()))
             for m in model.modules() if isinstance(m, Router)]
    try:
        model.zero_grad(set_to_none=True)
        out = model(batch["input_ids"], labels=batch["labels"], doc_ids=batch.get("doc_ids"))
        out.loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(out.loss.detach()), grads, routes


def _changed_assignments(routes: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[int, int]:
    """(token-expert assignments of `routes` absent from `ref`'s choice for the same token, all assignments)."""
    changed = total = 0
    for r, r0 in zip(routes, ref):
        same = (r[:, :, None] == r0[:, None, :]).any(-1)  # [N, k]: this pick is among the reference's picks
        changed += int((~same).sum())
        total += same.numel()
    return changed, total


def step_errors(models: Mapping[str, nn.Module], batches: Iterable[Mapping[str, torch.Tensor]],
                device: torch.device | str, max_batches: int,
                baselines: Mapping[str, str] | None = None) -> dict[str, Any]:
    """models: {"fp32": reference, "bf16": ..., "fp8": ..., more FP8 copies} holding the same weights; batches:
    the loader's dicts; baselines: {ablated copy: the copy its effect is measured against}.
    → the record described in the module doc (losses per batch and model, relative loss differences with their
    intervals, gradient relative errors and cosines overall and per group, each batch's overall gradient error,
    and per ablated copy its paired effect against its baseline)."""
    for m in models.values():
        m.train()
    candidates = [c for c in models if c != REFERENCE]
    losses: dict[str, list[float]] = {name: [] for name in models}
    sums = {c: _Sums() for c in candidates}
    flips = {c: [0, 0] for c in candidates}
    n = 0
    for batch in batches:
        if n >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        ref_loss, ref_grads, ref_routes = _loss_and_grads(models[REFERENCE], batch)
        ref_grads = {k: g.detach().float().clone() for k, g in ref_grads.items()}
        losses[REFERENCE].append(ref_loss)
        for c in candidates:
            loss, grads, routes = _loss_and_grads(models[c], batch)
            losses[c].append(loss)
            changed, total = _changed_assignments(routes, ref_routes)
            flips[c][0] += changed
            flips[c][1] += total
            sums[c].start_batch(device)
            for name, g_ref in ref_grads.items():
                g = grads.get(name)
                sums[c].add(parameter_group(name), torch.zeros_like(g_ref) if g is None else g, g_ref)
            models[c].zero_grad(set_to_none=True)
        n += 1
    if n == 0:
        raise ValueError("step_error: no batches to evaluate")
    rel = {c: spread([a / b - 1 for a, b in zip(losses[c], losses[REFERENCE])]) for c in candidates}
    if {"fp8", "bf16"} <= set(candidates):
        rel["fp8_vs_bf16"] = spread([a / b - 1 for a, b in zip(losses["fp8"], losses["bf16"])])
    groups = sorted(sums[candidates[0]].by_group)
    batch_errs = {c: sums[c].batch_rel_errs() for c in candidates}
    routing = {c: f[0] / f[1] if f[1] else None for c, f in flips.items()}
    effects = {}
    for c, b in (baselines or {}).items():
        effects[c] = {
            "baseline": b,
            # paired over batches: (loss_c − loss_b) / loss_fp32, and the change of the overall gradient error
            "loss_rel": spread([(a - z) / r for a, z, r in zip(losses[c], losses[b], losses[REFERENCE])]),
            "grad_rel_err": spread([e - f for e, f in zip(batch_errs[c], batch_errs[b])]),
            "routing_changed": None if routing[c] is None else routing[c] - routing[b],
        }
    return {
        "batches": n, "loss": losses, "loss_rel": rel, "grad_rel_err_batches": batch_errs,
        "grad_rel_err_spread": {c: spread(v) for c, v in batch_errs.items()}, "ablation_effect": effects,
        # share of token→expert assignments (all routers, all tokens) that differ from the fp32 model's
        "routing_changed": routing,
        "grad_rel_err": {c: {"all": sums[c].rel_err(), **{g: sums[c].rel_err(g) for g in groups}} for c in candidates},
        "grad_cosine": {c: {"all": sums[c].cosine(), **{g: sums[c].cosine(g) for g in groups}} for c in candidates},
    }


def format_step_errors(record: Mapping[str, Any]) -> str:
    """Markdown: the loss table (mean relative difference ± 95 % interval) and the gradient table per group."""
    cands = list(record["grad_rel_err"])
    pct = lambda x: f"{100 * x:+.4f} %"  # noqa: E731
    lines = [f"FP8 and BF16 against fp32 on the same weights, {record['batches']} batches", "",
             "| loss | mean rel. diff | 95 % interval |", "|---|---|---|"]
    for key, r in record["loss_rel"].items():
        label = "fp8 vs bf16" if key == "fp8_vs_bf16" else f"{key} vs fp32"
        lines.append(f"| {label} | {pct(r['mean'])} | [{pct(r['ci_low'])}, {pct(r['ci_high'])}] |")
    if any(v is not None for v in record.get("routing_changed", {}).values()):
        lines += ["", "Token→expert assignments that differ from fp32's: " + ", ".join(
            f"{c} {100 * v:.2f} %" for c, v in record["routing_changed"].items() if v is not None)]
    if spreads := record.get("grad_rel_err_spread"):
        lines += ["", "Gradient rel. error over all parameters, per batch: " + ", ".join(
            f"{c} {r['mean']:.3e} [{r['ci_low']:.3e}, {r['ci_high']:.3e}]" for c, r in spreads.items())]
    if record.get("ablation_effect"):
        lines += ["", "Ablation: each copy against its baseline, paired over batches (mean [95 % interval]); "
                  "a negative change means that component's FP8 rounding added error", "",
                  "| copy | baseline | Δ loss (rel. to fp32) | Δ gradient rel. error | Δ assignments changed |",
                  "|---|---|---|---|---|"]
        for c, e in record["ablation_effect"].items():
            dl, dg, dr = e["loss_rel"], e["grad_rel_err"], e["routing_changed"]
            lines.append(f"| {c} | {e['baseline']} | {pct(dl['mean'])} [{pct(dl['ci_low'])}, {pct(dl['ci_high'])}] | "
                         f"{dg['mean']:+.2e} [{dg['ci_low']:+.2e}, {dg['ci_high']:+.2e}] | "
                         + ("–" if dr is None else f"{100 * dr:+.2f} pp") + " |")
    lines += ["", "| gradient group | " + " | ".join(f"{c}: rel. err / cosine" for c in cands) + " |",
              "|---|" + "---|" * len(cands)]
    for g in record["grad_rel_err"][cands[0]]:
        cells = [f"{record['grad_rel_err'][c][g]:.3e} / {record['grad_cosine'][c][g]:.6f}" for c in cands]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
