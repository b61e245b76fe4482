"""The mixture-of-experts block, beside the dense MLP (models/mlp.py): a router scores each token for every expert,
each token goes to its top-k experts, and their outputs come back weighted by the routing weights. Dropless: every
token reaches every expert it picks, exactly as transformers routes (models/architecture.py's MixtureOfExperts holds
each family's options: Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, GPT-OSS).

The experts are held fused, as transformers 5 holds them: `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`down_proj` [E, H, I]; GPT-OSS's transposed, [E, H, 2I] with gate and up interleaved and [E, I, H], with biases. The
tokens are sorted by expert and run as one grouped GEMM per projection (torch's grouped_mm, where it has a kernel of
its own for the dtype and device: fp32 or bf16 on the CPU, bf16 on CUDA sm90 and sm100), else as a loop over the
experts' row blocks, whose sizes are read to the host once per layer, never once per expert. The order of every
sum follows transformers' grouped_mm path (sort, project, weight, unsort, sum over the k choices), so the outputs are
the same to the last bit where the kernels are.

The block routes, then hands the tokens to its dispatcher,

    dispatcher(hidden [T, H], expert_ids [T, k] int64, weights [T, k], experts) -> [T, H]

and never knows where the experts are: expert parallelism replaces the dispatcher and the experts with its own
(models/expert_parallel.py). `experts` holds a contiguous slice of the layer's experts: `experts.first_expert`,
`experts.num_local_experts`, and

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
from models.mlp import MLP
from models.sigmoid_router import SigmoidRouter, sequence_balance


class RoutedTokens:
    """The tokens a block routes: which are real (not padding: transformers' attention mask), the row (sequence)
    each belongs to, and the batch's rows. Statistics per sequence are sums over its tokens (sum_by_row).
    whole_rows: None where these are every token of their rows, else what makes their rows' sums [rows, F] the
    whole rows' (under context parallelism each rank holds a share of every row: ContextParallel.whole_rows)."""

    def __init__(self, real, rows, num_rows, whole_rows=None):
        self.real, self.rows, self.num_rows = real, rows, num_rows  # [T] bool, [T] int64, int
        self.whole_rows = whole_rows

    @classmethod
    def of(cls, document_ids, whole_rows=None):
        """The tokens of a batch's rows, from their document ids (batch, seq), 0 on padding."""
        batch, seq = document_ids.shape
        rows = torch.arange(batch * seq, device=document_ids.device) // seq
        return cls((document_ids != 0).reshape(-1), rows, batch, whole_rows)

    def sum_by_row(self, per_token):
        """[num_rows, F]: per_token [T, F] summed over each row's tokens."""
        sums = per_token.new_zeros(self.num_rows, per_token.shape[1]).index_add(0, self.rows, per_token)
        return sums if self.whole_rows is None else self.whole_rows(sums)


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
    """The feed-forward of a sparse decoder layer. Its router is named as the family's (`gate`, GPT-OSS's `router`),
    so the layer's state dict is the Hugging Face one; DeepSeek-V3's is a module of its own
    (models/sigmoid_router.py). A shared expert, where the family has one, is a dense MLP beside the routed
    experts: Qwen2-MoE's behind a sigmoid gate (`shared_expert`, `shared_expert_gate`), DeepSeek-V3's added as it
    is (`shared_experts`)."""

    def __init__(self, config):
        super().__init__()
        self.moe = moe = architecture_of(config).moe
        self.dispatcher = LOCAL_EXPERTS
        shared_expert = MLP(config, moe.shared_expert_size) if moe.shared_expert_size else None
        self.add_module(moe.router_name, SigmoidRouter(config) if moe.sigmoid_routing else
                        nn.Linear(config.hidden_size, moe.num_experts, bias=moe.router_bias))
        self.experts = Experts(moe, config.hidden_size, ACTIVATIONS[config.hidden_act], 0, moe.num_experts)
        if shared_expert is not None:  # under the family's name
            self.add_module(moe.shared_expert_name, shared_expert)
        if shared_expert is not None and moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x, tokens):
        """(the block's output, shaped as x; this layer's routing statistics: routing_statistics'). tokens: the
        RoutedTokens of x's tokens."""
        hidden = x.reshape(-1, x.shape[-1])
        logits, weights, expert_ids = self.route(hidden)
        out = self.dispatcher(hidden, expert_ids, weights, self.experts)
        shared_expert = getattr(self, self.moe.shared_expert_name, None)
        if shared_expert is not None:
            shared = shared_expert(hidden)
            if self.moe.shared_expert_gated:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out.view_as(x), routing_statistics(logits, expert_ids, tokens, self.moe)

    def route(self, hidden):
        """(router logits [T, E], routing weights [T, k], expert ids [T, k]) of hidden [T, H]."""
        router = getattr(self, self.moe.router_name)
        if self.moe.sigmoid_routing:
            return router(hidden)
        logits = router(hidden)
        return logits, *route(logits, self.moe)


def routing_statistics(logits, expert_ids, tokens, moe):
    """One layer's routing statistics: the real tokens' top-k choices per expert [E] int64, and the floating sum
    an auxiliary loss takes from the layer [E] fp32, else None: with transformers' load-balancing loss the sums of
    the real tokens' router probabilities (a softmax of the logits in their own dtype: load_balancing_loss_func's),
    with DeepSeek-V3's sequence-wise loss the layer's per-expert terms (models/sigmoid_router.py)."""
    mask = tokens.real.to(expert_ids.device)
    counts = torch.zeros(moe.num_experts, dtype=torch.int64, device=expert_ids.device).scatter_add_(
        0, expert_ids.reshape(-1), mask.to(torch.int64).repeat_interleave(moe.top_k))
    if moe.sequence_aux_loss_coef:
        return counts, sequence_balance(logits, expert_ids, tokens, moe.top_k)
    if not moe.aux_loss:
        return counts, None
    probabilities = F.softmax(logits, dim=-1).float()
    return counts, (probabilities * mask.to(torch.float32)[:, None]).sum(dim=0)


class RowGroups(NamedTuple):
    """The row blocks of a grouped projection (a mixture of experts: each expert's tokens): `offsets`, the int32
    cumulative row counts, for torch's grouped GEMM, or `split_sizes`, the counts as a list, for one matmul per block;
    and each row's group (int64, for the bias), or None without a bias."""
    offsets: torch.Tensor | None
    split_sizes: list | None
    group_of_row: torch.Tensor | None


def grouped_matmul(x, weight, groups):
    """Each row block of x [rows, in] times its group's weight [groups, in, out]."""
    if groups.split_sizes is None:
        return F.grouped_mm(x, weight, offs=groups.offsets)
    return torch.cat([block @ weight[g] for g, block in enumerate(x.split(groups.split_sizes))])


def grouped_linear(x, weight, bias, groups):
    """grouped_matmul, and each row's group's bias [groups, out] added (bias None: none)."""
    out = grouped_matmul(x, weight, groups)
    return out if bias is None else out + bias[groups.group_of_row]


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

    grouped_linear = staticmethod(grouped_linear)  # a stage's defers its weight gradients (models/tensor_parallel.py)

    def __init__(self, moe, hidden, act_fn, first_expert, num_local_experts):
        super().__init__()
        self.first_expert, self.num_local_experts, self.hidden_size = first_expert, num_local_experts, hidden
        self.moe = moe  # what expert parallelism's slice of them is built from
        self.transposed, self.act_fn = moe.transposed, act_fn
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

    def reset_parameters(self):
        for param in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(param, std=0.02)
        for param in (getattr(self, "gate_up_proj_bias", None), getattr(self, "down_proj_bias", None)):
            if param is not None:
                nn.init.zeros_(param)

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
        """x's row block of each expert through that expert's projection (and bias)."""
        weight = self.weight(name)
        weight = weight if self.transposed else weight.transpose(-2, -1)  # [experts, in, out]
        bias = None if rows_expert is None else getattr(self, f"{name}_bias")
        offsets = counts.cumsum(0, dtype=torch.int32) if split_sizes is None else None
        return self.grouped_linear(x, weight, bias, RowGroups(offsets, split_sizes, rows_expert))

    def weight(self, name):
        """A fused projection's weight as the experts apply it (LoRA's folds its adapters in: models/lora.py)."""
        return getattr(self, name)

    def gate(self, gate_up):
        """SwiGLU of the gate and up features; GPT-OSS's clamped one of its interleaved features."""
        if self.limit is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# The CUDA compute capabilities (major) where torch's grouped GEMM has kernels of its own (CUTLASS, bf16 in and out):
# sm90 (Hopper) and sm100 (Blackwell). Elsewhere torch falls back to reading the offsets to the host and running one
# GEMM per group, at every call: a sync in each of a layer's 2 projections forward and 4 grouped GEMMs backward.
GROUPED_MM_CUDA_MAJORS = (9, 10)


def grouped_mm_fast_on(device, dtype):
    """Whether torch's grouped GEMM runs a kernel of its own for dtype on device: fp32 or bf16 on the CPU, bf16 on
    CUDA sm90 and sm100."""
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    return device.type == "cuda" and dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(device)[0] in GROUPED_MM_CUDA_MAJORS


def grouped_mm_fits(operands, inner_width):
    """Whether the experts' operands (the tokens, then the weights; inner_width: the features between the
    projections) take torch's grouped GEMM on its own kernel (grouped_mm_fast_on), every address and stride on 16
    bytes. Else each expert's row block runs alone, the block sizes read to the host once per layer forward (none
    where the caller has them, as expert parallelism's exchange does) and none in backward: torch's own fallback
    would read them at each of its six grouped GEMMs."""
    x = operands[0]
    if x.shape[0] == 0:  # torch's CPU kernel takes no empty input in backward (an expert-parallel rank no token chose)
        return False
    aligned = all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
                  for t in operands)
    return grouped_mm_fast_on(x.device, x.dtype) and aligned and inner_width * x.element_size() % 16 == 0


class LocalExperts:
    """The dispatcher of a block that holds every expert of the layer."""

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
