"""Pipeline-parallel training of a LLaMA-family model with DeepSpeed.

  deepspeed --num_gpus N trainer_pipe.py -cp conf -cn CONFIG [key=value ...]
  torchrun --nproc_per_node N trainer_pipe.py -cp conf -cn CONFIG [key=value ...]
"""
import sys

import hydra


def say(line, stream=None):
    """One line in one write (stderr by default): every rank's line lands whole on the launcher's shared streams
    (print and sys.exit write the newline separately, so two ranks' messages could share a line)."""
    stream = stream or sys.stderr
    stream.write(f"{line}\n")
    stream.flush()


def strip_launcher_arguments():
    """The deepspeed launcher appends --local_rank=N (LOCAL_RANK carries the same); Hydra would reject it."""
    sys.argv = [a for i, a in enumerate(sys.argv)
                if not a.startswith("--local_rank") and not (i and sys.argv[i - 1] == "--local_rank")]


@hydra.main(version_base=None, config_path="conf", config_name="tiny")
def main(cfg):
    import collectives  # heavy imports after Hydra has parsed the command line
    from checkpoints.disk_space import DiskFullError
    from deepspeed_internals.registry import DeepSpeedMismatch
    from training.preemption import PREEMPTED_EXIT_CODE, Preempted
    import torch.distributed as dist
    exit_code = 0
    try:
        from training.loop import run  # in here: a DeepSpeed without a name it imports fails in one line too
        run(cfg)
    except DiskFullError as error:
        say(f"trainer_pipe: error: {error}")
        if error.every_rank:
            collectives.barrier()  # every rank has said it before any exits: the launcher ends the rest at one exit
        sys.exit(1)
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError,
            DeepSpeedMismatch) as error:  # what to fix
        say(f"trainer_pipe: error: {error}")
        sys.exit(1)
    except Preempted as stop:  # every rank saved together; the launcher passes the code on
        say(f"trainer_pipe: {stop}", sys.stdout)
        exit_code = PREEMPTED_EXIT_CODE
    # Only after success or a collective stop: tearing down a group whose peers are still mid-collective can block
    # a failing rank, while a plain exit lets the launcher end the others at once.
    if dist.is_initialized():
        dist.destroy_process_group()
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    strip_launcher_arguments()
    main()
