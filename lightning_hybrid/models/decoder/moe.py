"""The mixture-of-experts layer of the decoder core (Qwen3-MoE): router, experts, load-balancing loss. Single-device.

:class:`MoE` replaces the dense MLP of a sparse block (:meth:`~.config.DecoderConfig.mlp_kind`). Per token: the router
(:class:`Router`, a linear layer without bias) gives softmax probabilities over ``num_experts`` (in fp32), the top
``num_experts_per_tok`` are chosen (a per-expert bias added to the probabilities for the choice only, when
auxiliary-loss-free balancing is on), their probabilities renormalized when ``norm_topk_prob``; the token's output is
the weighted sum of its experts' SwiGLU outputs (:class:`Experts`, 3-D weights ``(num_experts, ...)``). Dropless:
every token reaches each of its experts.

What a strategy may set on the layer (the parallel side never edits this code; :mod:`lightning_hybrid.models.spec`
names the protocol): ``dispatch`` (how the routed (token, expert) rows, sorted by expert, reach their experts and come
back in the same order; :func:`local_dispatch` here, an all-to-all over the expert-parallel ranks under ``ep>1``),
``reduce_load`` (sums the load statistics over the ranks that see different tokens, no gradient; identity here),
``data_ranks`` (how many such ranks average their gradients) and ``grad_scale`` (the weight of a micro-batch's
load-balancing gradient).

The load-balancing loss of one layer and one micro-batch is Switch Transformer's, over the tokens of every data rank
(Qwen's global-batch balancing): ``E * sum_i f_i * P_i`` with ``f_i`` the fraction of tokens routed to expert ``i``
(top-k picks over tokens: the fractions sum to k) and ``P_i`` its mean router probability, both over the global
micro-batch. ``f`` has no gradient; a rank differentiates ``E * sum_i f_i * (its probability sum_i) / N_global *
data_ranks``, and the gradients' average over the data ranks is the gradient of the global loss. The objective is
``router_aux_loss_coef`` times the mean over the sparse layers, and its gradient is injected in the backward of the
layer's output (:class:`_AuxLossGradient`, as Megatron's aux-loss scaler does), so a pipeline stage without the
language-model loss needs none. On one process and one sparse layer the value equals ``transformers``'
``load_balancing_loss_func``; over several layers ``transformers`` pools the statistics of all layers into one product
while this layer's loss is per layer (the product of one layer's fractions and probabilities, as Megatron-Core's and
torchtitan's), which a pipeline stage computes from its own layers alone.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.models.decoder.config import DecoderConfig

__all__ = ["MoE", "Router", "Experts", "expert_mlp", "local_dispatch", "grouped_gemm_supported", "route",
           "MoEStepStats", "moe_layers", "step_metrics", "METRICS"]

# What :func:`step_metrics` gives per sparse layer, in order (logged as ``moe/layer_N/<name>``).
METRICS = ("load_max_over_mean", "aux_loss", "dropped_tokens")


def grouped_gemm_supported(tokens: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` computes the experts here: a CUDA device, bf16, and rows aligned to 16 bytes
    (its kernel's requirements); elsewhere (CPU, fp32) a loop over the experts computes the same."""
    return (tokens.is_cuda and tokens.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and tokens.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0)


def expert_mlp(tokens: Tensor, counts: list[int], gate_up: Tensor, down: Tensor,
               grouped: Optional[bool] = None) -> Tensor:
    """SwiGLU of each expert on its rows: ``tokens`` (rows, hidden) hold ``counts[e]`` rows for expert ``e`` in order.

    Args:
        tokens: the routed rows sorted by expert.
        counts: rows per expert (one entry per expert of ``gate_up``).
        gate_up: ``(experts, 2 * inter, hidden)``: gate rows, then up rows.
        down: ``(experts, hidden, inter)``.
        grouped: ``torch._grouped_mm`` (one kernel for all experts) or a loop; ``None``:
            :func:`grouped_gemm_supported`.
    """
    if grouped is None:
        grouped = grouped_gemm_supported(tokens, gate_up)
    if grouped:
        offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        hidden = torch._grouped_mm(tokens.contiguous(), gate_up.transpose(-2, -1), offs=offsets)
        gate, up = hidden.chunk(2, dim=-1)
        return torch._grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(-2, -1), offs=offsets)
    outputs = []
    # An expert without rows is computed too (an empty matmul): every weight gets a gradient, zero or not, on every
    # rank, so the gradient reductions over the data ranks see the same tensors everywhere.
    for expert, rows in enumerate(tokens.split(counts)):
        gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, down[expert]))
    return torch.cat(outputs)


def _local(weight: Tensor) -> Tensor:
    """The local part of a weight a strategy made a sharded tensor (its experts on this rank), the weight itself
    otherwise."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``moe_intermediate_size`` as two 3-D weights, experts first:
    ``gate_up_proj`` ``(E, 2 * I, H)`` (gate rows, then up rows) and ``down_proj`` ``(E, H, I)``, ``transformers``
    5's layout. A strategy may hold a slice of the experts on each rank (expert parallelism)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))

    rows_computed = 0  # the (token, expert) rows of the last forward

    def forward(self, tokens: Tensor, counts: list[int]) -> Tensor:
        """The outputs of ``tokens`` sorted by expert, ``counts[e]`` rows for the ``e``-th expert this module holds."""
        self.rows_computed = tokens.shape[0]
        return expert_mlp(tokens, counts, _local(self.gate_up_proj), _local(self.down_proj))


class Router(nn.Module):
    """The router: ``weight`` ``(num_experts, hidden)`` (no bias), and with auxiliary-loss-free balancing the buffer
    ``e_score_correction_bias`` (DeepSeek-V3's name) added to the probabilities for the top-k choice only."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias: Optional[Tensor]
        if config.router_bias_update_rate > 0:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor) -> Tensor:
        """Router probabilities (tokens, experts) in fp32."""
        return F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)


def route(probs: Tensor, top_k: int, norm_topk_prob: bool, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(chosen experts (tokens, k), their weights (tokens, k) in fp32): the top ``k`` of ``probs`` (plus ``bias`` for
    the choice only), renormalized to sum to one when ``norm_topk_prob``; ``transformers``' ``Qwen3MoeTopKRouter``."""
    choice = probs if bias is None else probs + bias
    index = torch.topk(choice, top_k, dim=-1).indices
    weights = probs.gather(-1, index)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights


def local_dispatch(rows: Tensor, counts: list[int], experts: nn.Module) -> Tensor:
    """The outputs of the routed rows (sorted by expert, ``counts[e]`` for expert ``e``) computed by ``experts`` on
    this device (all of them), in the same order."""
    return experts(rows, counts)


def sort_by_expert(index: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """(the routed pairs' order sorted by expert, stable; pairs per expert) of ``index`` (tokens, k) flattened."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.tolist()


def combine(out: Tensor, order: Tensor, rows: Tensor, weights: Tensor, x: Tensor) -> Tensor:
    """The tokens' outputs: each pair's expert output ``out`` (in ``order``) times its weight, summed per token."""
    weighted = out * weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, rows, weighted.to(x.dtype))


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the layer's output; its backward gives ``aux`` the gradient ``weight`` (Megatron's
    ``MoEAuxLossAutoScaler``), so the load-balancing loss reaches the gradient without being added to the loss."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.weight = weight
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


def _in_backward() -> bool:
    """Whether this forward is a recompute inside a backward pass (activation checkpointing): its statistics were
    recorded by the first forward already."""
    return torch._C._current_graph_task_id() != -1


class MoEStepStats:
    """What a layer saw since the last optimizer step, per micro-batch and global over the data ranks (tensors on the
    layer's device, float64): tokens per expert (``load``), the load-balancing loss and the (token, expert) pairs
    routed but not computed (``dropped``: 0, the layer is dropless), summed over the micro-batches kept."""

    def __init__(self) -> None:
        self.entries: list[tuple[Tensor, Tensor, Tensor]] = []

    def add(self, load: Tensor, aux_loss: Tensor, dropped: Tensor) -> None:
        self.entries.append((load.clone(), aux_loss.clone(), dropped.clone()))

    def keep_last(self, microbatches: int) -> None:
        """Forget all but the last ``microbatches`` entries (a pipeline's shape inference runs its stages once more
        before the real micro-batches, on made-up inputs)."""
        self.entries = self.entries[len(self.entries) - microbatches:] if len(self.entries) > microbatches \
            else self.entries

    @property
    def microbatches(self) -> int:
        return len(self.entries)

    @property
    def load(self) -> Optional[Tensor]:
        return torch.stack([e[0] for e in self.entries]).sum(0) if self.entries else None

    @property
    def aux_loss(self) -> Optional[Tensor]:
        return torch.stack([e[1] for e in self.entries]).sum() if self.entries else None

    @property
    def dropped(self) -> Optional[Tensor]:
        return torch.stack([e[2] for e in self.entries]).sum() if self.entries else None


class MoE(nn.Module):
    """A sparse block's mixture of experts: ``gate`` (the :class:`Router`) and ``experts`` (:class:`Experts`);
    ``MoE(config)(x)`` for ``x`` (batch, seq, hidden). See the module docstring for the loss and what a strategy
    may set."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.bias_update_rate = config.router_bias_update_rate
        sparse = sum(config.mlp_kind(i) == "experts" for i in range(config.num_hidden_layers))
        # Per layer: the objective is coef x the mean over the sparse layers of their losses.
        self.aux_loss_coef = config.router_aux_loss_coef / sparse
        self.gate = Router(config)
        self.experts = Experts(config)
        self.dispatch: Callable[[Tensor, list[int], nn.Module], Tensor] = local_dispatch
        self.reduce_load: Callable[[Tensor], Tensor] = lambda stats: stats
        self.data_ranks = 1
        self.grad_scale = 1.0  # 1 / micro-batches per optimizer step, set by whoever runs the step
        self.last_aux_loss: Optional[Tensor] = None  # the global loss of the last forward (logged, compared)
        self.stats = MoEStepStats()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x)
        index, weights = route(probs, self.top_k, self.norm_topk_prob, self.gate.e_score_correction_bias)
        order, counts = sort_by_expert(index, self.num_experts)
        rows = order // self.top_k  # the token of each routed pair, pairs sorted by expert (stable)
        out = combine(self.dispatch(x[rows], counts, self.experts), order, rows, weights.to(x.dtype), x)
        aux_local = self._balance(probs, index, self.experts.rows_computed)
        if self.training and torch.is_grad_enabled() and self.aux_loss_coef > 0:
            out = _AuxLossGradient.apply(out, aux_local, self.aux_loss_coef * self.grad_scale)
        return out.reshape(shape)

    def _balance(self, probs: Tensor, index: Tensor, computed: int) -> Tensor:
        """This rank's part of the load-balancing loss (its gradient, averaged over the data ranks, is the global
        loss's); records the micro-batch's global loss, load and dropped pairs (routed less computed)."""
        e = self.num_experts
        with torch.no_grad():  # counts in float64: exact beyond fp32's 2**24
            counts = torch.bincount(index.reshape(-1), minlength=e).double()
            sizes = torch.tensor([probs.shape[0], computed], dtype=torch.float64, device=probs.device)
            total = self.reduce_load(torch.cat([counts, probs.sum(0).double(), sizes]))  # every data rank's tokens
            tokens = total[2 * e]
            fraction = total[:e] / tokens
            self.last_aux_loss = e * (fraction * total[e:2 * e] / tokens).sum()
        if self.training and torch.is_grad_enabled() and not _in_backward():
            self.stats.add(total[:e], self.last_aux_loss, total[:e].sum() - total[2 * e + 1])
        return e * (fraction.to(probs.dtype) * probs.sum(0)).sum() / tokens.to(probs.dtype) * self.data_ranks

    @torch.no_grad()
    def end_step(self) -> None:
        """After an optimizer step: move the routing bias towards balance (auxiliary-loss-free balancing: experts
        above the step's mean load get ``rate`` less, those below ``rate`` more; the same on every rank, the load
        being global) and start the next step's statistics."""
        bias = self.gate.e_score_correction_bias
        if bias is not None and self.stats.load is not None:
            load = self.stats.load.to(bias.dtype)
            bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.stats = MoEStepStats()


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """The mixture-of-experts layers of ``model`` (a model or a pipeline stage's container) by global block index."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            found[int(name.split("layers.")[1].split(".")[0])] = module
    return found


@torch.no_grad()
def step_metrics(layers: dict[int, MoE], num_layers: int, device: torch.device) -> Tensor:
    """(num_layers, len(METRICS) + 1) float64: per layer of ``layers`` its step's :data:`METRICS` (the load of the
    busiest expert over the mean load, the mean load-balancing loss over the micro-batches, the dropped (token,
    expert) pairs) and a 1 that marks it present; zeros for the other layers (a sum over the pipeline stages gives
    every layer once per rank that holds it)."""
    table = torch.zeros(num_layers, len(METRICS) + 1, dtype=torch.float64, device=device)
    for index, layer in layers.items():
        stats = layer.stats
        if stats.load is None:
            continue
        load = stats.load.to(device)
        table[index, 0] = load.max() / load.mean().clamp(min=1e-12)
        table[index, 1] = stats.aux_loss.to(device) / stats.microbatches
        table[index, 2] = stats.dropped.to(device)
        table[index, 3] = 1.0
    return table
