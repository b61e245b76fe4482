"""Tensor parallelism inside a pipeline stage, in Megatron's layout, as the few calls the layers make.

A layer built with ``TensorParallel(size=t)`` holds 1/t of its projections: q, k, v, gate and up split by output
feature (column-parallel: each rank computes its own heads or MLP columns from the whole input), o and down split
by input feature (row-parallel: partial sums, added across the group), the embedding and LM head split by
vocabulary row. With ``sequence_parallel`` the residual stream between those projections holds 1/t of the tokens
(batch and sequence flattened), so norms, residual adds and the tensors sent between stages shrink by t; the
tokens are all-gathered before a column-parallel group and reduce-scattered after a row-parallel one.

With size 1 every call is the plain computation and no collective runs: the single-process model is this one.
Written here rather than taken from a library because DeepSpeed's AutoTP does not compose with PipelineModule, and
DTensor parameters would bypass DeepSpeed's optimizer and gradient machinery.
"""
import math

import torch
import torch.nn.functional as F

import collectives
from models.weight_grads import (deferrable_grouped_linear, embedding as row_grad_embedding, grouped_linear,
                                 keep_params, linear as deferrable_linear, linear_weight_grads, parameter_or_view,
                                 takes_weight_grads)

# DeepSpeed's marker of a parameter split across the tensor-parallel group: its gradient-norm code counts such a
# parameter on every rank and a replicated one on tensor-parallel rank 0 only.
SHARDED_MARKER = "tensor_model_parallel"


class TensorParallel:
    """One rank's place in its tensor-parallel group, and the collectives the layers call."""

    def __init__(self, size=1, rank=0, sequence_parallel=False, recompute_sequence_gather=False, group=None):
        self.size, self.rank, self.group = size, rank, group
        self.sequence_parallel = sequence_parallel and size > 1
        self.recompute_sequence_gather = recompute_sequence_gather
        self.buffers = BufferPool()
        self.weight_grads = None  # a WeightGradQueue (models/weight_grads.py) under the zero-bubble schedule

    def local(self, count, what):
        """This rank's share of `count` (heads, features, vocabulary rows), or an error naming what does not split."""
        if count % self.size:
            raise ValueError(f"{what}={count} is not divisible by tensor_parallel_size={self.size}; choose a "
                             f"tensor_parallel_size that divides it.")
        return count // self.size

    def mark_sharded(self, module, dim):
        """Record on each parameter of a split module the dimension it is split along (biases of a row-parallel
        layer are whole, added once after the reduction)."""
        if self.size == 1:
            return
        for name, param in module.named_parameters(recurse=False):
            if dim == 0 or name == "weight":
                setattr(param, SHARDED_MARKER, True)
                param.tensor_parallel_dim = dim

    # --- the calls the layers make ---------------------------------------------------------------------------
    def column_linears(self, x, linears):
        """Column-parallel projections sharing one input (q, k, v; gate, up; the LM head): this rank's output
        features for every token. Under sequence parallelism x holds this rank's tokens and the full set is
        gathered once for the whole group of projections. Projections with LoRA adapters add theirs."""
        adapters = self.column_adapters(x, linears)
        if self.size == 1:
            outputs = [self.linear(x, lin) for lin in linears]
        elif self.sequence_parallel:
            params = [t for lin in linears for t in (lin.weight, getattr(lin, "bias", None))]
            outputs = list(gathered_linears(self, x, *params))
        else:
            copied = CopyToGroup.apply(x, self.group)
            outputs = [self.linear(copied, lin) for lin in linears]
        return [out + adapters[i] if i in adapters else out for i, out in enumerate(outputs)]

    def whole_input(self, x):
        """The input of a column-parallel projection done outside column_linears (the chunked LM loss): every
        token (gathered under sequence parallelism), its gradient summed over the group."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return GatherTokens.apply(x, self)
        return CopyToGroup.apply(x, self.group)

    def row_linear(self, x, linear):
        """A row-parallel projection: partial sums over this rank's input features, added across the group (and
        split by token under sequence parallelism); the bias, held whole, is added once after the sum."""
        if self.size == 1:
            out = self.linear(x, linear)
        else:
            out = self.reduce(self.linear(x, linear, bias=False))
            out = out if linear.bias is None else out + self.replicated(linear.bias)
        return out + self.row_adapter(x, linear) if hasattr(linear, "lora_A") else out

    def replicated_linear(self, x, module):
        """A projection every rank holds whole, on this rank's tokens (MLA's latent projections): its weight and
        bias are replicated like a norm's, and so are both factors of its LoRA adapter."""
        bias = None if module.bias is None else self.replicated(module.bias)
        out = self.matmul(x, self.replicated(module.weight), bias)
        if not hasattr(module, "lora_A"):
            return out
        h = self.matmul(F.dropout(x, module.lora_dropout, module.training), self.replicated(module.lora_A.weight))
        return out + self.matmul(h, self.replicated(module.lora_B.weight)) * module.lora_scaling

    def whole_input_linear(self, x, module):
        """A column-parallel projection of an input every rank holds whole already (MLA's q_b_proj and kv_b_proj
        on the gathered latents), whose gradient the gather sums over the group: this rank's output features. Its
        LoRA adapter's A is whole and its gradient, from this rank's rows of B only, is summed over the group; B
        holds this rank's rows."""
        out = self.linear(x, module)
        if not hasattr(module, "lora_A"):
            return out
        a = module.lora_A.weight if self.size == 1 else CopyToGroup.apply(module.lora_A.weight, self.group)
        h = self.matmul(F.dropout(x, module.lora_dropout, module.training), a)
        return out + self.matmul(h, module.lora_B.weight) * module.lora_scaling

    def linear(self, x, module, bias=True):
        """x through a linear module (without its bias if bias=False)."""
        return self.matmul(x, module.weight, getattr(module, "bias", None) if bias else None)

    def matmul(self, x, weight, bias=None):
        """F.linear, its weight gradients deferred when the schedule splits the backward."""
        if self.weight_grads is None:
            return F.linear(x, weight, bias)
        return deferrable_linear(x, weight, bias, self.weight_grads)

    def grouped_linear(self, x, weight, bias, groups):
        """Each row block of x through its group's weight and bias (a mixture's experts: models/weight_grads.py
        grouped_linear), the weight gradients deferred when the schedule splits the backward (but a LoRA-folded
        weight's, parameter_or_view)."""
        if self.weight_grads is None or not parameter_or_view(weight):
            return grouped_linear(x, weight, bias, groups)
        return deferrable_grouped_linear(x, weight, bias, groups, self.weight_grads)

    # --- LoRA adapters (models/lora.py): split like their projection, so only rank-wide activations travel ----------
    def column_adapters(self, x, linears):
        """{position in linears: scaling * B(A(dropout(x)))} of the column-parallel projections with adapters.
        A is whole: each rank computes the rank-wide h = A x of its own tokens, and the h of the whole group cross
        the tensor-parallel group at once (gathered by token under sequence parallelism, whose A gradient, of this
        rank's tokens only, is then summed like a norm's); B holds this rank's output rows."""
        adapted = [(i, lin) for i, lin in enumerate(linears) if hasattr(lin, "lora_A")]
        if not adapted:
            return {}
        h = torch.cat([self.matmul(F.dropout(x, lin.lora_dropout, lin.training),
                                   self.replicated(lin.lora_A.weight)) for _, lin in adapted], dim=-1)
        if self.size > 1:
            h = GatherTokens.apply(h, self) if self.sequence_parallel else CopyToGroup.apply(h, self.group)
        parts = h.split([lin.lora_A.out_features for _, lin in adapted], dim=-1)
        return {i: self.matmul(part, lin.lora_B.weight) * lin.lora_scaling for (i, lin), part in zip(adapted, parts)}

    def row_adapter(self, x, linear):
        """scaling * B(A(dropout(x))) of a row-parallel projection: A holds this rank's input columns, so h = A x is
        a partial sum, reduced like the projection's own output (rank-wide); B is whole (its gradient, under
        sequence parallelism of this rank's tokens only, summed like a norm's)."""
        h = self.reduce(self.matmul(F.dropout(x, linear.lora_dropout, linear.training), linear.lora_A.weight))
        return self.matmul(h, self.replicated(linear.lora_B.weight)) * linear.lora_scaling

    def reduce(self, partial):
        """Sum partial results across the group: all-reduce, or reduce-scatter by token under sequence parallelism."""
        if self.size == 1:
            return partial
        if self.sequence_parallel:
            return ReduceScatterTokens.apply(partial.reshape(-1, partial.shape[-1]), self)
        return AllReduce.apply(partial, self.group)

    def replicated(self, param):
        """A parameter every rank holds whole (norms, row-parallel biases). Under sequence parallelism each rank
        sees only its tokens, so the gradient is summed over the group: identical on every rank, as without."""
        return CopyToGroup.apply(param, self.group) if self.sequence_parallel else param

    def shared_by_heads(self, param):
        """A parameter every rank applies to its own heads (Qwen3's per-head norms): each rank's gradient covers its
        heads only, so it is summed over the group."""
        return CopyToGroup.apply(param, self.group) if self.size > 1 else param

    def sum_over_heads(self, partial):
        """The group's sum of a per-rank partial over its heads (OLMo 2's mean of squares over a whole projection),
        every rank's gradient reaching every partial."""
        return AllReduce.apply(CopyToGroup.apply(partial, self.group), self.group) if self.size > 1 else partial

    def embedding(self, input_ids, weight, padding_idx=None):
        """Vocabulary-parallel lookup: this rank's rows, zeros for ids outside them, summed over the group.
        padding_idx: this rank's row that takes no gradient (the pad token's, where this rank holds it)."""
        if self.size == 1:
            return row_grad_embedding(input_ids, weight, padding_idx)
        local = input_ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        rows = row_grad_embedding(local.masked_fill(outside, 0), weight, padding_idx).masked_fill(outside[..., None], 0)
        return self.reduce(rows)

    def cross_entropy_sum(self, logits, labels, ignore_index):
        """Summed cross-entropy over the labels not equal to ignore_index, from vocabulary-sharded logits (never
        gathered: max, sum of exponentials and the target logit are reduced across the group instead)."""
        if self.size == 1:
            return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
        return VocabParallelCrossEntropy.apply(logits, labels, self, ignore_index).sum()

    # --- collectives -----------------------------------------------------------------------------------------
    def gather_tokens(self, x, pooled):
        """All-gather this rank's tokens (dim 0) from the group; into the reused pool buffer when pooled."""
        shape = (x.shape[0] * self.size, *x.shape[1:])
        out = (self.buffers.get("gather", shape, x.dtype, x.device) if pooled
               else torch.empty(shape, dtype=x.dtype, device=x.device))
        collectives.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def scatter_tokens(self, x):
        """Reduce-scatter over tokens (dim 0): the group's sum of this rank's share."""
        if x.shape[0] % self.size:
            raise ValueError(f"{x.shape[0]} tokens (micro_batch_size x seq_length) do not split over "
                             f"tensor_parallel_size={self.size} with sequence_parallel; make the product divisible.")
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        collectives.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out


class BufferPool:
    """Megatron's global memory buffer: one tensor per name and dtype, grown on demand and reused by every call,
    for data that lives only within one call (a gathered input used for one group of matmuls)."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, shape, dtype, device):
        count = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = self._buffers[key] = torch.empty(count, dtype=dtype, device=device)
        return buffer[:count].view(shape)


def all_reduce_copy(tensor, group):
    # A copy: never sum in place into a tensor autograd may still hand to another consumer. Contiguous: the
    # collective sums the ranks' memory element by element, and a gradient's layout may differ between ranks (an
    # expert's from the grouped GEMM transposed, from an empty row block not: tests/test_expert_parallel.py).
    tensor = tensor.clone(memory_format=torch.contiguous_format)
    collectives.all_reduce(tensor, group=group)
    return tensor


class CopyToGroup(torch.autograd.Function):
    """Identity forward; gradients summed over the group in backward (an input every rank uses whole)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group), None


class AllReduce(torch.autograd.Function):
    """Sum over the group forward; the gradient passes through (every rank's output is the same sum)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return parallel.scatter_tokens(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.parallel.gather_tokens(grad, pooled=False), None


class GatherTokens(torch.autograd.Function):
    """All-gather by token forward; the gradient reduce-scattered back to each rank's tokens."""

    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return parallel.gather_tokens(x, pooled=False)

    @staticmethod
    def backward(ctx, grad):
        return ctx.parallel.scatter_tokens(grad), None


class GatheredLinears(torch.autograd.Function):
    """Sequence-parallel column projections: gather the tokens once, apply every projection of the group.

    Backward needs the gathered input for the weight gradients: kept from forward (memory: the full tokens per
    layer and micro-batch in flight), or, with recompute_sequence_gather, gathered again into the pool buffer
    (one more all-gather per group, and only the pool's one buffer alive)."""

    @staticmethod
    def forward(ctx, parallel, x, *params):
        recompute = parallel.recompute_sequence_gather
        full = parallel.gather_tokens(x, pooled=recompute)
        weights, biases = params[0::2], params[1::2]
        outputs = tuple(F.linear(full, w, b) for w, b in zip(weights, biases))
        ctx.parallel, ctx.biases, ctx.full_shape = parallel, biases, full.shape
        # The input is kept for weight gradients only: a frozen group (LoRA's base) keeps none.
        ctx.trains = any(takes_weight_grads(w, b) for w, b in zip(weights, biases))
        ctx.save_for_backward(None if not ctx.trains else x if recompute else full)
        keep_params(ctx, *weights)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        parallel = ctx.parallel
        (saved,), weights = ctx.saved_tensors, ctx.params
        shape = ctx.full_shape
        # The input gradient over all tokens lives only until it is reduce-scattered: a pool buffer.
        grad_full = parallel.buffers.get("input_grad", (math.prod(shape[:-1]), shape[-1]), grads[0].dtype,
                                         grads[0].device)
        for index, (grad, weight) in enumerate(zip(grads, weights)):
            grad_full.addmm_(grad.reshape(-1, grad.shape[-1]), weight, beta=1 if index else 0)
        grad_x = parallel.scatter_tokens(grad_full.view(shape))
        if not ctx.trains:
            return None, grad_x, *([None] * 2 * len(weights))
        if parallel.weight_grads is not None and parallel.weight_grads.deferring:
            # W may run after other layers reused the pool buffer: keep the input, or gather it again then.
            queue_gathered_weight_grads(parallel, saved, grads, weights, ctx.biases)
            return None, grad_x, *([None] * 2 * len(weights))
        full = parallel.gather_tokens(saved, pooled=True) if parallel.recompute_sequence_gather else saved
        param_grads = []
        for grad, weight, bias in zip(grads, weights, ctx.biases):
            grad_of = {id(p): g for p, g in linear_weight_grads(full, grad, weight, bias)}
            param_grads += [grad_of.get(id(weight)), None if bias is None else grad_of.get(id(bias))]
        return None, grad_x, *param_grads


@torch.compiler.disable  # its backward decides at run time whether W is deferred (models/weight_grads.py)
def gathered_linears(parallel, x, *params):
    return GatheredLinears.apply(parallel, x, *params)


def queue_gathered_weight_grads(parallel, saved, grads, weights, biases):
    """Queue GatheredLinears' weight gradients (zero-bubble W); the tokens are gathered again at W when
    recompute_sequence_gather keeps only this rank's share (every rank of the group runs W at the same point)."""
    def params_and_grads():
        full = parallel.gather_tokens(saved, pooled=True) if parallel.recompute_sequence_gather else saved
        return [pair for grad, weight, bias in zip(grads, weights, biases)
                for pair in linear_weight_grads(full, grad, weight, bias)]
    parallel.weight_grads.add(params_and_grads)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy (0 where ignored) from logits split by vocabulary over the group."""

    @staticmethod
    def forward(ctx, logits, labels, parallel, ignore_index):
        group, vocab_local = parallel.group, logits.shape[-1]
        logits_max = logits.max(dim=-1).values
        collectives.all_reduce(logits_max, op=collectives.ReduceOp.MAX, group=group)
        shifted = logits - logits_max[:, None]
        local = labels - parallel.rank * vocab_local
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        target = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        collectives.all_reduce(target, group=group)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        collectives.all_reduce(sum_exp, group=group)
        valid = labels != ignore_index
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, outside, valid)
        return (sum_exp.log() - target) * valid

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside, valid = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(local.shape[0], device=local.device)
        grad_logits[rows, local] -= (~outside).to(grad_logits.dtype)
        grad_logits *= (grad * valid)[:, None]
        return grad_logits, None, None, None


def check_tensor_parallel_split(config, size, sequence_tokens=None):
    """Raise ValueError naming every count that tensor_parallel_size does not split evenly: heads, key/value heads,
    MLP columns, vocabulary rows and, under sequence parallelism, the tokens of a micro-batch."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be at least 1.")
    counts = {"num_attention_heads": config.num_attention_heads,
              "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
              "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    if getattr(config, "shared_expert_intermediate_size", None):  # Qwen2-MoE's shared expert splits as the MLP
        counts["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if sequence_tokens is not None:
        counts["micro_batch_size x seq_length"] = sequence_tokens
    bad = [f"{name}={count}" for name, count in counts.items() if count % size]
    if bad:
        hint = " (or set sequence_parallel=false)" if bad[-1].startswith("micro_batch_size") else ""
        raise ValueError(f"tensor_parallel_size={size} does not divide {', '.join(bad)}; choose a tensor_parallel_size "
                         f"that divides {'them' if len(bad) > 1 else 'it'}{hint}.")


NO_TENSOR_PARALLEL = TensorParallel()  # the plain single-process model
