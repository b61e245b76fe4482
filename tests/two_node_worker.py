"""One rank of a job on two simulated nodes (tests/test_preference.py, two PID namespaces: the ranks of both nodes have
the same pids): the DPO trainer, which writes its tokenized data cache and reference log-probabilities into the shared
output_dir, then the sample index of a token-shard corpus in a shared index_dir, read back on every rank.

  python -m tests.two_node_worker '{"out": DIR, "overrides": [...], "shards": PREFIX, "index_dir": DIR,
                                    "vocab_size": N}'
"""
import json
import os
import socket
import sys


def main(settings):
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from data.indexed import training_blend
    from data.shard_files import parse_sources
    from tests.conftest import ROOT
    from training.loop import run
    rank = int(os.environ["RANK"])
    with initialize_config_dir(config_dir=f"{ROOT}/conf", version_base=None):
        cfg = compose(config_name="tiny", overrides=settings["overrides"])
    run(cfg)
    blend = training_blend(parse_sources(settings["shards"], "train_file"), reads_data=True, seed=0, seq_length=16,
                           isolate=False, blend_dir=settings["index_dir"], vocab_size=settings["vocab_size"],
                           total_samples=200, build_limit_minutes=5, index_dir=settings["index_dir"])
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
              "samples": [blend[k]["labels"].tolist() for k in range(0, 200, 50)]}
    with open(os.path.join(settings["out"], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()  # the store lives in rank 0's process: it stays until every rank has read rank 0's word
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
