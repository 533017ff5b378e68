#!/usr/bin/env python3
"""torch_env_job: one rank of a PyTorch gloo job started by a torchrun-style launcher.

Checks that the environment a launcher (dtrun, dtrain_test_launch) gives each
worker is enough for an unmodified PyTorch script: init_process_group with
init_method="env://" must meet, agree on rank/world size and run collectives.

Prints `torch_env_job rank=R world_size=W local_rank=L sum=S ok` and exits 0;
on a mismatch it says what differed on stderr and exits 1; exits 77 (the
CTest skip code) when torch is not installed.
"""

import datetime
import os
import sys
from collections import Counter
from typing import NoReturn

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # the test is optional: python3-torch is not a build dependency
    sys.stdout.write(f"SKIPPED: python3-torch is not installed ({e})\n")
    sys.stdout.flush()
    sys.exit(77)


def say(stream, line: str) -> None:
    # One write per line: print() writes the text and the newline separately,
    # so lines from ranks sharing the launcher's stdout could run together.
    stream.write(line + "\n")
    stream.flush()


def fail(msg: str) -> NoReturn:
    say(sys.stderr, f"torch_env_job rank={os.environ.get('RANK', '?')}: {msg}")
    sys.exit(1)


def env_int(name: str, required: bool = True) -> int | None:
    value = os.environ.get(name)
    if value is None:
        if required:
            fail(f"{name} is not set")
        return None
    try:
        return int(value)
    except ValueError:
        fail(f"{name}={value!r} is not an integer")


def main() -> None:
    # What torchrun gives every worker; env:// itself only reads RANK,
    # WORLD_SIZE, MASTER_ADDR and MASTER_PORT, the rest we check ourselves.
    rank = env_int("RANK")
    world_size = env_int("WORLD_SIZE")
    local_rank = env_int("LOCAL_RANK")
    local_world_size = env_int("LOCAL_WORLD_SIZE")
    group_rank = env_int("GROUP_RANK", required=False)
    env_int("MASTER_PORT")
    env_int("TORCHELASTIC_RESTART_COUNT", required=False)  # needed by torch if TORCHELASTIC_USE_AGENT_STORE=True
    if not os.environ.get("MASTER_ADDR"):
        fail("MASTER_ADDR is not set")
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        fail(f"inconsistent RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank} "
             f"LOCAL_WORLD_SIZE={local_world_size}")
    if group_rank is not None and group_rank < 0:
        fail(f"GROUP_RANK={group_rank} is negative")

    # A bounded timeout so a launcher bug (wrong port, missing rank) fails the
    # test in a minute instead of torch's default 30 minutes.
    dist.init_process_group(backend="gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    if dist.get_rank() != rank or dist.get_world_size() != world_size:
        fail(f"torch says rank={dist.get_rank()} world_size={dist.get_world_size()}, "
             f"environment says RANK={rank} WORLD_SIZE={world_size}")

    # Every rank contributes rank+1, so the sum proves all ranks took part once.
    total = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    expected = world_size * (world_size + 1) // 2
    if total.item() != expected:
        fail(f"all_reduce sum is {total.item()}, expected {expected}")

    # LOCAL_RANK values gathered in rank order. torchrun starts the same
    # number of workers on every node, so each local rank 0..LOCAL_WORLD_SIZE-1
    # must occur once per node: this catches e.g. every worker getting 0.
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([local_rank], dtype=torch.int64))
    local_ranks = [int(t.item()) for t in gathered]
    nodes, rest = divmod(world_size, local_world_size)
    if local_ranks[rank] != local_rank or rest or Counter(local_ranks) != {lr: nodes for lr in range(local_world_size)}:
        fail(f"all_gather of LOCAL_RANK gave {local_ranks} (LOCAL_WORLD_SIZE={local_world_size})")

    dist.barrier()
    say(sys.stdout, f"torch_env_job rank={rank} world_size={world_size} local_rank={local_rank} sum={total.item()} ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
