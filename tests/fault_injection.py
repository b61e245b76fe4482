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
  slow              from that step on, this rank's every forward pass takes FAULT_SLOW_SECONDS longer (a slow device)
"""
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

        def submit_then_die(self, files, tag_dir, completion):
            submit(self, files, tag_dir, completion)
            if rank() == fault_rank and tag_dir.endswith(f"global_step{fault_step}"):
                self.copied()  # the copier has handed the files to the writer
                print(f"FAULT {kind} AT {fault_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        BackgroundSave.submit = submit_then_die
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
    else:
        raise ValueError(f"unknown fault {kind}")


if __name__ == "__main__":
    for fault in os.environ["FAULT"].split(","):
        fault_kind, fault_rank_text, fault_step_text = fault.split(":")
        inject(fault_kind, int(fault_rank_text), int(fault_step_text))
    trainer_pipe.strip_launcher_arguments()
    trainer_pipe.main()
