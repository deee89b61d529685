"""GPU: the gathered/in-place token-dim quantizer, the committed kernel against a pipelined prototype
(scratch/tokq_pipe.py: one index load per program, a tl.range(num_stages) loop over feature chunks). Every variant
is checked bit for bit against the committed kernel on the written blocks; do_bench medians in µs.
Run from the repo root: python scratch/tokq_sweep2.py"""
import os, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
sys.path.insert(0, os.path.join(os.getcwd(), "scratch"))
import torch
import triton.testing
import fp8.grouped as G
from bench_moe import H, INTER, routing
from model.dispatch import plan_dispatch
from tokq_pipe import quant_tokens_pipe_kernel

# (features per chunk, chunks per program, stages, warps)
VARIANTS = [(16, 8, 3, 1), (16, 16, 3, 1), (16, 8, 4, 1), (16, 8, 2, 1), (32, 4, 3, 1), (32, 4, 3, 2), (32, 8, 3, 2),
            (64, 4, 3, 4), (64, 2, 3, 4), (128, 2, 2, 4), (128, 4, 2, 8), (16, 32, 3, 1)]


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median") * 1e3


def pipe(x, rows, src, bf, chunks, stages, warps):
    k = x.shape[1]
    nb = rows.max_blocks()
    qt = torch.empty(k, nb * 128, device=x.device, dtype=torch.float8_e4m3fn)
    st = torch.empty(nb, k, device=x.device, dtype=torch.float32).t()
    quant_tokens_pipe_kernel[(nb, k // (bf * chunks))](
        x, src if src is not None else st, qt, st, rows.offsets, rows.block_offsets(), rows.block_groups(), k,
        rows.num_groups, x.stride(0), qt.stride(0), st.stride(1),
        BLOCK_F=bf, CHUNKS=chunks, STAGES=stages, HAS_IDX=src is not None, POW2=False, num_warps=warps)
    return qt, st


def main() -> None:
    print(torch.cuda.get_device_name())
    table = []
    for tokens, experts in ((16384, 64), (16384, 256), (4096, 256)):
        idx, _ = routing(tokens, experts)
        plan = plan_dispatch(idx, experts, 16)
        rows, src = plan.rows, plan.row_src
        torch.manual_seed(0)
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        dh = torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        nb = int(rows.block_offsets()[-1])
        cut = lambda out: (out[0][:, :nb * 128].view(torch.uint8), out[1][:, :nb])  # noqa: E731
        for name, t, s in (("gathered x", x, src), ("dh", dh, None)):
            base_fn = lambda t=t, s=s: G.quantize_tokens_grouped(t, rows, s)  # noqa: E731
            base = cut(base_fn())
            row = [f"{tokens}/{experts}e {name}", f"{us(base_fn):.1f}"]
            with G.GROUPED_TUNING.override(tokens_block_f=8):
                ok = all(torch.equal(a, b) for a, b in zip(cut(base_fn()), base))
                row.append(f"{us(base_fn):.1f}{'' if ok else ' BITS!'}")
            for bf, ch, stg, w in VARIANTS:
                if t.shape[1] % (bf * ch):
                    row.append("-")
                    continue
                f = lambda t=t, s=s, bf=bf, ch=ch, stg=stg, w=w: pipe(t, rows, s, bf, ch, stg, w)  # noqa: E731
                ok = all(torch.equal(a, b) for a, b in zip(cut(f()), base))
                row.append(f"{us(f):.1f}{'' if ok else ' BITS!'}")
            table.append(row)
            print(" | ".join(row), flush=True)
    head = ["operand", "committed", "committed, 8 features"] + [f"pipe {bf}x{ch} s{s} w{w}" for bf, ch, s, w in VARIANTS]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
