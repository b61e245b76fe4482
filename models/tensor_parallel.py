"""Tensor parallelism inside a pipeline stage, in Megatron's layout, applied to the built layers of a stage from
outside: the plain parts (models/attention.py, models/mlp.py, ...) compute as on one device, and a plan per part
(PART_PLANS) turns them into this rank's share of the group's work.

A plan replaces each nn.Linear it names by one of this file's linear modules under the same name, holding this
rank's shard under the same parameter names, so a layer's state dict, its layer files and the post-init loader keep
their keys; the split dimension is marked on the parameter (`tensor_parallel_dim`, DeepSpeed's SHARDED_MARKER), which
checkpoints/layer_files.py slices by. Column-parallel projections (q, k, v, gate, up) split by output feature: each
rank computes its heads or MLP columns from the block's whole input. Row-parallel ones (o, down) split by input
feature: partial sums, added across the group at the block's output, the bias once after the sum. The embedding and
the LM head split by vocabulary row (vocabulary_rows, vocab_parallel_logits).

With `sequence_parallel` the residual stream between blocks holds 1/t of the tokens (batch and sequence flattened),
so norms, residual adds and the tensors sent between stages shrink by t: a block's input is all-gathered once, by
a forward pre-hook on the block (q, k and v share that one gather), and its output reduce-scattered by a forward hook.
The parameters every rank holds whole but applies to its own tokens (norms, the row-parallel biases, a mixture's
router, the latent projections of multi-head latent attention) have their gradients summed over the group by a hook
on the parameter: identical on every rank, as without sequence parallelism. A mixture's experts are summed so too,
but once per step, at its boundary (sum_gradients_at_step, run by the engine: engines/pipeline_engine.py), not in
every micro-batch's backward: their gradients are large and a rank's tokens few.

A block's projections of its gathered input (BlockInputLinear) add their input gradients into one buffer of the
pool (BufferPool), which the gather's backward reduce-scatters: the gradient over all tokens exists once per block.
With `recompute_sequence_gather` the gathered input goes to the pool too, and what backward keeps of it is this
rank's share; the whole is gathered again for the weight gradients, once per block, the pool knowing whose tokens it
holds.

Every linear layer of a stage is one of these modules, at tensor_parallel_size 1 too (StageLinear), and so are the
mixture's grouped projections and DeepSeek-V3's router through `matmul` and `grouped_linear`: the engine that splits
the backward for a zero-bubble schedule sets one queue, TensorParallel.weight_grads (models/weight_grads.py).

Written here rather than taken from a library because DeepSpeed's AutoTP does not compose with PipelineModule, and
DTensor parameters would bypass DeepSpeed's optimizer and gradient machinery.
"""
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import collectives
from models.architecture import LINEAR_ATTENTION, architecture_of, key_value_heads
from models.attention import Attention
from models.gated_attention import GatedAttention
from models.gated_mlp import GatedMLP
from models.gemma3 import Gemma3Attention, Gemma3RMSNorm
from models.gemma4 import Gemma4Attention, Gemma4DecoderLayer, Gemma4RMSNorm
from models.linear_attention import DeltaRuleCore, FusedGatedDeltaNet, GatedDeltaNet
from models.latent_attention import LatentAttention
from models.mlp import MLP
from models.moe import Experts, MoEBlock, RoutedTokens
from models.norms import ProjectionRMSNorm, RMSNorm
from models.sigmoid_router import SigmoidRouter
from models.weight_grads import (deferrable_grouped_linear, embedding as row_grad_embedding, grouped_linear,
                                 keep_params, linear as deferrable_linear, linear_weight_grads, parameter_or_view,
                                 takes_weight_grads)

# DeepSpeed's marker of a parameter split across the tensor-parallel group: its gradient-norm code counts such a
# parameter on every rank and a replicated one on tensor-parallel rank 0 only.
SHARDED_MARKER = "tensor_model_parallel"


class TensorParallel:
    """One rank's place in its tensor-parallel group, the collectives the plan's hooks and modules call, and the
    weight-gradient queue of a split backward (None: undivided)."""

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

    # --- the stage's matmuls ---------------------------------------------------------------------------------
    def matmul(self, x, weight, bias=None):
        """F.linear, its weight gradients deferred when the schedule splits the backward."""
        if self.weight_grads is None:
            return F.linear(x, weight, bias)
        return deferrable_linear(x, weight, bias, self.weight_grads)

    def grouped_linear(self, x, weight, bias, groups):
        """Each row block of x through its group's weight and bias (a mixture's experts: models/moe.py
        grouped_linear), the weight gradients deferred when the schedule splits the backward (but a LoRA-folded
        weight's, parameter_or_view)."""
        if self.weight_grads is None or not parameter_or_view(weight):
            return grouped_linear(x, weight, bias, groups)
        return deferrable_grouped_linear(x, weight, bias, groups, self.weight_grads)

    # --- a block's input and output ----------------------------------------------------------------------------
    def block_input(self, x):
        """A column-parallel block's input: every token (gathered under sequence parallelism, into the pool with
        recompute_sequence_gather), its gradient summed over the group."""
        if self.sequence_parallel:
            return gathered_block_input(x, self)
        return CopyToGroup.apply(x, self.group)

    def whole_input(self, x):
        """The input of a column-parallel projection whose input is kept for backward as it is (the chunked LM
        loss, MLA's latents): every token, gathered into a fresh tensor under sequence parallelism, its gradient
        summed over the group."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return GatherTokens.apply(x, self, None)
        return CopyToGroup.apply(x, self.group)

    def reduce(self, partial):
        """Sum partial results across the group: all-reduce, or reduce-scatter by token under sequence parallelism."""
        if self.size == 1:
            return partial
        if self.sequence_parallel:
            return ReduceScatterTokens.apply(partial.reshape(-1, partial.shape[-1]), self)
        return AllReduce.apply(partial, self.group)

    def column_linear(self, x, weight, bias=None):
        """x through this rank's output features; a block's gathered input through BlockInputLinear."""
        gather = getattr(x, "block_gather", None)
        if gather is None:
            return self.matmul(x, weight, bias)
        return block_input_linear(x, weight, bias, gather)

    # --- the vocabulary -----------------------------------------------------------------------------------------
    def embedding(self, input_ids, weight, padding_idx=None):
        """Vocabulary-parallel lookup: this rank's rows, zeros for ids outside them, summed over the group.
        padding_idx: this rank's row that takes no gradient (the pad token's, where this rank holds it)."""
        if self.size == 1:
            return row_grad_embedding(input_ids, weight, padding_idx)
        local = input_ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        rows = row_grad_embedding(local.masked_fill(outside, 0), weight, padding_idx).masked_fill(outside[..., None], 0)
        return self.reduce(rows)

    def logits(self, hidden, weight):
        """This rank's vocabulary share of the logits, from every token's hidden states."""
        return self.column_linear(self.block_input(hidden) if self.size > 1 else hidden, weight)

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
        if pooled:
            self.buffers.hold(x, out)
        return out

    def regather(self, source):
        """The pool's gather of `source` (this rank's tokens of a block input): the pool's buffer as it is when it
        still holds them, else gathered again into it."""
        held = self.buffers.holding(source)
        return held if held is not None else self.gather_tokens(source, pooled=True)

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
    for data that lives only within one call (a gathered block input used for one block's matmuls, the input
    gradient its projections add up). It remembers whose tokens its gather buffer holds, so a block's projections
    gather them again only once between them, and which block's input gradient its other buffer holds."""

    def __init__(self):
        self._buffers = {}
        self._held = None  # (the tokens gathered, their version, the gather buffer's view holding them)
        self._claimed = set()  # the names of the buffers a block's input gradient holds

    def get(self, name, shape, dtype, device):
        count = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = self._buffers[key] = torch.empty(count, dtype=dtype, device=device)
        return buffer[:count].view(shape)

    def claim(self, name, shape, dtype, device):
        """The buffer `name` for one user until release, or a fresh tensor while another holds it."""
        if name in self._claimed:
            return torch.empty(shape, dtype=dtype, device=device)
        self._claimed.add(name)
        return self.get(name, shape, dtype, device)

    def release(self, name, tensor):
        if tensor.data_ptr() == self._buffers.get((name, tensor.dtype, tensor.device), tensor[:0]).data_ptr():
            self._claimed.discard(name)

    def hold(self, source, gathered):
        self._held = (source, source._version, gathered)

    def holding(self, source):
        """The buffer's view holding source's gather, if it still holds it."""
        if self._held is not None and self._held[0] is source and self._held[1] == source._version:
            return self._held[2]
        return None


def all_reduce_copy(tensor, group):
    # A copy: never sum in place into a tensor autograd may still hand to another consumer. Contiguous: the
    # collective sums the ranks' memory element by element, and a gradient's layout may differ between ranks (as an
    # expert's did, from the grouped GEMM transposed and from an empty row block not, when experts were summed here).
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
    """All-gather by token forward (a block's input: BlockGather, into the pool with recompute_sequence_gather);
    the gradient reduce-scattered back to each rank's tokens, a block's with what its projections added up."""

    @staticmethod
    def forward(ctx, x, parallel, block):
        ctx.parallel, ctx.block = parallel, block
        ctx.set_materialize_grads(False)  # a block's projections hand their gradients over through the block
        return parallel.gather_tokens(x, pooled=block is not None and block.source is not None)

    @staticmethod
    def backward(ctx, grad):
        if ctx.block is not None:
            grad = ctx.block.take_input_grad(grad)
        if grad is None:
            return None, None, None
        scattered = ctx.parallel.scatter_tokens(grad)
        if ctx.block is not None:
            ctx.parallel.buffers.release("input_grad", grad)
        return scattered, None, None


class BlockGather:
    """The gather of one block's input under sequence parallelism: its tokens (kept to gather them again with
    recompute_sequence_gather, else None), and the input gradient its projections add up, in the pool's buffer."""

    def __init__(self, parallel, source=None):
        self.parallel, self.source = parallel, source
        self.input_grad = None

    def add_input_grad(self, grad, weight):
        """The input gradient grad @ weight of one projection added in."""
        if self.input_grad is None:
            shape = (grad.shape[0], weight.shape[1])
            self.input_grad = self.parallel.buffers.claim("input_grad", shape, grad.dtype, grad.device)
            self.input_grad.addmm_(grad, weight, beta=0)
        else:
            self.input_grad.addmm_(grad, weight)

    def take_input_grad(self, grad):
        """The block input's whole gradient: what its projections added up, and `grad` from any other reader."""
        total, self.input_grad = self.input_grad, None
        if total is None or grad is None:
            return total if grad is None else grad
        return total.add_(grad.reshape(total.shape))


@torch.compiler.disable  # the gathered tensor carries its BlockGather to the block's projections
def gathered_block_input(x, parallel):
    block = BlockGather(parallel, x if parallel.recompute_sequence_gather else None)
    full = GatherTokens.apply(x, parallel, block)
    full.block_gather = block
    return full


class BlockInputLinear(torch.autograd.Function):
    """A column-parallel projection of a block's gathered input: its input gradient added into the block's
    (BlockGather), its weight gradients from the input kept, or with recompute_sequence_gather from this rank's
    tokens gathered again, now or at W (every rank of the group runs W at the same point)."""

    @staticmethod
    def forward(ctx, x, weight, bias, block):
        ctx.block, ctx.trains = block, takes_weight_grads(weight, bias)
        # The input is kept for weight gradients only: a frozen projection (LoRA's base) keeps none.
        ctx.save_for_backward((x if block.source is None else block.source) if ctx.trains else None)
        keep_params(ctx, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (kept,), (weight, bias), block = ctx.saved_tensors, ctx.params, ctx.block
        parallel = block.parallel
        grad = grad.reshape(-1, grad.shape[-1])
        block.add_input_grad(grad, weight)
        if not ctx.trains:
            return None, None, None, None

        def weight_grads():
            full = kept if block.source is None else parallel.regather(kept)
            return linear_weight_grads(full, grad, weight, bias)
        if parallel.weight_grads is not None and parallel.weight_grads.deferring:
            # W may run after other layers reused the pool's buffer: the input kept, or gathered again then.
            parallel.weight_grads.add(weight_grads)
            return None, None, None, None
        grad_of = {id(p): g for p, g in weight_grads()}
        return None, grad_of.get(id(weight)), None if bias is None else grad_of.get(id(bias)), None


@torch.compiler.disable  # its backward decides at run time whether W is deferred (models/weight_grads.py)
def block_input_linear(x, weight, bias, block):
    return BlockInputLinear.apply(x, weight, bias, block)


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


# --- the stage's linear layers ---------------------------------------------------------------------------------

class StageLinear(nn.Linear):
    """A linear layer every rank of the group holds whole."""

    def forward(self, x):
        return self.parallel.matmul(x, self.weight, self.bias)


class ColumnParallelLinear(StageLinear):
    """This rank's output features of a projection of the block's whole input (a LoRA adapter's A, held whole,
    reads that input too)."""

    def forward(self, x):
        return self.parallel.column_linear(x, self.weight, self.bias)


class RowParallelLinear(StageLinear):
    """A projection of this rank's input features: partial sums, which the block's output hook adds over the group,
    then adds the bias (held whole) once."""

    def forward(self, x):
        return self.parallel.matmul(x, self.weight)


def stage_linear(linear, cls, parallel, split_dim=None, check=None, device=None, blocks=None):
    """`linear` as a `cls` module holding this rank's shard along split_dim (None: whole) under the same parameter
    names. A linear built on the meta device gets a fresh shard initialised as nn.Linear initialises one, on
    `device`; a real one, its own rows or columns (of each of `blocks`: shard_of). check: (count, what) that tensor
    parallelism must divide."""
    if check is not None:
        parallel.local(*check)
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.parallel = parallel
    if split_dim is None or parallel.size == 1:
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        return module
    weight_shard = list(linear.weight.shape)
    weight_shard[split_dim] //= parallel.size
    module.out_features, module.in_features = weight_shard
    bias_split = split_dim == 0 and linear.bias is not None
    if linear.weight.is_meta and device != "meta":
        module.weight = nn.Parameter(torch.empty(weight_shard, dtype=linear.weight.dtype, device=device))
        module.bias = None if linear.bias is None else nn.Parameter(torch.empty(
            module.out_features if bias_split else linear.bias.shape[0], dtype=linear.bias.dtype, device=device))
        nn.Linear.reset_parameters(module)
    else:
        module.weight = nn.Parameter(own_shard(linear.weight, split_dim, parallel, blocks))
        module.bias = None if linear.bias is None else nn.Parameter(
            own_shard(linear.bias, 0, parallel) if bias_split else linear.bias.detach().clone())
    mark_sharded(module.weight, split_dim, blocks)
    if bias_split:
        mark_sharded(module.bias, 0)
    return module


def own_shard(tensor, dim, parallel, blocks=None):
    return shard_of(tensor.detach(), dim, parallel.rank, parallel.size, blocks).clone()


def shard_of(tensor, dim, rank, size, blocks=None):
    """Rank `rank`'s shard of a whole tensor split along dim over `size` ranks: its chunk, or with blocks (the whole
    sizes of consecutive blocks along dim that split apart: the linear attention's q, k and v channels) its chunk of
    each block, in order."""
    if blocks is None:
        return tensor.chunk(size, dim)[rank]
    return torch.cat([block.chunk(size, dim)[rank] for block in tensor.split(list(blocks), dim)], dim)


def joined_shards(shards, dim, blocks=None):
    """shard_of's inverse: the whole tensor of every rank's shard, in rank order."""
    if blocks is None:
        return torch.cat(shards, dim)
    pieces = [shard.split([block // len(shards) for block in blocks], dim) for shard in shards]
    return torch.cat([pieces[rank][block] for block in range(len(blocks)) for rank in range(len(shards))], dim)


def mark_sharded(param, dim, blocks=None):
    """Record on a parameter the dimension it is split along over the group (and the blocks along it that split
    apart: shard_of)."""
    setattr(param, SHARDED_MARKER, True)
    param.tensor_parallel_dim = dim
    if blocks is not None:
        param.tensor_parallel_blocks = tuple(blocks)


def sum_gradient_over_group(module, name):
    """Parameter `name` of `module`, whose gradient on each rank covers only that rank's share (of the tokens or the
    heads), takes the group's sum, identical on every rank: from a hook that hook_gradient_sums puts on it once the
    layer's parameters are made (a parameter made from the meta device is a new tensor)."""
    module.__dict__.setdefault("gradients_summed_over_group", set()).add(name)


def replicated(module, parallel):
    """A module every rank holds whole and applies to its own tokens: under sequence parallelism its gradients are
    summed over the group."""
    if parallel.sequence_parallel:
        for sub in module.modules():
            for name, param in sub.named_parameters(recurse=False):
                sum_gradient_over_group(sub, name)


def sum_gradients_at_step(module, parallel):
    """A module every rank holds whole and applies to its own tokens, whose gradients are summed over the group once
    per step rather than in each micro-batch's backward (sum_step_gradients, at the step's boundary): a mixture's
    experts, whose gradients dwarf a rank's share of the activations (a Qwen3-30B-A3B layer's are ~1.2 GB against
    the few MB of its tokens). Each rank accumulates its own tokens' gradient over the micro-batches; the sum over
    the group is linear, so summing the accumulated gradients once gives every rank the gradient that summing each
    micro-batch's would, in micro-batches fewer collectives."""
    if parallel.sequence_parallel:
        module.gradients_summed_at_step = True


def step_summed_parameters(module):
    """The trainable parameters whose gradients sum_gradients_at_step left to the step, in module order."""
    params = {}
    for sub in module.modules():
        if getattr(sub, "gradients_summed_at_step", False):
            params.update((id(p), p) for p in sub.parameters() if p.requires_grad)
    return list(params.values())


def sum_step_gradients(module, parallel, accumulated_gradient):
    """At a step's boundary, before the data-parallel reduction and clipping: each gradient left to the step
    summed over the group in place, accumulated_gradient(param) naming the tensor that holds it (.grad, or the
    bf16 optimizer's fp32 one). Every rank of the group holds the same modules, so the collectives pair up."""
    for param in step_summed_parameters(module):
        grad = accumulated_gradient(param)
        if grad is None:
            raise RuntimeError(f"an expert parameter of shape {tuple(param.shape)} has no gradient at the step: its "
                               f"tensor-parallel peers would wait for its sum; every sparse layer's experts must "
                               f"take part in the backward.")
        collectives.all_reduce(grad, group=parallel.group)


def hook_gradient_sums(module, parallel):
    """The hooks summing over the group the gradients sum_gradient_over_group named, each parameter's once. A
    gradient a split backward leaves to W reaches the hook as None in B, and as itself at W."""
    def summed(grad):
        return grad if grad is None else all_reduce_copy(grad, parallel.group)
    for sub in module.modules():
        for name in getattr(sub, "gradients_summed_over_group", ()):
            param = getattr(sub, name)
            if not getattr(param, "gradient_summed_over_group", False):
                param.register_hook(summed)
                param.gradient_summed_over_group = True


def gather_input(block, parallel):
    """The block's input (its first argument) whole before its column-parallel projections: once per block."""
    block.register_forward_pre_hook(lambda module, args: (parallel.block_input(args[0]), *args[1:]))


def reduce_output(block, row, parallel):
    """The block's output (its row-parallel projection's partial sums) added over the group, then the projection's
    bias once (whole on every rank, added to its own tokens under sequence parallelism). A block returning a tuple
    (Gemma 4's attention: its output, then its keys and values) has its first element reduced, the rest as they are."""
    def reduced(module, args, output):
        partial, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
        out = parallel.reduce(partial)
        out = out if row.bias is None else out + row.bias
        return out if rest is None else (out, *rest)
    block.register_forward_hook(reduced)
    if row.bias is not None and parallel.sequence_parallel:
        sum_gradient_over_group(row, "bias")


# --- the plans of the parts ------------------------------------------------------------------------------------

def split_block(block, columns, row, parallel, device, check):
    """A block of column-parallel projections `columns` reading its gathered input and the row-parallel `row`
    whose output is reduced."""
    for name in columns:
        setattr(block, name, stage_linear(getattr(block, name), ColumnParallelLinear, parallel, 0, check, device))
    setattr(block, row, stage_linear(getattr(block, row), RowParallelLinear, parallel, 1, check, device))
    gather_input(block, parallel)
    reduce_output(block, getattr(block, row), parallel)


def attention_plan(attention, parallel, device):
    """Each rank computes whole heads: its query heads and the key/value heads they attend with (q, k, v split by
    heads, o by its input). Qwen3's per-head norms are whole, their gradient (of each rank's heads) summed over the
    group; OLMo 2's whole-projection norms split with the heads, their mean of squares summed over the group;
    GPT-OSS's sinks split with the heads."""
    parallel.local(attention.num_kv_heads, "num_key_value_heads")
    split_block(attention, ("q_proj", "k_proj", "v_proj"), "o_proj", parallel, device,
                (attention.num_heads, "num_attention_heads"))
    if attention.qk_norm == "head":
        for norm in (attention.q_norm, attention.k_norm):
            sum_gradient_over_group(norm, "weight")
    elif attention.qk_norm == "projection":
        attention.q_norm = ShardedProjectionRMSNorm.of(attention.q_norm, parallel, device)
        attention.k_norm = ShardedProjectionRMSNorm.of(attention.k_norm, parallel, device)
    if hasattr(attention, "sinks"):
        attention.sinks = shard_parameter(attention.sinks, parallel, device)


def latent_attention_plan(attention, parallel, device):
    """The heads split (q_b_proj or q_proj, kv_b_proj by output rows, o_proj by input columns); the latent
    projections and their norms whole on every rank: they are narrow (DeepSeek-V3's kv_a_proj_with_mqa is 576 x
    7168, q_a_proj 1536 x 7168: 16 MB of 1.3 GB per layer in bf16), and splitting them would put a collective inside
    each latent norm. Each rank computes them on its own tokens (its share under sequence parallelism), then the
    latents, not the hidden states, cross the group (latent_tokens): kv_lora_rank + qk_rope_head_dim (+ q_lora_rank)
    features a token, 2,112 against a hidden size of 7,168 for DeepSeek-V3."""
    heads = (attention.kv_b_proj.out_features // (attention.nope + attention.v_dim), "num_attention_heads")
    column = functools.partial(stage_linear, cls=ColumnParallelLinear, parallel=parallel, split_dim=0, check=heads,
                               device=device)
    if attention.q_rank is None:
        attention.q_proj = column(attention.q_proj)
        gather_input(attention.q_proj, parallel)
    else:
        attention.q_a_proj = stage_linear(attention.q_a_proj, StageLinear, parallel)
        attention.q_b_proj = column(attention.q_b_proj)
        replicated(attention.q_a_proj, parallel)
        replicated(attention.q_a_layernorm, parallel)
    attention.kv_a_proj_with_mqa = stage_linear(attention.kv_a_proj_with_mqa, StageLinear, parallel)
    replicated(attention.kv_a_proj_with_mqa, parallel)
    replicated(attention.kv_a_layernorm, parallel)
    attention.kv_b_proj = column(attention.kv_b_proj)
    attention.latent_tokens.register_forward_hook(lambda module, args, latents: parallel.whole_input(latents))
    attention.o_proj = stage_linear(attention.o_proj, RowParallelLinear, parallel, 1, heads, device)
    reduce_output(attention, attention.o_proj, parallel)


def mlp_plan(mlp, parallel, device, what="intermediate_size"):
    """gate and up split by columns, down by its input."""
    split_block(mlp, ("gate_proj", "up_proj"), "down_proj", parallel, device, (mlp.gate_proj.out_features, what))


def moe_plan(block, parallel, device):
    """Each rank holds every expert whole and routes its own tokens: the sequence-parallel share of the tokens
    (each rank computes 1/t of the block, no collective), or without sequence parallelism all of them, as every
    rank computes a norm. The router's gradients are then summed over the group as a norm's, in each backward; the
    experts', far larger, once per step (sum_gradients_at_step); the shared expert splits like the dense MLP."""
    moe = block.moe
    if not moe.sigmoid_routing:
        setattr(block, moe.router_name, stage_linear(getattr(block, moe.router_name), StageLinear, parallel))
    shared_expert = getattr(block, moe.shared_expert_name, None)
    if shared_expert is not None:
        mlp_plan(shared_expert, parallel, device, "the shared expert's width")
    if hasattr(block, "shared_expert_gate"):
        block.shared_expert_gate = stage_linear(block.shared_expert_gate, StageLinear, parallel)
    for name, module in block.named_children():
        if name == "experts":
            sum_gradients_at_step(module, parallel)
        elif name != moe.shared_expert_name:
            replicated(module, parallel)
    if parallel.sequence_parallel:
        block.register_forward_pre_hook(lambda module, args: (args[0], TokenShare(args[1], parallel)))


def gemma4_moe_plan(layer, parallel, device):
    """Gemma 4's MoE block beside its dense MLP (mlp_plan splits that), as moe_plan splits the other families':
    every rank holds the router and every expert whole and routes its own tokens (its sequence-parallel share, or
    all of them), with no collective. The router (its projection, scale and per_expert_scale) takes the group's
    gradient sum as a norm does, in each backward; the experts once per step (sum_gradients_at_step). The block's
    three norms are the layer's own (LAYER_NORMS)."""
    if not layer.moe:
        return
    layer.router.proj = stage_linear(layer.router.proj, StageLinear, parallel)
    replicated(layer.router, parallel)
    sum_gradients_at_step(layer.experts, parallel)
    if parallel.sequence_parallel:  # the tokens whose routing choices it counts (models/decoder.py Gemma4Decoder)
        layer.routed = functools.partial(TokenShare, parallel=parallel)


def gemma_attention_plan(attention, parallel, device):
    """Gemma 3's and Gemma 4's attention split by heads as attention_plan splits grouped-query attention: q, k and v
    by heads, o by its input, the per-head q and k norms whole, their gradients summed over the group (v's has no
    weight). Each layer splits its own head count: Gemma 4's full layers their num_global_key_value_heads and
    global_head_dim, a full layer with attention_k_eq_v its k_proj only (its values are its keys). A layer reusing
    another's keys and values has q and o only: the keys and values it is given are this rank's heads, computed by
    its source layer's share on this rank (on its stage, or sent in the stage tuple by the same tensor-parallel
    rank of the source's stage)."""
    columns = [name for name in ("q_proj", "k_proj", "v_proj") if hasattr(attention, name)]
    if hasattr(attention, "k_proj"):
        parallel.local(attention.k_proj.out_features // attention.head_dim, "num_key_value_heads")
    split_block(attention, columns, "o_proj", parallel, device,
                (attention.q_proj.out_features // attention.head_dim, "num_attention_heads"))
    for name in ("q_norm", "k_norm"):
        if hasattr(attention, name):
            sum_gradient_over_group(getattr(attention, name), "weight")


def per_layer_embedding_plan(layer, parallel, device):
    """Gemma 4's per-layer embeddings (PLE) whole on every rank and applied to its own tokens (its sequence-parallel
    share, or all of them): a decoder layer's share of the per-layer table is one layer's columns (256 features in
    Gemma 4 E2B), and a token's per-layer input reads only its own id and embedding, so each rank computes its
    tokens' exactly with no collective, where splitting the columns would add a gather in every layer. Their
    gradients are summed over the group as a norm's."""
    if not layer.per_layer_width:
        return
    per_layer = layer.per_layer_inputs
    for parent, name in ((layer, "per_layer_input_gate"), (layer, "per_layer_projection"),
                         (per_layer, "per_layer_model_projection")):
        setattr(parent, name, stage_linear(getattr(parent, name), StageLinear, parallel))
    for part in (layer.per_layer_input_gate, layer.per_layer_projection, per_layer):
        replicated(part, parallel)
    if parallel.sequence_parallel:  # the ids of this rank's tokens, the embedded tokens being its share already
        per_layer.register_forward_pre_hook(
            lambda module, args: (args[0].reshape(-1).chunk(parallel.size)[parallel.rank], *args[1:]))


def gated_attention_plan(attention, parallel, device):
    """The hybrids' full attention split as attention_plan splits grouped-query attention: q_proj's rows are each
    head's [query | gate], so a split by heads keeps each head's gate with its query; the per-head (1 + w) norms
    whole, their gradients summed over the group."""
    heads = attention.q_proj.out_features // (2 * attention.head_dim)
    parallel.local(attention.k_proj.out_features // attention.head_dim, "num_key_value_heads")
    split_block(attention, ("q_proj", "k_proj", "v_proj"), "o_proj", parallel, device, (heads, "num_attention_heads"))
    for norm in (attention.q_norm, attention.k_norm):
        sum_gradient_over_group(norm, "weight")


def linear_attention_plan(mixer, parallel, device):
    """Gated DeltaNet split by heads: each rank computes its key heads and the value heads they serve (value heads
    j * r .. j * r + r - 1 with key head j), the recurrence of each head being its own. in_proj_qkv and the
    convolution's channels are cut per block (q, k, v: shard_of's blocks), in_proj_z, in_proj_b, in_proj_a, A_log and
    dt_bias by value heads, Qwen3-Next's in_proj_qkvz and in_proj_ba (grouped by key head) by key heads; out_proj by
    its input; the gated norm's per-head weight whole, its gradient summed over the group."""
    heads = (mixer.num_key_heads, "linear_num_key_heads")
    parallel.local(mixer.num_value_heads, "linear_num_value_heads")
    qkv = mixer.conv1d.weight.tensor_parallel_blocks
    column = functools.partial(stage_linear, cls=ColumnParallelLinear, parallel=parallel, split_dim=0, check=heads,
                               device=device)
    if hasattr(mixer, "in_proj_qkvz"):
        mixer.in_proj_qkvz, mixer.in_proj_ba = column(mixer.in_proj_qkvz), column(mixer.in_proj_ba)
    else:
        mixer.in_proj_qkv = column(mixer.in_proj_qkv, blocks=qkv)
        mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a = (column(mixer.in_proj_z), column(mixer.in_proj_b),
                                                              column(mixer.in_proj_a))
    mixer.out_proj = stage_linear(mixer.out_proj, RowParallelLinear, parallel, 1, heads, device)
    # left on the meta device where the layer was built there: materialize initialises them as their modules do
    mixer.conv1d.weight = shard_parameter(mixer.conv1d.weight, parallel, "meta", blocks=qkv)
    mixer.A_log, mixer.dt_bias = (shard_parameter(mixer.A_log, parallel, "meta"),
                                  shard_parameter(mixer.dt_bias, parallel, "meta"))
    sum_gradient_over_group(mixer.norm, "weight")
    mixer.num_key_heads, mixer.num_value_heads = mixer.num_key_heads // parallel.size, \
        mixer.num_value_heads // parallel.size
    mixer.key_dim, mixer.value_dim = mixer.key_dim // parallel.size, mixer.value_dim // parallel.size
    mixer.core = DeltaRuleCore(mixer.num_key_heads, mixer.num_value_heads, mixer.key_head_dim,
                               mixer.value_head_dim)  # the convolution and the rule over this rank's heads
    gather_input(mixer, parallel)
    reduce_output(mixer, mixer.out_proj, parallel)


PART_PLANS = {Attention: attention_plan, LatentAttention: latent_attention_plan, MLP: mlp_plan, MoEBlock: moe_plan,
              GatedAttention: gated_attention_plan, GatedDeltaNet: linear_attention_plan,
              FusedGatedDeltaNet: linear_attention_plan, Gemma3Attention: gemma_attention_plan,
              Gemma4Attention: gemma_attention_plan, GatedMLP: mlp_plan}
# The plans of the parts a decoder layer holds directly rather than in a submodule: {the layer's kind: its plans}.
LAYER_PLANS = {Gemma4DecoderLayer: (per_layer_embedding_plan, gemma4_moe_plan)}
# The norms a decoder layer applies to its residual stream, on every rank to its own tokens.
LAYER_NORMS = (RMSNorm, Gemma3RMSNorm, Gemma4RMSNorm)


def parallelize(layer, parallel, device=None):
    """A built decoder layer (or one of its parts) as this rank's share of it, its parts by PART_PLANS, every
    linear layer a stage linear. device: where the shards of a layer built on the meta device are made (None:
    torch's default)."""
    if parallel.size > 1:
        for part in [layer] if type(layer) in PART_PLANS else planned_parts(layer):
            PART_PLANS[type(part)](part, parallel, device)
        for kind, plans in LAYER_PLANS.items():
            if isinstance(layer, kind):
                for plan in plans:
                    plan(layer, parallel, device)
    for parent in list(layer.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                if parallel.size > 1:
                    raise ValueError(f"tensor parallelism has no plan for {type(parent).__name__}.{name} of "
                                     f"{type(layer).__name__}; add one to PART_PLANS (models/tensor_parallel.py).")
                setattr(parent, name, stage_linear(child, StageLinear, parallel))
            elif isinstance(child, Experts):
                child.grouped_linear = parallel.grouped_linear
            elif isinstance(child, SigmoidRouter):
                child.linear = parallel.matmul
    for child in layer.children():
        if type(child) in LAYER_NORMS:  # a decoder layer's norms, applied to this rank's tokens
            replicated(child, parallel)
    if device != "meta":
        materialize(layer, device)
    hook_gradient_sums(layer, parallel)


def materialize(module, device=None):
    """Every parameter and buffer a plan left on the meta device made on `device` (None: torch's default) and
    initialised by its module's reset_parameters (a module without one is refused: its values would be whatever
    memory held), keeping the attributes set on it (markers)."""
    device = device if device is not None else torch.get_default_device()
    for sub in module.modules():
        tensors = {**sub._parameters, **sub._buffers}
        if not any(t is not None and t.is_meta for t in tensors.values()):
            continue
        if not hasattr(sub, "reset_parameters"):
            raise TypeError(f"{type(sub).__name__} has no reset_parameters to initialise it after a build on the meta "
                            f"device.")
        for name, param in sub._parameters.items():
            if param is not None and param.is_meta:
                made = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                made.__dict__.update(param.__dict__)
                sub._parameters[name] = made
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device=device)
        sub.reset_parameters()


def planned_parts(module):
    """The outermost submodules of `module` that PART_PLANS has a plan for (a plan takes care of what it holds)."""
    for child in module.children():
        if type(child) in PART_PLANS:
            yield child
        else:
            yield from planned_parts(child)


def parallelize_adapters(layer, parallel):
    """A decoder layer's LoRA adapters (models/lora.py) as stage linears split like their projection: on a
    column-parallel projection A is whole and reads the block's whole input, its gradient (of this rank's rows of
    B only) summed over the group, and B holds this rank's output rows; on a row-parallel one A holds this rank's
    input columns, and B is whole, its partial output summed with the projection's and its gradient over the
    group; on a projection every rank holds whole both are whole (replicated, as the projection). The experts'
    adapters are replicated as the experts are."""
    done = {}
    for projection in [m for m in layer.modules() if isinstance(m, StageLinear) and hasattr(m, "lora_A")]:
        for factor in ("lora_A", "lora_B"):
            current = getattr(projection, factor)
            if id(current) not in done:  # Phi-3's fused parts share one A
                column_a = factor == "lora_A" and isinstance(projection, ColumnParallelLinear)
                done[id(current)] = stage_linear(current, ColumnParallelLinear if column_a else StageLinear, parallel)
                summed = (column_a or (factor == "lora_B" and isinstance(projection, RowParallelLinear)))
                if parallel.size > 1 and summed:
                    sum_gradient_over_group(done[id(current)], "weight")
                elif type(projection) is StageLinear:
                    replicated(done[id(current)], parallel)
            setattr(projection, factor, done[id(current)])
    for experts in [m for m in layer.modules() if isinstance(m, Experts) and hasattr(m, "lora_A")]:
        sum_gradients_at_step(experts, parallel)
    hook_gradient_sums(layer, parallel)


class ShardedProjectionRMSNorm(ProjectionRMSNorm):
    """OLMo 2's whole-projection q/k norm of a rank's heads: its weight split with them, the mean of squares over
    the whole projection summed over the group (every rank's gradient reaching every partial sum)."""

    @classmethod
    def of(cls, norm, parallel, device):
        sharded = cls.__new__(cls)
        nn.Module.__init__(sharded)
        sharded.eps, sharded.scale_in_fp32, sharded.whole_width = norm.eps, norm.scale_in_fp32, norm.whole_width
        sharded.parallel = parallel
        sharded.weight = shard_parameter(norm.weight, parallel, device, fill=1.0)
        return sharded

    def square_sum(self, x32):
        partial = x32.square().sum(-1, keepdim=True)
        return AllReduce.apply(CopyToGroup.apply(partial, self.parallel.group), self.parallel.group)


def shard_parameter(param, parallel, device, fill=0.0, blocks=None):
    """This rank's rows (dim 0) of a parameter split with the heads (of each of `blocks`: shard_of); a meta one's
    made on `device`, filled (a module's reset_parameters initialises it after materialize)."""
    rows = param.shape[0] // parallel.size
    if param.is_meta and device != "meta":
        shard = nn.Parameter(torch.full((rows, *param.shape[1:]), fill, dtype=param.dtype, device=device))
    else:
        shard = nn.Parameter(own_shard(param, 0, parallel, blocks) if not param.is_meta else
                             torch.empty((rows, *param.shape[1:]), dtype=param.dtype, device="meta"))
    shard.__dict__.update({k: v for k, v in param.__dict__.items() if not k.startswith("_")})  # its markers
    mark_sharded(shard, 0, blocks)
    return shard


class TokenShare(RoutedTokens):
    """This rank's share of a block's routed tokens under sequence parallelism; a per-sequence sum is the whole
    group's (and, under context parallelism too, the context group's: the tokens' whole_rows)."""

    def __init__(self, tokens, parallel):
        real, rows = (t.chunk(parallel.size)[parallel.rank] for t in (tokens.real, tokens.rows))
        super().__init__(real, rows, tokens.num_rows, tokens.whole_rows)
        self.group = parallel.group

    def sum_by_row(self, per_token):
        return AllReduce.apply(super().sum_by_row(per_token), self.group)


def vocabulary_rows(config, parallel):
    """(this rank's vocabulary rows, its row of the pad token or None) of the embedding and LM head."""
    rows = parallel.local(config.vocab_size, "vocab_size")
    pad = getattr(config, "pad_token_id", None)
    mine = pad is not None and parallel.rank * rows <= pad < (parallel.rank + 1) * rows
    return rows, pad - parallel.rank * rows if mine else None


def key_value_head_counts(config):
    """{the config's name of a key/value head count: the count}, from models/architecture.py's per-layer counts:
    Gemma 4's full layers with attention_k_eq_v have num_global_key_value_heads, every other layer (and family)
    num_key_value_heads."""
    counts = key_value_heads(config)
    if config.model_type != "gemma4_text":
        return {"num_key_value_heads": counts[0]}
    global_heads = getattr(config, "attention_k_eq_v", False)
    return {"num_global_key_value_heads" if global_heads and kind == "full_attention" else "num_key_value_heads":
            count for kind, count in zip(config.layer_types, counts)}


def check_tensor_parallel_split(config, size, sequence_tokens=None):
    """Raise ValueError naming every count that tensor_parallel_size does not split evenly: heads, key/value heads,
    MLP columns, vocabulary rows and, under sequence parallelism, the tokens of a micro-batch."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be at least 1.")
    if size == 1:  # one rank splits nothing (and Gemma 4's per-layer key/value head counts need not be read)
        return
    counts = {"num_attention_heads": config.num_attention_heads, **key_value_head_counts(config),
              # Qwen3.5-MoE's config has none: every layer is sparse
              "intermediate_size": getattr(config, "intermediate_size", None) or 0, "vocab_size": config.vocab_size}
    if LINEAR_ATTENTION in architecture_of(config).mixer_layers:  # Gated DeltaNet splits by key and value heads
        counts.update(linear_num_key_heads=config.linear_num_key_heads,
                      linear_num_value_heads=config.linear_num_value_heads)
    if getattr(config, "shared_expert_intermediate_size", None):  # Qwen2-MoE's shared expert splits as the MLP
        counts["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if sequence_tokens is not None:
        counts["micro_batch_size x seq_length"] = sequence_tokens
    bad = [f"{name}={count}" for name, count in counts.items() if count % size]
    if bad:
        hint = " (or set sequence_parallel=false)" if bad[-1].startswith("micro_batch_size") else ""
        raise ValueError(f"tensor_parallel_size={size} does not divide {', '.join(bad)}; choose a tensor_parallel_size "
                         f"that divides {'them' if len(bad) > 1 else 'it'}{hint}.")


NO_TENSOR_PARALLEL = TensorParallel()  # the plain single-process computation
