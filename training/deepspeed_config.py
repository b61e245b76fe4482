"""DeepSpeed's config from a run's Hydra config: the `deepspeed:` node with precision, the LR schedule and the
optimizer's placement filled in."""
from omegaconf import OmegaConf


def deepspeed_config(cfg, total_steps):
    """DeepSpeed's config from the Hydra node, with precision and the LR schedule filled in; monitors are
    returned apart because the trainer drives them itself."""
    ds = OmegaConf.to_container(cfg.deepspeed, resolve=True)
    monitors = {key: ds.pop(key) for key in ("tensorboard", "wandb", "csv_monitor", "comet") if key in ds}
    # precision decides which is enabled; other keys of a bf16/fp16 node added under deepspeed are kept
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": cfg.precision == "bf16"}
    ds["fp16"] = {"initial_scale_power": 16, **ds.get("fp16", {}), "enabled": cfg.precision == "fp16"}
    if cfg.precision != "fp32":  # bf16 + fp32 sums: DeepSpeed's bf16 optimizer; fp16 or offload: ZeRO-1's own
        ds["data_types"] = {**ds.get("data_types", {}), "grad_accum_dtype": cfg.grad_accum_dtype}
    ds["scheduler"] = lr_scheduler_config(cfg, total_steps)
    # DeepSpeed's partitioning of tensors sent between stages assumes they are equal on every tensor-parallel rank;
    # under sequence parallelism each rank already sends only its own tokens.
    ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    if cfg.offload_optimizer == "cpu":
        # ZeRO-1 keeps its fp32 partition and Adam's moments in pinned host memory; the step runs DeepSpeed's
        # CPU Adam (ops/adam/cpu_adam, JIT-built on first use: scripts/setup.sh prebuilds it).
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        ds["optimizer"]["params"].pop("torch_adam", None)
    if not ds["optimizer"]["params"].get("torch_adam", False):
        ds["optimizer"]["params"].pop("fused", None)  # an argument of torch's AdamW, not of DeepSpeed's Adams
    return ds, monitors


def lr_scheduler_config(cfg, total_steps):
    # DeepSpeed's schedulers need a warmup of at least one step; warmup_steps=0 means starting at the peak LR.
    warmup = max(1, min(cfg.warmup_steps, total_steps))
    start_ratio = 0.0 if cfg.warmup_steps > 0 else 1.0
    if cfg.lr_scheduler == "cosine":
        # Without warmup, start past iteration -1, where this scheduler would set the first step's LR to 0.
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total_steps, "warmup_num_steps": warmup, "warmup_type": "linear",
            "warmup_min_ratio": start_ratio, "cos_min_ratio": cfg.min_lr_ratio,
            "last_batch_iteration": -1 if cfg.warmup_steps > 0 else 0}}
    params = {"warmup_num_steps": warmup, "warmup_type": "linear", "warmup_min_lr": start_ratio * cfg.learning_rate,
              "warmup_max_lr": cfg.learning_rate}
    if cfg.lr_scheduler == "linear":
        return {"type": "WarmupDecayLR", "params": {"total_num_steps": total_steps, **params}}
    return {"type": "WarmupLR", "params": params}


def accumulation_warning(cfg):
    """What a run that sums gradients in its 16-bit dtype should know, or None."""
    if cfg.precision == "fp32" or cfg.grad_accum_dtype == "fp32":
        return None
    return (f"warning: grad_accum_dtype={cfg.grad_accum_dtype}: each step sums {cfg.gradient_accumulation_steps} "
            f"micro-batches' gradients in {cfg.grad_accum_dtype} (8 mantissa bits for bf16; bench/grad_accumulation.py "
            f"measured ~1e-2 relative error at 64 micro-batches). grad_accum_dtype=fp32 sums them exactly enough.")
