"""The mixture-of-experts block, beside the dense MLP (models/llama.py): a router scores each token for every expert,
each token goes to its top-k experts, and their outputs come back weighted by the routing weights. Dropless: every
token reaches every expert it picks, exactly as transformers routes (models/architecture.py's MixtureOfExperts holds
each family's options: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, GPT-OSS).

The experts are held fused, as transformers 5 holds them: `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`down_proj` [E, H, I]; GPT-OSS's transposed, [E, H, 2I] with gate and up interleaved and [E, I, H], with biases. The
tokens are sorted by expert and run as one grouped GEMM per projection (torch's grouped_mm, where it takes the dtype
and device: fp32 or bf16 on the CPU, bf16 on CUDA from sm80), else as a loop over the experts' row blocks, whose sizes
are read to the host once per layer, never once per expert. The order of every sum follows transformers' grouped_mm
path (sort, project, weight, unsort, sum over the k choices), so the outputs are the same to the last bit where the
kernels are.

The seam for expert parallelism: the block routes, then hands the tokens to a dispatcher injected at construction,

    dispatcher(hidden [T, H], expert_ids [T, k] int64, weights [T, k], experts) -> [T, H]

and never knows where the experts are. `experts` holds a contiguous slice of the layer's experts, which the
dispatcher chooses when the block is built (`dispatcher.expert_range(num_experts) -> (first, count)`):
`experts.first_expert`, `experts.num_local_experts`, and

    experts(tokens [N, H] sorted by local expert, counts [num_local_experts] int64 on the device,
            split_sizes: the same counts as Python ints, or None) -> [N, H]

(the counts as ints when the caller has them on the host already, as an all-to-all does; None, and the experts
read them only if they must loop). LocalExperts, the default, holds every expert: it sorts the T x k choices by
expert, runs them, unsorts and sums each token's k weighted outputs. The all-to-all dispatcher of expert parallelism
(models/expert_parallel.py) sorts the same way, sends each expert's rows to the rank holding it, runs its own, sends
them back and combines alike (sort_by_expert, combine); the experts' parameters are then the rank's slice
(ExpertSlice), their gradients reduced over the ranks holding the same.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.architecture import ACTIVATIONS, architecture_of
from models.sigmoid_router import SigmoidRouter, sequence_balance
from models.tensor_parallel import NO_TENSOR_PARALLEL
from models.weight_grads import RowGroups


class RoutedTokens(NamedTuple):
    """The tokens a rank's block routes (its sequence-parallel share of the micro-batch's): which are real (not
    padding: transformers' attention mask), the row (sequence) each belongs to, and the micro-batch's rows."""
    real: torch.Tensor  # [T] bool
    rows: torch.Tensor  # [T] int64
    num_rows: int


def route(logits, moe):
    """(routing weights [T, k], expert ids [T, k]) from the router's logits [T, E], as the family's router does."""
    if moe.softmax_after_topk:  # GPT-OSS: the top-k logits, then a softmax over them
        top, expert_ids = torch.topk(logits, moe.top_k, dim=-1)
        return F.softmax(top, dim=1, dtype=top.dtype), expert_ids
    weights, expert_ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype) if moe.weights_in_logits_dtype else weights), expert_ids


class MoEBlock(nn.Module):
    """The MLP of a sparse decoder layer. Its router is named as the family's (`gate`, GPT-OSS's `router`), so the
    layer's state dict is the Hugging Face one; DeepSeek-V3's is a module of its own (models/sigmoid_router.py).
    shared_expert: a dense MLP beside the routed experts, Qwen2-MoE's behind a sigmoid gate (`shared_expert`,
    `shared_expert_gate`), DeepSeek-V3's added as it is (`shared_experts`).

    Under tensor parallelism each rank holds every expert whole and routes its own tokens: the sequence-parallel
    share of the tokens (each rank computes 1/t of the block, no collective), or without sequence parallelism all
    of them, as every rank computes a norm. The router's and experts' gradients are then summed over the group as a
    norm's (TensorParallel.replicated); the shared expert splits like the dense MLP."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, dispatcher=None, shared_expert=None):
        super().__init__()
        self.moe = moe = architecture_of(config).moe
        self.parallel = parallel
        self.dispatcher = dispatcher or LOCAL_EXPERTS
        self.add_module(moe.router_name, SigmoidRouter(config, parallel) if moe.sigmoid_routing else
                        nn.Linear(config.hidden_size, moe.num_experts, bias=moe.router_bias))
        first, count = self.dispatcher.expert_range(moe.num_experts)
        self.experts = Experts(moe, config.hidden_size, ACTIVATIONS[config.hidden_act], first, count, parallel)
        if shared_expert is not None:  # under the family's name
            self.add_module(moe.shared_expert_name, shared_expert)
        if shared_expert is not None and moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x, document_ids):
        """(the block's output, shaped as x; this layer's routing statistics: routing_statistics'). document_ids:
        the micro-batch's [batch, seq], 0 on padding."""
        hidden = x.reshape(-1, x.shape[-1])
        logits, weights, expert_ids = self.route(hidden)
        out = self.dispatcher(hidden, expert_ids, weights, self.experts)
        shared_expert = getattr(self, self.moe.shared_expert_name, None)
        if shared_expert is not None:
            shared = shared_expert(hidden)
            if self.moe.shared_expert_gated:
                shared = torch.sigmoid(self.parallel.replicated_linear(hidden, self.shared_expert_gate)) * shared
            out = out + shared
        statistics = routing_statistics(logits, expert_ids, self.routed_tokens(document_ids), self.moe, self.parallel)
        return out.view_as(x), statistics

    def route(self, hidden):
        """(router logits [T, E], routing weights [T, k], expert ids [T, k]) of hidden [T, H]."""
        router = getattr(self, self.moe.router_name)
        if self.moe.sigmoid_routing:
            return router(hidden)
        logits = self.parallel.replicated_linear(hidden, router)
        return logits, *route(logits, self.moe)

    def routed_tokens(self, document_ids):
        """The RoutedTokens this rank's block sees: its sequence-parallel share of the micro-batch's."""
        batch, seq = document_ids.shape
        real = (document_ids != 0).reshape(-1)
        rows = torch.arange(batch * seq, device=document_ids.device) // seq
        if self.parallel.sequence_parallel:
            real, rows = (t.chunk(self.parallel.size)[self.parallel.rank] for t in (real, rows))
        return RoutedTokens(real, rows, batch)


def routing_statistics(logits, expert_ids, tokens, moe, parallel=NO_TENSOR_PARALLEL):
    """One layer's routing statistics: the real tokens' top-k choices per expert [E] int64, and the floating sum
    an auxiliary loss takes from the layer [E] fp32, else None: with transformers' load-balancing loss the sums of
    the real tokens' router probabilities (a softmax of the logits in their own dtype: load_balancing_loss_func's),
    with DeepSeek-V3's sequence-wise loss the layer's per-expert terms (models/sigmoid_router.py)."""
    mask = tokens.real.to(expert_ids.device)
    counts = torch.zeros(moe.num_experts, dtype=torch.int64, device=expert_ids.device).scatter_add_(
        0, expert_ids.reshape(-1), mask.to(torch.int64).repeat_interleave(moe.top_k))
    if moe.sequence_aux_loss_coef:
        return counts, sequence_balance(logits, expert_ids, tokens, moe.top_k, parallel)
    if not moe.aux_loss:
        return counts, None
    probabilities = F.softmax(logits, dim=-1).float()
    return counts, (probabilities * mask.to(torch.float32)[:, None]).sum(dim=0)


class ExpertSlice(NamedTuple):
    """The experts an expert parameter holds (its rows along dim 0) out of the layer's `total`."""
    first: int
    count: int
    total: int

    def of(self, tensor):
        """This slice of a tensor holding the layer's every expert along dim 0 (a view: a memory-mapped file's
        tensor reads only these rows), or the tensor itself when it holds this slice already."""
        return tensor.narrow(0, self.first, self.count) if tensor.shape[0] == self.total != self.count else tensor


class Experts(nn.Module):
    """Experts first_expert .. first_expert + num_local_experts - 1 of a layer, fused: see the module's docstring."""

    def __init__(self, moe, hidden, act_fn, first_expert, num_local_experts, parallel=NO_TENSOR_PARALLEL):
        super().__init__()
        self.first_expert, self.num_local_experts = first_expert, num_local_experts
        self.transposed, self.act_fn, self.parallel = moe.transposed, act_fn, parallel
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        count, inter = num_local_experts, moe.expert_size
        gate_up, down = ((count, hidden, 2 * inter), (count, inter, hidden)) if moe.transposed else \
            ((count, 2 * inter, hidden), (count, hidden, inter))
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(down).normal_(std=0.02))
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(count, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.zeros(count, hidden))
        for param in self.parameters():  # the layer's experts it holds along dim 0: what loading reads, saving gathers
            param.expert_slice = ExpertSlice(first_expert, num_local_experts, moe.num_experts)

    def forward(self, tokens, counts, split_sizes=None):
        inter = self.down_proj.shape[-2 if self.transposed else -1]
        grouped = grouped_mm_fits((tokens, self.gate_up_proj, self.down_proj), inter)
        if not grouped and split_sizes is None:
            split_sizes = counts.tolist()  # one read per layer: the row block of each expert
        rows_expert = None
        if hasattr(self, "gate_up_proj_bias"):  # each row's expert, for its bias
            rows_expert = torch.repeat_interleave(torch.arange(self.num_local_experts, device=counts.device), counts,
                                                  output_size=tokens.shape[0])
        sizes = None if grouped else split_sizes
        inner = self.gate(self.project(tokens, "gate_up_proj", counts, sizes, rows_expert))
        return self.project(inner, "down_proj", counts, sizes, rows_expert)

    def project(self, x, name, counts, split_sizes, rows_expert):
        """x's row block of each expert through that expert's projection (and bias); under a zero-bubble schedule
        their gradients wait for W as a linear layer's do."""
        weight = self.weight(name)
        weight = weight if self.transposed else weight.transpose(-2, -1)  # [experts, in, out]
        bias = None if rows_expert is None else self.parallel.replicated(getattr(self, f"{name}_bias"))
        offsets = counts.cumsum(0, dtype=torch.int32) if split_sizes is None else None
        return self.parallel.grouped_linear(x, weight, bias, RowGroups(offsets, split_sizes, rows_expert))

    def weight(self, name):
        """A fused projection's weight, with its LoRA update where it has adapters (models/lora.py): W_e + scaling
        * B_e A_e for each expert, one baddbmm, as peft's ParamWrapper folds it (A [E, rank, in], B [E, out,
        rank])."""
        weight = self.parallel.replicated(getattr(self, name))
        adapters = getattr(self, "lora_A", {})
        if name not in adapters or not self.lora_scaling:
            return weight
        a, b = (self.parallel.replicated(factors[name]) for factors in (self.lora_A, self.lora_B))
        if self.transposed:  # [E, in, out]
            return torch.baddbmm(weight, a.transpose(-2, -1), b.transpose(-2, -1), alpha=self.lora_scaling)
        return torch.baddbmm(weight, b, a, alpha=self.lora_scaling)

    def gate(self, gate_up):
        """SwiGLU of the gate and up features; GPT-OSS's clamped one of its interleaved features."""
        if self.limit is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def grouped_mm_fits(operands, inner_width):
    """Whether torch's grouped GEMM takes the experts' operands (the tokens, then the weights; inner_width: the
    features between the projections): fp32 or bf16 on the CPU, bf16 on CUDA from sm80, every address and stride on
    16 bytes. Else each expert's row block runs alone."""
    x = operands[0]
    if x.device.type == "cpu":
        supported = x.dtype in (torch.float32, torch.bfloat16)
    else:
        supported = x.device.type == "cuda" and x.dtype == torch.bfloat16 and \
            torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.shape[0] == 0:  # torch's CPU kernel takes no empty input in backward (an expert-parallel rank no token chose)
        return False
    aligned = all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
                  for t in operands)
    return supported and aligned and inner_width * x.element_size() % 16 == 0


class LocalExperts:
    """The dispatcher of a rank that holds every expert of the layer."""

    def expert_range(self, num_experts):
        return 0, num_experts

    def __call__(self, hidden, expert_ids, weights, experts):
        top_k = expert_ids.shape[1]
        order, counts = sort_by_expert(expert_ids, experts.num_local_experts, experts.first_expert)
        return combine(experts(hidden[order // top_k], counts), order, weights, hidden.dtype)


def sort_by_expert(expert_ids, num_experts, first_expert=0):
    """(order: the T x k choices sorted by expert, stably; counts [num_experts] int64: each expert's choices)."""
    flat = expert_ids.reshape(-1) - first_expert
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def combine(rows, order, weights, dtype):
    """Each sorted choice's output (rows, in `order`) weighted by its routing weight, unsorted, and each token's k
    rows summed in their routing order."""
    out = rows * weights.reshape(-1)[order, None]
    return UnsortAndSum.apply(out, order, weights.shape[1]).to(dtype)


def inverse_permutation(order):
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


class UnsortAndSum(torch.autograd.Function):
    """Each token's k rows (sorted by expert, `order` the sort's permutation), back in their routing order and
    summed, as transformers' grouped_mm path sums them. Its backward gathers each row's token's gradient in one
    pass: autograd's would broadcast the sum's gradient over a tokens x k x hidden copy, then scatter it through
    the unsort into zeros (bench/moe_block.py)."""

    @staticmethod
    def forward(ctx, rows, order, top_k):
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return rows[inverse_permutation(order)].view(-1, top_k, rows.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, grad):
        order, = ctx.saved_tensors
        return grad.index_select(0, order // ctx.top_k), None, None


LOCAL_EXPERTS = LocalExperts()
