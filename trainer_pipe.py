"""Pipeline-parallel training of a LLaMA-family model with DeepSpeed.

  deepspeed --num_gpus N trainer_pipe.py -cp conf -cn CONFIG [key=value ...]
  torchrun --nproc_per_node N trainer_pipe.py -cp conf -cn CONFIG [key=value ...]
"""
import sys

import hydra



def strip_launcher_arguments():
    """The deepspeed launcher appends --local_rank=N (LOCAL_RANK carries the same); Hydra would reject it."""
    sys.argv = [a for i, a in enumerate(sys.argv)
                if not a.startswith("--local_rank") and not (i and sys.argv[i - 1] == "--local_rank")]


@hydra.main(version_base=None, config_path="conf", config_name="tiny")
def main(cfg):
    from training.loop import run  # heavy imports after Hydra has parsed the command line
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as error:  # says what to fix
        sys.exit(f"trainer_pipe: error: {error}")
    # Only after success: tearing down a group whose peers are still mid-collective can block a failing rank,
    # while a plain exit lets the launcher end the others at once.
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    strip_launcher_arguments()
    main()
