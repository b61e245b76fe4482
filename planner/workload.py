"""What one training step runs, as far as compute and memory depend on it: the planner's view of a run."""
from dataclasses import dataclass

from omegaconf import OmegaConf

from models.lora import NO_LORA, LoraSettings
from models.tensor_parallel import check_tensor_parallel_split

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Workload:
    """conf/base.yaml's defaults; from_cfg fills it from a run's config."""
    seq_length: int = 512
    micro_batch_size: int = 1
    micro_batches: int = 8  # gradient_accumulation_steps: the pipeline's m
    precision: str = "bf16"
    grad_accum_dtype: str = "fp32"  # what a 16-bit run sums its micro-batch gradients in (conf/base.yaml)
    zero_stage: int = 1
    data_parallel: int = 1  # replicas of the model (each context group is one)
    activation_checkpoint_interval: int = 0
    reduce_bucket_size: int = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default
    torch_adam: bool = True  # torch's Adam (conf/base.yaml) rather than DeepSpeed's fused one
    fused_adam: bool = True  # torch's Adam in one kernel (conf/base.yaml's `fused`): no per-tensor temporaries
    tensor_parallel: int = 1  # ranks splitting each layer (conf/base.yaml's tensor_parallel_size)
    sequence_parallel: bool = True  # with tensor_parallel > 1: residual stream on 1/t of the tokens
    recompute_sequence_gather: bool = False  # sequence parallel: gather again in backward rather than keep
    context_parallel: int = 1  # ranks splitting each sequence
    expert_parallel: int = 1  # data-parallel ranks splitting each sparse layer's experts
    checkpoint_keeps_rows: bool = True  # expert parallel: a checkpointed sparse layer keeps its exchanged rows
    document_masks: bool = False  # rows hold packed documents that attend only to themselves: a seq x seq mask
    offload_optimizer: bool = False  # ZeRO-1's fp32 partition, its gradient and Adam's moments in host memory
    pipeline_schedule: str = "1f1b"  # zero_bubble: micro-batches also wait for their weight gradients (W)
    zero_bubble_max_waiting: int | None = None  # zero_bubble: cap on those per stage (None: ZB-H1's s on stage s)
    virtual_stages: int = 1  # interleaved_1f1b: chunks of layers per rank (zbv holds 2)
    zbv_times: list | None = None  # zbv: a chunk's [F, B, W] times (or one per stage) its V order is made for
    loss_chunk_tokens: int = 1024  # the LM head and loss a chunk of tokens at a time; 0: the whole logits
    lora: LoraSettings = NO_LORA  # LoRA adapters: only they train, the rest is frozen
    async_save: bool = False  # a save's snapshot of each rank's checkpoint files in host memory (async_save)

    @classmethod
    def from_cfg(cls, cfg, data_parallel):
        """The workload a run's config describes on `data_parallel` replicas: what the planner costs and the
        balanced partition weighs."""
        ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
        optimizer_params = ds.get("optimizer", {}).get("params", {})
        rows_per_example = 2 if cfg.objective in ("dpo", "simpo") else 1  # a pair's chosen and rejected sequences
        return cls(seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size * rows_per_example,
                   micro_batches=cfg.gradient_accumulation_steps, precision=cfg.precision,
                   grad_accum_dtype=cfg.grad_accum_dtype,
                   zero_stage=cfg.zero_stage, data_parallel=data_parallel,
                   activation_checkpoint_interval=cfg.activation_checkpoint_interval,
                   reduce_bucket_size=int(ds.get("zero_optimization", {}).get("reduce_bucket_size",
                                                                               cls.reduce_bucket_size)),
                   torch_adam=bool(optimizer_params.get("torch_adam", False)),
                   fused_adam=bool(optimizer_params.get("fused", False)),
                   tensor_parallel=cfg.tensor_parallel_size, sequence_parallel=bool(cfg.sequence_parallel),
                   context_parallel=cfg.context_parallel_size, expert_parallel=cfg.expert_parallel_size,
                   checkpoint_keeps_rows=bool(cfg.moe.checkpoint_keeps_rows),
                   document_masks=bool(cfg.data.document_isolation if cfg.data.format in ("text", "indexed")
                                       else cfg.data.packing),
                   recompute_sequence_gather=bool(cfg.recompute_sequence_gather),
                   offload_optimizer=cfg.offload_optimizer == "cpu", pipeline_schedule=cfg.pipeline_schedule,
                   loss_chunk_tokens=cfg.loss_chunk_tokens if cfg.loss_impl == "chunked" else 0,
                   zero_bubble_max_waiting=cfg.zero_bubble_max_waiting, virtual_stages=cfg.virtual_stages or 1,
                   zbv_times=(OmegaConf.to_container(cfg.zbv_times) if OmegaConf.is_list(cfg.zbv_times)
                              else cfg.zbv_times),
                   lora=LoraSettings.from_cfg(cfg.lora), async_save=bool(cfg.async_save))

    @property
    def tokens(self):
        """Tokens of a micro-batch one rank computes on: its share of each sequence under context parallelism."""
        return self.seq_length * self.micro_batch_size // self.context_parallel

    @property
    def key_value_tokens(self):
        """Tokens whose keys and values attention holds: the whole sequences under context parallelism."""
        return self.seq_length * self.micro_batch_size if self.context_parallel > 1 else self.tokens

    @property
    def gradient_reduction_ranks(self):
        """Ranks DeepSpeed averages gradients and partitions ZeRO over: data x context parallel."""
        return self.data_parallel * self.context_parallel

    @property
    def splits_sequence(self):
        """Whether the residual stream holds 1/tensor_parallel of the tokens on each rank."""
        return self.sequence_parallel and self.tensor_parallel > 1

    @property
    def residual_tokens(self):
        """Tokens of the residual stream, norms and stage-boundary hidden states on one rank."""
        return self.tokens // self.tensor_parallel if self.splits_sequence else self.tokens

    @property
    def gathered_input_tokens(self):
        """Tokens of the input a column-parallel group keeps for its backward: all of them, or this rank's share
        when recompute_sequence_gather gathers them again."""
        return self.residual_tokens if self.splits_sequence and self.recompute_sequence_gather else self.tokens

    @property
    def activation_bytes(self):
        return PRECISION_BYTES[self.precision]

    @property
    def sums_gradients_in_fp32(self):
        """A 16-bit run whose micro-batch gradients are summed in fp32 (DeepSpeed's data_types.grad_accum_dtype)."""
        return self.precision != "fp32" and self.grad_accum_dtype == "fp32"

    @property
    def bf16_optimizer(self):
        """DeepSpeed 0.19.8 runs bf16 + ZeRO-1 + fp32 sums without offload through its bf16 optimizer (engine.py
        _do_optimizer_sanity_check); fp16 and offload keep ZeRO-1's optimizer, which sums into an fp32 grad_accum."""
        return self.sums_gradients_in_fp32 and self.precision == "bf16" and not self.offload_optimizer


def check_tensor_parallel(config, workload):
    """check_tensor_parallel_split for a workload: ValueError naming what its tensor-parallel size does not split."""
    check_tensor_parallel_split(config, workload.tensor_parallel, workload.tokens if workload.splits_sequence else None)


def describe_workload(workload):
    checkpointing = (f"checkpoint every {workload.activation_checkpoint_interval} layers"
                     if workload.activation_checkpoint_interval else "no activation checkpointing")
    tensor = ""
    if workload.tensor_parallel > 1:
        sequence = ("sequence parallel, sequence gather recomputed in backward"
                    if workload.splits_sequence and workload.recompute_sequence_gather
                    else "sequence parallel" if workload.splits_sequence else "no sequence parallel")
        tensor = f"tensor-parallel {workload.tensor_parallel} ({sequence}), "
    if workload.context_parallel > 1:
        tensor += f"context-parallel {workload.context_parallel}, "
    experts = f" (experts split over {workload.expert_parallel})" if workload.expert_parallel > 1 else ""
    return (f"seq_length={workload.seq_length}, micro_batch_size={workload.micro_batch_size}, "
            f"{workload.micro_batches} micro-batches, {workload.precision}, ZeRO-{workload.zero_stage}"
            f"{' with optimizer offloaded to CPU' if workload.offload_optimizer else ''}, "
            f"{tensor}data-parallel {workload.data_parallel}{experts}, {checkpointing}"
            f"{f', LoRA rank {workload.lora.rank}' if workload.lora.enabled else ''}"
            f"{schedule_description(workload)}")


def schedule_description(workload):
    cap = workload.zero_bubble_max_waiting
    capped = "" if cap is None else f" (at most {cap} micro-batches waiting for W)"
    return {"zero_bubble": f", zero-bubble schedule{capped}", "zbv": f", ZB-V schedule, 2 chunks per rank{capped}",
            "interleaved_1f1b": f", interleaved 1F1B, {workload.virtual_stages} chunks per rank"}.get(
                workload.pipeline_schedule, "")
