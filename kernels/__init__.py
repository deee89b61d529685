"""Kernel plumbing shared by `fp8/` and `model/`, part of neither: whether Triton is there and which backend
runs (`kernels.backend`), kernel launch configs with frozen defaults and scoped overrides (`kernels.tuning`),
`Fusable`, a function beside its torch.compile twin (`kernels.fusable`), the row gather and ordered row sum of
MoE dispatch and combine (`kernels.rows`), and the Triton interpreter's cast fix for running the kernels on CPU
tensors (`kernels.interpreter`).

Importing any of it needs neither CUDA nor Triton.
"""
