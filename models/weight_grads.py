"""A linear layer's backward split in two for zero-bubble pipeline schedules (schedules/orders.py): the input
gradient, which the previous stage waits for, now; the weight gradient, which nobody waits for, later.

While a `WeightGradQueue` is deferring (one micro-batch's backward pass B), the linear layers built with it (and the
grouped projections of a mixture's experts, each expert's row block through its own weight) return no weight
gradient and queue (input, output gradient) instead; `run_oldest` (the schedule's W) computes that
micro-batch's weight gradients and hands them to autograd's accumulation, so .grad and the gradient hooks that
DeepSpeed's optimizers register (bf16 and ZeRO gradient buffers) see them as in an undivided backward. Embedding
and norm weights keep their gradients in B. The LM head's (tied or not) waits for W like any linear layer's: its
B would otherwise cost the last stage twice its W, and the first stage waits for that B at the start of every step.
Its price is the logits' output gradient (activation dtype, this rank's vocabulary share) held by each micro-batch
waiting for W on the last stage, at most p - 1 of them, on the stage that holds the fewest activations under 1F1B
(one micro-batch's, against the first stage's p); bench/pipeline_efficiency.py measures both stages' peaks.

The embedding's weight gradient, under every schedule, is added to .grad row by row once .grad exists: torch's own
backward builds a dense vocabulary x hidden tensor per micro-batch (1-2 GB on a LLaMA-3 vocabulary) to add into it.
"""
import collections
import contextlib

import torch
import torch.nn.functional as F

from models.moe import RowGroups, grouped_linear, grouped_matmul


class WeightGradQueue:
    """Weight-gradient work of the micro-batches whose B has run and whose W has not, oldest first."""

    def __init__(self):
        self.deferring = False
        self._pending = collections.deque()

    @contextlib.contextmanager
    def defer(self):
        """Queue the weight-gradient work of the backward run inside this block as one micro-batch's W."""
        self.deferring, work = True, []
        self._pending.append(work)
        try:
            yield
        finally:
            self.deferring = False

    def add(self, params_and_grads_fn):
        """params_and_grads_fn() -> [(parameter, gradient), ...], computed when W runs."""
        self._pending[-1].append(params_and_grads_fn)

    def __len__(self):
        return len(self._pending)

    def run_oldest(self):
        """Compute the oldest micro-batch's weight gradients and accumulate them as autograd does (hooks included)."""
        for work in self._pending.popleft():  # one linear layer at a time: only its weight gradients alive at once
            with torch.no_grad():
                params, grads = zip(*work())
            torch.autograd.backward(params, grads)


@torch.compiler.disable  # a compiled graph would fix at trace time whether its backward defers (compile=true)
def linear(x, weight, bias, queue):
    """F.linear whose weight and bias gradients go to `queue` while it is deferring."""
    return DeferrableLinear.apply(x, weight, bias, queue)


def keep_params(ctx, *params):
    """Keep a layer's weight and bias on ctx as the tensors the forward took, for W to hand their gradients to.
    Saved tensors would come back, under non-reentrant activation checkpointing (its saved-tensor hooks), as new
    tensors that reach the parameter's gradient only while a graph still holds its accumulator: a W after the step's
    last graph was freed added its gradient to a copy and lost it."""
    ctx.params = params


def linear_weight_grads(x, grad, weight, bias):
    """[(weight, dW), (bias, db)] of y = x W^T + b from its input and output gradient (any leading dimensions), for
    those of weight and bias that take a gradient (a frozen base under LoRA takes none)."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    pairs = [(weight, grad_2d.t() @ x.reshape(-1, x.shape[-1]))] if weight.requires_grad else []
    return pairs + ([(bias, grad_2d.sum(0))] if bias is not None and bias.requires_grad else [])


def takes_weight_grads(weight, bias):
    return weight.requires_grad or (bias is not None and bias.requires_grad)


class DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue):
        # A frozen weight's backward needs only the weight: the input is not kept. The weight and bias are kept as
        # themselves (keep_params), not as saved tensors.
        ctx.save_for_backward(x if takes_weight_grads(weight, bias) else None)
        keep_params(ctx, weight, bias)
        ctx.queue = queue
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,), (weight, bias) = ctx.saved_tensors, ctx.params
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        if not takes_weight_grads(weight, bias):
            return grad_x, None, None, None
        if ctx.queue.deferring:
            ctx.queue.add(lambda: linear_weight_grads(x, grad, weight, bias))
            return grad_x, None, None, None
        grad_of = {id(param): param_grad for param, param_grad in linear_weight_grads(x, grad, weight, bias)}
        return grad_x, grad_of.get(id(weight)), None if bias is None else grad_of.get(id(bias)), None


def grouped_linear_weight_grads(x, grad, weight, bias, groups):
    """[(weight, dW), (bias, db)] of grouped_linear from its input and output gradient, for those of weight and bias
    that take a gradient: the bits autograd gives (tests/test_moe.py), the bias rows accumulated by index. A weight
    held transposed (each group's [in, out] column-major: the experts' [E, out, in] parameters) gets its gradient
    computed in the parameter's own layout, gradient^T x, as autograd's matmul does (mm_mat2_backward): then it
    adds into .grad contiguously (on the CPU a quarter of the experts' W was a strided add otherwise)."""
    pairs = []
    if weight.requires_grad:
        transposed = weight.stride(-2) == 1
        if groups.split_sizes is None:
            weight_grad = (F.grouped_mm(grad.t(), x, offs=groups.offsets).transpose(-2, -1) if transposed
                           else F.grouped_mm(x.t(), grad, offs=groups.offsets))
        else:
            weight_grad = torch.stack([(block_grad.t() @ block).t() if transposed else block.t() @ block_grad
                                       for block, block_grad in zip(x.split(groups.split_sizes),
                                                                    grad.split(groups.split_sizes))])
        pairs.append((weight, weight_grad))
    if bias is not None and bias.requires_grad:
        pairs.append((bias, grad.new_zeros(bias.shape).index_put_((groups.group_of_row,), grad, accumulate=True)))
    return pairs


def parameter_or_view(weight):
    """Whether W can hand a gradient to `weight`: a parameter, or a view of one. A weight computed by operations that
    keep tensors for their backward (LoRA's folded expert weights, W + scaling B A) is not: B runs through that
    computation and frees them before W, so such a weight's gradients come in B."""
    return (weight._base if weight._is_view() else weight).is_leaf


@torch.compiler.disable  # as linear's
def deferrable_grouped_linear(x, weight, bias, groups, queue):
    """grouped_linear whose weight and bias gradients go to `queue` while it is deferring."""
    return DeferrableGroupedLinear.apply(x, weight, bias, groups, queue)


class DeferrableGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, queue):
        ctx.save_for_backward(x if takes_weight_grads(weight, bias) else None, groups.offsets, groups.group_of_row)
        keep_params(ctx, weight, bias)
        ctx.split_sizes, ctx.queue = groups.split_sizes, queue
        return grouped_linear(x, weight, bias, groups)

    @staticmethod
    def backward(ctx, grad):
        (x, offsets, group_of_row), (weight, bias) = ctx.saved_tensors, ctx.params
        groups = RowGroups(offsets, ctx.split_sizes, group_of_row)
        grad_x = grouped_matmul(grad, weight.transpose(-2, -1), groups) if ctx.needs_input_grad[0] else None
        if not takes_weight_grads(weight, bias):
            return grad_x, None, None, None, None
        if ctx.queue.deferring:
            ctx.queue.add(lambda: grouped_linear_weight_grads(x, grad, weight, bias, groups))
            return grad_x, None, None, None, None
        grad_of = {id(param): param_grad for param, param_grad in grouped_linear_weight_grads(x, grad, weight, bias,
                                                                                              groups)}
        return grad_x, grad_of.get(id(weight)), None if bias is None else grad_of.get(id(bias)), None, None


def embedding(input_ids, weight, padding_idx=None):
    """F.embedding whose weight gradient reaches autograd's accumulation as only the looked-up rows; row
    padding_idx, as torch's, takes none."""
    return RowGradEmbedding.apply(input_ids, weight, padding_idx)


class RowGradEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_ids, weight, padding_idx):
        ctx.save_for_backward(input_ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(input_ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (input_ids,) = ctx.saved_tensors
        weight, padding_idx = ctx.weight, ctx.padding_idx
        if not weight.is_leaf or weight.grad is None:
            # The first gradient of a step becomes .grad itself: dense, as torch's embedding backward makes it.
            return None, torch.ops.aten.embedding_dense_backward(
                grad, input_ids, weight.shape[0], -1 if padding_idx is None else padding_idx, False), None
        if padding_idx is not None:
            grad = grad.masked_fill((input_ids == padding_idx)[..., None], 0)
        # Accumulation into a dense .grad adds a sparse gradient in place, one row per token (hooks run as usual).
        return None, torch.sparse_coo_tensor(input_ids.reshape(1, -1), grad.reshape(-1, grad.shape[-1]),
                                             weight.shape, check_invariants=False), None
