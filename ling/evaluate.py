"""Held-out evaluation: token-weighted losses of a LingForCausalLM over batches, summed across ranks."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], device: torch.device, *,
             max_batches: int | None = None) -> dict[str, float]:
    """Mean losses over the target tokens of `batches` (input_ids/labels int64 [B, T], optional doc_ids).

    Runs in eval mode under no_grad and restores the previous mode. Each batch's mean losses are weighted by
    its number of target tokens (labels != -100) and summed over data-parallel ranks, so the result is the
    per-token mean over everything every rank saw. Keys: loss, lm_loss, ppl (= exp(lm_loss)), and mtp_loss
    when the model has MTP heads.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss·n, lm_loss·n, mtp_loss·n, n
    has_mtp = False
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            labels = batch["labels"].to(device)
            doc_ids = batch.get("doc_ids")
            out = model(batch["input_ids"].to(device), labels=labels,
                        doc_ids=doc_ids.to(device) if doc_ids is not None else None)
            n = (labels != -100).sum().double()
            has_mtp = out.mtp_loss is not None
            mtp = out.mtp_loss if has_mtp else out.loss * 0
            sums += torch.stack([out.loss.double() * n, out.lm_loss.double() * n, mtp.double() * n, n])
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    total = max(float(sums[3]), 1.0)
    metrics = {"loss": float(sums[0]) / total, "lm_loss": float(sums[1]) / total}
    metrics["ppl"] = math.exp(min(metrics["lm_loss"], 700.0))
    if has_mtp:
        metrics["mtp_loss"] = float(sums[2]) / total
    return metrics
