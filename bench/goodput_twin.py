#!/usr/bin/python3
# bench/goodput_twin.py: bench/goodput.sh's PyTorch row. The demo's model
# (vs_pytorch.py's twin: the same data, layers and optimizer) in PyTorch DDP
# over Gloo, one worker of a torchrun job, trained for a fixed number of
# samples: rank 0 saves a checkpoint (model, optimizer, progress) every
# --checkpoint-every steps to a shared directory (torch.save to a temporary
# file, then a rename), and every worker resumes from it at start, as a
# torchrun job that survives restarts must. Rank 0 logs each step as it
# begins it, as the demo does, to --sample-log/round-<restart>-rank-0.txt
# (line-buffered), for the steps trained twice (tests/scripts/sample_log.py:
# a step was trained when the next one began). Run by torchrun; not a
# program of its own.
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_pytorch import Mlp, fisher_yates, generate  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def main():
    p = argparse.ArgumentParser(prog="goodput_twin.py")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--sample-log", required=True)
    s = p.parse_args()

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = generate(s.features, s.classes, s.samples, s.seed, 0)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    model = Mlp([s.features, s.hidden, s.hidden, s.classes], s.seed)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    path = os.path.join(s.checkpoint_dir, "latest.pt")
    step, done = 0, 0  # steps trained, samples trained (of epochs x samples)
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, done = state["step"], state["done"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = None
    if rank == 0:
        os.makedirs(s.sample_log, exist_ok=True)
        log = open(os.path.join(s.sample_log, f"round-{restart}-rank-0.txt"), "a", buffering=1)
    total = s.epochs * s.samples
    orders = {}
    while done < total:
        epoch, at = divmod(done, s.samples)
        if epoch not in orders:
            orders = {epoch: torch.tensor(fisher_yates(s.samples, s.seed + epoch))}
        mine = orders[epoch][at + rank * s.batch_size:at + (rank + 1) * s.batch_size]
        if len(mine) == 0:
            mine = orders[epoch][:s.batch_size]
        if log:
            log.write(f"{step + 1}\n")  # as the step begins, as the demo does
        loss = F.cross_entropy(ddp(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        done += min(s.batch_size * world, s.samples - at)
        if rank == 0 and step % s.checkpoint_every == 0:
            tmp = path + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "done": done}, tmp)
            os.replace(tmp, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
