"""trainer_pipe.py with faults injected, for reliability tests launched through the real launcher.

FAULT=kind:rank:step[,kind:rank:step...]; with FAULT_ONCE_DIR set, each fault fires once (a marker file there
remembers it), so a supervised run's restart goes past it. kind one of
  kill_during_save  SIGKILL this rank after it wrote its part of the step's checkpoint, before it is complete
  raise             raise RuntimeError in this rank's train_batch at that step
  nan               the loss (last stage) becomes NaN at that step, so gradients are NaN too
  unlabelled        every label of that step's micro-batches becomes -100 on every rank that reads data (the rank
                    field is not used): the step's global batch has nothing to learn
  pause             this rank prints PAUSED_AT <step> PID <its pid> and waits at the start of that step until it is
                    asked to stop (SIGTERM, or its launcher gone): a preemption lands in a known step
  sigkill, sigstop  this rank sends itself SIGKILL (a dead rank) or SIGSTOP (a hung one) at the start of that step
  kill_while_writing  async_save: SIGKILL this rank right after it handed the step's checkpoint to its writer process
  kill_writer       async_save: SIGKILL this rank's writer process with the step's checkpoint handed to it unwritten
                    (stopped first, so that it cannot write it before it dies: the OOM killer mid-write)
  kill_building     this rank SIGKILLs itself as it starts building the tokenized data (step unused): the others
                    wait for it on the store (cluster/shared_files.py)
  fill_disk         this rank fills output_dir's disk (a file beside output_dir) right after the step's save found
                    room for the checkpoint, leaving FILL_LEAVES_BYTES: another writer filled it meanwhile
  slow              from that step on, this rank's every forward pass takes FAULT_SLOW_SECONDS longer (a slow device)
  stale_listing     this rank's listing of output_dir misses the checkpoints of that step and later (a shared
                    filesystem's directory cache lagging behind another node's saves)
  load_tag          this rank's DeepSpeed loads global_step<step> whatever resume tag it is asked for (a node that
                    read another checkpoint)
"""
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILL_LEAVES_BYTES = 256 * 1024  # room for the small files a save writes itself (RNG states, markers), not its layers
sys.path.insert(0, ROOT)

import trainer_pipe  # noqa: E402


def rank():
    return int(os.environ["RANK"])


def fires_once(kind, fault_rank, fault_step):
    """Whether this fault fires now: always without FAULT_ONCE_DIR, else the first time only."""
    if "FAULT_ONCE_DIR" not in os.environ:
        return True
    marker = os.path.join(os.environ["FAULT_ONCE_DIR"], f"{kind}-{fault_rank}-{fault_step}")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def inject(kind, fault_rank, fault_step):
    if kind in ("sigkill", "sigstop"):
        from deepspeed.runtime.pipe.engine import PipelineEngine
        train_batch = PipelineEngine.train_batch

        def signalled_train_batch(self, *args, **kwargs):
            if rank() == fault_rank and self.global_steps + 1 == fault_step and fires_once(kind, fault_rank,
                                                                                            fault_step):
                print(f"FAULT {kind} AT {fault_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            return train_batch(self, *args, **kwargs)
        PipelineEngine.train_batch = signalled_train_batch
    elif kind == "slow":
        from deepspeed.runtime.pipe import schedule
        from deepspeed.runtime.pipe.engine import PipelineEngine
        forward = PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass]  # before any engine class copies the map

        slowed = []

        def slow_forward(self, *args, **kwargs):
            if rank() == fault_rank and self.global_steps + 1 >= fault_step and self.module.training:
                if not slowed:
                    print(f"FAULT {kind} AT {self.global_steps + 1}", flush=True)
                    slowed.append(True)
                time.sleep(float(os.environ["FAULT_SLOW_SECONDS"]))
            return forward(self, *args, **kwargs)
        PipelineEngine._INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ForwardPass: slow_forward}
    elif kind == "kill_while_writing":
        from checkpoints.background_save import BackgroundSave
        submit = BackgroundSave.submit

        def submit_then_die(self, files, tag_dir, completion, needed_bytes):
            submit(self, files, tag_dir, completion, needed_bytes)
            if rank() == fault_rank and tag_dir.endswith(f"global_step{fault_step}"):
                self.copied()  # the copier has handed the files to the writer
                print(f"FAULT {kind} AT {fault_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        BackgroundSave.submit = submit_then_die
    elif kind == "kill_writer":
        from checkpoints.background_save import BackgroundSave
        submit = BackgroundSave.submit

        def submit_to_a_killed_writer(self, files, tag_dir, completion, needed_bytes):
            doomed = rank() == fault_rank and tag_dir.endswith(f"global_step{fault_step}")
            if doomed:
                os.kill(self.writer.pid, signal.SIGSTOP)
            submit(self, files, tag_dir, completion, needed_bytes)
            if doomed:
                print(f"FAULT {kind} AT {fault_step} PID {self.writer.pid}", flush=True)
                os.kill(self.writer.pid, signal.SIGKILL)
        BackgroundSave.submit = submit_to_a_killed_writer
    elif kind == "kill_building":
        from data import datasets  # build_dataset_distributed looks built_by_rank_zero up here
        built_by_rank_zero = datasets.built_by_rank_zero

        def killed_while_building(build, what, *args, **kwargs):
            if rank() == fault_rank:
                print(f"FAULT {kind} {what}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return built_by_rank_zero(build, what, *args, **kwargs)
        datasets.built_by_rank_zero = killed_while_building
    elif kind == "fill_disk":
        import shutil

        from checkpoints import saving  # save_checkpoint looks check_space_for_checkpoint up here
        check_space = saving.check_space_for_checkpoint

        def check_then_fill(output_dir, tag, needed_bytes):
            check_space(output_dir, tag, needed_bytes)
            if rank() == fault_rank and tag == f"global_step{fault_step}":
                with open(os.path.join(os.path.dirname(os.path.abspath(output_dir)), "filler"), "wb") as f:
                    f.write(bytes(max(0, shutil.disk_usage(output_dir).free - FILL_LEAVES_BYTES)))
                print(f"FAULT {kind} AT {fault_step}", flush=True)
        saving.check_space_for_checkpoint = check_then_fill
    elif kind == "kill_during_save":
        from checkpoints import saving  # save_checkpoint looks save_rng_state up here
        save_rng_state = saving.save_rng_state

        def save_then_die(tag_dir, this_rank):
            save_rng_state(tag_dir, this_rank)
            if (this_rank == fault_rank and tag_dir.endswith(f"global_step{fault_step}")
                    and fires_once(kind, fault_rank, fault_step)):
                print(f"FAULT {kind} AT {fault_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        saving.save_rng_state = save_then_die
    elif kind == "raise":
        from deepspeed.runtime.pipe.engine import PipelineEngine
        train_batch = PipelineEngine.train_batch

        def failing_train_batch(self, *args, **kwargs):
            if rank() == fault_rank and self.global_steps + 1 == fault_step:
                print(f"FAULT_AT {time.time()}", flush=True)
                raise RuntimeError(f"injected failure on rank {fault_rank} at step {fault_step}")
            return train_batch(self, *args, **kwargs)
        PipelineEngine.train_batch = failing_train_batch
    elif kind == "nan":
        from models.loss import CausalLMLoss
        loss_fn = CausalLMLoss.__call__
        calls = []

        def nan_at_step(self, outputs, labels):
            calls.append(1)
            loss = loss_fn(self, outputs, labels)
            gas = int(os.environ["FAULT_GAS"])
            return loss * float("nan") if (len(calls) - 1) // gas + 1 == fault_step else loss
        CausalLMLoss.__call__ = nan_at_step
    elif kind == "unlabelled":
        import torch

        from training import loop
        step_micro_batches, steps = loop.step_micro_batches, []

        def unlabelled_at_step(engine, stream, count):
            steps.append(1)
            batches = step_micro_batches(engine, stream, count)
            if len(steps) == fault_step and isinstance(batches, list):  # a stage that reads data
                return [(inputs, torch.full_like(labels, -100)) for inputs, labels in batches]
            return batches
        loop.step_micro_batches = unlabelled_at_step
    elif kind == "pause":
        from deepspeed.runtime.pipe.engine import PipelineEngine
        from resilience import preemption
        watches = []
        watch_init = preemption.PreemptionWatch.__init__

        def recording_init(self, *args, **kwargs):
            watch_init(self, *args, **kwargs)
            watches.append(self)
        preemption.PreemptionWatch.__init__ = recording_init
        train_batch = PipelineEngine.train_batch

        def paused_train_batch(self, *args, **kwargs):
            if rank() == fault_rank and self.global_steps + 1 == fault_step:
                print(f"PAUSED_AT {fault_step} PID {os.getpid()}", flush=True)
                while watches[0].requested_at is None:
                    watches[0].check_launcher()
                    time.sleep(0.1)
            return train_batch(self, *args, **kwargs)
        PipelineEngine.train_batch = paused_train_batch
    elif kind == "stale_listing":
        from checkpoints.tag_dirs import TAG_PATTERN
        from training import resume
        complete_tags = resume.complete_tags

        def lagging_complete_tags(output_dir):
            tags = complete_tags(output_dir)
            if rank() != fault_rank:
                return tags
            return [tag for tag in tags if int(TAG_PATTERN.match(tag).group(1)) < fault_step]
        resume.complete_tags = lagging_complete_tags
    elif kind == "load_tag":
        from deepspeed.runtime.engine import DeepSpeedEngine
        load_checkpoint = DeepSpeedEngine.load_checkpoint

        def load_another_tag(self, load_dir, tag=None, *args, **kwargs):
            if rank() == fault_rank and tag is not None:
                tag = f"global_step{fault_step}"
            return load_checkpoint(self, load_dir, tag, *args, **kwargs)
        DeepSpeedEngine.load_checkpoint = load_another_tag
    else:
        raise ValueError(f"unknown fault {kind}")


if __name__ == "__main__":
    for fault in os.environ["FAULT"].split(","):
        fault_kind, fault_rank_text, fault_step_text = fault.split(":")
        inject(fault_kind, int(fault_rank_text), int(fault_step_text))
    trainer_pipe.strip_launcher_arguments()
    trainer_pipe.main()
