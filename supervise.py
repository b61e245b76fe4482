"""Run a training launch again with resume=auto whenever it fails, until it finishes (docs/reliability.md).

  python supervise.py [--max-restarts 3] [--backoff-seconds 30] -- deepspeed --hostfile H trainer_pipe.py -cp conf -cn C
  python supervise.py -- srun --kill-on-bad-exit=1 scripts/slurm_rank.sh trainer_pipe.py -cp conf -cn C
  python supervise.py -- torchrun --max-restarts 0 --nproc_per_node 8 ... trainer_pipe.py -cp conf -cn C
"""
import argparse
import sys

from resilience.supervisor import Supervisor, output_dir_of


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="restarts in a row without a new complete checkpoint before giving up (default 3)")
    parser.add_argument("--backoff-seconds", type=float, default=30,
                        help="wait before the first restart in a row, doubled for each next one (default 30)")
    parser.add_argument("--max-backoff-seconds", type=float, default=600, help="longest wait (default 600)")
    parser.add_argument("--output-dir", help="the run's output_dir (default: composed from the command's config)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launch command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no launch command: put it after --")
    if args.max_restarts < 0 or args.backoff_seconds < 0 or args.max_backoff_seconds < 0:
        parser.error("--max-restarts, --backoff-seconds and --max-backoff-seconds must not be negative")
    try:
        output_dir = args.output_dir or output_dir_of(command)
    except Exception as error:  # a config the trainer would refuse too: its own message, in one line
        parser.error(f"cannot read the run's output_dir from the command ({error}); pass --output-dir")
    sys.exit(Supervisor(command, output_dir, args.max_restarts, args.backoff_seconds,
                        args.max_backoff_seconds).run())


if __name__ == "__main__":
    main()
