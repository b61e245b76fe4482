"""The model as pipeline layers (DeepSpeed LayerSpecs): embedding, decoder layers, final norm, LM head, each
wrapping the plain parts of models/ and passing on what crosses a stage boundary.

What travels between layers is StageActivations, named fields, defined here once; DeepSpeed's pipeline engine sends
tuples of tensors, and marks every floating tensor it receives `requires_grad` and waits for its gradient, so
StageTuple turns the fields into the tuple and back, the floating tensors first (the engine receives the k-th
floating gradient into the buffer of the tuple's k-th tensor, whatever that one's dtype): the hidden states and, for
an auxiliary loss of a mixture of experts, the running sum every router's gradient comes back through; then the
document ids and positions as integers (the causal mask and rotary tables are derived inside each stage, once per
stage) and the experts' top-k counts. Labels never travel: the last stage reads them from its own loader.

A decoder layer is built as the plain DecoderLayer (on the meta device where a plan reshapes its parameters), then
transformed by the stage's plan (StagePlan): the experts' slice (models/expert_parallel.py), tensor parallelism and
the stage's linear layers (models/tensor_parallel.py), context parallelism around the attention core
(models/context_parallel.py). Parameter names inside each layer equal transformers' names after the
`model.layers.{i}.` prefix, so a layer's state dict is the Hugging Face one with the prefix stripped.
"""
import contextlib
import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from models.architecture import architecture_of
from models.context_parallel import NO_CONTEXT_PARALLEL, ContextParallel, wrap_attention_cores
from models.decoder import DecoderLayer
from models.expert_parallel import NO_EXPERT_PARALLEL, ExpertParallel
from models.linear_attention import KEPT_AS_STORED
from models.moe import RoutedTokens
from models.multi_token_prediction import MultiTokenPrediction, next_tokens
from models.norms import RMSNorm
from models.sigmoid_router import FP32_MARKER
from models.tensor_parallel import (NO_TENSOR_PARALLEL, TensorParallel, hook_gradient_sums, mark_sharded, parallelize,
                                    replicated, vocabulary_rows)


class Routing(NamedTuple):
    """What the loss takes from a mixture's sparse layers (models/router_loss.py), carried from the embedding on in
    the same shapes across every boundary: each sparse layer's top-k counts of the real tokens, zeros until the
    layer has run; with an auxiliary loss, the running sum of the layers' floating terms (router probabilities, or
    DeepSeek-V3's per-expert sequence-wise terms), which starts as zeros that take a gradient, so that a stage
    without a sparse layer passes on a tensor DeepSpeed can run backward from."""
    counts: torch.Tensor  # [sparse layers, E] int64
    loss_sums: torch.Tensor | None = None  # [E] fp32

    def tensors(self):
        """(counts[, loss sums]): the order the LM head hands them on to the loss in."""
        return (self.counts,) if self.loss_sums is None else (self.counts, self.loss_sums)

    def with_layer(self, row, statistics):
        """These statistics with sparse layer number `row`'s (counts [E], its floating term [E] or None) added."""
        counts, term = statistics
        stacked = torch.cat([self.counts[:row], counts[None], self.counts[row + 1:]])
        return Routing(stacked, None if term is None else self.loss_sums + term)


class StageActivations(NamedTuple):
    """What a decoder layer takes and hands on: hidden states (batch, seq, hidden), or under sequence parallelism
    this rank's share of the flattened tokens (batch * seq / tp, hidden); each token's document id (0 on padding)
    and position, (batch, seq); a mixture's Routing (None for a dense model); with multi-token prediction trained,
    the shared embedding of each position's next token (laid out as hidden), which the last stage's MTP layer reads
    (models/multi_token_prediction.py) and whose gradient goes back to the embedding through every stage."""
    hidden: torch.Tensor
    document_ids: torch.Tensor
    position_ids: torch.Tensor
    routing: Routing | None = None
    next_embedded: torch.Tensor | None = None


def trains_multi_token_prediction(config):
    """Whether the run trains the MTP layer: the run's mtp_loss_scale, which its config checks set on the model
    config (training/config_checks.py), > 0."""
    return getattr(config, "mtp_loss_scale", 0.0) > 0


class StageTuple:
    """StageActivations as the tuple of tensors DeepSpeed's engine sends between stages, for one model: (hidden[,
    loss sums][, next embedded], document ids, positions[, counts])."""

    def __init__(self, config):
        architecture = architecture_of(config)
        self.moe, self.sparse_layers = architecture.moe, sum(architecture.sparse_layers)
        self.multi_token = trains_multi_token_prediction(config)

    def pack(self, activations):
        routing = activations.routing
        sums = () if routing is None or routing.loss_sums is None else (routing.loss_sums,)
        embedded = (activations.next_embedded,) if self.multi_token else ()
        counts = () if routing is None else (routing.counts,)
        return (activations.hidden, *sums, *embedded, activations.document_ids, activations.position_ids, *counts)

    def unpack(self, tensors):
        hidden, *rest = tensors
        loss_sums = rest.pop(0) if self.moe is not None and self.moe.loss_sum else None
        next_embedded = rest.pop(0) if self.multi_token else None
        document_ids, position_ids, *counts = rest
        routing = Routing(counts[0], loss_sums) if self.moe is not None else None
        return StageActivations(hidden, document_ids, position_ids, routing, next_embedded)

    def start(self, hidden, document_ids, position_ids, next_embedded=None):
        """The tuple the embedding hands on: a mixture's routing statistics start at zeros."""
        return self.pack(StageActivations(hidden, document_ids, position_ids, self.initial_routing(hidden.device),
                                          next_embedded))

    def initial_routing(self, device):
        if self.moe is None:
            return None
        counts = torch.zeros(self.sparse_layers, self.moe.num_experts, dtype=torch.int64, device=device)
        if not self.moe.loss_sum:
            return Routing(counts)
        return Routing(counts, torch.zeros(self.moe.num_experts, dtype=torch.float32, device=device,
                                           requires_grad=True))


def head_outputs(outputs, chunked, multi_token=False):
    """(the LM head's outputs: (logits,), or with the chunked loss (its input, its weight); the Routing of an MoE
    model, or None) from the last layer's output, which the loss receives (models/loss.py). multi_token: the
    outputs hold the MTP layer's too (lm_head), returned as a third item: (its head outputs, as the main ones,
    the document ids); None without."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    width = 2 if chunked else 1
    head, rest = outputs[:width], outputs[width:]
    mtp = None
    if multi_token:
        mtp_head = (rest[0], head[1]) if chunked else (rest[0],)
        mtp, rest = (mtp_head, rest[1]), rest[2:]
    routing = Routing(*rest) if rest else None
    return (head, routing, mtp) if multi_token else (head, routing)


@dataclasses.dataclass
class StagePlan:
    """How a stage's decoder layers are built: the attention implementation, and the parallelism applied to each.
    device: where the parameters of a layer a plan reshapes are made ("meta": shapes only; None: torch's default)."""
    attention_impl: str = "sdpa"
    parallel: TensorParallel = NO_TENSOR_PARALLEL
    context: ContextParallel = NO_CONTEXT_PARALLEL
    experts: ExpertParallel = NO_EXPERT_PARALLEL
    device: str | None = None
    # keys of a decoder layer's parameters marked KEPT_AS_STORED that the checkpoint stores in fp32: kept in fp32
    # whatever the training dtype (checkpoints/layer_files.py fp32_stored_keys)
    kept_in_fp32: frozenset = frozenset()

    def building(self):
        """Where the plain layer is built: on the meta device when the plan replaces its parameters by this rank's
        shares (no memory for the whole layer), else where it stays."""
        reshaping = self.parallel.size > 1 or self.experts.size > 1 or self.device == "meta"
        return torch.device("meta") if reshaping else contextlib.nullcontext()

    def apply(self, layer):
        if self.experts.size > 1:
            self.experts.split_experts(layer, self.device)
        parallelize(layer, self.parallel, self.device)
        if self.context.size > 1:
            wrap_attention_cores(layer, self.context)
        keep_in_fp32(layer, self.kept_in_fp32)


def keep_in_fp32(layer, keys):
    """The layer's parameters of `keys` that transformers computes with as stored (KEPT_AS_STORED) made fp32, and
    marked so that the engines keep them fp32 beside the training dtype (models/sigmoid_router.py FP32_MARKER)."""
    for key, param in layer.named_parameters():
        if key in keys and getattr(param, KEPT_AS_STORED, False):
            param.data = param.data.float()
            setattr(param, FP32_MARKER, True)


PLAIN_STAGE = StagePlan()


class EmbeddingPipe(nn.Embedding):
    """Layer 0: token ids to hidden states; document ids and positions pass through as integer tensors (and a
    mixture's routing statistics start).

    As transformers builds it (padding_idx=config.pad_token_id): the pad token's row takes no gradient from the
    lookup, which matters where pad is a real token (pad = eos; ChatML's <|im_end|>). Under tensor parallelism the
    row lives on the rank whose vocabulary share holds it (padding_idx there, None on the others)."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL):
        rows, padding_idx = vocabulary_rows(config, parallel)
        super().__init__(rows, config.hidden_size, padding_idx=padding_idx)
        if parallel.size > 1:
            mark_sharded(self.weight, 0)
        self.parallel = parallel
        self.multiplier = architecture_of(config).embedding_multiplier  # Granite's
        self.stage = StageTuple(config)
        self.multi_token = self.stage.multi_token  # the head (when tied) hands the MTP layer's outputs on too

    def forward(self, inputs):
        input_ids, document_ids, position_ids = inputs
        next_embedded = self.embedded(next_tokens(input_ids)) if self.multi_token else None
        return self.stage.start(self.embedded(input_ids), document_ids, position_ids, next_embedded)

    def embedded(self, input_ids):
        return scaled(self.parallel.embedding(input_ids, self.weight, self.padding_idx), self.multiplier)


class DecoderLayerPipe(DecoderLayer):
    """A decoder layer between stage tuples: the stage's shared attention inputs (stage_inputs, built once per
    micro-batch) and a sparse layer's routed tokens go in, its routing statistics join the tuple's."""

    def __init__(self, config, stage_inputs, layer_index=0, plan=PLAIN_STAGE):
        with plan.building():
            super().__init__(config, layer_index, plan.attention_impl)
        plan.apply(self)
        self.stage_inputs = stage_inputs
        self.stage = StageTuple(config)
        self.sparse_row = sum(architecture_of(config).sparse_layers[:layer_index])  # its row of the routing counts
        self.math = super().forward

    def forward(self, inputs):
        stage = self.stage.unpack(inputs)
        attention_inputs = self.stage_inputs(stage.hidden, stage.document_ids, stage.position_ids,
                                             self.window)
        tokens = RoutedTokens.of(stage.document_ids) if self.sparse else None
        hidden, statistics = self.math(stage.hidden, attention_inputs, tokens)
        routing = stage.routing if statistics is None else stage.routing.with_layer(self.sparse_row, statistics)
        return self.stage.pack(stage._replace(hidden=hidden, routing=routing))

    def compile(self, *args, **kwargs):
        """torch.compile the layer's math only: the stage's shared attention inputs stay a Python-side cache."""
        self.math = torch.compile(self.math, *args, **kwargs)


class FinalNormPipe(RMSNorm):
    """Layer L+1: drops document ids and positions, which nothing after it needs (a mixture's routing statistics
    go on to the loss). Granite divides its logits by logits_scaling: done here, to the LM head's input (the head is
    linear), so every loss path sees it.

    With multi-token prediction trained, the layer holds the MTP layer too (`mtp`, its tensors in this layer's file
    under `mtp.`), which reads the normed hidden states, the next tokens' embedding and the attention inputs
    (stage_inputs, the stage's): its normed output and the document ids (which mask its labels) follow the main
    hidden states to the shared head."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, stage_inputs=None, attention_impl="sdpa"):
        architecture = architecture_of(config)
        super().__init__(config.hidden_size, config.rms_norm_eps, scale_in_fp32=architecture.norm_scale_in_fp32,
                         offset=architecture.offset_norms)
        self.stage = StageTuple(config)
        self.mtp = MultiTokenPrediction(config, attention_impl) if self.stage.multi_token else None
        replicated(self, parallel)
        hook_gradient_sums(self, parallel)
        self.logits_multiplier = 1 / architecture.logits_scaling
        self.stage_inputs = stage_inputs

    def forward(self, inputs):
        stage = self.stage.unpack(inputs)
        normed = super().forward(stage.hidden)
        head_inputs = (scaled(normed, self.logits_multiplier),)
        if self.mtp is not None:
            attention_inputs = self.stage_inputs(normed, stage.document_ids, stage.position_ids,
                                                 self.mtp.layer.self_attn.window)
            tokens = RoutedTokens.of(stage.document_ids) if self.mtp.layer.sparse else None
            predicted = self.mtp(normed, stage.next_embedded, attention_inputs, tokens)
            head_inputs += (scaled(predicted, self.logits_multiplier), stage.document_ids)
        routing = stage.routing.tensors() if stage.routing is not None else ()
        return (*head_inputs, *routing) if len(head_inputs) + len(routing) > 1 else head_inputs[0]


def scaled(x, multiplier):
    """x * multiplier (Granite's multipliers); the same x, with no kernel, at 1."""
    return x if multiplier == 1 else x * multiplier


class LMHeadPipe(nn.Linear):
    """Layer L+2: hidden states to logits (this rank's vocabulary rows under tensor parallelism); with
    chunked_loss, the hidden states and the weight, which the loss projects a chunk of tokens at a time
    (models/loss.py), so no layer output holds the logits."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, chunked_loss=False):
        super().__init__(config.hidden_size, vocabulary_rows(config, parallel)[0], bias=False)
        if parallel.size > 1:
            mark_sharded(self.weight, 0)
        self.parallel, self.chunked_loss = parallel, chunked_loss
        self.multi_token = trains_multi_token_prediction(config)

    def forward(self, hidden):
        return lm_head(self, hidden, self.chunked_loss)


def lm_head(module, inputs, chunked_loss=False):
    """The LM head of `module`'s weight: its own, or the embedding's when tied (DeepSpeed's TiedLayerSpec calls
    forward_fn(embedding, inputs)). inputs: the hidden states, or those and a mixture's routing statistics, which
    follow the head's outputs to the loss (head_outputs); with multi-token prediction (module.multi_token), the MTP
    layer's hidden states and the document ids after the main hidden states, the former through the same head."""
    hidden, *rest = inputs if isinstance(inputs, tuple) else (inputs,)
    mtp = ()
    if module.multi_token:
        mtp_hidden, document_ids, *rest = rest
        mtp = ((mtp_hidden if chunked_loss else module.parallel.logits(mtp_hidden, module.weight)), document_ids)
    if chunked_loss:
        # A view, not the leaf: DeepSpeed hooks the outputs that have a grad_fn to start each backward (the bf16
        # optimizer clears its gradients there), and so runs that before the weight's gradient accumulates.
        return hidden, module.weight.view_as(module.weight), *mtp, *rest
    logits = module.parallel.logits(hidden, module.weight)
    return (logits, *mtp, *rest) if mtp or rest else logits


def decoder_on_meta(config, tensor_parallel=1, layer_index=None):
    """One decoder layer on the meta device (shapes and split dimensions, no memory): layer_index's, or (None) a
    sparse one where the model has any, its largest kind."""
    if layer_index is None:
        sparse = architecture_of(config).sparse_layers
        layer_index = sparse.index(True) if True in sparse else 0
    plan = StagePlan(parallel=TensorParallel(tensor_parallel), device="meta")
    return DecoderLayerPipe(config, stage_inputs=None, layer_index=layer_index, plan=plan)


def decoder_kinds_of(config):
    """Each decoder layer's kind, (its token mixer, whether its feed-forward is sparse): the layers of one kind hold
    the same tensors."""
    architecture = architecture_of(config)
    return list(zip(architecture.mixer_layers, architecture.sparse_layers))


def layers_on_meta(config, parallel=NO_TENSOR_PARALLEL):
    """{pipeline index: module} with one decoder layer standing for all of its kind (decoder_kinds_of), built on the
    meta device (no memory): the shapes and split dimensions of every layer file."""
    kinds = decoder_kinds_of(config)
    plan = StagePlan(parallel=parallel, device="meta")
    with torch.device("meta"):
        decoders = {kind: DecoderLayerPipe(config, stage_inputs=None, layer_index=kinds.index(kind), plan=plan)
                    for kind in set(kinds)}
        modules = {0: EmbeddingPipe(config, parallel), config.num_hidden_layers + 1: FinalNormPipe(config, parallel)}
        if not config.tie_word_embeddings:
            modules[config.num_hidden_layers + 2] = LMHeadPipe(config, parallel)
    modules.update({i + 1: decoders[kind] for i, kind in enumerate(kinds)})
    return modules
