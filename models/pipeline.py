"""The model as DeepSpeed layer specs, split into stages. Specs are built into modules only on the rank that owns
them, so no rank ever holds more than its own stage."""
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime import utils as ds_utils

from models.llama import (DecoderLayerPipe, EmbeddingPipe, FinalNormPipe, LMHeadPipe, StageAttentionInputs,
                          causal_lm_loss, head_dim_of, tied_lm_head)
from models.layout import num_pipeline_layers

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


def layer_parameter_counts(config):
    """Parameters of each pipeline layer, from the config alone (nothing is built)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = head_dim_of(config)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    if getattr(config, "attention_bias", False) or config.model_type == "qwen2":
        attn += head_dim * (heads + 2 * kv_heads)
    if getattr(config, "attention_bias", False) and config.model_type != "qwen2":
        attn += hidden
    mlp = 3 * hidden * inter + ((2 * inter + hidden) if getattr(config, "mlp_bias", False) else 0)
    decoder = attn + mlp + 2 * hidden
    embedding = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else embedding
    return [embedding] + [decoder] * layers + [hidden, head]


def stage_bounds_from_decoder_counts(decoder_counts, num_hidden_layers):
    """Stage boundaries from decoder layers per stage; the embedding joins the first stage, norm and head the last."""
    if sum(decoder_counts) != num_hidden_layers or min(decoder_counts) < 0:
        raise ValueError(f"partition {list(decoder_counts)} must list decoder layers per stage summing to "
                         f"num_hidden_layers ({num_hidden_layers}).")
    bounds = [0]
    for count in decoder_counts:
        bounds.append(bounds[-1] + count)
    bounds = [b + 1 for b in bounds]
    bounds[0], bounds[-1] = 0, num_pipeline_layers(num_hidden_layers)
    return bounds


class LlamaPipeline(PipelineModule):
    """DeepSpeed's PipelineModule with partitions computed from the config instead of by building every layer
    (DeepSpeed's 'parameters' method builds each layer on every rank to count it), plus explicit partitions."""

    def __init__(self, config, partition, **kwargs):
        self.model_config = config
        self.partition = partition
        super().__init__(partition_method=partition if isinstance(partition, str) else "explicit", **kwargs)

    def _partition_layers(self, method="parameters"):
        stage = self._topo.get_coord(self.global_rank).pipe
        if isinstance(self.partition, str) and self.partition != "parameters":
            return super()._partition_layers(self.partition)
        if self.partition == "parameters":
            self.parts = ds_utils.partition_balanced(layer_parameter_counts(self.model_config), self.num_stages)
        else:
            if len(self.partition) != self.num_stages:
                raise ValueError(f"partition {list(self.partition)} has {len(self.partition)} entries for "
                                 f"{self.num_stages} stages.")
            self.parts = stage_bounds_from_decoder_counts(self.partition, self.model_config.num_hidden_layers)
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_pipeline_module(config, topology, partition="parameters", attention_impl="sdpa",
                          activation_checkpoint_interval=0):
    check_model_config(config)
    return LlamaPipeline(config, partition,
                         layers=build_pipeline_layers(config, attention_impl),
                         topology=topology,
                         loss_fn=causal_lm_loss,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         # The embedding's input is integer ids: reentrant checkpointing of it would get no grad.
                         checkpointable_layers=[DecoderLayerPipe.__name__])
