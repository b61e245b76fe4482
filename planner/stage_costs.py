"""What each stage costs in compute and memory, per rank, from the model config and the workload alone (nothing is
built): the cost the `balanced` partition minimises and the per-stage figures the memory plan prints.

Per layer kind (LayerCosts):
- compute: training FLOPs per micro-batch (forward, backward = 2x forward, and the forward again when the layer is
  recomputed by activation checkpointing). Decoder layers count their attention at seq_length, the LM head its
  matmul over the whole vocabulary; the embedding (a gather) and the final norm are free.
- activations: what autograd and the engine keep per micro-batch in flight (1F1B keeps up to num_stages - stage
  micro-batches on a stage; the last stage also keeps two micro-batches of its output (the logits, or with the
  chunked loss the head's input); under the zero-bubble schedule
  stage s also keeps up to s micro-batches waiting for their weight gradients), and the largest short-lived peak
  of one backward pass (a recomputed chunk, the LM head's fp32 loss gradients, or the chunked loss's one chunk).
The training state beside them (weights, gradients, optimizer, buffers, the optimizer step's peak, host memory) is
planner/training_state.py's, from the stage's parameters and largest tensor.

Context parallelism over c ranks (models/context_parallel.py): every rank computes on 1/c of each sequence's tokens
(the workload's `tokens`), its queries attend over the whole sequence (attention FLOPs: local tokens x
seq_length), attention keeps the whole sequence's keys and values for backward (all-gathered, this rank's key/value
heads) and their gradients while it runs backward, and each stage holds one additive mask per local half (local
chunk x the keys up to it, in the activation dtype, per row) when rows hold padding or packed documents: counted
so, though rows of one whole document need none (models/context_parallel.py).

Tensor parallelism (Megatron's layout, models/tensor_parallel.py) over t ranks: every figure is one rank's. The
projections, the embedding and the LM head hold 1/t of their weights (norms and row-parallel biases stay whole),
and the matmuls do 1/t of the FLOPs; attention heads, MLP columns and logits split by t. With sequence parallelism
the residual stream, the norms and the stage-boundary hidden states hold 1/t of the tokens; each column-parallel
group (q/k/v, gate/up, LM head) all-gathers its input, which backward keeps (full tokens, per layer and micro-batch
in flight) unless recompute_sequence_gather gathers it again into one pooled buffer; its input gradient over all
tokens is summed into another before the reduce-scatter. Without sequence parallelism the residual stream is whole
on every rank.

A stage's cost, which the `balanced` partition minimises on the costliest stage, is its compute in units of one
decoder layer (the slowest stage sets a pipeline's pace) as long as its memory fits the device; a stage over the
device's memory costs more than any that fits, by how far over it is. bench/trainer_profile.py compares stage
compute times measured on a device with these FLOPs.
"""
from models.architecture import architecture_of, head_dim_of, key_value_heads
from models.partition import (DECODER, DECODERS, EMBEDDING, HEAD, NORM, decoder_kinds, kind_layer, layer_kinds,
                              mtp_decoder)
from models.pipeline_layers import StageTuple
from schedules.orders import rank_orders
from schedules.rules import chunk_ids, chunks_per_rank, in_flight_micro_batches, waiting_micro_batches
from schedules.zbv_order import configured_zbv_durations
from planner import training_state
from planner.decoder_costs import INT64_BYTES, DecoderCosts
from planner.training_state import FP32_BYTES
from planner.workload import check_tensor_parallel

# The share of a device's memory the plan does not model (CUDA context, NCCL buffers, allocator fragmentation):
# `balanced` fills stages to the rest.
UNMODELLED_DEVICE_SHARE = 0.1


class LayerCosts:
    """Compute and memory of each layer kind for one micro-batch of a workload, and of stages built from them.

    The activation figures follow what this project's layers and DeepSpeed's pipeline engine keep alive; they were
    checked against saved-tensor hooks (tests/test_partition.py) and against torch's memory profiler and peak RSS
    on the CPU (bench/memory_plan_check.py).
    """

    def __init__(self, config, workload):
        self.config, self.workload = config, workload
        check_tensor_parallel(config, workload)
        t = workload.tensor_parallel  # every split count below divides by t (check_tensor_parallel)
        tokens, hidden, vocab = workload.tokens, config.hidden_size, config.vocab_size // t
        residual, gathered = workload.residual_tokens, workload.gathered_input_tokens
        act = workload.activation_bytes
        decoders = {kind: DecoderCosts(config, workload, kind_layer(config, kind))
                    for kind in set(decoder_kinds(config))}
        chunked = workload.loss_chunk_tokens > 0
        # The chunked loss's working set: one chunk of fp32 logits (and its activation-dtype copies below fp32),
        # and, where its weight gradient is summed in fp32 (fp16, or fp32 sums), a product to add to that sum no
        # larger than the chunk's fp32 logits (models/loss.py add_weight_grad).
        weight_grad_bytes = FP32_BYTES if workload.precision == "fp16" or workload.sums_gradients_in_fp32 else act
        chunk = min(workload.loss_chunk_tokens, tokens)
        chunk_logits = chunk * vocab * FP32_BYTES
        chunk_bytes = (chunk_logits + chunk * vocab * (act if act != FP32_BYTES else 0)
                       + (chunk_logits if weight_grad_bytes != act else 0))
        # A trained MTP layer (models/multi_token_prediction.py), held by the final norm's layer: its decoder layer's
        # costs (DecoderCosts), its projection of [embedding | hidden] (2 h x h) and three norms whole on every rank
        # and run on its tokens; its output takes the LM head a second time (`heads`), and every stage boundary
        # carries the next tokens' embedding beside the hidden states.
        mtp_layer = mtp_decoder(config)
        mtp = DecoderCosts(mtp_layer[0], workload, mtp_layer[1]) if mtp_layer else None
        heads = 2 if mtp else 1
        mtp_own = 2 * hidden * hidden + 3 * hidden if mtp else 0
        norm = hidden + (mtp.parameters + mtp_own if mtp else 0)
        mtp_flops = mtp.matmul_flops + 2 * residual * 2 * hidden * hidden if mtp else 0
        # vocab is this rank's share; parameters are this rank's too. A tied head is a second copy of the embedding
        # where they sit on different ranks (held_sum).
        self.parameters = {EMBEDDING: vocab * hidden, NORM: norm, HEAD: vocab * hidden,
                           **{kind: decoder.parameters for kind, decoder in decoders.items()}}
        self.largest_tensor = {EMBEDDING: vocab * hidden, NORM: max(hidden, mtp.largest_tensor if mtp else 0),
                               HEAD: vocab * hidden,
                               **{kind: decoder.largest_tensor for kind, decoder in decoders.items()}}
        # LoRA (models/lora.py): only the adapters train; they add their parameters to a decoder layer's.
        lora = workload.lora
        self.trained = ({EMBEDDING: 0, NORM: 0, HEAD: 0, **{kind: decoder.adapters for kind, decoder in
                                                          decoders.items()}} if lora.enabled
                        else dict(self.parameters))
        self.largest_file = {EMBEDDING: self.trained[EMBEDDING], NORM: self.trained[NORM], HEAD: self.trained[HEAD],
                             **{kind: decoder.largest_file for kind, decoder in decoders.items()}}
        self.largest_trained = ({EMBEDDING: 0, NORM: 0, HEAD: 0,
                                 **{kind: lora.rank * max(hidden, decoder.inter * t) if decoder.adapters else 0
                                    for kind, decoder in decoders.items()}} if lora.enabled
                                else self.largest_tensor)
        self.optimized = {**self.trained, **{kind: self.trained[kind] + (decoder.experts_not_held if
                                                                        workload.zero_stage >= 1 else 0)
                                             for kind, decoder in decoders.items()}}  # what ZeRO-1 shards over every
        # data-parallel rank: under expert parallelism every expert (planner/decoder_costs.py)
        self.forward_flops = {EMBEDDING: 0, NORM: mtp_flops + (mtp.forward_flops - mtp.matmul_flops if mtp else 0),
                              HEAD: heads * 2 * tokens * hidden * vocab,
                              **{kind: decoder.forward_flops for kind, decoder in decoders.items()}}
        # W, the weight gradients a split backward defers (models/weight_grads.py): a trained matmul's forward FLOPs
        # (the chunked loss computes its head's in F, models/loss.py); B is the rest of the backward. A frozen base
        # skips them (its backward computes input gradients only).
        matmuls = {EMBEDDING: 0, NORM: mtp_flops, HEAD: self.forward_flops[HEAD],
                   **{kind: decoder.matmul_flops for kind, decoder in decoders.items()}}
        self.frozen_weight_grad_flops = matmuls if lora.enabled else dict.fromkeys(matmuls, 0)
        self.weight_grad_flops = {kind: (2 * tokens * decoders[kind].adapters if kind in DECODERS else 0)
                                  if lora.enabled else (0 if kind == HEAD and chunked else flops)
                                  for kind, flops in matmuls.items()}
        self.saved_bytes = {
            # Vocabulary-parallel: this rank's local ids and the mask of ids outside its rows.
            EMBEDDING: tokens * (INT64_BYTES + 1) if t > 1 else 0,
            # The norm's fp32 input and inverse RMS, its normalised output, and its scaled output as the LM head's
            # input (gathered under sequence parallelism).
            # The chunked loss keeps no input of the head: it has its gradients already (models/loss.py).
            # The MTP layer's: its decoder layer's, its projection's input and its norms' as the final norm's.
            NORM: heads * (residual * (FP32_BYTES * (hidden + 1) + act * hidden) + (0 if chunked else
                                                                                   gathered * act * hidden))
            + (mtp.saved_bytes + 2 * residual * hidden * act
               + 2 * residual * (FP32_BYTES * (hidden + 1) + act * hidden) if mtp else 0),
            # Logits: the loss's fp32 log-softmax and its shifted labels (the logits themselves: see
            # last_output_bytes); vocabulary-parallel, the labels as local ids and two boolean token masks
            # (models/tensor_parallel.py). Chunked: the gradients of the head's input (all tokens) and weight
            # computed in forward (fp32 weight gradient under fp16; none for a frozen head), under every schedule.
            HEAD: (heads * act * tokens * hidden + (0 if lora.enabled else weight_grad_bytes * vocab * hidden)
                   if chunked else heads * tokens * (vocab * FP32_BYTES + INT64_BYTES + (2 if t > 1 else 0))),
            **{kind: decoder.saved_bytes for kind, decoder in decoders.items()}}
        # Gradients alive at once while a layer runs backward (a decoder's: planner/decoder_costs.py); the loss's two
        # fp32 logits-sized gradients.
        pooled = 1 if workload.splits_sequence else 0
        self.backward_bytes = {EMBEDDING: 0, NORM: mtp.backward_bytes if mtp else 0,
                               HEAD: chunk_bytes if chunked else heads * 2 * tokens * vocab * FP32_BYTES,
                               **{kind: decoder.backward_bytes for kind, decoder in decoders.items()}}
        # The last stage's output, which the engine holds (below): the logits, or the chunked loss's input.
        self.last_output_bytes = heads * (residual * hidden * act if chunked else tokens * vocab * act)
        # A micro-batch waiting for its W (zero-bubble schedule) keeps each deferred linear layer's input and output
        # gradient (a decoder's: planner/decoder_costs.py); the logits head's input and its logits-sized gradient (the
        # chunked loss's head leaves no W: models/loss.py).
        self.weight_grad_bytes = {
            EMBEDDING: 0, NORM: mtp.weight_grad_bytes if mtp else 0,
            HEAD: 0 if chunked else heads * act * (gathered * hidden + tokens * vocab),
            **{kind: decoder.weight_grad_bytes for kind, decoder in decoders.items()}}
        # What a checkpointed run of layers keeps beside its input (a sparse layer's dispatch under expert
        # parallelism: planner/decoder_costs.py).
        self.checkpoint_kept_bytes = {EMBEDDING: 0, NORM: 0, HEAD: 0,
                                      **{kind: decoder.checkpoint_kept_bytes for kind, decoder in decoders.items()}}
        # What a checkpoint input holds: the hidden states (and a trained MTP layer's next tokens' embedding); a
        # stage boundary holds the whole tuple (boundary_bytes).
        self.hidden_bytes = heads * residual * hidden * act
        self.stage_tuple = StageTuple(config)
        self.key_value_bytes = [2 * workload.tokens * kv_heads * head_dim_of(config, layer) // t * act
                                for layer, kv_heads in enumerate(key_value_heads(config))]
        self.largest_boundary = max(range(-1, config.num_hidden_layers), key=self.boundary_bytes)
        # Sequence parallelism's pool, once per stage: the buffer every column group sums its input gradient into,
        # and with recompute_sequence_gather the one it gathers its input into.
        self.pool_bytes = tokens * hidden * act * pooled * (2 if workload.recompute_sequence_gather else 1)
        # Context parallelism's attention masks, once per stage: local chunk x keys up to it, for both halves.
        c = workload.context_parallel
        chunk = workload.seq_length // (2 * c)
        # One mask per sliding window shorter than the sequence, and one for the layers without when rows hold
        # padding or packed documents (models/attention.py StageAttentionInputs).
        # A window's mask over rows of one document each is one row's, shared by the micro-batch's rows.
        windows = {w if w and w < workload.seq_length else None for w in architecture_of(config).sliding_windows}
        rows = workload.micro_batch_size if workload.document_masks else 1
        full_masks = workload.micro_batch_size if None in windows and workload.document_masks else 0
        masks = len(windows - {None}) * rows + full_masks
        self.context_mask_bytes = (workload.micro_batch_size * chunk * chunk * (2 * c + 1) * act
                                   * len(windows) if c > 1 else 0)
        # Packed documents' and sliding windows' additive masks (models/attention.py), which attention keeps for
        # backward: each per micro-batch in flight. Rows of one document, padded or not, attend with is_causal and
        # need none without a window.
        self.document_mask_bytes = masks * workload.seq_length ** 2 * act if c == 1 else 0

    def boundary_bytes(self, after):
        """(bytes of the tuple one micro-batch sends after decoder layer `after` (-1: the embedding's), of its
        floating tensors: the gradient that comes back) on one rank, as models/pipeline_layers.py StageTuple packs
        it: the hidden states (and a trained MTP layer's next tokens' embedding), a mixture's fp32 loss sums, Gemma 4's
        embedded tokens (with per-layer embeddings; their share under sequence parallelism) and the keys and values
        of each source layer a later layer reuses (this rank's heads, every token); the int64 document ids and
        positions, Gemma 4's token ids, a mixture's routing counts."""
        workload, config, stage = self.workload, self.config, self.stage_tuple
        floating = self.hidden_bytes + sum(self.key_value_bytes[source] for source in stage.carried_sources(after))
        if stage.per_layer:
            floating += workload.residual_tokens * config.hidden_size * workload.activation_bytes
        ids = 3 if stage.per_layer else 2
        integers = ids * workload.tokens * INT64_BYTES
        if stage.moe is not None:
            integers += stage.sparse_layers * stage.moe.num_experts * INT64_BYTES
            floating += stage.moe.num_experts * FP32_BYTES if stage.moe.loss_sum else 0
        return floating + integers, floating

    def stage_boundaries(self, kinds, start):
        """(the tuple a stage receives, the one it sends, the bytes of the latter its own layers made: the hidden
        states and the keys and values of its source layers it carries on): boundary_bytes of a stage of `kinds`
        from pipeline layer `start`; where start is not known, the largest boundary's, all of its keys and values
        made on the stage (the safe side)."""
        if start is None:
            sent_after = self.largest_boundary
            received, made_sources = self.boundary_bytes(sent_after), self.stage_tuple.carried_sources(sent_after)
        else:
            received, sent_after = self.boundary_bytes(start - 2), start + len(kinds) - 2
            made_sources = [source for source in self.stage_tuple.carried_sources(sent_after) if source >= start - 1]
        made = self.hidden_bytes + sum(self.key_value_bytes[source] for source in made_sources)
        return received, self.boundary_bytes(sent_after), made

    def chunks(self, kinds):
        """DeepSpeed's activation checkpointing: consecutive runs of `interval` layers from the stage's first layer,
        each checkpointed when it holds decoder layers only (the project's checkpointable_layers)."""
        interval = self.workload.activation_checkpoint_interval
        if interval == 0:
            return [(kinds, False)]
        runs = [kinds[i:i + interval] for i in range(0, len(kinds), interval)]
        return [(run, all(kind in DECODERS for kind in run)) for run in runs]

    def stage_flops(self, kinds):
        flops = 0
        for run, checkpointed in self.chunks(kinds):
            forward = sum(self.forward_flops[kind] for kind in run)
            flops += forward * (4 if checkpointed else 3) - sum(self.frozen_weight_grad_flops[kind] for kind in run)
        return flops

    def stage_pass_flops(self, kinds):
        """stage_flops by pass: F (the forward; the chunked loss's head all of its own), W (weight_grad_flops), and
        B, the rest (input gradients, the forward again where checkpointed)."""
        forward = sum(self.forward_flops[kind] for kind in kinds)
        if HEAD in kinds and self.workload.loss_chunk_tokens > 0:
            forward += 2 * self.forward_flops[HEAD] - self.frozen_weight_grad_flops[HEAD]
        weight = sum(self.weight_grad_flops[kind] for kind in kinds)
        return {"F": forward, "B": self.stage_flops(kinds) - forward - weight, "W": weight}

    def stage_activation_bytes(self, kinds, in_flight, waiting=0, start=None):
        """Peak activation memory: what in_flight micro-batches keep for their backward and `waiting` ones for
        their weight gradients, the engine's buffers, and the largest short-lived peak of one layer's backward
        (after recomputing its checkpointed chunk). start: the stage's first pipeline layer, which decides the
        tuples at its boundaries (stage_boundaries)."""
        received, sent, made = self.stage_boundaries(kinds, start)
        per_micro_batch, transient = 0, 0
        for run, checkpointed in self.chunks(kinds):
            saved = sum(self.saved_bytes[kind] for kind in run)
            workspace = max(self.backward_bytes[kind] for kind in run)
            if checkpointed:
                per_micro_batch += self.hidden_bytes + sum(self.checkpoint_kept_bytes[kind] for kind in run)
                transient = max(transient, saved + workspace)
            else:
                per_micro_batch += saved
                transient = max(transient, workspace)
        persistent = 0
        if kinds[0] != EMBEDDING:  # the received input stays until its gradient is sent; a receive buffer and copy
            per_micro_batch += received[0]
            persistent += 2 * received[0]
        if kinds[-1] != HEAD:  # the output (what the stage made of it) stays until its backward; a receive buffer
            per_micro_batch += made  # for its gradient
            persistent += sent[1]
        else:  # DeepSpeed never frees the last stage's outputs: each of its two buffers keeps one until reused
            persistent += min(2, self.workload.micro_batches) * self.last_output_bytes
        decoders = any(kind in DECODERS for kind in kinds)
        if decoders or HEAD in kinds:  # column-parallel groups use the stage's pool
            persistent += self.pool_bytes
        if decoders:
            persistent += self.context_mask_bytes
            per_micro_batch += self.document_mask_bytes
        waiting_bytes = waiting * sum(self.weight_grad_bytes[kind] for kind in kinds)
        return in_flight * per_micro_batch + waiting_bytes + persistent + transient

    def held_sum(self, figures, kinds):
        """figures summed over the kinds a stage (or a rank's chunks) holds; a tied LM head beside the embedding on
        one rank counted once: DeepSpeed's TiedLayerSpec builds one module there (models/pipeline.py), a copy of
        its own on another rank."""
        total = sum(figures[kind] for kind in kinds)
        if self.config.tie_word_embeddings and EMBEDDING in kinds and HEAD in kinds:
            total -= figures[HEAD]
        return total

    def stage_parameters(self, kinds):
        return self.held_sum(self.parameters, kinds)

    def stage_trained(self, kinds):
        return self.held_sum(self.trained, kinds)

    def stage_state_bytes(self, kinds):
        """Weights, gradients and optimizer state of a stage, in bytes."""
        return training_state.state_bytes(self.workload, self.stage_parameters(kinds), self.stage_trained(kinds),
                                          self.held_sum(self.optimized, kinds))

    def stage_buffer_bytes(self):
        return training_state.buffer_bytes(self.workload, max(self.largest_trained.values()))

    def stage_host_bytes(self, kinds):
        return training_state.host_bytes(self.workload, self.stage_trained(kinds), max(self.largest_trained.values()))

    def stage_snapshot_bytes(self, kinds):
        return training_state.snapshot_bytes(self.workload, self.stage_trained(kinds))

    def stage_save_bytes(self, kinds):
        """(device, host) bytes a save takes beyond the training state (training_state.save_device_bytes,
        save_host_bytes)."""
        return (training_state.save_device_bytes(self.workload, max(self.largest_trained[kind] for kind in kinds)),
                training_state.save_host_bytes(self.workload, max(self.largest_file[kind] for kind in kinds)))

    def stage_step_bytes(self, kinds):
        return training_state.step_bytes(self.workload, self.stage_trained(kinds),
                                         max(self.largest_trained[kind] for kind in kinds))


class StageCostModel:
    """Compute, memory and the cost of a stage given its layer kinds. device_bytes: the memory each device has
    (None: no limit)."""

    def __init__(self, config, workload, num_stages, device_bytes=None):
        self.layers = LayerCosts(config, workload)
        self.workload, self.num_stages, self.device_bytes = workload, num_stages, device_bytes
        # one decoder layer: a sliding one of Gemma's, the first layer of a model without a DECODER kind
        self.compute_unit = self.layers.stage_flops([DECODER if DECODER in self.layers.parameters
                                                     else decoder_kinds(config)[0]])

    def in_flight(self, stage):
        return in_flight_micro_batches(stage, self.num_stages, self.workload.micro_batches)

    def waiting(self, stage):
        return waiting_micro_batches(stage, self.num_stages, self.workload.micro_batches,
                                     self.workload.pipeline_schedule, self.workload.zero_bubble_max_waiting)

    def activation_bytes(self, stage, kinds, start=None):
        """Under zero_bubble the larger of two moments: before a B, and just after it, when its micro-batch has
        traded its activations for its weight-gradient tensors (more than a checkpointed micro-batch keeps). The
        first stage runs each B with its W, as 1F1B does (schedules/orders.py): only the first moment. start: the
        stage's first pipeline layer (LayerCosts.stage_boundaries)."""
        in_flight, waiting = self.in_flight(stage), self.waiting(stage)
        peak = self.layers.stage_activation_bytes(kinds, in_flight, waiting, start)
        if self.workload.pipeline_schedule == "zero_bubble" and stage > 0:
            peak = max(peak, self.layers.stage_activation_bytes(kinds, in_flight - 1, waiting + 1, start))
        return peak

    def memory_bytes(self, stage, kinds, start=None):
        """Peak memory: weights, optimizer state and buffers, plus the largest of the backward passes (gradients
        and activations), the optimizer step and a save (after the step: with the gradients)."""
        return peak_bytes(self.layers.stage_state_bytes(kinds), self.activation_bytes(stage, kinds, start),
                          self.layers.stage_step_bytes(kinds), self.layers.stage_buffer_bytes(),
                          self.layers.stage_save_bytes(kinds)[0])

    def compute(self, kinds):
        """A stage's training compute per micro-batch in decoder layers: its share of the step's time."""
        return self.layers.stage_flops(kinds) / self.compute_unit

    def cost(self, stage, kinds, start=None):
        """(bytes over the device memory the plan models, compute): a stage that fits is as costly as its compute.
        start: the stage's first pipeline layer, where known (models/partition.py balanced_mixed_counts)."""
        if self.device_bytes is None:
            return 0, self.compute(kinds)
        usable = self.device_bytes * (1 - UNMODELLED_DEVICE_SHARE)
        return max(0, self.memory_bytes(stage, kinds, start) - usable), self.compute(kinds)


def peak_bytes(state, activations, step, buffers, save):
    """A stage's peak on its device: the state that stays (weights, optimizer, buffers), then the largest of the
    backward passes (gradients and activations), the optimizer step (gradients included) and a save's buffer beside
    the gradients."""
    gradients = state["gradients"]
    return state["weights"] + state["optimizer"] + buffers + max(gradients + activations, step, gradients + save)


def balanced_stage_cost(config, workload, num_stages, device_bytes=None):
    """The stage cost models/partition.py's `balanced` method minimises for this run."""
    return StageCostModel(config, workload, num_stages, device_bytes).cost


def chunk_micro_batches_at_peak(workload, num_stages, rank):
    """[(micro-batches between F and B, waiting only for W) per local chunk] at the moment this rank holds the most
    micro-batch-chunks (its chunks are of a size): from its order (schedules/orders.py). Interleaving holds more
    on the first ranks than 1F1B, (p - r - 1)·2 + (v - 1)·p + 1 chunks on rank r; ZB-V at most 2p on every rank."""
    order = rank_orders(workload.pipeline_schedule, num_stages, workload.micro_batches, workload.virtual_stages,
                        workload.zero_bubble_max_waiting, configured_zbv_durations(workload.zbv_times))[rank]
    chunks = chunks_per_rank(workload.pipeline_schedule, workload.virtual_stages)
    # zbv splits every backward but the first chunk's (rank 0's local chunk 0: its B runs whole, its W is left out)
    split = [workload.pipeline_schedule == "zbv" and (rank, chunk) != (0, 0) for chunk in range(chunks)]
    in_flight, waiting, peak = [0] * chunks, [0] * chunks, ((0, 0), [(0, 0)] * chunks)
    for kind, chunk, _ in order:
        in_flight[chunk] += {"F": 1, "B": -1, "W": 0}[kind]
        waiting[chunk] += {"F": 0, "B": 1, "W": -1}[kind] if split[chunk] else 0
        held = (sum(in_flight) + sum(waiting), sum(in_flight))
        peak = max(peak, (held, list(zip(in_flight, waiting))))
    return peak[1]


def stage_plan(config, bounds, workload):
    """Per stage: its layers, parameters, compute (TFLOP and decoder layers' worth) and memory by kind (bytes).
    bounds: each global chunk's (models/partition.py's chunk_bounds); a rank with several chunks is one row."""
    if chunks_per_rank(workload.pipeline_schedule, workload.virtual_stages) > 1:
        return chunked_stage_plan(config, bounds, workload)
    num_stages = len(bounds) - 1
    model = StageCostModel(config, workload, num_stages)
    kinds_of = layer_kinds(config)
    rows = []
    for stage in range(num_stages):
        start, stop = bounds[stage], bounds[stage + 1]
        kinds = kinds_of[start:stop]
        state = model.layers.stage_state_bytes(kinds)
        rows.append({
            "stage": stage, "layers": (start, stop), "chunks": [(start, stop)], "decoder_layers": decoder_count(kinds),
            "parameters": model.layers.stage_parameters(kinds),
            "tflops_per_micro_batch": model.layers.stage_flops(kinds) / 1e12,
            **{f"{name}_bytes": value for name, value in state.items()},
            "activation_bytes": model.activation_bytes(stage, kinds, start),
            "step_bytes": model.layers.stage_step_bytes(kinds),
            "buffer_bytes": model.layers.stage_buffer_bytes(),
            "host_bytes": model.layers.stage_host_bytes(kinds),
            "snapshot_bytes": model.layers.stage_snapshot_bytes(kinds),
            **dict(zip(("save_bytes", "save_host_bytes"), model.layers.stage_save_bytes(kinds))),
            "in_flight": model.in_flight(stage),
            "waiting_for_weight_grads": model.waiting(stage),
            "memory_bytes": model.memory_bytes(stage, kinds, start),
            "compute": model.compute(kinds),
        })
    return rows


def chunked_stage_plan(config, bounds, workload):
    """stage_plan's rows for a schedule with several chunks per rank: a rank's weights, state and compute are its
    chunks' together; its activations each chunk's with the micro-batches that chunk holds at the rank's peak,
    each chunk with its own receive buffers (a chunk that does not start the model receives its input, one that
    does not end it its output's gradient) and its own largest backward workspace (an upper bound: one runs at a
    time)."""
    per_rank = chunks_per_rank(workload.pipeline_schedule, workload.virtual_stages)
    num_stages = (len(bounds) - 1) // per_rank
    model = StageCostModel(config, workload, num_stages)
    kinds_of = layer_kinds(config)
    rows = []
    for rank in range(num_stages):
        chunks = [(bounds[chunk], bounds[chunk + 1]) for chunk in chunk_ids(workload.pipeline_schedule, num_stages,
                                                                            rank, workload.virtual_stages)]
        chunk_kinds = [kinds_of[start:stop] for start, stop in chunks]
        kinds = sum(chunk_kinds, [])
        held = chunk_micro_batches_at_peak(workload, num_stages, rank)
        activations = sum(model.layers.stage_activation_bytes(chunk, in_flight, waiting, start)
                          for chunk, (in_flight, waiting), (start, _) in zip(chunk_kinds, held, chunks))
        state = model.layers.stage_state_bytes(kinds)
        step = model.layers.stage_step_bytes(kinds)
        buffers = model.layers.stage_buffer_bytes()
        save = model.layers.stage_save_bytes(kinds)
        rows.append({
            "stage": rank, "layers": chunks[0], "chunks": chunks, "decoder_layers": decoder_count(kinds),
            "parameters": model.layers.stage_parameters(kinds),
            "tflops_per_micro_batch": model.layers.stage_flops(kinds) / 1e12,
            **{f"{name}_bytes": value for name, value in state.items()},
            "activation_bytes": activations, "step_bytes": step, "buffer_bytes": buffers,
            "host_bytes": model.layers.stage_host_bytes(kinds),
            "snapshot_bytes": model.layers.stage_snapshot_bytes(kinds),
            **dict(zip(("save_bytes", "save_host_bytes"), save)),
            "in_flight": sum(in_flight for in_flight, _ in held),
            "waiting_for_weight_grads": sum(waiting for _, waiting in held),
            "memory_bytes": peak_bytes(state, activations, step, buffers, save[0]),
            "compute": model.compute(kinds),
        })
    return rows


def decoder_count(kinds):
    return sum(kind in DECODERS for kind in kinds)


def layer_ranges(row):
    """A row's layers as first-last, its chunks' joined by '+' (rank 0 under zbv: '0-3+14-16')."""
    return "+".join(f"{start}-{stop - 1}" for start, stop in row["chunks"])


def format_stage_plan(rows):
    """The plan as a table: layers, parameters, compute and estimated memory per stage."""
    width = max(9, *(len(layer_ranges(row)) for row in rows))
    lines = [f"{'stage':>5} {'layers':>{width}} {'decoders':>8} {'params':>9} {'TFLOP/mb':>9} {'memory':>9} "
             f"{'compute':>7}"]
    for row in rows:
        lines.append(f"{row['stage']:>5} {layer_ranges(row):>{width}} {row['decoder_layers']:>8} "
                     f"{row['parameters'] / 1e9:>8.2f}B {row['tflops_per_micro_batch']:>9.2f} "
                     f"{row['memory_bytes'] / 2**30:>6.1f}GiB {row['compute']:>7.2f}")
    lines.append(f"compute in decoder layers; largest / smallest stage compute: {compute_spread(rows):.3f}")
    return "\n".join(lines)


def compute_spread(rows):
    """Largest stage compute over the smallest: 1.0 is a perfect balance."""
    computes = [row["compute"] for row in rows]
    return max(computes) / min(computes)
