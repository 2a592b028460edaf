"""What reading every target's weight costs the probe (gaeq.script.targets): a language model's last layer and
its cross-entropy, forward and backward, with and without the reader's hook on the logits — per micro-batch,
at the sizes of a small LM's step.

    python benchmarks/target_weights.py            # rows × positions × vocabulary: 8 × 512 × 32,000 and smaller
    python benchmarks/target_weights.py --tiny     # a tiny size: keeps the code working, numbers mean nothing

The reader holds the logits until their gradient arrives, then reads them in float64 a chunk at a time
(`targets.CHUNK`): its cost grows with rows × positions × vocabulary, as the cross-entropy's own does. Printed:
milliseconds per micro-batch without and with it, and the ratio; the machine's threads as torch uses them.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gaeq.script.targets import TargetWeights

SIZES = [(8, 128, 8_000, 256), (8, 512, 32_000, 256)]
"""(rows, positions, vocabulary, hidden): the logits a micro-batch hands its loss."""
TINY = [(2, 16, 64, 16)]


def micro_batch(rows: int, positions: int, vocab: int, hidden: int, *, read: bool, repeats: int) -> float:
    """Seconds per micro-batch: the output layer, its cross-entropy over every position, backward."""
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    x = torch.randn(rows, positions, hidden)
    y = torch.randint(0, vocab, (rows, positions))
    reader = TargetWeights()
    times = []
    for _ in range(repeats + 1):  # (the first warms up)
        head.zero_grad()
        started = time.perf_counter()
        logits = head(x)
        if read:
            reader.watch(logits)
        F.cross_entropy(logits.view(-1, vocab), y.view(-1)).backward()
        times.append(time.perf_counter() - started)
        reader.take()
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny size: the code, not the numbers")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = TINY if args.tiny else SIZES
    if args.tiny:
        print("tiny run (--tiny): its numbers mean nothing")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| rows × positions × vocabulary | without (ms) | with the reader (ms) | × |")
    print("|---|---|---|---|")
    for rows, positions, vocab, hidden in sizes:
        plain = micro_batch(rows, positions, vocab, hidden, read=False, repeats=args.repeats)
        read = micro_batch(rows, positions, vocab, hidden, read=True, repeats=args.repeats)
        print(f"| {rows} × {positions} × {vocab:,} | {plain * 1e3:.1f} | {read * 1e3:.1f} | {read / plain:.2f} |")


if __name__ == "__main__":
    main()
