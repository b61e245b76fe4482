"""trainer_pipe.py that also writes, from rank 0, OUTPUT_DIR/optimizer.json: which optimizer the engine stepped and
what it did to the master weights, read from the engine itself (tests/gpu's fused-AdamW and offload checks).

  optimizer       the torch optimizer DeepSpeed steps: the one ZeRO's or the bf16 optimizer wraps, else the engine's
  fused           its `fused` option (torch's AdamW), or null
  steps           its step counts over the master weights it holds ([n] when every one stepped n times)
  master_devices  where those master weights live (ZeRO's flat fp32 partitions: the host when offloaded)
  master_moved    the largest change of a master weight from the first step to the last
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import trainer_pipe  # noqa: E402


def record_the_stepped_optimizer():
    import torch.distributed as dist

    from deepspeed_internals.access import is_zero_optimizer, zero_wrapped_optimizer
    from training import loop
    train = loop.train

    def train_and_record(engine, spec, *args):
        optimizer = (zero_wrapped_optimizer(engine.optimizer) if is_zero_optimizer(engine.optimizer)
                     else engine.optimizer)
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        before = [master.detach().clone() for master in masters]
        result = train(engine, spec, *args)
        if dist.get_rank() == 0:
            facts = {"optimizer": type(optimizer).__name__, "fused": optimizer.defaults.get("fused"),
                     "steps": sorted({int(optimizer.state[m]["step"]) for m in masters if optimizer.state[m]}),
                     "master_devices": sorted({str(m.device) for m in masters}),
                     "master_moved": max(float((m.detach() - b).abs().max()) for m, b in zip(masters, before))}
            with open(os.path.join(spec.cfg.output_dir, "optimizer.json"), "w") as f:
                json.dump(facts, f)
        return result

    loop.train = train_and_record


if __name__ == "__main__":
    record_the_stepped_optimizer()
    trainer_pipe.strip_launcher_arguments()
    trainer_pipe.main()
