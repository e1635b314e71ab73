"""Our suffix trees (serving/drafters/suffix_tree.py) against Arctic Inference's (`SuffixDecodingCache`, tree mode,
what vLLM's suffix method calls) on the same random requests: prompts and answers appended in random pieces over
a few vocabulary sizes, tree depths, cache sizes, spec factors and probability floors; after each piece both draft
for the request. Prints how many drafts have the same score (ties between equal scores may pick different trees,
and Arctic sums in float32) and each one's microseconds per draft.

Arctic Inference ships only its source on PyPI; it builds where CMake finds Python's headers, e.g.
    CMAKE_ARGS="-DPython_EXECUTABLE=$(which python) -DPython_INCLUDE_DIR=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
        pip wheel --no-deps arctic-inference==0.3.0 -w /tmp/arctic && pip install --no-deps --target /tmp/arctic-t /tmp/arctic/*.whl
    PYTHONPATH=$PWD python benchmarks/suffix_vs_arctic.py --arctic /tmp/arctic-t
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

from serving.drafters.suffix_tree import SuffixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arctic", required=True, help="a folder holding the arctic_inference package")
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    sys.path.insert(0, args.arctic)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    rng = random.Random(0)
    num, num_same, num_drafted, ours_s, arctic_s = 0, 0, 0, 0.0, 0.0
    for _ in range(args.trials):
        depth, cached = rng.choice([4, 8, 24]), rng.choice([1, 3, 10])
        factor, min_prob = rng.choice([1.0, 2.0, 0.5]), rng.choice([0.0, 0.1, 0.3])
        ours, arctic = SuffixCache(depth, cached), SuffixDecodingCache(depth, cached)
        vocab = rng.choice([3, 5, 20])
        for key in range(8):
            seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            ours.start(key, seq)
            arctic.start_request(key, np.asarray(seq, np.int32))
            for _ in range(rng.randrange(1, 30)):
                piece = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
                seq += piece
                ours.add(key, piece)
                arctic.add_active_response(key, np.asarray(piece, np.int32))
                max_nodes = rng.randrange(1, 16)
                start = time.perf_counter()
                mine = ours.speculate(key, seq, max_nodes, factor, min_prob)
                middle = time.perf_counter()
                theirs = arctic.speculate(key, np.asarray(seq[-depth:], np.int32), max_nodes, factor, 0.0, min_prob, True)
                ours_s += middle - start
                arctic_s += time.perf_counter() - middle
                num += 1
                num_drafted += bool(mine.tokens)
                num_same += abs(mine.score - theirs.score) < 1e-4
            ours.stop(key)
            arctic.stop_request(key)
    print(f"{num_same}/{num} drafts score the same ({num_drafted} non-empty); microseconds per draft: ours "
          f"{ours_s / num * 1e6:.1f}, Arctic's {arctic_s / num * 1e6:.1f}")


if __name__ == "__main__":
    main()
