"""Prompt lookup (serving/drafters/ngram.py) against a direct reading of its rule: for n from the longest suffix
down, scan earlier occurrences from the most recent; the first followed by a full run of drafts wins, else the
one followed by the longest run; nothing when no suffix occurred before."""
import random

import pytest

from serving.drafters.ngram import NgramDrafter
from serving.spec_decode.config import SpeculativeConfig


def reference(tokens, num_drafts, min_n, max_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix, best = tokens[len(tokens) - n:], []
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + num_drafts]
                if len(follow) == num_drafts:
                    return follow
                if len(follow) > len(best):
                    best = follow
        if best:
            return best
    return []


def drafter(min_n, max_n):
    return NgramDrafter(SpeculativeConfig(method="ngram", prompt_lookup_min=min_n, prompt_lookup_max=max_n))


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 3), (2, 3), (2, 5), (3, 3)])
def test_lookup_follows_its_rule_on_random_sequences(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    lookup, num_nonempty = drafter(min_n, max_n), 0
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat often, at every suffix length
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        num_drafts = rng.randrange(1, 7)
        expected = reference(tokens, num_drafts, min_n, max_n)
        assert lookup.lookup(tokens, num_drafts) == expected, (tokens, num_drafts)
        num_nonempty += bool(expected)
    assert 100 < num_nonempty < 400  # both outcomes occur


def test_lookup_prefers_the_most_recent_full_run_then_the_longest_partial_one():
    lookup = drafter(2, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 8, 1, 2, 7, 8, 3, 4, 7, 8]  # "7 8" at 0 and 4: both followed by 4+ tokens
    assert lookup.lookup(tokens, 3) == [3, 4, 7]  # the most recent
    assert lookup.lookup(tokens, 6) == [1, 2, 7, 8, 3, 4]  # only the first has 6 after it
    assert lookup.lookup(tokens, 9) == [1, 2, 7, 8, 3, 4, 7, 8]  # none has 9: the longest run
    assert lookup.lookup([5, 6, 7, 8, 5, 9], 2) == []  # "5 9" never occurred before; 1-token suffixes are below min
    assert drafter(1, 3).lookup([5, 6, 7, 8, 5, 9, 1, 9], 2) == [1, 9]  # "9" at 5


def test_propose_is_a_chain_of_the_lookup_cut_to_the_budgets_nodes_and_depth():
    from types import SimpleNamespace

    from serving.drafters.base import DraftBudget
    from serving.spec_decode.tree import DraftTree

    lookup = drafter(2, 3)
    tokens = [7, 8, 1, 2, 7, 8, 3, 4, 7, 8]
    requests = [SimpleNamespace(request_id=name, token_ids=tokens) for name in ("a", "b", "c")]
    budgets = {"a": DraftBudget(6, 9), "b": DraftBudget(9, 2), "c": DraftBudget(3, 3)}
    trees = lookup.propose(None, requests, budgets)
    assert trees == {"a": DraftTree.chain([1, 2, 7, 8, 3, 4]), "b": DraftTree.chain([3, 4]),
                     "c": DraftTree.chain([3, 4, 7])}
    assert all(tree.parents == tuple(range(-1, len(tree) - 1)) for tree in trees.values())
