"""The causal LM loss on the last stage: next-token cross-entropy in fp32, the mean over the labelled tokens
(transformers' loss), from the LM head's input, so the stage never holds a tokens x vocabulary tensor.

`loss_chunk_tokens` > 0 (the default): the head's projection and the cross-entropy run together, that many tokens at
a time (Liger Kernel's fused linear cross-entropy, in plain torch). In training the gradients are computed in the
forward pass, chunk by chunk, while each chunk's logits exist; backward only scales them by the loss's gradient, so
the head costs the same three matmuls as the logits path and its backward is instant for the stage before it. Under
the zero-bubble schedule too: the weight gradient arrives with B and leaves no W, which would have to project every
chunk again (no chunk's logits outlive the forward pass).
`loss_chunk_tokens` = 0: the head's full logits, then the cross-entropy (the reference the chunked path is tested
against). Under tensor parallelism each rank projects onto its vocabulary rows, and the log-sum-exp and the target
logit are combined across the group, never the logits.
"""
import torch
import torch.nn.functional as F

import collectives
from models import IGNORE_INDEX
from models.context_parallel import NO_CONTEXT_PARALLEL
from models.gemma3 import soft_cap, soft_cap_derivative
from models.pipeline_layers import head_outputs
from models.tensor_parallel import NO_TENSOR_PARALLEL


def with_step_divisor(labels, divisor):
    """A micro-batch's labels as a training step hands them to the loss: the loader's (a tensor, or a tuple of
    tensors), then the step's divisor, a 0-d fp32 tensor on the device that makes the micro-batches' summed losses
    the global batch's mean (training/token_mean.py). A flat tuple of tensors: the labels DeepSpeed's pipeline
    engine moves to the device and passes to the loss as they are."""
    return (*labels, divisor) if isinstance(labels, (tuple, list)) else (labels, divisor)


def split_step_divisor(labels, own_tensors):
    """(the loader's labels, the step's divisor or None) of labels that hold `own_tensors` tensors of their own
    and, in a training step, the divisor after them (with_step_divisor)."""
    if own_tensors == 1:
        return (labels[0], labels[1]) if isinstance(labels, (tuple, list)) else (labels, None)
    if len(labels) == own_tensors + 1:
        return tuple(labels[:own_tensors]), labels[own_tensors]
    return labels, None


class CausalLMLoss:
    """The pipeline's loss_fn: (the last layer's output, a micro-batch's labels) -> the next-token loss summed over
    the labelled tokens, divided by the step's divisor when the labels carry one (a training step: the global
    batch's token mean, with_step_divisor), else by the micro-batch's own labelled tokens (its mean: evaluation). The
    last layer's output is the logits, or with chunk_tokens > 0 the head's input and weight (LMHeadPipe), whose
    chunks' weight gradients are summed in grad_sum_dtype (the run's grad_accum_dtype; None: the weight's).
    seq_length: the positions of a row, when its labels may be one wider (token shards, data/collator.py); None: as
    wide. logit_cap: Gemma's final_logit_softcapping (None: none), cap * tanh(logits / cap) of each chunk's logits.
    router: an MoE model's LoadBalancingLoss (models/router_loss.py), whose loss times its coefficient is added, as
    transformers adds it to outputs.loss; None for a dense model. mtp_scale > 0: the last layer's output holds the
    MTP layer's head outputs too (models/multi_token_prediction.py), whose next-next-token loss, summed over its
    labelled positions and divided as the main loss (by the same divisor: Megatron's per-token loss), times
    mtp_scale is added. An evaluation forward (no gradient) keeps the added terms (a 0-d tensor, their sum) until
    take_aux_terms: perplexity is of the cross-entropy alone."""

    def __init__(self, parallel=NO_TENSOR_PARALLEL, chunk_tokens=0, context=NO_CONTEXT_PARALLEL, grad_sum_dtype=None,
                 seq_length=None, router=None, logit_cap=None, mtp_scale=0.0):
        self.parallel, self.chunk_tokens, self.context = parallel, chunk_tokens, context
        self.logit_cap = logit_cap  # Gemma's final_logit_softcapping: each chunk's logits capped (models/gemma3.py)
        self.grad_sum_dtype, self.seq_length = grad_sum_dtype, seq_length
        self.router = router
        self.mtp_scale = mtp_scale
        self.aux_terms = []  # evaluation's added terms since take_aux_terms

    def units(self, labels, whole=False):
        """What the loss averages over, a 0-d int64 tensor beside the labels: labelled tokens, of this rank's share
        of a micro-batch, or (whole) of a micro-batch not yet split over the context group."""
        return labelled_tokens(labels, NO_CONTEXT_PARALLEL if whole else self.context)

    def __call__(self, outputs, labels):
        if self.mtp_scale > 0:
            outputs, routing, mtp = head_outputs(outputs, self.chunk_tokens > 0, multi_token=True)
        else:
            (outputs, routing), mtp = head_outputs(outputs, self.chunk_tokens > 0), None
        labels, divisor = split_step_divisor(labels, 1)
        next_labels = next_token_labels(labels, self.context, self.seq_length)
        divisor = self.divisor(next_labels) if divisor is None else divisor
        loss = self.loss_sum(outputs, next_labels, divisor)
        terms = []
        if self.router is not None and (aux := self.router(routing)) is not None:
            terms.append(self.router.coef * aux)
        if mtp is not None:
            mtp_outputs, document_ids = mtp
            terms.append(self.mtp_scale * self.loss_sum(mtp_outputs, mtp_labels(labels, document_ids, self.seq_length,
                                                                                self.context), divisor))
        if not terms:
            return loss
        term = sum(terms)
        if not torch.is_grad_enabled():
            self.aux_terms.append(term.detach())
        return loss + term

    def take_aux_terms(self):
        """The terms (load balancing, MTP) the evaluation forwards since the last call added to their losses, one
        0-d tensor per micro-batch ([] for a dense model without MTP)."""
        terms, self.aux_terms = self.aux_terms, []
        return terms

    def divisor(self, next_labels):
        """A micro-batch's own labelled tokens (evaluation), over the context group under context parallelism."""
        if self.context.size > 1:
            return self.context.loss_divisor(next_labels, IGNORE_INDEX)
        return (next_labels != IGNORE_INDEX).sum().clamp(min=1)

    def loss_sum(self, outputs, next_labels, divisor):
        """The cross-entropy of the head outputs against next_labels, summed over the labelled ones / divisor."""
        if self.chunk_tokens:
            hidden, weight = outputs
            return chunked_loss_sum(hidden, weight, next_labels.to(hidden.device), divisor, self.parallel,
                                    self.chunk_tokens, self.grad_sum_dtype, self.logit_cap)
        logits, = outputs
        return logits_loss_sum(soft_cap(logits, self.logit_cap), next_labels.to(logits.device), self.parallel) / divisor


class ContinuationScores:
    """The pipeline's loss_fn while lm-eval's requests are scored (evaluation/lm_eval_tasks.py): (the last layer's
    output, labels that are -100 but on each row's continuation) -> (rows, 2) continuation_scores, each row's sums
    over all its tokens under context parallelism. seq_length: the rows' width (their labels are one wider).
    multi_token: the outputs hold the MTP layer's too (a run training it), which scoring leaves aside."""

    def __init__(self, parallel, chunk_tokens, context, seq_length, logit_cap=None, multi_token=False):
        self.parallel, self.chunk_tokens, self.context, self.seq_length = parallel, chunk_tokens, context, seq_length
        self.logit_cap = logit_cap  # Gemma's final_logit_softcapping
        self.multi_token = multi_token

    def __call__(self, outputs, labels):
        next_labels = next_token_labels(labels, self.context, self.seq_length)
        head = head_outputs(outputs, self.chunk_tokens > 0, self.multi_token)[0]
        scores = continuation_scores(head if self.chunk_tokens else head[0], next_labels, labels.shape[0],
                                     self.parallel, self.chunk_tokens, self.logit_cap)
        if self.context.size > 1:  # each rank scored its tokens of every row
            collectives.all_reduce(scores, group=self.context.group)
        return scores


def shift_labels(labels, positions=None):
    """(rows, positions): position t's label is labels[:, t + 1] (the labels shifted, rather than the logits).
    Labels as wide as the rows (`positions` None or equal): the last position predicts nothing; one wider (token
    shards' samples, data/collator.py): it predicts the token after the row."""
    positions = labels.shape[1] if positions is None else positions
    return F.pad(labels[:, 1:], (0, positions + 1 - labels.shape[1]), value=IGNORE_INDEX)


def next_token_labels(labels, context=NO_CONTEXT_PARALLEL, positions=None):
    """The label each position predicts, flattened (shift_labels); under context parallelism shifted and split
    already (split_micro_batch)."""
    if context.size > 1:
        return labels.reshape(-1)
    return shift_labels(labels, positions).reshape(-1)


def mtp_labels(labels, document_ids, positions=None, context=NO_CONTEXT_PARALLEL):
    """What MTP position i predicts (models/multi_token_prediction.py), flattened: labels[:, i + 2] (as shift_labels
    shifts them, so labels one wider than the rows give the last but one position a label too), IGNORE_INDEX where
    the next token t_{i+1} is in another document than t_i (its embedding comes from the wrong document; a later
    document's first token is unlabelled already, the collator's) and at the last position, whose next token is not
    in the row. Under context parallelism labels and document_ids are this rank's tokens, the labels shifted once
    already (split_micro_batch): the label after next and the next document id, which may sit on another rank, are
    read off the whole sequences (ContextParallel.of_whole_sequences)."""
    next_labels = next_token_labels(labels, context, positions).view(document_ids.shape)
    return context.of_whole_sequences(after_next_labels, next_labels.to(document_ids.device),
                                      document_ids).reshape(-1)


def after_next_labels(next_labels, document_ids):
    """mtp_labels of whole rows from their shifted labels, (rows, positions)."""
    after_next = F.pad(next_labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    same_document = torch.cat([document_ids[:, 1:] == document_ids[:, :-1],
                               torch.zeros_like(document_ids[:, :1], dtype=torch.bool)], dim=1)
    return after_next.masked_fill(~same_document, IGNORE_INDEX)


def split_micro_batch(context, batch):
    """A collated micro-batch ((input_ids, document_ids, position_ids), labels) of whole sequences -> the context
    group rank's tokens of each (ContextParallel.local_tokens); as it is without context parallelism. The labels are
    shifted first, while the sequence is whole (each token's label is the next token's, which may sit on another
    rank): the context-parallel loss does not shift them again. Preference pairs' labels, (labels, reference
    log-probabilities per row), keep their per-row values whole."""
    if context.size == 1 or batch is None:
        return batch
    inputs, labels = batch
    labels, *per_row = labels if isinstance(labels, tuple) else (labels,)
    next_labels = context.local_tokens(shift_labels(labels, inputs[0].shape[1]))
    return tuple(context.local_tokens(t) for t in inputs), (next_labels, *per_row) if per_row else next_labels


def labelled_tokens(labels, context=NO_CONTEXT_PARALLEL):
    """Tokens that count in the shifted loss. In packed rows the collator has already ignored each later document's
    first token, so this is the loss's own count and a packed micro-batch weighs as many tokens as its examples would
    alone. A 0-d tensor beside the labels (reading it on the host is a sync when they are on an accelerator)."""
    return (next_token_labels(labels, context) != IGNORE_INDEX).sum()


def logits_loss_sum(logits, labels, parallel):
    """Summed cross-entropy of the labelled tokens from (this rank's vocabulary share of) the logits, in fp32."""
    return parallel.cross_entropy_sum(logits.float().reshape(-1, logits.shape[-1]), labels, IGNORE_INDEX)


def chunked_loss_sum(hidden, weight, labels, divisor, parallel, chunk_tokens, grad_sum_dtype=None, logit_cap=None):
    """Summed cross-entropy of the labelled tokens / divisor, projecting `chunk_tokens` tokens at a time (each chunk's
    logits soft-capped by logit_cap, if set)."""
    whole = parallel.whole_input(hidden)  # every token of the micro-batch; its gradient reduced over the group
    return ChunkedLinearCrossEntropy.apply(whole.reshape(-1, whole.shape[-1]), weight, labels, divisor, parallel,
                                           chunk_tokens, grad_sum_dtype, logit_cap)


def capped_logits(hidden, weight, cap):
    """(a chunk's logits in fp32, soft-capped by cap in the head's dtype as transformers caps them; the cap's
    derivative, which their gradient is multiplied by, or None without a cap)."""
    logits = soft_cap(F.linear(hidden, weight), cap).float()
    return logits, None if cap is None else soft_cap_derivative(logits, cap)


def sequence_log_probs(hidden, weight, labels, sequences, parallel, chunk_tokens, grad_sum_dtype=None,
                       logit_cap=None):
    """Each sequence's summed log-probability of its labelled next tokens, (sequences,) in fp32, differentiable:
    the response log-probabilities preference losses are made of (PreferenceLoss), from the head's input and
    weight, `chunk_tokens` tokens at a time, the chunks' weight gradients summed in grad_sum_dtype (as
    CausalLMLoss's), each chunk's logits soft-capped by logit_cap if set. labels: next_token_labels of `sequences`
    rows of equal length."""
    whole = parallel.whole_input(hidden)
    return SequenceLogProbs.apply(whole.reshape(-1, whole.shape[-1]), weight, labels, sequences, parallel,
                                  chunk_tokens, grad_sum_dtype, logit_cap)


class VocabularyShare:
    """Where each token's label falls in this rank's rows of the vocabulary."""

    def __init__(self, labels, rows, parallel):
        local = labels - parallel.rank * rows
        self.labelled = labels != IGNORE_INDEX
        self.inside = self.labelled & (local >= 0) & (local < rows)
        self.local = local.masked_fill(~self.inside, 0)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over labelled tokens of (log-sum-exp of the token's logits - its label's logit), / divisor.

    hidden (tokens, hidden) in the activation dtype; weight (this rank's vocabulary rows, hidden). Each chunk's
    logits are the head's (activation dtype), upcast to fp32 as the logits path does; its gradient
    (softmax - one-hot, unscaled, in [-1, 1]: no fp16 underflow) goes through the matmuls in the activation dtype
    and is summed in grad_sum_dtype (fp32 under fp16); backward scales the sums by the loss's gradient and
    1 / divisor, in fp32. With logit_cap (Gemma's), each chunk's logits are soft-capped, and their gradient
    multiplied by the cap's derivative, while the chunk exists."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, divisor, parallel, chunk_tokens, grad_sum_dtype, logit_cap=None):
        share = VocabularyShare(labels, weight.shape[0], parallel)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = weight_grad_buffer(weight, grad_sum_dtype) if ctx.needs_input_grad[1] else None
        log_sum_exp, row_max = (torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
                                for _ in range(2))
        target_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in token_chunks(hidden.shape[0], chunk_tokens):
            logits, cap_derivative = capped_logits(hidden[rows], weight, logit_cap)
            target = logits.gather(1, share.local[rows, None]).squeeze(1)
            target_sum += target.masked_fill(~share.inside[rows], 0).sum()
            row_max[rows] = exp_minus_row_max(logits)
            log_sum_exp[rows] = group_log_sum_exp(logits, row_max[rows], parallel)
            if grad_hidden is not None or grad_weight is not None:
                grad_logits = softmax_minus_target(logits, row_max, log_sum_exp, share, rows)
                if cap_derivative is not None:
                    grad_logits.mul_(cap_derivative)
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits @ weight
                if grad_weight is not None:
                    add_weight_grad(grad_weight, grad_logits, hidden[rows])
                del grad_logits
            del logits, cap_derivative  # before the next chunk's: one chunk of logits alive at a time
        if parallel.size > 1:
            collectives.all_reduce(target_sum, group=parallel.group)
        ctx.divisor, ctx.dtypes = divisor, (hidden.dtype, weight.dtype)
        ctx.grad_hidden, ctx.grad_weight = grad_hidden, grad_weight
        return (log_sum_exp.masked_fill(~share.labelled, 0).sum() - target_sum) / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        scale = grad_loss.float() / ctx.divisor
        grad_hidden = None if ctx.grad_hidden is None else (ctx.grad_hidden * scale).to(ctx.dtypes[0])
        grad_weight = None if ctx.grad_weight is None else ctx.grad_weight.mul_(scale).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None, None, None, None


class SequenceLogProbs(torch.autograd.Function):
    """Per sequence, sum over its labelled tokens of (the label's logit - the token's log-sum-exp), in fp32.

    Unlike the cross-entropy's, the gradient cannot be summed in forward: a preference loss weighs each sequence by
    a factor known only once every chunk is done. So forward keeps each token's log-sum-exp (one number per token)
    and backward projects each chunk again, scaling its softmax - one-hot by its sequence's gradient: four head
    matmuls instead of three, still one chunk of logits alive at a time. Under tensor parallelism the log-sum-exp is
    gathered per chunk in forward and the label logits summed over the group once; backward needs no collective."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, sequences, parallel, chunk_tokens, grad_sum_dtype, logit_cap=None):
        share = VocabularyShare(labels, weight.shape[0], parallel)
        target, log_sum_exp, _ = label_logits(lambda rows: capped_logits(hidden[rows], weight, logit_cap)[0],
                                              hidden.shape[0], share, parallel, chunk_tokens)
        ctx.save_for_backward(hidden, weight)
        ctx.share, ctx.log_sum_exp, ctx.parallel, ctx.chunk_tokens = share, log_sum_exp, parallel, chunk_tokens
        ctx.grad_sum_dtype, ctx.logit_cap = grad_sum_dtype, logit_cap
        per_token = (target - log_sum_exp).masked_fill(~share.labelled, 0)
        return per_token.view(sequences, -1).sum(dim=1)

    @staticmethod
    def backward(ctx, grad_logps):
        hidden, weight = ctx.saved_tensors
        share, log_sum_exp = ctx.share, ctx.log_sum_exp
        # d(log-prob)/d(logits) = one-hot - softmax: minus the cross-entropy's, times its sequence's gradient
        token_scale = -grad_logps.float().repeat_interleave(hidden.shape[0] // grad_logps.shape[0])
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = weight_grad_buffer(weight, ctx.grad_sum_dtype) if ctx.needs_input_grad[1] else None
        row_max = torch.empty_like(log_sum_exp)
        for rows in token_chunks(hidden.shape[0], ctx.chunk_tokens):
            logits, cap_derivative = capped_logits(hidden[rows], weight, ctx.logit_cap)
            row_max[rows] = exp_minus_row_max(logits)
            grad_logits = softmax_minus_target(logits, row_max, log_sum_exp, share, rows)
            grad_logits = grad_logits.mul_(token_scale[rows, None])
            if cap_derivative is not None:
                grad_logits.mul_(cap_derivative)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                add_weight_grad(grad_weight, grad_logits, hidden[rows])
            del logits, grad_logits, cap_derivative
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None,
                None, None)


def label_logits(logits_of, tokens, share, parallel, chunk_tokens, top=False):
    """(each token's label logit, 0 where unlabelled; its log-sum-exp over the whole vocabulary; with top its
    largest logit, else None), fp32, from `logits_of(rows)`: the logits of a chunk of tokens over this rank's share
    of the vocabulary, one chunk alive at a time. Under tensor parallelism the log-sum-exp is gathered per chunk, the
    label logits summed and the largest taken over the group once."""
    device = share.labelled.device
    log_sum_exp = torch.empty(tokens, dtype=torch.float32, device=device)
    target = torch.zeros(tokens, dtype=torch.float32, device=device)
    top_logit = torch.empty(tokens, dtype=torch.float32, device=device) if top else None
    for rows in token_chunks(tokens, chunk_tokens):
        logits = logits_of(rows).float()
        target[rows] = logits.gather(1, share.local[rows, None]).squeeze(1).masked_fill(~share.inside[rows], 0)
        row_max = exp_minus_row_max(logits)
        if top:
            top_logit[rows] = row_max
        log_sum_exp[rows] = group_log_sum_exp(logits, row_max, parallel)
        del logits
    if parallel.size > 1:
        collectives.all_reduce(target, group=parallel.group)
        if top:
            collectives.all_reduce(top_logit, op=collectives.ReduceOp.MAX, group=parallel.group)
    return target, log_sum_exp, top_logit


@torch.no_grad()
def continuation_scores(outputs, labels, sequences, parallel, chunk_tokens, logit_cap=None):
    """(sequences, 2) fp32, forward only: per sequence, the summed log-probability of its labelled next tokens and
    how many of them are not the top logit (lm-eval's loglikelihood and, where 0, is_greedy; a tie counts as the
    top). outputs: the head's input and weight (chunk_tokens > 0) or the logits (this rank's vocabulary share).
    labels: next_token_labels of `sequences` rows of equal length."""
    if chunk_tokens:
        hidden, weight = outputs
        hidden = parallel.whole_input(hidden)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        tokens, vocabulary_rows = hidden.shape[0], weight.shape[0]
        logits_of, device = (lambda chunk: capped_logits(hidden[chunk], weight, logit_cap)[0]), hidden.device
    else:
        logits = outputs.reshape(-1, outputs.shape[-1])
        (tokens, vocabulary_rows), chunk_tokens = logits.shape, logits.shape[0]
        # soft_cap makes a new tensor (label_logits works in place); clone where there is no cap
        logits_of, device = (lambda chunk: soft_cap(logits[chunk], logit_cap).clone()), logits.device
    share = VocabularyShare(labels.to(device), vocabulary_rows, parallel)
    target, log_sum_exp, top_logit = label_logits(logits_of, tokens, share, parallel, chunk_tokens, top=True)
    log_probs = (target - log_sum_exp).masked_fill(~share.labelled, 0)
    misses = ((target < top_logit) & share.labelled).float()
    return torch.stack([log_probs.view(sequences, -1).sum(dim=1), misses.view(sequences, -1).sum(dim=1)], dim=1)


def weight_grad_buffer(weight, grad_sum_dtype=None):
    """Zeros to sum the chunks' weight gradients into: in grad_sum_dtype (fp32 by default in 16-bit runs: a bf16 sum
    over many chunks keeps 8 bits), else the weight's dtype as Liger does, but fp32 under fp16, whose range an
    unscaled sum over many tokens can leave."""
    dtype = torch.float32 if weight.dtype == torch.float16 else grad_sum_dtype or weight.dtype
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


def add_weight_grad(grad_weight, grad_logits, hidden):
    """grad_weight += grad_logits^T hidden, in place. A 16-bit product added to an fp32 sum goes through
    temporaries of a block of the vocabulary's rows, each no larger than the chunk's fp32 logits, never the whole
    weight's (a 70B head's is 2 GiB)."""
    if grad_weight.dtype == hidden.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
        return
    block = max(1, 2 * grad_logits.numel() // hidden.shape[1])  # rows x hidden x 2 bytes <= tokens x vocab x 4
    for rows in token_chunks(grad_weight.shape[0], block):
        grad_weight[rows] += grad_logits[:, rows].t() @ hidden


def token_chunks(tokens, chunk_tokens):
    return [slice(start, min(start + chunk_tokens, tokens)) for start in range(0, tokens, chunk_tokens)]


def exp_minus_row_max(logits):
    """logits -> e^(logits - each row's max), in place (no temporary copy); returns the max."""
    row_max = logits.amax(dim=-1)
    logits.sub_(row_max[:, None]).exp_()
    return row_max


def group_log_sum_exp(exp, row_max, parallel):
    """Each token's log-sum-exp over the whole vocabulary, from e^(x - max) over this rank's share of it."""
    local = exp.sum(dim=-1).log_().add_(row_max)
    if parallel.size == 1:
        return local
    gathered = torch.empty(parallel.size * local.shape[0], dtype=local.dtype, device=local.device)
    collectives.all_gather_single(gathered, local, group=parallel.group)
    return torch.logsumexp(gathered.view(parallel.size, -1), dim=0)


def softmax_minus_target(exp, row_max, log_sum_exp, share, rows):
    """d(token's loss)/d(logits) from e^(x - max), in place: the softmax e^(x - max) e^(max - lse) less the one-hot
    of the label (this rank's rows of it), 0 on the tokens not labelled. Masks, not boolean indexing: that would read
    the mask on the host, a sync per chunk."""
    exp.mul_(((row_max[rows] - log_sum_exp[rows]).exp_() * share.labelled[rows])[:, None])
    return exp.scatter_add_(1, share.local[rows, None], -share.inside[rows, None].to(exp.dtype))
