"""The model as DeepSpeed layer specs, split into stages. Specs are built into modules only on the rank that owns
them, so no rank ever holds more than its own stage."""
import dataclasses
import functools

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from checkpoints.layer_files import load_layer_slice
from models.llama import (DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, LMHeadPipe,
                          StageAttentionInputs, causal_lm_loss, check_model_config, tied_lm_head)
from models.partition import Workload, describe_workload, format_stage_plan, stage_bounds, stage_plan
from models.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel

ATTENTION_IMPLS = ("sdpa", "eager")
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_pipeline_layers(config, attention_impl="sdpa", parallel=NO_TENSOR_PARALLEL):
    """Layer specs in pipeline index order (models/layout.py): embedding, decoder layers, final norm, LM head."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl '{attention_impl}' is not one of {ATTENTION_IMPLS}.")
    stage_inputs = StageAttentionInputs(config)
    tied = config.tie_word_embeddings
    embedding = (TiedLayerSpec("embed", EmbeddingPipe, config, parallel) if tied
                 else LayerSpec(EmbeddingPipe, config, parallel))
    head = (TiedLayerSpec("embed", EmbeddingPipe, config, parallel, forward_fn=tied_lm_head)
            if tied else LayerSpec(LMHeadPipe, config, parallel))
    decoders = [LayerSpec(DecoderLayerPipe, config, stage_inputs, attention_impl, parallel)
                for _ in range(config.num_hidden_layers)]
    return [embedding, *decoders, LayerSpec(FinalNormPipe, config, parallel), head]


class LlamaPipeline(PipelineModule):
    """DeepSpeed's PipelineModule with partitions computed from the config instead of by building every layer
    (DeepSpeed's 'parameters' method builds each layer on every rank to count it), plus explicit and balanced
    partitions (models/partition.py). Rank 0 prints the plan: layers, parameters, compute and memory per stage."""

    def __init__(self, config, partition, workload, parallel, **kwargs):
        self.model_config = config
        self.partition = partition
        self.workload = workload
        self.parallel = parallel
        super().__init__(partition_method=partition if isinstance(partition, str) else "explicit", **kwargs)

    def _partition_layers(self, method="parameters"):
        # DeepSpeed's grid made the process groups just before this call, and the layers are built after it.
        self.parallel.group = self._grid.get_slice_parallel_group()
        class_names = [spec.typename.__name__ for spec in self._layer_specs]
        self.parts = stage_bounds(self.model_config, self.num_stages, self.partition, self.workload, class_names)
        if self.global_rank == 0:
            print(f"pipeline partition '{self.partition}' for {describe_workload(self.workload)}:\n"
                  f"{format_stage_plan(stage_plan(self.model_config, self.parts, self.workload))}", flush=True)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        """DeepSpeed's per-layer loading, reading each layer file straight into the layer's parameters
        (checkpoints/layer_files.py): loading costs this stage and nothing more, where DeepSpeed's own loader also
        holds two layers' tensors. Under tensor parallelism each rank reads its slice of a whole layer file, or
        its own file of a checkpoint saved with the same tensor-parallel size."""
        for index, layer in enumerate(self.forward_funcs):
            if not hasattr(layer, "load_state_dict"):  # a tied head's forward function: its weight is tied
                continue
            load_layer_slice(layer, self.ckpt_layer_path_list(load_dir, index), self.parallel.rank,
                             self.parallel.size, strict)
        self._synchronize_tied_weights()


def build_pipeline_module(config, topology, partition="parameters", attention_impl="sdpa",
                          activation_checkpoint_interval=0, workload=None, dtype=None, sequence_parallel=True,
                          recompute_sequence_gather=False):
    """The pipeline module of this rank's stage. topology: DeepSpeed's, with a 'model' axis for tensor
    parallelism (training/distributed.py). workload (models/partition.py) describes the run for the balanced
    partition and the printed plan; its parallel degrees and checkpoint interval are taken from the arguments here.
    dtype: the training dtype to build the stage in (default torch's, fp32), so that a bf16 stage never exists in
    fp32 first."""
    check_model_config(config)
    tp_size = max(1, topology.get_dim("model"))
    rank = torch.distributed.get_rank()
    parallel = TensorParallel(tp_size, getattr(topology.get_coord(rank), "model", 0), sequence_parallel,
                              recompute_sequence_gather)
    workload = dataclasses.replace(workload or Workload(), data_parallel=topology.get_dim("data"),
                                   activation_checkpoint_interval=activation_checkpoint_interval,
                                   tensor_parallel=tp_size, sequence_parallel=sequence_parallel,
                                   recompute_sequence_gather=recompute_sequence_gather)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous_dtype)
    try:
        return LlamaPipeline(config, partition, workload, parallel,
                             layers=build_pipeline_layers(config, attention_impl, parallel),
                             topology=topology,
                             loss_fn=functools.partial(causal_lm_loss, parallel=parallel),
                             activation_checkpoint_interval=activation_checkpoint_interval,
                             # The embedding's input is integer ids: reentrant checkpointing of it would get no grad.
                             checkpointable_layers=[DecoderLayerPipe.__name__])
    finally:
        torch.set_default_dtype(previous_dtype)
