#!/usr/bin/env python3
# bench/vs_pytorch_gpu.py: dtrain's DDP against PyTorch's on the same GPU, in
# one run. The CNN of dtrain_train_torch (examples/torch_cnn.hpp) trains on
# cuda:0 four ways, each its own figure:
#   - LibTorch alone (no DDP) and LibTorch with dtrain::torch's DDP (NCCL,
#     world size 1, always_reduce): bench/torch_gpu, run as a child;
#   - PyTorch alone and PyTorch with torch.nn.parallel.DistributedDataParallel
#     (NCCL, world size 1): the same model in this process.
# And ZeRO stage 3 against FSDP2 (model "sharded"): a Sequential of Linear
# layers, LibTorch alone and with dtrain's stage 3 (each child a unit; at
# world size 1 a gather is a copy), PyTorch alone and with
# torch.distributed.fsdp.fully_shard on each Linear and on the whole (FSDP2's
# per-layer wrapping).
# Each wrapper's overhead is over its own plain loop (LibTorch's C++ loop and
# Python's eager loop differ by the interpreter's cost, so their step times
# are not what is compared); goal: dtrain's overhead no more than PyTorch's.
#
#   python3 bench/vs_pytorch_gpu.py [--bench build/bench/torch_gpu]
#       [--models example,wide,mlp,sharded] [--steps N] [--warmup N] [--rounds N]
#
# Models: example = the example's (batch 32, channels 16, fc 128: 0.2 M
# parameters, kernel-launch bound); wide = batch 256, channels 64, fc 2048
# (2.2 M parameters, 8.6 MB of gradients in the buckets); mlp = batch 256,
# 8 Linear(2048, 2048) with ReLU between and Linear(2048, 4) (33.6 M
# parameters), DDP on both sides; sharded = the same MLP, dtrain's stage 3
# against FSDP2 (needs PyTorch 2.6 or later for fully_shard; older: that row
# says so). Both sides: SGD with
# momentum 0.9, cross entropy, the optimizer's zero_grad (gradients dropped),
# DDP's default bucket caps (25 MiB, the first 1 MiB), cuDNN's defaults, one
# CPU thread for intra-op work. The protocol is bench/torch_gpu's: --warmup
# steps (10) of each loop, then --rounds rounds (7) of --steps steps (50),
# alternating, each timed between two torch.cuda.synchronize(); the median
# round. Timings never fail the run. Needs PyTorch with CUDA and NCCL and a GPU;
# without them (or without the bench binary) prints "SKIPPED: ..." and exits 77.
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SKIPPED = 77
MODELS = {
    "example": {"batch_size": 32, "channels": 16, "hidden": 128},
    "wide": {"batch_size": 256, "channels": 64, "hidden": 2048},
    "mlp": {"batch_size": 256, "hidden": 2048, "layers": 8, "sharding": 0},
    "sharded": {"batch_size": 256, "hidden": 2048, "layers": 8, "sharding": 3},
}
WRAPPERS = {0: ("DDP", "DDP"), 3: ("stage 3", "FSDP2")}  # dtrain's, PyTorch's
SIDE = 16
CLASSES = 4


def make_cnn(torch, channels, hidden):
    """examples/torch_cnn.hpp's CnnImpl, layer for layer."""
    nn = torch.nn
    widths = [1, channels // 2, channels // 2, channels, channels]

    class Cnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Conv2d(widths[i], widths[i + 1], 3, padding=1, bias=False),
                              nn.BatchNorm2d(widths[i + 1]), nn.ReLU()) for i in range(4))
            self.fc1 = nn.Linear(channels * (SIDE // 4) * (SIDE // 4), hidden)
            self.fc2 = nn.Linear(hidden, CLASSES)

        def forward(self, x):
            x = torch.max_pool2d(self.blocks[1](self.blocks[0](x)), 2)
            x = torch.max_pool2d(self.blocks[3](self.blocks[2](x)), 2)
            return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    return Cnn()


def make_mlp(torch, hidden, layers):
    """bench/torch_gpu's --layers model, layer for layer."""
    nn = torch.nn
    children = []
    for _ in range(layers):
        children += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*children, nn.Linear(hidden, CLASSES))


def make_model(torch, settings):
    if settings.get("layers"):
        return make_mlp(torch, settings["hidden"], settings["layers"])
    return make_cnn(torch, settings["channels"], settings["hidden"])


def wrap(torch, model, settings):
    """PyTorch's wrapper: DDP, or FSDP2 (fully_shard on each Linear, then the whole)."""
    if settings.get("sharding", 0) == 0:
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    from torch.distributed.fsdp import fully_shard  # PyTorch 2.6+
    for child in model:
        if isinstance(child, torch.nn.Linear):
            fully_shard(child)
    fully_shard(model)
    return model


def pytorch_figures(torch, settings, a):
    """PyTorch's plain loop and its DDP, as bench/torch_gpu times dtrain's."""
    device = torch.device("cuda", 0)
    n = settings["batch_size"]
    torch.manual_seed(1)
    if settings.get("layers"):
        xs = torch.randn(8 * n, settings["hidden"], device=device)
    else:
        xs = torch.randn(8 * n, 1, SIDE, SIDE, device=device)
    ys = torch.randint(0, CLASSES, (8 * n,), device=device)
    torch.manual_seed(1)
    model = make_model(torch, settings).to(device)
    torch.manual_seed(1)
    plain = make_model(torch, settings).to(device)
    parameters = sum(p.numel() for p in plain.parameters())
    ddp = wrap(torch, model, settings)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    at = [0]

    def batch():
        at[0] = (at[0] + 1) % 8
        return xs.narrow(0, at[0] * n, n), ys.narrow(0, at[0] * n, n)

    def ddp_step():
        x, y = batch()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        sgd.step()
        sgd.zero_grad()

    def plain_step():
        x, y = batch()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        plain_sgd.step()
        plain_sgd.zero_grad()

    def timed(step):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / a.steps * 1e6

    for _ in range(a.warmup):
        ddp_step()
        plain_step()
    ours, alone = [], []
    for r in range(a.rounds):
        if r % 2 == 0:
            ours.append(timed(ddp_step))
            alone.append(timed(plain_step))
        else:
            alone.append(timed(plain_step))
            ours.append(timed(ddp_step))
    return statistics.median(alone), statistics.median(ours), parameters


FIGURES = re.compile(r"^figures: plain_us=([0-9.]+) ddp_us=([0-9.]+) parameters=(\d+) buckets=(\d+)",
                     re.M)


def dtrain_figures(a, settings):
    command = [a.bench, "--batch-size", str(settings["batch_size"]),
               "--channels", str(settings.get("channels", 16)), "--hidden", str(settings["hidden"]),
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds", str(a.rounds)]
    if settings.get("layers"):
        command += ["--layers", str(settings["layers"]), "--sharding", str(settings["sharding"])]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_COMM", "DTRAIN_"))}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=a.timeout, env=env)
    if proc.returncode == SKIPPED:
        return None, proc.stdout.strip()
    match = FIGURES.search(proc.stdout)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    first = next(iter(proc.stdout.splitlines()), "")
    return (float(match.group(1)), float(match.group(2)), int(match.group(3)),
            int(match.group(4))), first


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(prog="vs_pytorch_gpu.py",
                                description="dtrain's DDP against PyTorch's on the same GPU")
    p.add_argument("--bench", default=os.path.join(here, "..", "build", "bench", "torch_gpu"))
    p.add_argument("--models", default="example,wide,mlp,sharded")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--timeout", type=int, default=300, help="seconds for each run of the bench")
    a = p.parse_args(argv)
    models = a.models.split(",")
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r} (known: {', '.join(MODELS)})")
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"SKIPPED: no PyTorch in {sys.executable} ({e})")
        return SKIPPED
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print(f"SKIPPED: PyTorch {torch.__version__} sees no CUDA device or has no NCCL")
        return SKIPPED
    if not os.access(a.bench, os.X_OK):
        print(f"SKIPPED: no bench binary at {a.bench} (build target dtrain_bench_torch_gpu, "
              "which needs a LibTorch with CUDA, or give --bench)")
        return SKIPPED
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        print(f"{torch.cuda.get_device_name(0)}; PyTorch {torch.__version__}, CUDA "
              f"{torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
              f"median of {a.rounds} rounds of {a.steps} steps, step time in us", flush=True)
        rows, failed = [], []
        for m in models:
            settings = MODELS[m]
            ours_name, theirs_name = WRAPPERS[settings.get("sharding", 0)]
            # A model that fails on one side is reported and the others still run.
            try:
                ours, said = dtrain_figures(a, settings)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  {m}: dtrain {ours_name} failed: {e}", flush=True)
                failed.append(m)
                continue
            if ours is None:
                print(said)
                return SKIPPED
            print(f"  {m}: {said}", flush=True)
            try:
                theirs = pytorch_figures(torch, settings, a)
            except ImportError as e:  # no fully_shard before PyTorch 2.6
                print(f"  {m}: no PyTorch figures: PyTorch {torch.__version__} has no "
                      f"{theirs_name} ({e})", flush=True)
                continue
            except Exception as e:  # noqa: BLE001 (reported, and the run fails)
                print(f"  {m}: PyTorch {theirs_name} failed: {type(e).__name__}: {e}", flush=True)
                failed.append(m)
                continue
            rows.append((m, ours_name, theirs_name, ours, theirs))
            print(f"  {m}: LibTorch plain {ours[0]:.1f}, dtrain {ours_name} {ours[1]:.1f}; "
                  f"PyTorch plain {theirs[0]:.1f}, PyTorch {theirs_name} {theirs[1]:.1f}",
                  flush=True)
        dist.destroy_process_group()
    print("\n| model | dtrain / PyTorch wrapper | parameters | LibTorch plain | dtrain | "
          "dtrain's overhead | PyTorch plain | PyTorch | PyTorch's overhead | dtrain / PyTorch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    met = []
    for m, ours_name, theirs_name, (lp, ld, params, buckets), (pp, pd, _) in rows:
        mine, theirs = ld / lp - 1, pd / pp - 1
        met.append(mine <= max(theirs, 0.0))
        print(f"| {m} | {ours_name} / {theirs_name} | {params:,} ({buckets} buckets) | {lp:.1f} | "
              f"{ld:.1f} | {100 * mine:+.1f}% | {pp:.1f} | {pd:.1f} | {100 * theirs:+.1f}% | "
              f"{ld / pd:.2f} |")
    if not rows:
        print("\ngoal: nothing measured (see above)")
        return 1
    verdicts = ", ".join(m + (" met" if ok else " not met") for (m, *_), ok in zip(rows, met))
    print("\ngoal: dtrain's overhead over its plain loop no more than PyTorch's over its own: "
          f"{'met' if all(met) else 'not met'} ({verdicts})")
    if failed:
        print(f"failed: {', '.join(failed)} (see above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
