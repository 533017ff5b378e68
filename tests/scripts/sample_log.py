#!/usr/bin/env python3
"""The demo's --sample-log across the rounds of a job: the steps trained twice,
and every sample of every epoch trained once.

examples/train_mlp.cpp --sample-log DIR makes each rank write
DIR/round-R-rank-N.txt (R: its agent's round, the restart count; N: the rank),
one line as it BEGINS a step: "STEP EPOCH INDEX..." (STEP from 1, EPOCH from 0,
the samples of its batch). bench/goodput_twin.py writes "STEP" alone, on rank 0.
A line without its newline (cut by a kill) is not read.

The one rule, for tests/cluster/test_cluster.sh, tests/training/resume.sh,
bench/recovery.sh and bench/goodput.sh: a step was trained by a round when
some rank of that round began the next one (its collectives were done); at
each change of round, the steps trained twice are those at or after the new
round's first step that an earlier round trained.

    python3 sample_log.py twice DIR

prints one number: the steps trained twice, summed over the changes of round.

    python3 sample_log.py check DIR --samples N --epochs E [--most-twice K]

prints the steps trained twice at each change of round, the rounds, and each
epoch's samples, counted from the steps the job kept (a round resumed at its
checkpoint supersedes what earlier rounds began from there on). Exits 1,
naming the epoch, sample, step and round, unless every sample 0..N-1 of every
epoch 0..E-1 is trained, none more often than the sampler's padding allows,
and (with --most-twice) at most K steps are trained twice at each change.
Exits 2 on a folder or line it cannot read.
"""
import argparse
import collections
import glob
import os
import re
import sys

FILE = re.compile(r"round-(\d+)-rank-(\d+)\.txt$")


def unreadable(message):
    print(f"sample_log.py: {message}", file=sys.stderr)
    sys.exit(2)


class Line:
    """One line of a sample log: a step that a rank of a round began."""

    def __init__(self, rnd, rank, step, epoch, samples, where):
        self.round = rnd
        self.rank = rank
        self.step = step
        self.epoch = epoch  # None in bench/goodput_twin.py's logs
        self.samples = samples
        self.where = where  # "file:line", for the messages


class Round:
    """What the ranks of one round began, step by step."""

    def __init__(self):
        self.steps = collections.defaultdict(list)  # step -> [Line], one per rank

    @property
    def first(self):
        return min(self.steps)

    @property
    def last(self):
        return max(self.steps)

    def trained(self, step):
        """Some rank of this round began the next step: this one's collectives were done."""
        return step + 1 in self.steps


def read(folder):
    """The rounds of FOLDER's logs that began a step, by number."""
    if not os.path.isdir(folder):
        unreadable(f"{folder} is not a folder (the demo's --sample-log DIR)")
    rounds = {}
    for path in sorted(glob.glob(os.path.join(folder, "round-*-rank-*.txt"))):
        m = FILE.search(os.path.basename(path))
        if not m:
            continue
        rnd, rank = int(m.group(1)), int(m.group(2))
        with open(path) as f:
            for n, text in enumerate(f, 1):
                if not text.endswith("\n"):
                    continue  # cut by the kill
                where = f"{path}:{n}"
                try:
                    fields = [int(x) for x in text.split()]
                except ValueError:
                    unreadable(f"{where}: not \"STEP EPOCH INDEX...\": {text.strip()!r}")
                if not fields:
                    unreadable(f"{where}: an empty line (each line begins with its step)")
                epoch = fields[1] if len(fields) > 1 else None
                line = Line(rnd, rank, fields[0], epoch, fields[2:], where)
                rounds.setdefault(rnd, Round()).steps[line.step].append(line)
    return dict(sorted(rounds.items()))


def trained_twice(rounds):
    """Round number -> the sorted steps it trained again that earlier rounds had
    trained, for every round after the first."""
    numbers = list(rounds)
    return {r: sorted({s for r0 in numbers if r0 < r for s in rounds[r0].steps
                       if s >= rounds[r].first and rounds[r0].trained(s)})
            for r in numbers[1:]}


def kept(rounds):
    """The lines of the steps the job kept: a step of round r is superseded when
    a later round began at or before it (resumed from an older state)."""
    for r, rnd in rounds.items():
        for step, lines in rnd.steps.items():
            if not any(r2 > r and later.first <= step for r2, later in rounds.items()):
                yield from lines


def where_seen(rounds, epoch, sample):
    """Every line, kept or not, that began a step with SAMPLE of EPOCH."""
    return [line for rnd in rounds.values() for lines in rnd.steps.values() for line in lines
            if line.epoch == epoch and sample in line.samples]


def describe(line, rounds):
    later = [r2 for r2, rnd in rounds.items() if r2 > line.round and rnd.first <= line.step]
    text = f"step {line.step} of round {line.round} (rank {line.rank}, {line.where})"
    if later:
        text += f", superseded by round {later[0]}, which began at step {rounds[later[0]].first}"
    return text


def twice_command(args):
    rounds = read(args.dir)
    print(sum(len(steps) for steps in trained_twice(rounds).values()))
    return 0


def check_command(args):
    rounds = read(args.dir)
    if not rounds:
        print(f"FAILED: no round began a step in {args.dir} (no round-R-rank-N.txt with a line)")
        return 1
    problems = []
    again = trained_twice(rounds)
    for r, steps in again.items():
        print(f"steps trained twice when round {r} began: {len(steps)} {steps}")
        if args.most_twice is not None and len(steps) > args.most_twice:
            problems.append(
                f"round {r} began at step {rounds[r].first} and trained again {len(steps)} steps "
                f"that earlier rounds had trained ({', '.join(map(str, steps))}): "
                f"at most {args.most_twice} allowed")
    widest = {r: max(len(lines) for lines in rnd.steps.values()) for r, rnd in rounds.items()}
    print("rounds with steps:", ", ".join(
        f"{r} (steps {rnd.first}..{rnd.last}, up to {widest[r]} ranks a step)"
        for r, rnd in rounds.items()))

    seen = collections.defaultdict(collections.Counter)  # epoch -> sample -> times
    for line in kept(rounds):
        if line.epoch is None:
            print(f"FAILED: {line.where}: step {line.step} has no epoch and no samples "
                  "(bench/goodput_twin.py's log? check reads the demo's)")
            return 1
        seen[line.epoch].update(line.samples)
    # The sampler pads an epoch's last step to the same size on every rank: at
    # most (ranks - 1) repeats. Allowed once a round: loose, but whichever
    # round trains that step, enough.
    padding = (max(widest.values()) - 1) * len(rounds)
    wanted = set(range(args.epochs))
    for epoch in sorted(wanted | set(seen)):
        counts = seen.get(epoch, collections.Counter())
        missing = [i for i in range(args.samples) if counts[i] == 0]
        strangers = sorted(i for i in counts if not 0 <= i < args.samples)
        extra = sum(counts.values()) - args.samples
        if not counts:
            problems.append(f"epoch {epoch}: no step that the job kept trained it "
                            f"(--epochs {args.epochs})")
            continue
        print(f"epoch {epoch}: {len(counts)} distinct samples of {args.samples}, {extra} repeated "
              f"(padding), {len(missing)} missing")
        if epoch not in wanted:
            problems.append(f"epoch {epoch} was trained, but the job has epochs "
                            f"0..{args.epochs - 1} (--epochs {args.epochs})")
            continue
        for i in missing[:5]:
            lines = where_seen(rounds, epoch, i)
            problems.append(f"epoch {epoch}: sample {i} was trained by no step the job kept" +
                            (": begun in " + "; ".join(describe(l, rounds) for l in lines)
                             if lines else " (no round began it)"))
        if len(missing) > 5:
            problems.append(f"epoch {epoch}: and {len(missing) - 5} more samples missing")
        for i in strangers[:5]:
            problems.append(f"epoch {epoch}: sample {i} is not below --samples {args.samples}")
        if not missing and extra > padding:
            twice = [i for i, c in sorted(counts.items()) if c > 1]
            problems.append(
                f"epoch {epoch}: {extra} samples repeated, more than the sampler's padding allows "
                f"({padding}: {max(widest.values()) - 1} a round, {len(rounds)} rounds); e.g. "
                f"sample {twice[0]} in " + "; ".join(
                    describe(l, rounds) for l in kept(rounds)
                    if l.epoch == epoch and twice[0] in l.samples))
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


def main(argv):
    parser = argparse.ArgumentParser(
        prog="sample_log.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The demo's --sample-log files (DIR/round-R-rank-N.txt) across a job's\n"
                    "rounds: the steps trained twice (a step was trained when some rank of its\n"
                    "round began the next), and every sample of every epoch trained once.",
        epilog="examples:\n"
               "  sample_log.py twice /tmp/samples\n"
               "  sample_log.py check /tmp/samples --samples 8192 --epochs 4 --most-twice 1\n"
               "exit status: 0 as it should be; 1 check failed (FAILED: lines say what);\n"
               "2 a folder or line that cannot be read, or a wrong argument")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{twice,check}")
    twice = sub.add_parser("twice", help="print the steps trained twice, summed over the changes "
                                         "of round")
    twice.add_argument("dir", help="the demo's --sample-log folder")
    twice.set_defaults(run=twice_command)
    check = sub.add_parser("check", help="every sample of every epoch trained once; the steps "
                                         "trained twice at each change of round; exit 1 if not")
    check.add_argument("dir", help="the demo's --sample-log folder")
    check.add_argument("--samples", type=int, required=True, metavar="N",
                       help="the demo's --samples: samples 0..N-1 in every epoch")
    check.add_argument("--epochs", type=int, required=True, metavar="E",
                       help="the demo's --epochs: epochs 0..E-1")
    check.add_argument("--most-twice", type=int, metavar="K",
                       help="fail when a change of round trains more than K steps twice")
    check.set_defaults(run=check_command)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
