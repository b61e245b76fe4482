"""Pipeline-parallel training of a LLaMA-family model with DeepSpeed.

  deepspeed --num_gpus N trainer_pipe.py -cp conf -cn CONFIG [key=value ...]
  torchrun --nproc_per_node N trainer_pipe.py -cp conf -cn CONFIG [key=value ...]
"""
import sys

import hydra


def say(line, stream=None):
    """One line in one write (stderr by default): every rank's line lands whole on the launcher's shared streams
    (print and sys.exit write the newline separately, so two ranks' messages could share a line), never after a
    progress bar (cluster/console.py)."""
    from cluster.console import say as console_say
    console_say(line, stream or sys.stderr)


def strip_launcher_arguments():
    """The deepspeed launcher appends --local_rank=N (LOCAL_RANK carries the same); Hydra would reject it."""
    sys.argv = [a for i, a in enumerate(sys.argv)
                if not a.startswith("--local_rank") and not (i and sys.argv[i - 1] == "--local_rank")]


@hydra.main(version_base=None, config_path="conf", config_name="tiny")
def main(cfg):
    """Runs the config; the exit code says why a run ended (resilience/exit_codes.py: what a restart can fix)."""
    import collectives  # heavy imports after Hydra has parsed the command line
    from checkpoints.disk_space import DiskFullError
    from checkpoints.integrity import ChecksumError
    from checkpoints.layer_files import UnsafeFileError
    from deepspeed_internals.registry import DeepSpeedMismatch
    from errors import ConfigError
    from resilience import exit_codes
    from resilience.preemption import Preempted
    from resilience.rank_records import record_end
    import torch.distributed as dist
    exit_code = 0
    try:
        from training.loop import run  # in here: a DeepSpeed without a name it imports fails in one line too
        run(cfg)
    except DiskFullError as error:
        fail(exit_codes.DISK_FULL, error)
        if error.every_rank:
            collectives.barrier()  # each rank has said it before any exits: the launcher ends the others at the first exit
        sys.exit(exit_codes.DISK_FULL)
    except (ChecksumError, UnsafeFileError) as error:
        sys.exit(fail(exit_codes.CHECKPOINT_REFUSED, error))
    except FloatingPointError as error:
        sys.exit(fail(exit_codes.LOSS_NOT_FINITE, error))
    except (ConfigError, DeepSpeedMismatch) as error:  # what a person must change: a restart repeats it
        sys.exit(fail(exit_codes.CONFIG_ERROR, error))
    except Preempted as stop:  # every rank saved together; the launcher passes the code on
        say(f"trainer_pipe: {stop}", sys.stdout)
        exit_code = exit_codes.PREEMPTED
    except Exception as error:  # a crash: its traceback follows, and a supervisor restarts the run
        from cluster.distributed import communication_failure
        record_end(exit_codes.CRASHED, f"{type(error).__name__}: {error}", communication_failure(error))
        raise
    record_end(exit_code, "preempted" if exit_code else "finished")
    # Only after success or a collective stop: tearing down a group whose peers are still mid-collective can block
    # a failing rank, while a plain exit lets the launcher end the others at once.
    if dist.is_initialized():
        dist.destroy_process_group()
    if exit_code:
        sys.exit(exit_code)


def fail(exit_code, error):
    """Say what to fix in one line and record it; the exit code to end with."""
    from resilience.rank_records import record_end
    say(f"trainer_pipe: error: {error}")
    record_end(exit_code, str(error))
    return exit_code


if __name__ == "__main__":
    strip_launcher_arguments()
    main()
