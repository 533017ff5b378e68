#!/usr/bin/python3
# bench/vs_pytorch.py: dtrain's MLP demo (examples/train_mlp.cpp) against its
# twin in PyTorch, DistributedDataParallel over Gloo, on this machine:
#
#   /usr/bin/python3 bench/vs_pytorch.py [--demo build/examples/dtrain_train_mlp]
#       [--demo-mpi build/examples/dtrain_train_mlp_mpi] [--ranks 1,2,4] [--repeats 3]
#       [--models default,wide] [--epochs N] [--samples N] [--depth N] [--timeout S]
#
# The demo over Gloo is the like-for-like column (PyTorch's engine; on one
# host dtrain's Gloo communicator allreduces through shared memory where
# PyTorch's goes through TCP on loopback: DTRAIN_GLOO_SHM=0 in this script's
# environment makes the demo use TCP too); the MPI build of the demo, under
# mpirun, is a column of its own when it and mpirun exist (--demo-mpi ''
# leaves it out): Debian's torch has no MPI backend to set against it.
#   /usr/bin/python3 bench/vs_pytorch.py --twin --nproc-per-node N [the demo's flags, --depth N]
#       (the twin alone: prints the demo's lines, for the same flags the same losses)
#
# Use /usr/bin/python3: Debian's torch 1.13 lives there, not in a pyenv.
#
# The twin does what the demo does, step for step: the same data and initial
# weights (mlp::rng's splitmix64 ported to numpy, float64 cast to float32 where
# the C++ casts), the same shards and batches (torch's DistributedSampler with
# dtrain's splitmix Fisher-Yates in place of torch.randperm; the last, shorter
# batch kept), nn.Linear + ReLU, F.cross_entropy, SGD with momentum, DDP with
# the demo's bucket caps (16 KiB, the first 4 KiB). Its losses equal the demo's:
# the first epoch's to the printed 4 decimals, the later ones within 1% (with
# denormals flushed, PyTorch's division of each gradient by the world size
# before the sum can lose a value dtrain's sum-then-divide keeps); checked on
# every run, exit 1 otherwise.
#
# Models: default = the demo's defaults (32-64-64-8, 8,192 samples, 5 epochs);
# wide = 1024-1024-1024-8 (1,024 samples, 3 epochs: enough for a steady rate,
# short enough for the bench; at 8 ranks that is 4 steps an epoch, so
# tools/gpu-check --host gives --samples 8192). --depth N (hidden layers, 2) is passed
# to the demo only when it is not 2, so binaries without the flag still run.
#
# For each model and rank count the demo and the twin run --repeats times
# (3), interleaved, the first of the pair alternating. A run's figure is the
# median of its epochs' samples/s (all ranks, as the demo prints them: set_epoch
# through the epoch's allreduce of its totals), the first epoch left out as
# warm-up; the table shows the median over repeats. Both children get
# OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1 (torchrun's setting for
# multi-process jobs), OPENBLAS_CORETYPE from the CPU's flags (OpenBLAS takes
# many VMs' CPUs for a 2004 Pentium 4 otherwise; both load the same
# libopenblas) and a world on the loopback interface only. Both flush
# denormals to zero (the demo always; the twin with torch.set_flush_denormal).
# Goal: dtrain / PyTorch >= 1.3 at every rank count, for both models. With 1
# among --ranks, a second table gives each program's scaling efficiency,
# samples/s at N ranks / (N x samples/s at 1 rank); goal at the most ranks:
# at least 0.9, and above PyTorch DDP's.
#
# The whole default bench takes 2-3 minutes on 2 cores (PyTorch's runs are
# most of it). Timings never fail it; losses that differ
# (the twin no longer trains what the demo trains) do, exit 1. When a child fails,
# prints too few epoch lines or outlives --timeout (300 s; then it is killed
# with its workers), the bench prints the end of its output and exits 1.
# Without torch or the demo binary: "SKIPPED: ..." and exit 77.

import argparse
import datetime
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

SKIPPED = 77

try:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
except ImportError as e:
    print(f"SKIPPED: {e} under {sys.executable}; run with /usr/bin/python3 (Debian's python3-torch)")
    sys.exit(SKIPPED)

RUN_TIMEOUT_S = 300  # one child: the demo or the twin, all its ranks
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


# ---------------------------------------------------------------- the twin

def splitmix64_mix(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Rng:
    """mlp::rng, many draws at a time: the k-th draw of rng(seed) is
    mix(seed + k * golden), so a block of draws is one numpy expression."""

    def __init__(self, seed):
        self.seed = np.uint64(seed & MASK64)
        self.drawn = 0

    def next(self, count):
        k = np.arange(self.drawn + 1, self.drawn + count + 1, dtype=np.uint64)
        self.drawn += count
        return splitmix64_mix(self.seed + k * np.uint64(GOLDEN))  # uint64 arrays wrap mod 2^64

    @staticmethod
    def to_uniform(draws):
        return (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def uniform(self, lo, hi, count):
        return lo + (hi - lo) * self.to_uniform(self.next(count))


def generate(features, classes, samples, seed, stream, blobs_per_class=3, spread=0.8):
    """mlp::dataset::generate: samples (float32, row-major) and labels (int64)."""
    blobs = classes * blobs_per_class
    centres = Rng(seed).uniform(-1.0, 1.0, blobs * features).reshape(blobs, features)
    rng = Rng(seed ^ ((0x5851F42D4C957F2D * (stream + 1)) & MASK64))
    x = np.empty((samples, features), dtype=np.float32)
    y = np.empty(samples, dtype=np.int64)
    per_sample = 1 + 12 * features  # below(blobs), then 12 uniforms per feature
    chunk = max(1, (1 << 22) // per_sample)  # bounds memory at the wide model's size
    for at in range(0, samples, chunk):
        m = min(chunk, samples - at)
        draws = rng.next(m * per_sample).reshape(m, per_sample)
        blob = (draws[:, 0] % np.uint64(blobs)).astype(np.int64)
        u = Rng.to_uniform(draws[:, 1:]).reshape(m, features, 12)
        # Added one by one, as rng::normal does (numpy's sum is pairwise).
        normal = u[:, :, 0].copy()
        for j in range(1, 12):
            normal += u[:, :, j]
        normal -= 6.0
        y[at:at + m] = blob % classes
        x[at:at + m] = (centres[blob] + spread * normal).astype(np.float32)
    return x, y


def fisher_yates(n, seed):
    """distributed_sampler's permutation of 0..n-1 for shuffle seed `seed`."""
    draws = Rng(seed).next(max(n - 1, 0))
    js = (draws % np.arange(n, 1, -1, dtype=np.uint64)).tolist()
    v = list(range(n))
    for i, j in zip(range(n, 1, -1), js):
        v[i - 1], v[j] = v[j], v[i - 1]
    return v


class SplitmixSampler(DistributedSampler):
    """torch's DistributedSampler (padding, striding, set_epoch) with dtrain's
    permutation instead of torch.randperm, so both programs see the same batches.
    The permutations are made up front: a Python loop of 8,192 swaps would
    charge PyTorch's epoch time ~2 ms that torch.randperm does not cost."""

    def __init__(self, dataset, num_replicas, rank, seed, epochs):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.orders = {e: fisher_yates(len(dataset), (seed + e) & MASK64) for e in range(epochs)}

    def __iter__(self):
        if self.epoch not in self.orders:
            self.orders[self.epoch] = fisher_yates(len(self.dataset), (self.seed + self.epoch) & MASK64)
        indices = list(self.orders[self.epoch])
        padding = self.total_size - len(indices)  # torch's padding: the list's start, repeated
        indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return iter(indices[self.rank:self.total_size:self.num_replicas])


class Mlp(nn.Module):
    """mlp::model: fc1, fc2, ... with ReLU between; He-uniform weights drawn
    layer by layer from one rng(seed), out x in row-major; biases zero."""

    def __init__(self, widths, seed):
        super().__init__()
        init = Rng(seed)
        for l in range(len(widths) - 1):
            n_in, n_out = widths[l], widths[l + 1]
            layer = nn.Linear(n_in, n_out)
            bound = math.sqrt(6.0 / n_in)
            w = init.uniform(-bound, bound, n_in * n_out).astype(np.float32).reshape(n_out, n_in)
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(w))
                layer.bias.zero_()
            self.add_module(f"fc{l + 1}", layer)

    def forward(self, x):
        *hidden, last = self.children()
        for layer in hidden:
            x = F.relu(layer(x))
        return last(x)


def twin_flags(argv):
    p = argparse.ArgumentParser(prog="vs_pytorch.py --twin",
                                description="PyTorch DDP twin of dtrain_train_mlp")
    p.add_argument("--twin", action="store_true")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=2, help="hidden layers (2)")
    return p.parse_args(argv)


def twin_worker(rank, world, s, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the demo does (mlp::flush_denormals)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))

    x, y = generate(s.features, s.classes, s.samples, s.seed, 0)
    x_test, y_test = generate(s.features, s.classes, s.samples // 4, s.seed, 1)
    train_set = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    widths = [s.features] + [s.hidden] * s.depth + [s.classes]
    model = Mlp(widths, s.seed)
    # 1.13's Reducer reads the first bucket's cap from here when DDP is built.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=16 / 1024)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=s.lr, momentum=s.momentum)
    sampler = SplitmixSampler(train_set, world, rank, s.seed, s.epochs)
    # Batched fetch (batch_size=None: the dataset gets each batch's index list):
    # per-sample fetch and collate would time Python, not DDP.
    loader = DataLoader(train_set, sampler=BatchSampler(sampler, s.batch_size, drop_last=False),
                        batch_size=None)

    if rank == 0:
        print(f"training a {'-'.join(map(str, widths))} MLP on {s.samples} samples: "
              f"{world} ranks x batch {s.batch_size} (global batch {s.batch_size * world}), "
              f"lr {s.lr:g}, momentum {s.momentum:g}, backend gloo (PyTorch {torch.__version__} DDP)",
              flush=True)
    for epoch in range(s.epochs):
        start = time.perf_counter()
        sampler.set_epoch(epoch)
        loss_sum = correct = count = 0.0
        for xb, yb in loader:
            logits = ddp(xb)
            loss = F.cross_entropy(logits, yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(yb)
            correct += (logits.argmax(1) == yb).sum().item()
            count += len(yb)
        totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
        dist.all_reduce(totals)
        elapsed = time.perf_counter() - start
        if rank == 0:
            with torch.no_grad():
                test_correct = (model(x_test).argmax(1) == y_test).sum().item()
            loss_sum, correct, count = totals.tolist()
            print(f"epoch {epoch + 1}/{s.epochs}  loss {loss_sum / count:.4f}  "
                  f"train accuracy {100 * correct / count:5.1f}%  "
                  f"test accuracy {100 * test_correct / len(y_test):5.1f}%  "
                  f"{count / elapsed:.0f} samples/s (all ranks)", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def twin_main(argv):
    s = twin_flags(argv)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the workers inherit it: loopback only
    mp.spawn(twin_worker, args=(s.nproc_per_node, s, free_port()), nprocs=s.nproc_per_node)
    return 0


# ---------------------------------------------------------------- the runner

EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)\s+loss (\S+)\s.*?(\d+) samples/s", re.M)

MODELS = {
    "default": {},
    "wide": {"features": 1024, "hidden": 1024, "samples": 1024, "epochs": 3},
}

# An outer launcher's world (torchrun, SLURM, mpirun) must not leak into the
# children: each is a world of --ranks processes on this machine's loopback.
FOREIGN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "DTRAIN_NPROC_PER_NODE",
               "DTRAIN_NNODES", "DTRAIN_NODE_RANK")
FOREIGN_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_")
# Open MPI's own settings (OMPI_MCA_*) stay: they tell mpirun how to start
# (a container's OMPI_MCA_plm_rsh_agent, say, without which mpirun looks for
# ssh and fails), and say nothing about a rank of an enclosing job.
KEPT_PREFIXES = ("OMPI_MCA_",)


def losses_agree(mine, theirs):
    """The first epoch's loss to the 4 printed decimals (a port error - data,
    weights, shuffle - shows there at once); the later ones within 1%: both
    flush denormals to zero, and PyTorch divides each gradient by the world
    size before it sums where dtrain sums first, so a value near the bottom of
    float's range can be lost on one side only; training then amplifies it."""
    if len(mine) != len(theirs) or not mine:
        return False
    if mine[0] != theirs[0]:
        return False
    return all(abs(float(a) - float(b)) <= 0.01 * max(abs(float(a)), abs(float(b)), 1e-4)
               for a, b in zip(mine[1:], theirs[1:]))


class ChildFailed(Exception):
    pass


def openblas_coretype():
    """OpenBLAS picks its kernels from the CPU model, and falls back to its
    SSE3 "Prescott" kernels on CPUs it does not know (many VMs): 2.5x slower
    sgemm here. Both programs load the same libopenblas, so both get the core
    the CPU's flags allow; OPENBLAS_CORETYPE in the environment wins."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return os.environ["OPENBLAS_CORETYPE"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ""
    if "avx512f" in flags:
        return "SkylakeX"
    if "avx2" in flags and "fma" in flags:
        return "Haswell"
    return ""


def child_env():
    env = {k: v for k, v in os.environ.items()
           if k not in FOREIGN_ENV and (k.startswith(KEPT_PREFIXES)
                                        or not k.startswith(FOREIGN_PREFIXES))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if openblas_coretype():
        env["OPENBLAS_CORETYPE"] = openblas_coretype()
    if os.geteuid() == 0:  # mpirun refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def mpi_command(mpirun, demo_mpi, n, flags):
    """The MPI build of the demo on n local ranks, with the children's BLAS settings."""
    exported = [x for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE")
                if name in child_env() for x in ("-x", name)]
    return [mpirun, "-np", str(n), "--oversubscribe", "--bind-to", "none", *exported,
            demo_mpi, *flags]


def run_child(name, command, timeout):
    """Runs one program to the end; returns its epoch lines as (loss text, samples/s)."""
    # Its own session, so that a timeout kills its workers too.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise ChildFailed(f"{name} did not finish in {timeout} s and was killed (with its "
                          f"workers): {' '.join(command)}", err or out)
    epochs = [(m.group(3), float(m.group(4)), int(m.group(2))) for m in EPOCH_LINE.finditer(out)]
    if proc.returncode != 0:
        raise ChildFailed(f"{name} exited with status {proc.returncode}: {' '.join(command)}",
                          err or out)
    if not epochs or len(epochs) != epochs[0][2]:
        raise ChildFailed(f"{name} printed {len(epochs)} epoch lines, not one per epoch: "
                          f"{' '.join(command)}", out + err)
    return out, [(loss, rate) for loss, rate, _ in epochs]


def figure(epochs):
    """A run's samples/s: the median over its epochs, the first (warm-up) left out."""
    rates = [rate for _, rate in epochs]
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def blas_in_use():
    """The BLAS library torch runs its matmuls with, as this process loaded it."""
    torch.ones(8, 8) @ torch.ones(8, 8)
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "blas" in os.path.basename(path).lower():
                found.add(os.path.realpath(path))
    config = torch.__config__.show()
    info = re.search(r"BLAS_INFO=(\w+)", config)
    return (f"BLAS_INFO={info.group(1) if info else '?'}, loaded "
            f"{', '.join(sorted(found)) or 'no libblas (torch links its own)'}")


def model_flags(settings, depth):
    flags = []
    for key, value in settings.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    if depth != 2:  # binaries without --depth still run the default
        flags += ["--depth", str(depth)]
    return flags


def runner_main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(prog="vs_pytorch.py",
                                description="dtrain's MLP demo against its PyTorch DDP twin")
    p.add_argument("--demo", default=os.path.join(here, "..", "build", "examples", "dtrain_train_mlp"))
    p.add_argument("--demo-mpi",
                   default=os.path.join(here, "..", "build", "examples", "dtrain_train_mlp_mpi"),
                   help="the MPI build of the demo, run under mpirun ('' leaves it out)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="default,wide")
    p.add_argument("--epochs", type=int, help="overrides each model's epochs")
    p.add_argument("--samples", type=int, help="overrides each model's samples")
    p.add_argument("--depth", type=int, default=2, help="hidden layers of both models (2)")
    p.add_argument("--timeout", type=int, default=RUN_TIMEOUT_S, help="seconds per run (300)")
    a = p.parse_args(argv)
    ranks = [int(r) for r in a.ranks.split(",")]
    models = a.models.split(",")
    for m in models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r} (known: {', '.join(MODELS)})")

    if not os.access(a.demo, os.X_OK):
        print(f"SKIPPED: no demo binary at {a.demo} (build target dtrain_train_mlp, or give --demo)")
        return SKIPPED
    mpirun = shutil.which("mpirun")
    with_mpi = bool(a.demo_mpi) and os.access(a.demo_mpi, os.X_OK) and mpirun is not None

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    print(f"machine: nproc {len(os.sched_getaffinity(0))}, load (1 min) {load_before:.2f}; "
          f"torch {torch.__version__}, {blas_in_use()}")
    shm = os.environ.get("DTRAIN_GLOO_SHM")
    print(f"demo {os.path.normpath(a.demo)} (Gloo, "
          + ("allreduces over TCP: DTRAIN_GLOO_SHM=" + shm if shm in ("0", "false", "no", "off")
             else "allreduces through shared memory, PyTorch's over TCP") + ")"
          + (f" and {os.path.normpath(a.demo_mpi)} (MPI, under mpirun)" if with_mpi else
             " (no MPI build or mpirun: the MPI column is left out)")
          + f"; {a.repeats} repeats; OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "
          f"OPENBLAS_CORETYPE={openblas_coretype() or '(detected)'}; all flush denormals to zero",
          flush=True)

    names = ["dtrain", "PyTorch"] + (["dtrain MPI"] if with_mpi else [])
    rows, mismatches, runs = [], [], 0
    for m in models:
        settings = dict(MODELS[m])
        if a.epochs:
            settings["epochs"] = a.epochs
        if a.samples:
            settings["samples"] = a.samples
        flags = model_flags(settings, a.depth)
        for n in ranks:
            programs = {
                "dtrain": [a.demo, "--nproc-per-node", str(n), *flags],
                "PyTorch": [sys.executable, os.path.abspath(__file__), "--twin",
                            "--nproc-per-node", str(n), *flags],
            }
            if with_mpi:
                programs["dtrain MPI"] = mpi_command(mpirun, a.demo_mpi, n, flags)
            figures = {name: [] for name in names}
            for r in range(a.repeats):
                order = names[r % len(names):] + names[:r % len(names)]  # who goes first rotates
                losses = {}
                for name in order:
                    try:
                        out, epochs = run_child(name, programs[name], a.timeout)
                    except ChildFailed as failure:
                        message, tail = failure.args
                        print(f"FAILED: {message}\n--- the end of its output ---", file=sys.stderr)
                        print("\n".join(tail.splitlines()[-20:]) or "(none)", file=sys.stderr)
                        return 1
                    if n == ranks[0] and r == 0:  # what each program says it trains, once a model
                        print(f"  {name}: {next(iter(out.splitlines()), '')}", flush=True)
                    figures[name].append(figure(epochs))
                    losses[name] = [loss for loss, _ in epochs]
                for name in names:
                    if name == "PyTorch":
                        continue
                    runs += 1
                    if not losses_agree(losses[name], losses["PyTorch"]):
                        mismatches.append(f"{m} x{n} repeat {r + 1}: {name} "
                                          f"{' '.join(losses[name])} / PyTorch "
                                          f"{' '.join(losses['PyTorch'])}")
            medians = {name: statistics.median(figures[name]) for name in names}
            rows.append((m, n, medians))
            print(f"  {m} x{n}: " + "; ".join(
                f"{name} {', '.join(f'{v:.0f}' for v in figures[name])}" for name in names)
                + " samples/s", flush=True)

    print(f"\nload (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"wall time {time.monotonic() - started:.0f} s\n")
    mpi_head = " dtrain MPI samples/s |" if with_mpi else ""
    mpi_ratio_head = " dtrain MPI / PyTorch |" if with_mpi else ""
    print(f"| model | ranks | dtrain samples/s |{mpi_head} PyTorch samples/s | dtrain / PyTorch |"
          f"{mpi_ratio_head}")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if with_mpi else ""))
    for m, n, v in rows:
        mpi_cell = f" {v['dtrain MPI']:,.0f} |" if with_mpi else ""
        mpi_ratio = f" {v['dtrain MPI'] / v['PyTorch']:.2f} |" if with_mpi else ""
        print(f"| {m} | {n} | {v['dtrain']:,.0f} |{mpi_cell} {v['PyTorch']:,.0f} | "
              f"{v['dtrain'] / v['PyTorch']:.2f} |{mpi_ratio}")
    print("\ngoal: dtrain / PyTorch >= 1.3 at every rank count, for both models")
    if 1 in ranks and len(ranks) > 1:
        # Scaling: an epoch of 100 s on one rank should take 100 / N s on N
        # (the guide's 100 s -> 50 s -> 25 s); efficiency = rate(N) / (N x rate(1)).
        print("\nscaling efficiency, samples/s at N ranks / (N x samples/s at 1 rank):\n")
        print("| model | ranks | " + " | ".join(f"{name} efficiency" for name in names) + " |")
        print("|---|---:|" + "---:|" * len(names))
        single = {m: v for m, n, v in rows if n == 1}
        for m, n, v in rows:
            if n != 1:
                print(f"| {m} | {n} | " + " | ".join(
                    f"{v[name] / (n * single[m][name]):.2f}" for name in names) + " |")
        top = max(ranks)
        verdicts = []
        for m, n, v in rows:
            if n == top:
                ours, theirs = (v[name] / (n * single[m][name]) for name in ("dtrain", "PyTorch"))
                ok = ours >= 0.9 and ours > theirs
                verdicts.append(f"{m} {ours:.2f} against PyTorch's {theirs:.2f}: "
                                f"{'met' if ok else 'not met'}")
        print(f"\ngoal: dtrain's efficiency at {top} ranks >= 0.9 and above PyTorch DDP's: "
              + "; ".join(verdicts))
    for name, what in (("dtrain", "the demo over Gloo (PyTorch's engine too)"),
                       ("dtrain MPI", "the demo over MPI (Debian's torch has no MPI backend)")):
        if name not in names:
            continue
        met = [f"{m} x{n}" for m, n, v in rows if v[name] / v["PyTorch"] >= 1.3]
        missed = [f"{m} x{n} ({v[name] / v['PyTorch']:.2f})" for m, n, v in rows
                  if v[name] / v["PyTorch"] < 1.3]
        print(f"  {what}: met: {', '.join(met) or 'none'}; not met: {', '.join(missed) or 'none'}")
    if mismatches:
        print(f"\nFAILED: the losses differ in {len(mismatches)} of {runs} comparisons: the "
              "programs did not train alike, so the comparison does not hold")
        for line in mismatches:
            print(f"  {line}")
        return 1
    print(f"\nlosses: every dtrain run agrees with its PyTorch run ({runs} comparisons; the first "
          "epoch to 4 decimals, the others within 1%)")
    return 0


if __name__ == "__main__":
    if "--twin" in sys.argv[1:]:
        sys.exit(twin_main(sys.argv[1:]))
    sys.exit(runner_main(sys.argv[1:]))
