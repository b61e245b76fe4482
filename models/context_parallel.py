"""Context parallelism inside a pipeline stage: every rank of a context group holds 1/c of each sequence's tokens
through the whole stage, and attention sees the whole sequence.

The form Llama 3 was trained with (all-gather context parallelism, not a ring): each attention layer all-gathers
the keys and values of the group's tokens and attends this rank's queries over them; backward reduce-scatters the
key/value gradients back to the ranks that own the tokens. It splits any head count (Ulysses' all-to-all needs the
query and key/value heads to divide by tensor x context size, which 8 key/value heads stop at 8), and under
grouped-query attention the gathered keys and values are small next to the queries and the MLP's activations.

Tokens are split zig-zag: the sequence is cut into 2c chunks and rank r keeps chunks r and 2c-1-r, so under the
causal mask every rank attends over the same number of keys ((2c+1)/(2c) of a sequence's worth of chunks), and
each local half attends only over the keys up to its own chunk. Each token keeps its document id and position
(they travel with it), so rotary embeddings and the per-document causal mask are those of the whole sequence.

Applied from outside to a built stage: each layer's attention core (models/attention.py AttentionCore; Gemma 3's
and Gemma 4's own attention hold one too, with their scales) is wrapped by ContextParallelCore, and the stage's
masks are ContextParallelAttentionInputs' (one per local half and window). A sliding window's half attends only
the keys within its queries' reach, from window - 1 before its chunk, on whichever ranks' chunks they sit. Gemma
4's reusing layers are handed their source's keys and values of this rank's tokens and gather them as their own.

Multi-head latent attention hands its core the keys' latent and rotary part with their expansion (models/latent_attention.py),
so the group gathers those (576 features a token for DeepSeek-V3), not the expanded keys and values (num_heads x 320
= 40,960), and each rank expands the whole sequence's latent: the latent's gradient is reduce-scattered back, the
expansion's weight gradient of each rank's queries summed over the group with the data-parallel ones.

Linear attention (Gated DeltaNet, models/linear_attention.py) runs along the sequence in order, its convolution
and recurrent state carried from token to token, so it is made exact differently: a head all-to-all (Megatron's
scheme for Gated DeltaNet, Ulysses' for attention). Each linear-attention layer's core
(models/linear_attention.py DeltaRuleCore: the convolution and the delta rule) is wrapped by
ContextParallelDeltaRuleCore: the q|k|v projections, betas and decays of this rank's tokens go to the rank owning
their heads (rank j: key heads and value heads j/c of each), which puts the whole sequence back in order and runs
the convolution and the rule over all of it for its heads, the document ids gathered so both restart at every
document boundary, including one that falls on a rank boundary; the outputs go back to the ranks owning the tokens.
Key and value heads must divide by the group's size. Everything before and after the core (projections, the gated
norm, the output projection) is per token and runs on this rank's tokens.

With size 1 every call is the plain computation and no collective runs.
"""
import torch
import torch.distributed as dist
from torch import nn

import collectives
from models.attention import StageAttentionInputs, additive_mask
from models.tensor_parallel import AllReduce


class ContextParallel:
    """One rank's place in its context group: which tokens it holds and the collectives attention calls. A collated
    micro-batch is split by models/loss.py split_micro_batch, which shifts its labels first."""

    def __init__(self, size=1, rank=0, group=None):
        self.size, self.rank, self.group = size, rank, group
        self._orders = {}  # {chunk length: (gathered -> global order, global -> gathered order)}

    def replica(self, data_rank, data_size):
        """(this rank's replica, replicas) from its coordinate on DeepSpeed's data axis, which holds the context
        ranks too (build_context_parallel): the data loader's rank and size, shared by the context group."""
        return data_rank // self.size, data_size // self.size

    # --- which tokens this rank holds --------------------------------------------------------------------------
    def global_chunks(self):
        """The global chunk index of this rank's two halves (of 2 x size chunks)."""
        return self.rank, 2 * self.size - 1 - self.rank

    def local_tokens(self, x, dim=1):
        """This rank's tokens of a whole sequence: chunks rank and 2c-1-rank of `dim`, concatenated."""
        if self.size == 1:
            return x
        chunks = x.chunk(2 * self.size, dim=dim)
        return torch.cat([chunks[index] for index in self.global_chunks()], dim=dim)

    def of_whole_sequences(self, function, *tensors):
        """function(*whole sequences) at this rank's tokens: for a per-token value read off another token (each
        position's next token id, its label after next), which may sit on another rank. tensors: this rank's
        (batch, local tokens) integers, all-gathered (no gradient; B x S of each, small beside one layer's gathered
        keys), so function runs on the whole sequences as on one device, and this rank's tokens of its result are
        kept."""
        if self.size == 1:
            return function(*tensors)
        return self.local_tokens(function(*(self.gather_sequence(t, dim=1) for t in tensors)))

    # --- attention --------------------------------------------------------------------------------------------
    def gather_keys_values(self, *tensors):
        """Keys and values (batch, heads, local tokens, features), or what they are expanded from, of the whole
        sequence in global order; one all-gather for all, its backward a reduce-scatter of their gradients."""
        if self.size == 1:
            return tensors
        gathered = GatherSequence.apply(torch.cat(tensors, dim=-1), self, 2)
        return gathered.split([t.shape[-1] for t in tensors], dim=-1)

    def attention_masks(self, document_ids, window=None):
        """Per local half, the boolean (batch, 1, chunk, keys) mask of the keys its queries may attend: causal by
        global position, within the query's document and within `window` positions of it (a sliding window; None:
        unlimited); a padding query sees only itself (no empty row). The keys are those up to the chunk's end, and
        under a window only those from the window's reach of the chunk's first query (window - 1 keys before it,
        on the chunks of whichever ranks hold them): `attend` reads the half's first key from the mask's width.
        The whole sequence's document ids are all-gathered once per micro-batch. Rows of one document and no
        window need none (ContextParallelAttentionInputs): causal attention whose queries end the keys
        (models/attention_kernels.py causal_lower_right_attention)."""
        whole = self.gather_sequence(document_ids, dim=1)
        if window is not None and window >= whole.shape[1]:
            window = None
        chunk = document_ids.shape[1] // 2
        masks = []
        for index in self.global_chunks():
            end = (index + 1) * chunk
            first_key = 0 if window is None else max(0, index * chunk - window + 1)
            queries = torch.arange(index * chunk, end, device=document_ids.device)
            keys = torch.arange(first_key, end, device=document_ids.device)
            causal = keys[None, :] <= queries[:, None]
            if window is not None:
                causal &= keys[None, :] > queries[:, None] - window
            query_docs, key_docs = whole[:, index * chunk:end], whole[:, first_key:end]
            allowed = causal & (query_docs[:, :, None] == key_docs[:, None, :]) & (key_docs != 0)[:, None, :]
            masks.append((allowed | (keys[None, :] == queries[:, None]))[:, None])
        return masks

    def attend(self, attention, q, k, v, masks):
        """attention(q, k, v, mask) of this rank's queries: each half over the keys up to its own chunk (the
        causal saving that the zig-zag split makes even across ranks), from the first its mask covers (a sliding
        window's reach: attention_masks). The halves are joined token-major, the layout the output projection
        reads, so joining them is the only copy."""
        chunk = q.shape[2] // 2
        outputs = []
        for half, (index, mask) in enumerate(zip(self.global_chunks(), masks)):
            end = (index + 1) * chunk
            first_key = 0 if mask is None else end - mask.shape[-1]
            out = attention(q[:, :, half * chunk:(half + 1) * chunk], k[:, :, first_key:end], v[:, :, first_key:end],
                            mask)
            outputs.append(out.transpose(1, 2))
        return torch.cat(outputs, dim=1).transpose(1, 2)

    # --- the loss ---------------------------------------------------------------------------------------------
    def loss_divisor(self, next_labels, ignore_index):
        """What this rank divides its tokens' loss sum by: the group's labelled tokens / size.

        DeepSpeed sees the context ranks as data-parallel ranks and averages their gradients and losses; so each
        rank returns size x (its tokens' loss sum) / (the group's labelled tokens), whose mean over the group is
        exactly the whole sequences' mean loss, and the averaged gradient exactly its gradient."""
        count = (next_labels != ignore_index).sum().reshape(1)
        collectives.all_reduce(count, group=self.group)
        return count.clamp(min=1).squeeze(0) / self.size

    def whole_sequence_loss(self, loss):
        """A loss every rank of the group computes whole (from sums over the group, e.g. sequences'
        log-probabilities): the same value, its gradient times the group's size. DeepSpeed averages the group's
        gradients as data-parallel ones, and each rank's covers only its own tokens: the average of size x each is
        their sum, the whole sequences' gradient."""
        return loss if self.size == 1 else ScaleGradient.apply(loss, float(self.size))

    def whole_rows(self, sums):
        """Per-row sums of this rank's tokens [rows, F] -> the whole rows' (the group's sum; a mixture's routing
        statistics per sequence, models/moe.py RoutedTokens). The gradient passes through to this rank's tokens:
        the loss made of them is whole on every rank (whole_sequence_loss)."""
        return AllReduce.apply(sums, self.group)

    # --- collectives ------------------------------------------------------------------------------------------
    def gather_sequence(self, x, dim):
        """All-gather this rank's tokens along `dim` into the whole sequence in global order (no gradient)."""
        gathered_first = self.all_gather(x.movedim(dim, 0))
        to_global, _ = self.orders(x.shape[dim] // 2, x.device)
        return gathered_first.index_select(0, to_global).movedim(0, dim)

    def all_gather(self, x):
        out = torch.empty((x.shape[0] * self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        collectives.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x):
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        collectives.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def orders(self, chunk, device):
        """Index maps between the all-gathered order (rank 0's two chunks, rank 1's, ...) and the global one."""
        if chunk not in self._orders:
            gathered_chunk = [index for rank in range(self.size)
                              for index in (rank, 2 * self.size - 1 - rank)]  # the global chunk at each position
            to_gathered = torch.tensor(gathered_chunk).argsort()  # global chunk -> position in the gathered order
            to_global = (to_gathered[:, None] * chunk + torch.arange(chunk)).reshape(-1)
            self._orders[chunk] = (to_global, to_global.argsort())
        to_global, to_gathered = self._orders[chunk]
        return to_global.to(device), to_gathered.to(device)


class ContextParallelCore(nn.Module):
    """An attention core (models/attention.py AttentionCore) of a context group's rank: the whole sequence's keys
    and values (or what they expand from) gathered, then this rank's queries attended over them half by half."""

    def __init__(self, core, context):
        super().__init__()
        self.core, self.context = core, context

    def forward(self, q, keys_values, masks, expand=None, sinks=None):
        gathered = self.context.gather_keys_values(*keys_values)
        k, v = gathered if expand is None else expand(*gathered)
        return self.context.attend(lambda *args: self.core.attend(*args, sinks=sinks), q, k, v, masks)


class ContextParallelAttentionInputs(StageAttentionInputs):
    """A stage's attention inputs under context parallelism: one mask per local half of the tokens (or None for
    plain causal attention), which padded rows take too."""

    def __init__(self, config, context, row_layout="packed"):
        super().__init__(config, row_layout)
        self.context = context
        self.masked = row_layout in ("packed", "padded")

    def mask(self, document_ids, dtype, window):
        needed = self.masked or (window is not None and window < document_ids.shape[1] * self.context.size)
        halves = self.context.attention_masks(document_ids, window) if needed else [None, None]
        return [additive_mask(half, dtype) for half in halves]


def wrap_attention_cores(layer, context):
    """A decoder layer's attention core replaced by its context-parallel form: its softmax attention's
    (`self_attn`) or its linear attention's (`linear_attn`)."""
    if hasattr(layer, "linear_attn"):
        layer.linear_attn.core = ContextParallelDeltaRuleCore(layer.linear_attn.core, context)
    else:
        layer.self_attn.core = ContextParallelCore(layer.self_attn.core, context)


class ContextParallelDeltaRuleCore(nn.Module):
    """A linear-attention core (models/linear_attention.py DeltaRuleCore) of a context group's rank: its inputs
    exchanged from this rank's tokens of every head to the whole sequence of this rank's heads, the core run there,
    the outputs exchanged back (the module docstring)."""

    def __init__(self, core, context):
        super().__init__()
        for heads, name in ((core.num_key_heads, "linear_num_key_heads"), (core.num_value_heads,
                                                                          "linear_num_value_heads")):
            if heads % context.size:
                raise ValueError(f"{name}={heads} does not split over context_parallel_size={context.size}: "
                                 f"linear attention's context parallelism gives each rank a whole share of the "
                                 f"heads; set context_parallel_size to a divisor of {heads}.")
        self.context = context
        size = context.size
        self.core = type(core)(core.num_key_heads // size, core.num_value_heads // size, core.key_head_dim,
                               core.value_head_dim)  # this rank's heads over the whole sequence
        self.key_width = core.num_key_heads * core.key_head_dim  # q's (and k's) channels, of every head
        self.value_width = core.num_value_heads * core.value_head_dim

    def forward(self, qkv, conv_weight, g, beta, document_ids=None, context=None, context_ids=None,
                initial_state=None, output_final_state=False):
        if context is not None or initial_state is not None or output_final_state:
            raise ValueError("context parallelism runs each linear-attention layer over whole sequences: a stretch "
                             "carried from another (forward_carrying) is not split across ranks.")
        size, rank = self.context.size, self.context.rank
        batch, local, _ = qkv.shape
        q, k, v = qkv.split([self.key_width, self.key_width, self.value_width], dim=-1)
        heads = self.core.num_value_heads
        # [B, S/c, c, width/c] per destination rank, q|k|v|beta in the activations' dtype, g (fp32) apart
        sent = torch.cat([x.reshape(batch, local, size, -1) for x in (q, k, v, beta)], dim=-1)
        whole = self.whole_sequence(sent)
        decays = self.whole_sequence(g.reshape(batch, local, size, heads))
        ids = None if document_ids is None else self.context.gather_sequence(document_ids, dim=1)
        q, k, v, beta = whole.split([self.key_width // size, self.key_width // size, self.value_width // size,
                                     heads], dim=-1)
        key_rows = torch.arange(rank * self.key_width // size, (rank + 1) * self.key_width // size,
                                device=conv_weight.device)
        value_rows = torch.arange(rank * self.value_width // size, (rank + 1) * self.value_width // size,
                                  device=conv_weight.device)
        weight = conv_weight.index_select(0, torch.cat([key_rows, key_rows + self.key_width,
                                                        value_rows + 2 * self.key_width]))
        out, _ = self.core(torch.cat([q, k, v], dim=-1), weight, decays, beta.contiguous(), ids)
        return self.tokens_of_every_head(out.flatten(2)).unflatten(-1, (-1, self.core.value_head_dim)), None

    def whole_sequence(self, x):
        """[B, S/c, c, w]: this rank's tokens, a share w of the channels for each rank -> [B, S, w]: every rank's
        tokens of this rank's share, in sequence order (the exchange differentiable: its backward the reverse)."""
        size, (batch, local, _, width) = self.context.size, x.shape
        received = collectives.exchange_rows(x.permute(2, 0, 1, 3).reshape(size * batch, local * width),
                                             [batch] * size, [batch] * size, self.context.group)
        gathered = received.view(size, batch, local, width).transpose(0, 1).reshape(batch, size * local, width)
        to_global, _ = self.context.orders(local // 2, x.device)
        return gathered.index_select(1, to_global)

    def tokens_of_every_head(self, x):
        """whole_sequence's inverse: [B, S, w] of this rank's heads -> [B, S/c, c * w], this rank's tokens of all."""
        size, (batch, seq, width) = self.context.size, x.shape
        local = seq // size
        _, to_gathered = self.context.orders(local // 2, x.device)
        by_rank = x.index_select(1, to_gathered).view(batch, size, local, width).transpose(0, 1)
        received = collectives.exchange_rows(by_rank.reshape(size * batch, local * width), [batch] * size,
                                             [batch] * size, self.context.group)
        return received.view(size, batch, local, width).permute(1, 2, 0, 3).reshape(batch, local, size * width)


class ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class GatherSequence(torch.autograd.Function):
    """The whole sequence along `dim` from every rank's tokens; backward: each rank's share of the summed
    gradient (reduce-scatter), since every rank's queries used every rank's keys and values."""

    @staticmethod
    def forward(ctx, x, context, dim):
        ctx.context, ctx.dim = context, dim
        return context.gather_sequence(x, dim)

    @staticmethod
    def backward(ctx, grad):
        context, dim = ctx.context, ctx.dim
        _, to_gathered = context.orders(grad.shape[dim] // (2 * context.size), grad.device)
        in_gathered_order = grad.movedim(dim, 0).index_select(0, to_gathered)
        return context.reduce_scatter(in_gathered_order).movedim(0, dim), None, None


def build_context_parallel(topology, size):
    """This rank's ContextParallel. The context ranks are folded into DeepSpeed's data axis (so DeepSpeed
    averages gradients and partitions ZeRO over data x context, as Megatron does): data coordinate d is replica
    d // size, context rank d % size. Every rank creates every group, in the same order, as new_group requires."""
    if size == 1:
        return NO_CONTEXT_PARALLEL
    rank = dist.get_rank()
    mine = None
    for data_ranks in topology.get_axis_comm_lists("data"):
        for start in range(0, len(data_ranks), size):
            members = data_ranks[start:start + size]
            group = dist.new_group(members)
            if rank in members:
                mine = ContextParallel(size, members.index(rank), group)
    return mine


def context_parallel_error(size, seq_length, data_axis):
    """Why context_parallel_size cannot split this run (a message naming the key and what to set), or None.
    data_axis: world size / (num_stages x tensor_parallel_size), which context x data-parallel ranks share."""
    if size < 1:
        return f"context_parallel_size={size} must be at least 1."
    if size > 1 and seq_length % (2 * size):
        return (f"seq_length={seq_length} does not split over context_parallel_size={size}: the zig-zag split "
                f"cuts each sequence into 2 x {size} equal chunks; set seq_length to a multiple of {2 * size}.")
    if data_axis % size:
        return (f"context_parallel_size={size} does not divide the {data_axis} ranks each stage x tensor-parallel "
                f"slot has (world size / (num_stages x tensor_parallel_size)); launch a multiple of {size} such "
                f"ranks or set context_parallel_size to a divisor of {data_axis}.")
    return None


NO_CONTEXT_PARALLEL = ContextParallel()  # every rank holds whole sequences
