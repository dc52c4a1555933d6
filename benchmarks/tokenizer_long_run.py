"""Time to train the BPE tokenizer on a document holding one long run without a space, with
runs cut into slices of ``MAX_TRAINING_RUN`` (as ``train_tokenizer`` does) and given whole
(as before), side by side in one process.

    python benchmarks/tokenizer_long_run.py [--sizes 16384 65536]

The whole-run column grows much faster than the size; keep its sizes small (at 256 KB it took
minutes, at 1 MB hours).
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from common import machine

from mergekit_loco.train import tokenizer as tokenizer_module


def seconds_to_train(size: int, whole: bool) -> float:
    """Seconds to train a 300-token BPE on a little code and ``size`` x's (``whole``: no cut)."""
    documents = [["def f(x):\n    return x + 1\n" * 100, "x" * size]]
    cut = (lambda text: iter([text])) if whole else tokenizer_module.bounded_runs
    with mock.patch.object(tokenizer_module, "bounded_runs", cut):
        began = time.perf_counter()
        tokenizer_module.train_tokenizer(documents, vocab_size=300)
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    args = parser.parse_args()
    print(machine())
    print(f"{'run length':>12} {'cut (s)':>10} {'whole (s)':>10} {'whole / cut':>12}")
    for size in args.sizes:
        cut, whole = seconds_to_train(size, False), seconds_to_train(size, True)
        print(f"{size:>12,} {cut:>10.3f} {whole:>10.3f} {whole / cut:>12.0f}")


if __name__ == "__main__":
    main()
