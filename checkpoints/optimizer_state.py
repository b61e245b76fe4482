"""The optimizer's state saved per layer, beside the layer files, in a form every layout loads.

For each pipeline layer a training checkpoint holds `layer_XX[-model_YY]-optim_states.pt`: per parameter its fp32
master weight and the optimizer's moments (Adam's exp_avg, exp_avg_sq), whole across data-parallel ranks (ZeRO-1's
partitions gathered) and laid out like the layer's own files: sliced under tensor parallelism (the replicated
parameters in rank 0's file only), and under expert parallelism each slice of the experts in a file of its own,
`layer_XX-experts_SS-of-KK-optim_states.pt`, gathered from that slice's replicas alone. A resume cuts each rank's share
out of them, one layer at a time, for whatever stages, tensor- and data-parallel ranks, ZeRO stage, offload and
partition it runs with; the step count, the LR schedule's position and the engine's counters travel in
trainer_state.json. DeepSpeed's own per-rank copies (ZeRO's *_optim_states.pt, the optimizer inside mp_rank_*) are
not written: they would double a checkpoint and load only on the layout that wrote them. Hand-written because
DeepSpeed's universal checkpoint needs an offline conversion and does not handle a PipelineModule outside
Megatron-DeepSpeed.

Where ZeRO keeps each parameter's piece is DeepSpeed's own fragment bookkeeping (param._hp_mapping, ZeRO's fp32
partitions), reached through deepspeed_internals/ and kept there rather than DeepSpeed's public
safe_get_full_* / safe_set_full_*, which cover the same fragments: safe_get_full_* all-reduces every parameter over
the data-parallel group where a save reduces it to the one rank that writes it; the optimizer-state setters need
the fragment links ZeRO makes only in its first step, which a resume comes before (they raise there); without ZeRO
(fp32) they return None, so this module's own path stays anyway; safe_get_local_* are ZeRO-3's. Nor are they faster:
measured on this project's CPU, a save and a load took as long with either.
"""
import glob
import os

import torch
import torch.distributed as dist
from deepspeed.pipe import TiedLayerSpec

import collectives
from checkpoints.layer_files import (expert_rows_of_shards, layer_files_and_expert_shards, load_weights_only,
                                    own_experts, tensors_for_rank)
from checkpoints.state_files import STATE_ADVICE
from deepspeed_internals.access import (checkpoint_engine_of, engine_counters, is_zero_optimizer, layer_specs,
                                        loss_scaler_state, replay_cpu_adam_steps, restore_engine_counters,
                                        restore_loss_scaler_state, zero_fp32_partitions, zero_fragment,
                                        zero_wrapped_optimizer)
from errors import ConfigError

MASTER = "fp32"  # the key of the master weights in a layer's optimizer-state file


def optimizer_state_path(layer_path):
    """layer_03-model_states.pt -> layer_03-optim_states.pt (layer_03-model_01-… keeps its tensor-parallel rank)."""
    return layer_path[:-len("model_states.pt")] + "optim_states.pt"


def saved_optimizer_state_paths(tag_dir, index):
    return sorted(glob.glob(os.path.join(tag_dir, f"layer_{index:02d}-*optim_states.pt")))


def stage_layers(module):
    """(pipeline layer index, layer, whether this stage saves it) for each layer with trained parameters here. A
    tied weight (the embedding again as the LM head on the last stage) is saved with its first layer, by the stage
    holding it, and read from that layer's files by every stage that holds it."""
    layers, seen = [], set()
    for local, layer in enumerate(module.forward_funcs):
        if isinstance(layer, torch.nn.Module) and trained_parameters(layer):
            layers.append((module.layer_indices[local], layer, True))
            seen.add(id(layer))
    for key, tied in module.tied_modules.items():
        if id(tied) not in seen and trained_parameters(tied):
            first = next(i for i, spec in enumerate(layer_specs(module))
                         if isinstance(spec, TiedLayerSpec) and spec.key == key)
            layers.append((first, tied, False))
    return layers


def trained_parameters(layer):
    """{name: parameter} of the parameters the optimizer steps (under LoRA the adapters: the base is frozen)."""
    return {name: param for name, param in layer.named_parameters() if param.requires_grad}


class MasterState:
    """Where this rank keeps each parameter's fp32 master weight and optimizer moments: ZeRO's flat partitions, of
    which a parameter may own a fragment (deepspeed_internals.access.zero_fragment), or, without ZeRO in fp32, the parameter
    itself and torch's per-parameter state."""

    def __init__(self, engine):
        self.zero = is_zero_optimizer(engine.optimizer)
        self.optimizer = zero_wrapped_optimizer(engine.optimizer) if self.zero else engine.optimizer
        self.partitions = zero_fp32_partitions(engine.optimizer) if self.zero else None
        if not self.zero and (engine.fp16_enabled() or engine.bfloat16_enabled()):
            raise ConfigError("below fp32 the master weights are ZeRO's: set zero_stage=1.")
        self.create_state()

    def holders(self):
        """The tensors the optimizer steps: ZeRO's flat partitions, or the parameters."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def create_state(self):
        """Adam-type optimizers create their state at the first step: one with zero gradients and lr 0 creates it
        and changes no weight (AdamW's decay is lr x weight_decay). Every rank calls this together (the skipping
        optimizer's step is a collective)."""
        holders, groups = self.holders(), self.optimizer.param_groups
        if all(self.optimizer.state.get(holder) for holder in holders):
            return
        grads, lrs = [holder.grad for holder in holders], [group["lr"] for group in groups]
        for holder in holders:
            holder.grad = torch.zeros_like(holder)
        for group in groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for holder, grad in zip(holders, grads):
            holder.grad = grad
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        self.step = 0

    @property
    def moment_keys(self):
        holder = self.holders()[0]
        return sorted(key for key, value in self.optimizer.state[holder].items()
                      if torch.is_tensor(value) and value.shape == holder.shape)

    @property
    def step(self):
        return int(self.optimizer.state[self.holders()[0]]["step"])

    @step.setter
    def step(self, step):
        for holder in self.holders():
            state = self.optimizer.state[holder]
            if torch.is_tensor(state["step"]):
                state["step"].fill_(step)
            else:
                state["step"] = step
        for group in self.optimizer.param_groups:
            if "step" in group:  # DeepSpeed's fused Adam keeps a group's step too
                group["step"] = step
        replay_cpu_adam_steps(self.optimizer, step)  # offload's CPU Adam keeps its own in C++

    def fragment(self, param, key):
        """(offset in the flattened parameter, this rank's piece of its master weight or moment `key`), or None
        when ZeRO placed none of the parameter in this rank's partition."""
        if not self.zero:
            return 0, (param if key == MASTER else self.optimizer.state[param][key]).detach().view(-1)
        fragment = zero_fragment(param)
        if fragment is None:
            return None
        partition = self.partitions[fragment.partition]
        source = partition if key == MASTER else self.optimizer.state[partition][key]
        return fragment.param_start, source.detach().narrow(0, fragment.partition_start, fragment.numel)

    def gathered(self, param, key, group, writer, writes):
        """The parameter's `key` (its tensor on this rank: under expert parallelism this rank's slice of the
        experts) in host memory on rank `writer` of `group`, the ranks holding the parameter alike, where `writes`;
        None on the others. Under ZeRO its fragments are summed into it there, each rank of the group allocating
        the parameter's size in fp32 for the reduction, once at a time; nothing larger than the parameter."""
        if not (self.zero or writes):
            return None
        piece = self.fragment(param, key)
        if not self.zero:
            return piece[1].view(param.shape).to("cpu", copy=True)
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if piece is not None:
            whole.narrow(0, piece[0], piece[1].numel()).copy_(piece[1])
        collectives.reduce(whole, dst=dist.get_global_rank(group, writer), group=group)
        return whole.view(param.shape).cpu() if writes else None

    def assign(self, param, key, value, name, where):
        if value.shape != param.shape:
            raise ConfigError(f"{key} of {name} in {where} has shape {tuple(value.shape)}, this run's parameter "
                              f"{tuple(param.shape)}; the checkpoint is of another model.")
        piece = self.fragment(param, key)
        if piece is not None:
            piece[1].copy_(value.reshape(-1).narrow(0, piece[0], piece[1].numel()))


def save_training_state(engine, tag_dir):
    """Write this stage's layers' optimizer state, in the files models/pipeline.py's saved_parts names (every rank
    takes part: each file's tensors are gathered from ZeRO's fragments on the rank that writes it, the layers'
    files taking turns over the data-parallel ranks) through the engine's checkpoint engine; returns what
    trainer_state.json carries for the resume: the step count, the lr and the LR schedule, the engine's counters
    and fp16's loss scaler."""
    state = MasterState(engine)
    keys = [MASTER, *state.moment_keys]
    module = engine.module
    saved_here = [(index, layer) for index, layer, saves in stage_layers(module) if saves]
    for turn, (index, layer) in enumerate(saved_here):
        parts = module.saved_parts(tag_dir, module.layer_indices.index(index), trained_parameters(layer), turn)
        for part in parts:
            tensors = {key: {name: state.gathered(param, key, part.group, part.writer, part.writes)
                             for name, param in part.tensors.items()} for key in keys}
            if part.writes:
                checkpoint_engine_of(engine).save(tensors, optimizer_state_path(part.path))
            del tensors  # its host copies go before the next file's are made: one file's at a time
    return {"optimizer_step": state.step, "lr": engine.optimizer.param_groups[0]["lr"],
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "engine_counters": engine_counters(engine), "loss_scaler": loss_scaler_state(engine)}


def has_layout_free_state(trainer_state):
    """Whether a checkpoint's optimizer state is saved per layer (this module), so that any layout resumes it;
    older checkpoints hold DeepSpeed's per-rank files, which only their own layout loads."""
    return "optimizer_step" in trainer_state


def check_optimizer_state_files(tag_dir, trainer_state, layer_indices):
    """Every layer's optimizer state is in the checkpoint: one file per tensor-parallel rank that wrote it, and
    under expert parallelism one complete set of expert shards."""
    slices = trainer_state.get("topology", {}).get("tensor_parallel", 1)
    for index in layer_indices:
        paths = saved_optimizer_state_paths(tag_dir, index)
        found = len(layer_files_and_expert_shards(paths)[0]) if paths else 0
        if found != slices:
            raise FileNotFoundError(missing_state_message(tag_dir, index) if not found else
                                    f"checkpoint {tag_dir} has {found} optimizer-state files for layer {index}, its "
                                    f"{slices} tensor-parallel ranks wrote {slices}; copy the checkpoint again, or "
                                    f"set resume_weights_only=true to continue from its weights.")


def load_training_state(engine, tag_dir, trainer_state):
    """The optimizer state of this rank's parameters from the per-layer files (this rank's tensor-parallel slice,
    its experts' rows from the expert shard files that hold them, and its ZeRO fragment; the weights themselves
    came with the layer files), then the step count, lr, LR schedule, counters and loss scaler. Peak memory: one
    parameter's saved state, memory-mapped."""
    state = MasterState(engine)
    keys = [MASTER, *state.moment_keys]
    rank, size = engine.module.parallel.rank, engine.module.parallel.size
    for index, layer, _ in stage_layers(engine.module):
        paths = saved_optimizer_state_paths(tag_dir, index)
        if not paths:
            raise FileNotFoundError(missing_state_message(tag_dir, index))
        paths, shard_paths = layer_files_and_expert_shards(paths)
        saved = [load_weights_only(path, advice=STATE_ADVICE) for path in paths]
        shards = [load_weights_only(path, advice=STATE_ADVICE) for path in shard_paths]
        targets = trained_parameters(layer)
        for key in keys:
            if key not in saved[0]:
                raise ConfigError(f"{paths[0]} holds no '{key}' (it has {sorted(saved[0])}): the checkpoint was "
                                  f"trained with another optimizer; set resume_weights_only=true to start a fresh one.")
            values = tensors_for_rank([own_experts(s[key], targets) for s in saved], targets, rank, size, paths[0])
            for name, param in targets.items():
                if shards and name in shards[0][key]:
                    values[name] = expert_rows_of_shards([s[key] for s in shards], name, param, shard_paths[0])
                if name not in values:
                    raise ConfigError(f"{paths[0]} has no {key} of {name}; the checkpoint is of another model.")
                state.assign(param, key, values[name], name, paths[0])
    state.step = trainer_state["optimizer_step"]
    for group in engine.optimizer.param_groups:  # the schedule sets the lr after a step: this step's is saved
        group["lr"] = trainer_state["lr"]
    if engine.lr_scheduler is not None and trainer_state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
    restore_engine_counters(engine, trainer_state["engine_counters"])
    restore_loss_scaler_state(engine, trainer_state.get("loss_scaler"))


def missing_state_message(tag_dir, index):
    return (f"checkpoint {tag_dir} has no optimizer state for layer {index} "
            f"({os.path.basename(optimizer_state_path(os.path.join(tag_dir, f'layer_{index:02d}-model_states.pt')))}"
            f"); set resume_weights_only=true to continue from its weights with a fresh optimizer.")
