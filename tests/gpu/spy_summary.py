"""Summarize py-spy's collapsed stacks (``py-spy record -f raw --threads``, tests/gpu/gap_check.sh) of a training
run: the samples of the thread that ran the training loop, after compilation, by innermost frame (self) and by
frame (inclusive).

    python tests/gpu/spy_summary.py spy.txt [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    loop = collections.Counter()
    leaf = collections.Counter()
    inclusive = collections.Counter()
    threads = collections.Counter()
    total = 0
    for line in open(args.path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        frames = stack.split(";")
        threads[frames[0]] += n
        total += n
        if not any("_TrainingEpochLoop" in f for f in frames):  # the loop: batches, steps, callbacks
            continue
        if any(re.search(r"inductor|convert_frame|_compile|compile_fx", f) for f in frames):
            loop["compiling"] += n
            continue
        loop[frames[0]] += n
        leaf[frames[-1][:140]] += n
        for name in {f.split(" (")[0][:100] for f in frames[1:]}:
            inclusive[name] += n
    print(f"{total} samples; by thread: {threads.most_common(6)}")
    steady = sum(v for k, v in loop.items() if k != "compiling")
    print(f"training loop after compilation: {steady} samples (compiling {loop['compiling']})")
    print("innermost frames (self):")
    for f, n in leaf.most_common(args.top):
        print(f"  {100 * n / max(steady, 1):5.1f}%  {f}")
    print("frames (inclusive):")
    for f, n in [kv for kv in inclusive.most_common() if kv[1] < 0.995 * steady][:args.top * 2]:
        print(f"  {100 * n / max(steady, 1):5.1f}%  {f}")


if __name__ == "__main__":
    main()
