"""Resume: which checkpoint a run starts from, whether it fits the run, what the resume changes, and loading it.

`resume` names a checkpoint (auto: output_dir's newest complete one), else the run starts from the converted model.
Each rank's own look at output_dir, before the process group exists, serves the config checks; a shared
filesystem whose directory cache lags can show a node an older listing, though, so once a collective can carry it
rank 0, holding output_dir's lease, decides: it finishes a move of an abandoned branch a crash interrupted,
resolves `resume`, starts a new branch where the resume goes back in the run's history (checkpoints/branches.py),
and broadcasts its choice, which every rank follows and, once loaded, is checked to have loaded.

A checkpoint resumes onto the same model; its optimizer state, saved per layer, follows any change of layout, and
state that cannot carry over to the run's settings (fp16's loss scale) is dropped only when asked. A fresh start
refuses to mix its checkpoints with an older run's, and every start refuses an output_dir holding what the
trainer did not write and would clean up."""
import dataclasses
import os

import torch.distributed as dist
from transformers import AutoConfig

import collectives
from checkpoints.branches import finish_moves, start_branch
from checkpoints.files import COMPLETE_MARKER, IN_PROGRESS_MARKER, read_latest
from checkpoints.optimizer_state import check_optimizer_state_files, has_layout_free_state, load_training_state
from checkpoints.rng_state import load_rng_state
from checkpoints.tag_dirs import complete_tags, incomplete_tags, is_complete
from checkpoints.trainer_state import read_trainer_state
from cluster.distributed import log_rank0
from cluster.shared_files import VISIBLE_WITHIN_S, wait_for_files
from errors import ConfigError
from models.layout import layer_indices_with_files, text_config_of
from models.lora import adapter_layer_indices
from models.partition import decoder_counts_of_bounds
from cluster.console import say



# --- which checkpoint ------------------------------------------------------------------------------------------------

def resolve_resume(resume, output_dir):
    """(checkpoint dir, tag) to resume from, or None for a fresh start. resume: auto | a checkpoint dir | a tag dir."""
    if resume in (None, "", False):
        return None
    if resume == "auto":
        tags = complete_tags(output_dir)
        return (output_dir, tags[-1]) if tags else None
    path = os.path.abspath(str(resume))
    if is_complete(path):
        return os.path.dirname(path), os.path.basename(path)
    tag = read_latest(path)
    if tag and is_complete(os.path.join(path, tag)):
        return path, tag
    raise ConfigError(f"resume='{resume}' is neither a complete checkpoint tag directory (with a {COMPLETE_MARKER} "
                      f"file) nor a directory whose 'latest' names one; use resume=auto or a valid path.")


def check_fresh_start(output_dir, overwrite):
    """A run that does not resume must not mix its checkpoints with an older run's."""
    tags = complete_tags(output_dir)
    if tags and not overwrite:
        raise ConfigError(f"output_dir '{output_dir}' already holds checkpoints ({', '.join(tags)}); set "
                          f"resume=auto to continue from {tags[-1]}, choose another output_dir, or set "
                          f"overwrite_output_dir=true to delete them.")


def check_output_dir_is_ours(output_dir, model_name_or_path):
    """Nothing in output_dir that a start's cleanup could delete was written by someone else: it is not the model
    the run starts from, and each incomplete global_stepN in it is an interrupted save of this trainer."""
    if os.path.realpath(output_dir) == os.path.realpath(model_name_or_path):
        raise ConfigError(f"output_dir '{output_dir}' is model_name_or_path, the converted model this run starts "
                          f"from: its checkpoints would replace the model's 'latest' and mix with its global_step0; "
                          f"choose another output_dir.")
    others = incomplete_tags(output_dir)[1]
    if others:
        raise ConfigError(f"output_dir '{output_dir}' holds {', '.join(others)}, which no save of this trainer "
                          f"wrote (neither {COMPLETE_MARKER} nor {IN_PROGRESS_MARKER} in it: a converted model, "
                          f"another tool's checkpoint?); move it out of output_dir or choose another output_dir.")


def start_checkpoint_dir(model_name_or_path, resume_from):
    """The tag directory a run loads: the resumed checkpoint's, else the converted model's."""
    if resume_from:
        return os.path.join(*resume_from)
    return os.path.join(model_name_or_path, read_latest(model_name_or_path))


# --- whether it fits the run -----------------------------------------------------------------------------------------

def with_resume(spec, resume_from):
    """spec resuming resume_from ((checkpoint dir, tag), or None for a fresh start), once it fits the run."""
    cfg = spec.cfg
    trainer_state = read_trainer_state(os.path.join(*resume_from)) if resume_from else {}
    if resume_from is None and not cfg.eval_only:
        check_fresh_start(cfg.output_dir, cfg.overwrite_output_dir)
    spec = dataclasses.replace(spec, resume_from=resume_from, trainer_state=trainer_state)
    if resume_from:
        check_resume(spec)
    return spec


def check_resume(spec):
    """The checkpoint to resume fits this run: the same model, its state files present, and state that cannot carry
    over to this run's settings dropped only when asked (resume_drop_state)."""
    cfg, trainer_state, tag_dir = spec.cfg, spec.trainer_state, os.path.join(*spec.resume_from)
    check_same_model(tag_dir, spec.model_config)
    check_same_adapters(spec, tag_dir)
    check_same_reference(spec, tag_dir)
    if cfg.eval_only or cfg.resume_weights_only:
        return
    if not has_layout_free_state(trainer_state):
        return check_resume_topology(trainer_state, spec.layout, False, tag_dir)
    config = spec.model_config
    check_optimizer_state_files(tag_dir, trainer_state, adapter_layer_indices(config.num_hidden_layers)
                                if spec.lora.enabled else
                                layer_indices_with_files(config.num_hidden_layers, config.tie_word_embeddings))
    dropped = dropped_state(trainer_state.get("settings", {}), spec.settings)
    if dropped and not cfg.resume_drop_state:
        raise ConfigError(f"resuming {tag_dir} cannot carry over {', '.join(dropped)}; set resume_drop_state=true "
                          f"to start it fresh, or resume with the checkpoint's settings.")


MODEL_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")


def check_same_model(tag_dir, model_config):
    """A checkpoint resumes only onto the model it was trained as: its config.json against the run's model."""
    path = os.path.join(tag_dir, "config.json")
    if not os.path.isfile(path):
        return
    saved = text_config_of(AutoConfig.from_pretrained(tag_dir)).to_dict()  # a multimodal checkpoint's text model's
    current = model_config.to_dict()
    differ = [f"{key} {saved.get(key)} there, {current.get(key)} here" for key in MODEL_SHAPE_KEYS
              if saved.get(key) != current.get(key)]
    if differ:
        raise ConfigError(f"checkpoint {tag_dir} is of another model than model_name_or_path ({'; '.join(differ)}): "
                          f"resume a checkpoint of this model, or set model_name_or_path to the converted model the "
                          f"checkpoint was trained from.")


def check_same_adapters(spec, tag_dir):
    """A LoRA checkpoint resumes only as LoRA with the same adapters, onto the base it was trained on (its
    manifest's checksum); a full fine-tuning checkpoint only as full fine-tuning."""
    saved, base = spec.trainer_state.get("lora"), spec.trainer_state.get("base_model")
    current = spec.lora.as_dict() if spec.lora.enabled else None
    if saved is None and current is None:
        return
    if saved is None:
        raise ConfigError(f"checkpoint {tag_dir} is a full fine-tuning checkpoint, this run trains LoRA adapters "
                          f"(lora.rank={spec.lora.rank}): to put adapters on its weights, start a new run with "
                          f"model_name_or_path={os.path.dirname(tag_dir)} and no resume; or resume it with lora.rank=0.")
    settings = " ".join(f"lora.{key}={value if key != 'target_modules' else '[' + ','.join(value) + ']'}"
                        for key, value in saved.items() if key != "dropout")
    if current is None:
        raise ConfigError(f"checkpoint {tag_dir} holds LoRA adapters, not a whole model: resume it as LoRA with "
                          f"{settings} (the base is {base['path']}), or export the merged model (python "
                          f"convert2ckpt.py --to_hf --merge_lora --ckpt_dir {os.path.dirname(tag_dir)} ...) and "
                          f"convert it to fine-tune every weight.")
    differ = [key for key in ("rank", "alpha", "target_modules") if saved[key] != current[key]]
    if differ:
        raise ConfigError(f"checkpoint {tag_dir} holds adapters with {settings}; this run has "
                          f"{', '.join(f'lora.{key}={current[key]}' for key in differ)}: set the checkpoint's.")
    converted = spec.converted_model
    if converted.digest != base["manifest_xxh3_128"]:
        raise ConfigError(f"checkpoint {tag_dir} holds adapters trained on the base {base['path']} (checksum "
                          f"{base['manifest_xxh3_128']}), but model_name_or_path {converted.path} has checksum "
                          f"{converted.digest}: "
                          f"another base, whose outputs the adapters would not fit; set model_name_or_path to the "
                          f"base the adapters were trained on.")


def check_same_reference(spec, tag_dir):
    """A DPO checkpoint resumes against the reference it was trained against: the same starting checkpoint."""
    saved = spec.trainer_state.get("reference")
    if not saved or not spec.preference.needs_reference:
        return
    if saved["checkpoint"] != spec.reference_checkpoint:
        raise ConfigError(f"checkpoint {tag_dir} was trained with DPO against the reference log-probabilities of the "
                          f"checkpoint with manifest checksum {saved['checkpoint']}, but model_name_or_path "
                          f"{spec.cfg.model_name_or_path} has checksum {spec.reference_checkpoint}: set "
                          f"model_name_or_path to the checkpoint that run started from.")


def check_resume_topology(trainer_state, topology, weights_only, tag_dir):
    """A checkpoint written before the optimizer state was saved per layer: its state is laid out per stage (and per
    data-parallel rank under ZeRO-1) and cannot follow a change."""
    saved = trainer_state.get("topology")
    if saved and "stage_bounds" not in saved:  # written before the stages' layers were recorded
        topology = degrees_of(topology)
    if saved and saved != topology and not weights_only:
        only_layers_differ = "stage_bounds" in saved and degrees_of(saved) == degrees_of(topology)
        partition = (f", or partition={decoder_counts_of_bounds(saved['stage_bounds'])} to build the checkpoint's "
                     f"stages" if only_layers_differ else "")
        raise ConfigError(f"checkpoint {tag_dir} was trained with {saved}, this run has {topology}; its optimizer "
                          f"state (written before checkpoints saved it per layer) cannot follow a topology change. Set "
                          f"resume_weights_only=true to continue from its weights with a fresh optimizer (the data "
                          f"position is kept by consumed samples){partition}.")


def degrees_of(topology):
    """A saved or current topology without its stage bounds: the parallel degrees alone."""
    return {key: value for key, value in topology.items() if key != "stage_bounds"}


def dropped_state(saved_settings, settings):
    """What a resume under `settings` cannot carry over from a checkpoint written under saved_settings."""
    if saved_settings.get("precision") == "fp16" and settings["precision"] != "fp16":
        return [f"fp16's loss scale (the run goes from fp16 to {settings['precision']})"]
    return []


# --- what it changes -------------------------------------------------------------------------------------------------

def layout_change(trainer_state, layout, settings):
    """'key: old -> new' for each thing a resume changes about the run that wrote the checkpoint."""
    unsplit = {"tensor_parallel": 1, "context_parallel": 1, "expert_parallel": 1}  # recorded only when > 1
    saved = {**unsplit, **trainer_state.get("topology", {}), **trainer_state.get("settings", {})}
    current = {**unsplit, **layout, **settings}
    return [f"{key} {saved[key]} -> {current[key]}" for key in current if key in saved and saved[key] != current[key]]


def describe_resume(spec):
    """What a resume changes about the run that wrote its checkpoint (a line at start-up), or None."""
    if spec.resume_from is None or spec.cfg.resume_weights_only:
        return None
    changes = layout_change(spec.trainer_state, spec.layout, spec.settings)
    if not changes:
        return None
    consumed = spec.trainer_state.get("consumed_samples", 0)
    per_micro_step = spec.data_parallel * spec.cfg.micro_batch_size
    # token shards continue at the very next sample of the blend; the sampler rounds down to whole micro-batches
    again = (f", of which the last {consumed % per_micro_step} are read again: the position rounds down to a whole "
             f"micro-batch of each of the {spec.data_parallel} data-parallel ranks"
             if consumed % per_micro_step and spec.cfg.data.format != "indexed" else "")
    return (f"resuming {os.path.join(*spec.resume_from)} with another layout ({'; '.join(changes)}): the optimizer "
            f"state is resharded from its per-layer files; the data position is kept in samples ({consumed} "
            f"consumed{again})"
            + "".join(f"; dropped: {state}" for state in
                      dropped_state(spec.trainer_state.get("settings", {}), spec.settings)))


def data_position(trainer_state, micro_batches_per_epoch, dp_size, micro_batch_size):
    """(epoch, micro-batches consumed in it) to continue from. Derived from consumed samples, which every rank
    knows (middle stages pull no data) and which stays meaningful when the data-parallel degree changes."""
    consumed = trainer_state.get("consumed_samples", 0) // (dp_size * micro_batch_size)
    return divmod(consumed, micro_batches_per_epoch)


# --- decided once for the job, and loaded ----------------------------------------------------------------------------

def agreed_start(spec):
    """spec resuming the checkpoint rank 0 chose (collective; rank 0 holds output_dir's lease). Rank 0's failure to
    decide (a move that cannot finish) stops every rank, not rank 0 alone."""
    decision, failure = [None, None], None  # (checkpoint, rank 0's error)
    if dist.get_rank() == 0:
        try:
            decision[0] = rank0_choice(spec.cfg)
        except Exception as error:
            decision[1], failure = f"{type(error).__name__}: {error}", error
    collectives.broadcast_object_list(decision, src=0)
    if failure is not None:
        raise failure
    if decision[1]:
        raise RuntimeError(f"rank 0 could not decide which checkpoint to resume: {decision[1]}")
    resume_from = tuple(decision[0]) if decision[0] else None
    if resume_from == spec.resume_from:
        return spec
    if dist.get_rank():
        seen = os.path.join(*spec.resume_from) if spec.resume_from else "no checkpoint"
        say(f"rank {dist.get_rank()}: starting from {os.path.join(*resume_from) if resume_from else 'scratch'}, "
            f"as rank 0 decided; this node saw {seen} (a shared filesystem's directory cache lagging?)")
    if resume_from:
        wait_for_files([os.path.join(*resume_from, COMPLETE_MARKER)], VISIBLE_WITHIN_S)
    return with_resume(spec, resume_from)


def rank0_choice(cfg):
    """Rank 0: the checkpoint to resume, (checkpoint dir, tag) or None, once a move of an abandoned branch that a
    crash interrupted is finished and, where the resume goes back in the run's history, a new branch started."""
    for branch in finish_moves(cfg.output_dir):
        log_rank0(f"finished moving an abandoned branch's checkpoints into {branch} (a crash had interrupted it)")
    resume_from = resolve_resume(cfg.resume, cfg.output_dir)
    if resume_from and not cfg.eval_only:
        moved = start_branch(cfg.output_dir, os.path.join(*resume_from))
        if moved:
            log_rank0(f"resuming {os.path.join(*resume_from)}, older than {cfg.output_dir}'s newest checkpoint "
                      f"({moved[1][-1]}): the run's history branches here; the abandoned branch's checkpoints "
                      f"({', '.join(moved[1])}) and logs were moved, not deleted, to {moved[0]}")
    return resume_from


def check_same_start(spec, loaded_dir, step):
    """Collective, after loading: every rank loaded the checkpoint rank 0 chose (loaded_dir, the tag directory
    DeepSpeed read its state from, None on a fresh start) and restored the same step; else one line naming both."""
    every_rank = [None] * dist.get_world_size()
    collectives.all_gather_object(every_rank, (loaded_dir, step))
    wrong = [(rank, loaded) for rank, loaded in enumerate(every_rank) if loaded != every_rank[0]]
    if wrong:
        rank, (other_dir, other_step) = wrong[0]
        raise RuntimeError(f"rank {rank} loaded {other_dir} at step {other_step}, rank 0 {every_rank[0][0]} at step "
                           f"{every_rank[0][1]} (resume chose {os.path.join(*spec.resume_from)}): a node saw "
                           f"another checkpoint; a restart resumes it on every rank once every node sees it")


def load_start_state(engine, spec):
    """Load the resume checkpoint (all state, or weights only), or the converted model's weights; the tag
    directory DeepSpeed read the resumed state from, or None."""
    cfg, resume_from = spec.cfg, spec.resume_from
    if resume_from is None or spec.lora.enabled:  # a LoRA checkpoint holds the adapters only: the base first
        engine.load_checkpoint(cfg.model_name_or_path, load_module_only=True)
    if resume_from is None:
        return None
    ckpt_dir, tag = resume_from
    tag_dir = os.path.join(ckpt_dir, tag)
    if cfg.resume_weights_only:
        loaded, _ = engine.load_checkpoint(ckpt_dir, tag, load_module_only=True)
        log_rank0(f"resumed from {tag_dir} (weights only, fresh optimizer)")
        return os.path.dirname(loaded)
    if has_layout_free_state(spec.trainer_state):
        loaded, _ = engine.load_checkpoint(ckpt_dir, tag, load_module_only=True)
        load_training_state(engine, tag_dir, spec.trainer_state)
    else:  # written before the optimizer state was saved per layer: DeepSpeed's own files, on their own layout
        loaded, _ = engine.load_checkpoint(ckpt_dir, tag)
    load_rng_state(tag_dir, dist.get_rank())
    log_rank0(f"resumed from {tag_dir}")
    return os.path.dirname(loaded)


def load_with_reference(engine, spec, data, pad_id):
    """load_start_state, and under DPO the reference log-probabilities of the starting weights: computed after a
    fresh start's load, or on a resume whose stored values are missing, from the converted model loaded first.
    A resume's every rank is checked to have loaded the same checkpoint and step."""
    resuming = spec.resume_from is not None
    if resuming and data.missing_reference() and not spec.lora.enabled:
        engine.load_checkpoint(spec.cfg.model_name_or_path, load_module_only=True)  # the starting weights
        data.add_reference(engine, spec, pad_id, log_rank0)
    loaded = load_start_state(engine, spec)
    if resuming:
        check_same_start(spec, loaded, engine.global_steps)
    data.add_reference(engine, spec, pad_id, log_rank0)  # read back, or computed (a LoRA base with its adapters off)
