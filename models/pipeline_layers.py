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

from models.architecture import COMPOSED, GEMMA3, GEMMA4, architecture_of
from models.context_parallel import NO_CONTEXT_PARALLEL, ContextParallel, wrap_attention_cores
from models.decoder import DecoderLayer, Gemma3Decoder, Gemma4Decoder
from models.gemma3 import Gemma3RMSNorm
from models.gemma4 import Gemma4RMSNorm, kv_sources
from models.expert_parallel import NO_EXPERT_PARALLEL, ExpertParallel
from models.linear_attention import KEPT_AS_STORED
from models.moe import RoutedTokens
from models.multi_token_prediction import MultiTokenPrediction, next_tokens
from models.norms import RMSNorm
from models.sigmoid_router import FP32_MARKER
from models.tensor_parallel import (NO_TENSOR_PARALLEL, StageLinear, TensorParallel, hook_gradient_sums, mark_sharded,
                                    materialize, parallelize, replicated, stage_linear, vocabulary_rows)


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
    and position, (batch, seq); a mixture's Routing (None for a dense model). Gemma 4 adds what its layers read
    beyond the hidden states: with per-layer embeddings the token ids and the model's first hidden states
    (`embedded`), which each layer's per-layer input is computed from where the layer lives; with shared key/values
    {source layer: (keys, values)} of the source layers whose keys and values a later layer reuses. With
    multi-token prediction trained, the shared embedding of each position's next token (`next_embedded`, laid out
    as hidden), which the last stage's MTP layer reads (models/multi_token_prediction.py) and whose gradient goes
    back to the embedding through every stage."""
    hidden: torch.Tensor
    document_ids: torch.Tensor
    position_ids: torch.Tensor
    routing: Routing | None = None
    input_ids: torch.Tensor | None = None
    embedded: torch.Tensor | None = None
    shared_kv: dict | None = None
    next_embedded: torch.Tensor | None = None


def trains_multi_token_prediction(config):
    """Whether the run trains the MTP layer: the run's mtp_loss_scale, which its config checks set on the model
    config (training/config_checks.py), > 0."""
    return getattr(config, "mtp_loss_scale", 0.0) > 0


class StageTuple:
    """StageActivations as the tuple of tensors DeepSpeed's engine sends between stages, for one model: (hidden[,
    loss sums][, embedded][, next embedded][, keys and values of each source layer carried], document ids,
    positions[, token ids][, counts]).

    Which source layers' keys and values a tuple carries depends on where it is: `after` (the layer whose output it
    is; -1: the embedding's) carries those stored at or before it that a layer after it reuses, so the tuple at
    each boundary is the same for every micro-batch, and the keys and values take their gradient back to the stage
    that computed them."""

    def __init__(self, config):
        architecture = architecture_of(config)
        self.moe, self.sparse_layers = architecture.moe, sum(architecture.sparse_layers)
        self.per_layer = architecture.decoder == GEMMA4 and bool(config.hidden_size_per_layer_input)
        self.kv_sources = kv_sources(config) if architecture.decoder == GEMMA4 else {}
        self.multi_token = trains_multi_token_prediction(config)

    def carried_sources(self, after):
        """The source layers whose keys and values the tuple after layer `after` carries, in order."""
        return sorted({source for reuser, source in self.kv_sources.items() if source <= after < reuser})

    def pack(self, activations, after=-1):
        routing = activations.routing
        floating = [activations.hidden]
        if routing is not None and routing.loss_sums is not None:
            floating.append(routing.loss_sums)
        if self.per_layer:
            floating.append(activations.embedded)
        if self.multi_token:
            floating.append(activations.next_embedded)
        for source in self.carried_sources(after):
            floating.extend(activations.shared_kv[source])
        integers = [activations.document_ids, activations.position_ids]
        if self.per_layer:
            integers.append(activations.input_ids)
        if routing is not None:
            integers.append(routing.counts)
        return (*floating, *integers)

    def unpack(self, tensors, after=-1):
        tensors = list(tensors)
        hidden = tensors.pop(0)
        loss_sums = tensors.pop(0) if self.moe is not None and self.moe.loss_sum else None
        embedded = tensors.pop(0) if self.per_layer else None
        next_embedded = tensors.pop(0) if self.multi_token else None
        shared_kv = {source: (tensors.pop(0), tensors.pop(0)) for source in self.carried_sources(after)}
        document_ids, position_ids = tensors.pop(0), tensors.pop(0)
        input_ids = tensors.pop(0) if self.per_layer else None
        routing = Routing(tensors.pop(0), loss_sums) if self.moe is not None else None
        return StageActivations(hidden, document_ids, position_ids, routing, input_ids, embedded, shared_kv,
                                next_embedded)

    def start(self, hidden, document_ids, position_ids, input_ids=None, next_embedded=None):
        """The tuple the embedding hands on: a mixture's routing statistics start at zeros; Gemma 4's per-layer
        embeddings take the token ids and the embedded tokens; a trained MTP layer the next tokens' embedding."""
        return self.pack(StageActivations(hidden, document_ids, position_ids, self.initial_routing(hidden.device),
                                          input_ids, hidden, {}, next_embedded))

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

    def multi_token_prediction(self, config):
        """The MTP layer (models/multi_token_prediction.py) split as the decoder layers are: its decoder layer by
        this plan (its experts' slice, its parts by tensor parallelism's PART_PLANS); its projection of [embedding |
        hidden] and its norms whole on every rank and applied to its own tokens, as a decoder layer's norms are (the
        projection, 2 h x h, is small beside the layer it feeds), their gradients summed over the group under
        sequence parallelism."""
        with self.building():
            mtp = MultiTokenPrediction(config, self.attention_impl)
        self.apply(mtp.layer)
        mtp.projection = stage_linear(mtp.projection, StageLinear, self.parallel)
        for part in (mtp.embedding_norm, mtp.hidden_norm, mtp.projection, mtp.norm):
            replicated(part, self.parallel)
        if self.device != "meta":
            materialize(mtp, self.device)
        hook_gradient_sums(mtp, self.parallel)
        return mtp


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
    row lives on the rank whose vocabulary share holds it (padding_idx there, None on the others). With multi-token
    prediction trained, each position's next token is the whole sequence's, which under context parallelism may sit
    on another rank (the context group's, `context`)."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, context=NO_CONTEXT_PARALLEL):
        rows, padding_idx = vocabulary_rows(config, parallel)
        super().__init__(rows, config.hidden_size, padding_idx=padding_idx)
        if parallel.size > 1:
            mark_sharded(self.weight, 0)
        self.parallel, self.context = parallel, context
        self.architecture = architecture_of(config)  # Granite's multiplier, Gemma's scale
        self.stage = StageTuple(config)
        self.multi_token = self.stage.multi_token  # the head (when tied) hands the MTP layer's outputs on too

    def forward(self, inputs):
        input_ids, document_ids, position_ids = inputs
        next_embedded = (self.embedded(self.context.of_whole_sequences(next_tokens, input_ids)) if self.multi_token
                         else None)
        return self.stage.start(self.embedded(input_ids), document_ids, position_ids, input_ids, next_embedded)

    def embedded(self, input_ids):
        embedded = self.parallel.embedding(input_ids, self.weight, self.padding_idx)
        return scaled(embedded, self.architecture.embedding_scale(embedded.dtype))


class StageDecoder:
    """What makes a decoder layer a pipeline layer, between stage tuples: the stage's shared attention inputs
    (stage_inputs, built once per micro-batch) and a sparse layer's routed tokens go in, its routing statistics join
    the tuple's. Mixed into each family's decoder layer (below), whose state dict stays transformers'."""

    def __init__(self, config, stage_inputs, layer_index=0, plan=None):
        plan = plan or PLAIN_STAGE
        with plan.building():
            super().__init__(config, layer_index, plan.attention_impl)
        plan.apply(self)
        self.stage_inputs = stage_inputs
        self.stage = StageTuple(config)
        self.layer_index = layer_index
        self.sparse_row = sum(architecture_of(config).sparse_layers[:layer_index])  # its row of the routing counts
        # a sparse layer's per-sequence routing sums over the context group's tokens (DeepSeek-V3's sequence-wise loss)
        self.whole_rows = plan.context.whole_rows if plan.context.size > 1 else None
        self.math = super().forward

    def forward(self, inputs):
        stage = self.stage.unpack(inputs, self.layer_index - 1)
        attention_inputs = self.stage_inputs(stage.hidden, stage.document_ids, stage.position_ids,
                                             self.window)
        tokens = RoutedTokens.of(stage.document_ids, self.whole_rows) if self.sparse else None
        hidden, statistics, stage = self.run(stage, attention_inputs, tokens)
        routing = stage.routing if statistics is None else stage.routing.with_layer(self.sparse_row, statistics)
        return self.stage.pack(stage._replace(hidden=hidden, routing=routing), self.layer_index)

    def run(self, stage, attention_inputs, tokens):
        """(hidden states, routing statistics or None, the stage's activations with what the layer adds)."""
        return *self.math(stage.hidden, attention_inputs, tokens), stage

    def compile(self, *args, **kwargs):
        """torch.compile the layer's math only: the stage's shared attention inputs stay a Python-side cache."""
        self.math = torch.compile(self.math, *args, **kwargs)


class DecoderLayerPipe(StageDecoder, DecoderLayer):
    """The composed decoder layer (models/decoder.py) as a pipeline layer."""


class Gemma3DecoderPipe(StageDecoder, Gemma3Decoder):
    """Gemma 3's decoder layer as a pipeline layer."""


class Gemma4DecoderPipe(StageDecoder, Gemma4Decoder):
    """Gemma 4's decoder layer as a pipeline layer: it reads the token ids and embedded tokens for its per-layer
    input, and a reusing layer its source's keys and values from the tuple; a storing layer adds its own."""

    def run(self, stage, attention_inputs, tokens):
        hidden, statistics, key_value = self.math(stage.hidden, attention_inputs, tokens, stage.input_ids,
                                                  stage.embedded, stage.shared_kv.get(self.kv_source))
        if self.stores_kv:  # heads-first views, made contiguous once: the engine sends them as they are
            key_value = tuple(t.contiguous() for t in key_value)
            stage = stage._replace(shared_kv={**stage.shared_kv, self.layer_index: key_value})
        return hidden, statistics, stage


DECODER_PIPES = {COMPOSED: DecoderLayerPipe, GEMMA3: Gemma3DecoderPipe, GEMMA4: Gemma4DecoderPipe}


def decoder_pipe(config):
    """The pipeline layer class of the model's decoder layers."""
    return DECODER_PIPES[architecture_of(config).decoder]


class StageFinalNorm:
    """What makes a final norm the pipeline's layer L+1: it drops document ids, positions and what else only the
    decoder layers read (a mixture's routing statistics go on to the loss). Granite divides its logits by
    logits_scaling: done here, to the LM head's input (the head is linear), so every loss path sees it. Mixed into
    each family's final norm (below).

    With multi-token prediction trained, the layer holds the MTP layer too (`mtp`, its tensors in this layer's file
    under `mtp.`), which reads the normed hidden states, the next tokens' embedding and the attention inputs
    (stage_inputs, the stage's): its normed output and the document ids (which mask its labels) follow the main
    hidden states to the shared head."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, stage_inputs=None, plan=None):
        architecture = architecture_of(config)
        super().__init__(config.hidden_size, config.rms_norm_eps, **self.norm_options(architecture))
        self.stage = StageTuple(config)
        replicated(self, parallel)
        self.mtp = (plan or StagePlan(parallel=parallel)).multi_token_prediction(config) if self.stage.multi_token \
            else None
        hook_gradient_sums(self, parallel)
        self.logits_multiplier = 1 / architecture.logits_scaling
        self.stage_inputs = stage_inputs
        self.last_layer = config.num_hidden_layers - 1

    @staticmethod
    def norm_options(architecture):
        return {}

    def forward(self, inputs):
        stage = self.stage.unpack(inputs, self.last_layer)
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


class FinalNormPipe(StageFinalNorm, RMSNorm):
    @staticmethod
    def norm_options(architecture):
        return {"scale_in_fp32": architecture.norm_scale_in_fp32, "offset": architecture.offset_norms}


class Gemma3FinalNormPipe(StageFinalNorm, Gemma3RMSNorm):
    pass


class Gemma4FinalNormPipe(StageFinalNorm, Gemma4RMSNorm):
    pass


FINAL_NORM_PIPES = {COMPOSED: FinalNormPipe, GEMMA3: Gemma3FinalNormPipe, GEMMA4: Gemma4FinalNormPipe}


def final_norm_pipe(config):
    return FINAL_NORM_PIPES[architecture_of(config).decoder]


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
    return decoder_pipe(config)(config, stage_inputs=None, layer_index=layer_index, plan=plan)


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
    # Gemma's layers differ by type (sliding or full, storing or reusing keys and values): each is built
    own_layers = architecture_of(config).decoder != COMPOSED
    with torch.device("meta"):
        decoders = {kind: decoder_pipe(config)(config, stage_inputs=None, layer_index=kinds.index(kind), plan=plan)
                    for kind in ([] if own_layers else set(kinds))}
        modules = {0: EmbeddingPipe(config, parallel),
                   config.num_hidden_layers + 1: final_norm_pipe(config)(config, parallel, plan=plan)}
        if not config.tie_word_embeddings:
            modules[config.num_hidden_layers + 2] = LMHeadPipe(config, parallel)
        modules.update({i + 1: decoder_pipe(config)(config, stage_inputs=None, layer_index=i, plan=plan) if own_layers
                        else decoders[kind] for i, kind in enumerate(kinds)})
    return modules
