"""Which checkpoint a run starts from, decided once for the whole job. Each rank's own look at output_dir, before
the process group exists, serves the config checks (training/run_spec.py); a shared filesystem whose directory
cache lags can show a node an older listing, though, so once a collective can carry it rank 0, holding output_dir's
lease, decides: it finishes a move of an abandoned branch a crash interrupted, resolves `resume`, starts a new branch
where the resume goes back in the run's history (checkpoints/branches.py), and broadcasts its choice, which every
rank follows. Loading it (load_start_state), every rank's loaded checkpoint and step are compared."""
import os

import torch.distributed as dist

import collectives
from checkpoints.branches import finish_moves, start_branch
from checkpoints.files import COMPLETE_MARKER
from checkpoints.optimizer_state import has_layout_free_state, load_training_state
from checkpoints.rng_state import load_rng_state
from cluster.distributed import log_rank0
from cluster.shared_files import VISIBLE_WITHIN_S, wait_for_files
from training.resume import resolve_resume
from training.run_spec import with_resume


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
        print(f"rank {dist.get_rank()}: starting from {os.path.join(*resume_from) if resume_from else 'scratch'}, "
              f"as rank 0 decided; this node saw {seen} (a shared filesystem's directory cache lagging?)", flush=True)
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
