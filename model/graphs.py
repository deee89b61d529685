"""CUDA graphs of the model's blocks (`model.cuda_graphs`): each decoder layer's and MTP layer's forward and
backward replayed from a graph instead of launched kernel by kernel from Python.

Why: an FP8 layer launches a few hundred small kernels (quantizers, GEMMs, the dispatch plan, the compiled
elementwise chains); at 4,096 tokens per micro-batch the host needs longer to launch them than the GPU to run
them (docs/benchmarks.md). The MoE path is sync-free at `moe.ep_size=1` (model/dispatch.py), so every shape is
static and a layer's forward and backward can be captured once and replayed: one launch per layer and pass.

How (`LayerGraphs`; the capture follows `torch.cuda.make_graphed_callables`, with what training here needs):
- Captured at the first training forward with gradients (and again when the input shapes or a layer's
  `graph_state()` change: the FP8 monitor's per-layer fallback, an ablation): every block warms up eagerly on a
  side stream (`warmup` forward+backward passes: Triton and Inductor compile there), then the forwards are
  captured in model order and the backwards in reverse, all in one memory pool, the order they run in.
- Inputs: a block's static input is the previous block's static output where one feeds the next (no copy); other
  inputs are copied in when they live elsewhere. Outputs are the graph's static tensors (valid until the block
  replays again, i.e. the next micro-batch). Activations live in the graphs too, so each graphed forward's
  backward must come before the next graphed forward; a backward through an overwritten forward is refused.
- Parameter gradients: every backward graph leaves its parameter gradients in one shared slab per dtype,
  outside the pool, so the pool holds one block's gradients rather than the whole model's. The FP8 wgrad GEMMs
  (experts, FP8Linear) write theirs straight into the slab (`kernels.gradient_outputs`); the others (norms, the
  router, BF16 GEMMs: all of a BF16 block) are computed in the pool and copied in. They must be consumed before the
  next block's backward replays: DeepSpeed's gradient hooks do so at once (autograd runs AccumulateGrad first);
  without such hooks, a gradient autograd stored by reference is cloned out of the slab before the next replay
  (`_unalias_pending_grads`).
- Buffers the warm-up passes touch (the routers' expert-load counts) are restored after the capture; a
  captured forward keeps updating them at every replay, as the eager forward does.
- FP8 weight caches are made `stable` (fp8/linear.py: re-quantized into the same tensors) and refreshed from
  Python before each forward replay (`refresh_fp8_weights`): the graphs read the current weights.
- Falls back to eager for a forward in which any FP8 module collects health (the monitor's sampled steps): the
  graphs are released first, so that the eager step has the memory an eager run has, and captured again at the
  next training forward (one warm-up pass per block; the first capture makes `warmup` passes).
- A capture that runs out of memory releases what it holds, logs a warning naming `model.cuda_graphs` and what to
  change (`out_of_memory_advice`: expandable segments where the allocator has none), and the run goes on eagerly
  (`disabled` says why).

Limits (refused with the key named, ling/config_check.py and `LayerGraphs.inputs_supported`): CUDA only;
`model.recompute` none or selective (a fully checkpointed layer recomputes its forward inside backward); no
FlexAttention BlockMask (`data.document_mask` with flex attention); `moe.ep_size=1` (the exchange reads split
sizes on the host); ZeRO-3 (it gathers parameters in module hooks). torch.profiler sees a replay as one launch:
profile with `model.cuda_graphs=false` to see the kernels by part.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from fp8.linear import weight_caches
from kernels.gradient_outputs import GRADIENT_OUTPUTS

log = logging.getLogger(__name__)

WARMUP_PASSES = 2  # eager forward+backward passes per block before the first capture (the first pass compiles)
SLAB_ALIGNMENT = 128  # elements between two gradients in a slab (256 bytes in bf16)
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # where PyTorch reads its allocator settings
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def out_of_memory_advice() -> str:
    """What to change after a capture ran out of memory. The capture needs room beside an eager step, and a
    fragmented cache can refuse it with gigabytes reserved but unallocated, which PyTorch's expandable segments
    avoid (the e64 proxy's FP8 step at micro-batch 12 captures only with them: docs/benchmarks.md)."""
    advice = "set model.cuda_graphs=false or a smaller train.micro_batch_size"
    if not any(EXPANDABLE_SEGMENTS in os.environ.get(name, "").replace(" ", "") for name in ALLOCATOR_ENV):
        advice += (f", or start the run with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} when the error says much "
                   "memory is reserved but unallocated")
    return advice


@dataclass
class _Graph:
    """One block's captured forward and backward and their static tensors."""

    block: nn.Module
    aliases: dict[str, nn.Parameter]  # name → an alias of each parameter that needs a gradient (parameter_aliases)
    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # the static user inputs
    params: tuple[nn.Parameter, ...]  # the block's parameters that need a gradient
    outputs: tuple[torch.Tensor, ...] = ()  # the flattened static outputs
    spec: pytree.TreeSpec | None = None
    grad_outputs: tuple[torch.Tensor | None, ...] = ()  # static incoming gradients (None: no gradient flows)
    grad_inputs: tuple[torch.Tensor | None, ...] = ()  # static gradients of `inputs` (None: needs none)
    grad_params: tuple[torch.Tensor | None, ...] = ()  # views of the shared slab (None: unused parameter)
    refresh: list[Callable[[], None]] = field(default_factory=list)  # the FP8 weight refreshes
    copied: int = 0  # gradient elements the backward graph copies into the slab (the FP8 wgrads write it directly)


class _Replay(torch.autograd.Function):
    """Replay one block: forward(graph, runner, *inputs, *params) → its static outputs; backward replays the
    backward graph and returns the static gradients."""

    @staticmethod
    def forward(ctx, graph: _Graph, runner: LayerGraphs, *args: torch.Tensor):
        for static, x in zip(graph.inputs, args):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        graph.fwd.replay()
        ctx.graph, ctx.runner, ctx.forward_index = graph, runner, runner.forwards
        outputs = tuple(o.detach() for o in graph.outputs)
        ctx.mark_non_differentiable(*(o for o, g in zip(outputs, graph.grad_outputs) if g is None))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        graph, runner = ctx.graph, ctx.runner
        if ctx.forward_index != runner.forwards:
            raise RuntimeError("model.cuda_graphs: backward through a graphed forward after a later graphed forward "
                               "overwrote its activations; run each forward's backward before the next forward (or "
                               "set model.cuda_graphs=false)")
        for static, g in zip(graph.grad_outputs, grads):
            if static is not None and static.data_ptr() != g.data_ptr():
                static.copy_(g)
        runner._unalias_pending_grads()
        graph.bwd.replay()
        runner._pending = graph
        return None, None, *(g.detach() if g is not None else None for g in (*graph.grad_inputs, *graph.grad_params))


class LayerGraphs:
    """CUDA graphs of `blocks` (the model's decoder layers, then its MTP layers), captured together, replayed in
    the order of `blocks` forward and in reverse backward (the module doc).

    Per training forward: `ready(samples, kwargs)` (captures when needed; False: run eagerly this time), then
    `run(i, *args)` for block i in order, args as in `samples[i]`.

    The captures run each block on aliases of its parameters (`parameter_aliases`, `torch.func.functional_call`):
    autograd then never touches the parameters' own AccumulateGrad nodes while capturing (DeepSpeed keeps those
    alive from the default stream, and a capture that routes a gradient through one fails); a replay returns the
    gradients to the parameters themselves. The aliases are Parameters, so the compiled functions reuse the eager
    forward's graphs and Inductor kernels rather than compiling (and autotuning) their own.
    """

    def __init__(self, blocks: Sequence[nn.Module], chained: Sequence[bool], warmup: int = WARMUP_PASSES) -> None:
        """`chained[i]`: block i's first input is block i-1's first output and nothing else reads that output (the
        residual stream between decoder layers), so block i reads it in place and block i-1 receives its gradient
        in place."""
        if len(chained) != len(blocks) or (chained and chained[0]):
            raise ValueError("LayerGraphs: chained needs one flag per block, False for the first")
        self.blocks = list(blocks)
        self.chained = list(chained)
        self._kwargs: dict[str, object] = {}
        self.warmup = warmup
        self._watched = [m for b in self.blocks for m in b.modules()
                         if hasattr(m, "collect_health") or hasattr(m, "graph_state")]
        self._graphs: list[_Graph] = []
        self._key: tuple | None = None
        self._pending: _Graph | None = None  # the block whose gradients sit in the slab
        self._slabs: dict[torch.dtype, torch.Tensor] = {}
        self._captures = 0
        self.forwards = 0  # graphed forwards so far: a backward must belong to the latest (its activations)
        self.disabled: str | None = None  # why the graphs are off for the rest of the run (None: they are not)

    # ------------------------------------------------------------------ per forward
    @staticmethod
    def inputs_supported(samples: Sequence[tuple[torch.Tensor, ...]]) -> str | None:
        """Why these inputs cannot be graphed (None: they can)."""
        for args in samples:
            for a in args:
                if not isinstance(a, torch.Tensor):
                    return (f"model.cuda_graphs: a block input of type {type(a).__name__} (a FlexAttention "
                            "BlockMask?) cannot be captured; set data.document_mask=false or "
                            "model.document_attention=dense, or model.cuda_graphs=false")
                if not a.is_cuda:
                    return f"model.cuda_graphs needs CUDA tensors, got a {a.device} input"
        return None

    def ready(self, samples: Sequence[tuple[torch.Tensor, ...]], kwargs: dict[str, object] | None = None) -> bool:
        """Prepare the graphs for a forward whose blocks take `samples` (block i's args, tensors) and the constant
        keyword arguments `kwargs` (e.g. mask=None); False when this forward must run eagerly (a module collects
        FP8 health)."""
        if self.disabled:
            return False
        if any(getattr(m, "collect_health", False) for m in self._watched):
            self.release()
            return False
        problem = self.inputs_supported(samples)
        if problem:
            raise ValueError(problem)
        key = (tuple(tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args) for args in samples),
               tuple(m.graph_state() for m in self._watched if hasattr(m, "graph_state")), repr(kwargs))
        if key != self._key:
            self.release()
            self._kwargs = dict(kwargs or {})
            try:
                self._capture(samples)
            except torch.OutOfMemoryError as error:
                self.release()
                self.disabled = f"capturing the layers' CUDA graphs ran out of GPU memory ({str(error)[:200]})"
                log.warning("model.cuda_graphs: %s; the run goes on without CUDA graphs (%s)", self.disabled,
                            out_of_memory_advice())
                return False
            self._key = key
        self._unalias_pending_grads()
        self.forwards += 1
        return True

    def release(self) -> None:
        """Drop the graphs and their memory pool; the next `ready` captures again."""
        if not self._graphs and not self._slabs:
            return
        self._graphs, self._pending, self._slabs, self._key = [], None, {}, None
        if torch.cuda.is_available():
            _synchronize()
            torch.cuda.empty_cache()

    def run(self, i: int, *args: torch.Tensor):
        """Block i's outputs from its graph (its FP8 weights refreshed first)."""
        graph = self._graphs[i]
        for refresh in graph.refresh:
            refresh()
        flat = _Replay.apply(graph, self, *pytree.arg_tree_leaves(*args), *graph.params)
        return pytree.tree_unflatten(list(flat), graph.spec)

    def _unalias_pending_grads(self) -> None:
        """Clone out of the slab the gradients that autograd stored by reference (no hook consumed them) before
        the slab is written again."""
        graph, self._pending = self._pending, None
        if graph is None:
            return
        for p, g in zip(graph.params, graph.grad_params):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()

    # ------------------------------------------------------------------ capture
    def _capture(self, samples: Sequence[tuple[torch.Tensor, ...]]) -> None:
        """Warm up and capture every block; the blocks' buffers (the expert loads) are restored however it ends."""
        _synchronize()
        buffers = [(b, b.clone()) for block in self.blocks for b in block.buffers()]
        try:
            self._graphs = self._capture_all(samples)
        finally:
            for b, saved in buffers:
                b.copy_(saved)
            _synchronize()
        self._captures += 1

    def _capture_all(self, samples: Sequence[tuple[torch.Tensor, ...]]) -> list[_Graph]:
        for cache in (c for block in self.blocks for c in weight_caches(block)):
            cache.stable = True
        graphs: list[_Graph] = []
        for block, args, chained in zip(self.blocks, samples, self.chained):
            # a chained block's first input becomes the previous block's output at capture: until then (the
            # warm-up) it borrows the first block's, rather than holding a copy of the residual stream per layer
            graphs.append(self._new_graph(block, args, graphs[0].inputs[0] if chained else None))
        self._warm_up(graphs, self.warmup if self._captures == 0 else 1)
        pool = torch.cuda.graph_pool_handle()
        for i, graph in enumerate(graphs):  # forwards in model order
            if self.chained[i]:
                _chain_input(graphs[i - 1], graph)
            with torch.cuda.graph(graph.fwd, pool=pool):
                outputs = self._call(graph)
            flat, graph.spec = pytree.tree_flatten(outputs)
            graph.outputs = tuple(flat)
        self._make_slabs(graphs)
        for i in reversed(range(len(graphs))):  # backwards in reverse
            graph = graphs[i]
            graph.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in graph.outputs)
            if i + 1 < len(graphs) and self.chained[i + 1]:
                graph.grad_outputs = _chain_grad(graph, graphs[i + 1])
            self._capture_backward(graph, pool)
        return graphs

    def _new_graph(self, block: nn.Module, args: tuple[torch.Tensor, ...],
                   first_input: torch.Tensor | None = None) -> _Graph:
        inputs = tuple(first_input if i == 0 and first_input is not None
                       else a.detach().clone().requires_grad_(a.requires_grad) for i, a in enumerate(args))
        named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        aliases = parameter_aliases(named)
        refresh = [m.refresh_fp8_weights for m in block.modules() if hasattr(m, "refresh_fp8_weights")]
        return _Graph(block, aliases, torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), inputs,
                      tuple(p for _, p in named), refresh=refresh)

    def _call(self, graph: _Graph):
        """The block on its static inputs, its parameters replaced by their aliases."""
        return torch.func.functional_call(graph.block, graph.aliases, graph.inputs, self._kwargs)

    def _warm_up(self, graphs: list[_Graph], passes: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for graph in graphs:
                for refresh in graph.refresh:
                    refresh()
                for _ in range(passes):
                    outputs = [o for o in pytree.tree_leaves(self._call(graph))
                               if isinstance(o, torch.Tensor) and o.requires_grad]
                    wrt = [t for t in (*graph.inputs, *graph.aliases.values()) if t.requires_grad]
                    if outputs:
                        torch.autograd.grad(outputs, wrt, [torch.ones_like(o) for o in outputs], allow_unused=True)
                    del outputs
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _make_slabs(self, graphs: list[_Graph]) -> None:
        """One slab per parameter dtype, as large as the largest block's parameters (`_slab_ends`)."""
        need: dict[torch.dtype, int] = {}
        for graph in graphs:
            for dtype, end in _slab_ends(graph.params).items():
                need[dtype] = max(need.get(dtype, 0), end)
        device = graphs[0].inputs[0].device
        self._slabs = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in need.items()}

    def _capture_backward(self, graph: _Graph, pool) -> None:
        outputs = [o for o, g in zip(graph.outputs, graph.grad_outputs) if g is not None]
        grads_in = [g for g in graph.grad_outputs if g is not None]
        wrt = [t for t in (*graph.inputs, *graph.aliases.values()) if t.requires_grad]
        views = [self._slabs[p.dtype][start:start + p.numel()].view_as(p)
                 for p, start in zip(graph.params, _slab_starts(graph.params))]
        # the FP8 wgrad GEMMs write their weights' gradients straight into the slab (GRADIENT_OUTPUTS); the rest
        # (norms, the router, BF16 GEMMs) are copied in
        direct = GRADIENT_OUTPUTS.into({p.data_ptr(): view for p, view in zip(graph.params, views)})
        with torch.cuda.graph(graph.bwd, pool=pool), direct:
            grads = torch.autograd.grad(outputs, wrt, grads_in, allow_unused=True) if outputs else [None] * len(wrt)
            grads = list(grads)
            n_inputs = sum(t.requires_grad for t in graph.inputs)
            param_grads = grads[n_inputs:]
            copies = [(view, g) for view, g in zip(views, param_grads) if g is not None and not _same_memory(g, view)]
            for view, g in copies:
                view.copy_(g)
            del param_grads
        graph.copied = sum(view.numel() for view, _ in copies)
        del copies
        it = iter(grads[:n_inputs])
        graph.grad_inputs = tuple(next(it) if t.requires_grad else None for t in graph.inputs)
        graph.grad_params = tuple(v if g is not None else None for v, g in zip(views, grads[n_inputs:]))
        del grads


def parameter_aliases(named: Sequence[tuple[str, nn.Parameter]]) -> dict[str, nn.Parameter]:
    """name → a new leaf Parameter over the same memory as the named parameter, for `functional_call`: autograd
    gives it its own gradient, never touching the parameter's AccumulateGrad. A Parameter, not a plain tensor: the
    compiled functions (kernels/fusable.py) then see the types an eager forward gives them and reuse its dynamo
    graphs and Inductor kernels; a plain tensor makes dynamo compile a second graph, whose Inductor kernels can
    autotune to another reduction order, and uses up dynamo's recompile limit sooner, after which the function runs
    eagerly (either way other bits than the eager model's)."""
    return {n: nn.Parameter(p.detach()) for n, p in named}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same elements of the same storage (a gradient written into its slab view)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _synchronize() -> None:
    """Wait for the GPU where there is one (the capture's decisions are also tested on CPU builds)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _slab_starts(params: Sequence[torch.Tensor]) -> list[int]:
    """Where each parameter's gradient starts in its dtype's slab: one after another, SLAB_ALIGNMENT-aligned."""
    ends: dict[torch.dtype, int] = {}
    starts = []
    for p in params:
        start = ends.get(p.dtype, 0)
        starts.append(start)
        ends[p.dtype] = start + (p.numel() + SLAB_ALIGNMENT - 1) // SLAB_ALIGNMENT * SLAB_ALIGNMENT
    return starts


def _slab_ends(params: Sequence[torch.Tensor]) -> dict[torch.dtype, int]:
    """The slab length each dtype needs for these parameters' gradients (the layout of `_slab_starts`)."""
    ends: dict[torch.dtype, int] = {}
    for p, start in zip(params, _slab_starts(params)):
        ends[p.dtype] = start + p.numel()
    return ends


def _chain_input(prev: _Graph, graph: _Graph) -> None:
    """Block i reads block i-1's first output (the residual stream) in place as its first input."""
    out, first = prev.outputs[0], graph.inputs[0]
    if out.shape != first.shape or out.dtype != first.dtype:
        raise ValueError(f"LayerGraphs: a chained block takes {tuple(first.shape)} {first.dtype}, the block before "
                         f"gives {tuple(out.shape)} {out.dtype}")
    graph.inputs = (out.detach().requires_grad_(first.requires_grad), *graph.inputs[1:])


def _chain_grad(graph: _Graph, nxt: _Graph) -> tuple[torch.Tensor | None, ...]:
    """Block i's first output's gradient is block i+1's first input's gradient (chained blocks): receive it in
    place."""
    grad_outputs = list(graph.grad_outputs)
    if grad_outputs[0] is not None and nxt.grad_inputs[0] is not None:
        grad_outputs[0] = nxt.grad_inputs[0]
    return tuple(grad_outputs)
