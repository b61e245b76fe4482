"""The model as DeepSpeed layer specs, split into stages. Specs are built into modules only on the rank that owns
them, so no rank ever holds more than its own stage."""
import dataclasses

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from models.llama import (DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, LMHeadPipe, StageAttentionInputs,
                          causal_lm_loss, tied_lm_head)
from models.partition import Workload, describe_workload, format_stage_plan, stage_bounds, stage_plan

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_IMPLS = ("sdpa", "eager")


def check_model_config(config):
    """Refuse configs whose layout this pipeline does not implement, before anything is built."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type '{config.model_type}' is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (the LLaMA layout).")
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) is not a multiple of "
                         f"num_key_value_heads ({kv_heads}).")
    if config.hidden_act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"):
        raise ValueError(f"hidden_act '{config.hidden_act}' is not supported.")


def build_pipeline_layers(config, attention_impl="sdpa"):
    """Layer specs in pipeline index order (models/layout.py): embedding, decoder layers, final norm, LM head."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl '{attention_impl}' is not one of {ATTENTION_IMPLS}.")
    stage_inputs = StageAttentionInputs(config)
    tied = config.tie_word_embeddings
    embedding = TiedLayerSpec("embed", EmbeddingPipe, config) if tied else LayerSpec(EmbeddingPipe, config)
    head = (TiedLayerSpec("embed", EmbeddingPipe, config, forward_fn=tied_lm_head)
            if tied else LayerSpec(LMHeadPipe, config))
    decoders = [LayerSpec(DecoderLayerPipe, config, stage_inputs, attention_impl)
                for _ in range(config.num_hidden_layers)]
    return [embedding, *decoders, LayerSpec(FinalNormPipe, config), head]


class LlamaPipeline(PipelineModule):
    """DeepSpeed's PipelineModule with partitions computed from the config instead of by building every layer
    (DeepSpeed's 'parameters' method builds each layer on every rank to count it), plus explicit and balanced
    partitions (models/partition.py). Rank 0 prints the plan: layers, parameters, compute and memory per stage."""

    def __init__(self, config, partition, workload, **kwargs):
        self.model_config = config
        self.partition = partition
        self.workload = workload
        super().__init__(partition_method=partition if isinstance(partition, str) else "explicit", **kwargs)

    def _partition_layers(self, method="parameters"):
        class_names = [spec.typename.__name__ for spec in self._layer_specs]
        self.parts = stage_bounds(self.model_config, self.num_stages, self.partition, self.workload, class_names)
        if self.global_rank == 0:
            print(f"pipeline partition '{self.partition}' for {describe_workload(self.workload)}:\n"
                  f"{format_stage_plan(stage_plan(self.model_config, self.parts, self.workload))}", flush=True)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_pipeline_module(config, topology, partition="parameters", attention_impl="sdpa",
                          activation_checkpoint_interval=0, workload=None):
    """The pipeline module of this rank's stage. workload (models/partition.py) describes the run for the
    balanced partition and the printed plan; its stage count, data-parallel degree and checkpoint interval are
    taken from the arguments here."""
    check_model_config(config)
    workload = dataclasses.replace(workload or Workload(), data_parallel=topology.get_dim("data"),
                                   activation_checkpoint_interval=activation_checkpoint_interval)
    return LlamaPipeline(config, partition, workload,
                         layers=build_pipeline_layers(config, attention_impl),
                         topology=topology,
                         loss_fn=causal_lm_loss,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         # The embedding's input is integer ids: reentrant checkpointing of it would get no grad.
                         checkpointable_layers=[DecoderLayerPipe.__name__])
