"""Acceptance counts, as docs/design.md ("Measuring acceptance") defines them.

Positions are tree depths. For every verify step whose tree reaches depth d, positions 1..d: `proposed_i` (the
tree reaches depth i), `reached_i` (the accepted path reached depth i - 1 at a node with children, so depth i was
tried), `accepted_i` (the accepted path reaches depth i). Conditional acceptance is accepted_i / reached_i, survival
is accepted_i / steps that carried drafts (vLLM's per-position rate), the acceptance rate is sum(accepted) / draft
nodes verified (every node of every tree counts), rows per step is 1 + draft nodes per verify step, and the mean
acceptance length tau is emitted tokens / verify steps (1.0 for plain decoding). A chain of d drafts is the tree
whose depths are 1..d. Lookahead rows (computed, never accepted) count in rows per step, not as drafts.
Structured outputs: drafts the grammar forbade are cut before verification and counted only in
`num_invalid_spec_tokens` (vLLM's name); nodes the grammar forced count among the draft nodes, and apart in
`num_grammar_draft_tokens` and `num_accepted_grammar_draft_tokens` (the drafter's own are the rest).
"""
from __future__ import annotations


class AcceptanceStats:
    def __init__(self, num_positions: int = 0):
        self.num_steps = 0
        self.num_emitted = 0
        self.num_drafts = 0  # steps that carried at least one draft (vLLM's spec_decode_num_drafts)
        self.num_draft_tokens = 0  # draft nodes verified (vLLM's spec_decode_num_draft_tokens)
        self.num_lookahead_rows = 0  # rows computed beside the drafts and never accepted (lookahead decoding)
        self.num_invalid_spec_tokens = 0  # drafts the grammar forbade, cut before verification
        self.num_grammar_draft_tokens = 0  # draft nodes the grammar forced, verified
        self.num_accepted_grammar_draft_tokens = 0  # of those, accepted
        self.proposed = [0] * num_positions
        self.reached = [0] * num_positions
        self.accepted = [0] * num_positions

    def _grow(self, size: int):
        for counts in (self.proposed, self.reached, self.accepted):
            counts.extend([0] * (size - len(counts)))

    def record(self, tree, path: list[int], num_emitted: int) -> None:
        """One verify step: `tree` (a serving.spec_decode.tree.DraftTree) proposed, `path` accepted, `num_emitted` tokens
        kept (fewer than len(path) + 1 where a stop cut them)."""
        depth = tree.depth
        self._grow(depth)
        self.num_steps += 1
        self.num_emitted += num_emitted
        self.num_drafts += len(tree) > 0
        self.num_draft_tokens += len(tree)
        self.num_lookahead_rows += tree.num_rows - len(tree)
        if tree.forced:
            self.num_grammar_draft_tokens += tree.num_forced
            self.num_accepted_grammar_draft_tokens += sum(tree.forced[node] for node in path)
        num_tried = depths_tried(tree, path)
        for i in range(depth):
            self.proposed[i] += 1
            self.reached[i] += i < num_tried
            self.accepted[i] += i < len(path)

    def merge(self, other: "AcceptanceStats") -> None:
        self._grow(len(other.proposed))
        self.num_steps += other.num_steps
        self.num_emitted += other.num_emitted
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_lookahead_rows += other.num_lookahead_rows
        self.num_invalid_spec_tokens += other.num_invalid_spec_tokens
        self.num_grammar_draft_tokens += other.num_grammar_draft_tokens
        self.num_accepted_grammar_draft_tokens += other.num_accepted_grammar_draft_tokens
        for mine, theirs in ((self.proposed, other.proposed), (self.reached, other.reached), (self.accepted, other.accepted)):
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def tau(self) -> float:
        return self.num_emitted / self.num_steps if self.num_steps else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's mean acceptance length, 1 + accepted / drafts: tokens per drafting step (tau counts every verify
        step, drafted for or not, and tokens a stop cut off as not emitted)."""
        return 1 + sum(self.accepted) / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return sum(self.accepted) / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def rows_per_step(self) -> float:
        """Rows the target computed per step: the newest token, every draft node and lookahead row (1.0 for plain
        decoding)."""
        return 1 + (self.num_draft_tokens + self.num_lookahead_rows) / self.num_steps if self.num_steps else 0.0

    def per_position(self) -> list[dict]:
        return [
            {
                "position": i + 1,
                "proposed": self.proposed[i],
                "reached": self.reached[i],
                "accepted": self.accepted[i],
                "conditional": self.accepted[i] / self.reached[i] if self.reached[i] else 0.0,
                "survival": self.accepted[i] / self.num_drafts if self.num_drafts else 0.0,
            }
            for i in range(len(self.proposed))
        ]

    @classmethod
    def from_dict(cls, summary: dict) -> "AcceptanceStats":
        """The counts back from `to_dict`'s summary (a RequestOutput's metrics["spec"])."""
        stats = cls()
        stats.num_steps, stats.num_emitted = summary["num_verify_steps"], summary["num_emitted_tokens"]
        stats.num_drafts = summary["spec_decode_num_drafts"]
        stats.num_draft_tokens = summary["spec_decode_num_draft_tokens"]
        stats.num_lookahead_rows = summary["num_lookahead_rows"]
        stats.num_invalid_spec_tokens = summary["num_invalid_spec_tokens"]
        stats.num_grammar_draft_tokens = summary["num_grammar_draft_tokens"]
        stats.num_accepted_grammar_draft_tokens = summary["num_accepted_grammar_draft_tokens"]
        for key in ("proposed", "reached", "accepted"):
            setattr(stats, key, [p[key] for p in summary["per_position"]])
        return stats

    def to_dict(self) -> dict:
        """The summary, with vLLM's metric names where the meaning matches."""
        return {
            "tau": self.tau,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "rows_per_step": self.rows_per_step,
            "num_verify_steps": self.num_steps,
            "num_emitted_tokens": self.num_emitted,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "num_lookahead_rows": self.num_lookahead_rows,
            "num_invalid_spec_tokens": self.num_invalid_spec_tokens,
            "num_grammar_draft_tokens": self.num_grammar_draft_tokens,
            "num_accepted_grammar_draft_tokens": self.num_accepted_grammar_draft_tokens,
            "spec_decode_num_accepted_tokens": sum(self.accepted),
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted),
            "per_position": self.per_position(),
        }


def depths_tried(tree, path: list[int]) -> int:
    """How many depths of `tree` a step tried: those of the accepted path, and the one below it if its last node (or
    the newest token) had children."""
    last = path[-1] if path else -1
    return len(path) + 1 if tree.children[last + 1] else len(path)
