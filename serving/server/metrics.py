"""The server's Prometheus metrics, under vLLM's `vllm:` names where the meaning matches, so dashboards and
benchmark clients written for vLLM read them unchanged.

Counters grow by what each engine step did: tokens emitted, and the speculator's global acceptance counts
(serving.spec_decode.metrics.AcceptanceStats, drafts of aborted requests included), so over any window the difference of
two scrapes is that window's acceptance. `vllm:inter_token_latency_seconds` is observed once per request per step
that emitted tokens to it (a speculative step emits several at once, as in vLLM). `kv_cache_usage_perc` is a
fraction in [0, 1], as vLLM's is despite its name. As in vLLM, every counter shows from the start (a client that
reads /metrics before and after a window, as `vllm bench serve` does, finds them both times) and the per-position
acceptance is labelled by the draft position counted from 0. Each server has a registry of its own.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        label, r = ["model_name"], self.registry
        self.num_requests_running = Gauge("vllm:num_requests_running", "Requests in the running batch", label,
                                          registry=r)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", label,
                                          registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of K/V blocks held by requests (0 to 1)",
                                    label, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens emitted", label, registry=r)
        self.request_success = Counter("vllm:request_success", "Requests finished, by finish reason",
                                       [*label, "finished_reason"], registry=r)
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps that carried drafts", label, registry=r)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified",
                                        label, registry=r)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", label,
                                           registry=r)
        self.num_accepted_tokens_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                                   "Draft tokens accepted at each depth (position 0: depth 1)",
                                                   [*label, "position"], registry=r)
        # Not vLLM's: with these, tau (emitted tokens per verify step) reads as the offline bench computes it.
        self.num_verify_steps = Counter("draftheads:spec_decode_num_verify_steps", "Verify steps, drafts or not",
                                        label, registry=r)
        self.num_emitted_tokens = Counter("draftheads:spec_decode_num_emitted_tokens", "Tokens emitted by verify steps",
                                          label, registry=r)
        # Structured outputs: drafts the grammar forbade (vLLM's num_invalid_spec_tokens), and those it forced.
        self.num_invalid_spec_tokens = Counter("draftheads:spec_decode_num_invalid_spec_tokens",
                                               "Drafts the grammar forbade, cut before verification", label, registry=r)
        self.num_grammar_draft_tokens = Counter("draftheads:spec_decode_num_grammar_draft_tokens",
                                                "Draft tokens the grammar forced, verified", label, registry=r)
        self.num_accepted_grammar_draft_tokens = Counter("draftheads:spec_decode_num_accepted_grammar_draft_tokens",
                                                         "Draft tokens the grammar forced, accepted", label, registry=r)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "From arrival to the first token",
                                             label, buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Between a request's successive steps that emitted tokens", label,
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("vllm:e2e_request_latency_seconds", "From arrival to the last token",
                                             label, buckets=REQUEST_BUCKETS, registry=r)
        self.model_name = model_name
        for counter in (self.prompt_tokens, self.generation_tokens):
            self.of(counter)
        self._spec_seen = None  # the speculator's counts at the last update

    def of(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    def update_engine(self, engine) -> None:
        """Gauges from the engine's state, and counters by the speculator's counts since the last call
        (engine thread)."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.of(self.num_requests_running).set(len(scheduler.running))
        self.of(self.num_requests_waiting).set(len(scheduler.waiting))
        self.of(self.kv_cache_usage).set(1 - blocks.num_free_blocks / blocks.num_blocks)
        if engine.speculator is None:
            return
        stats = engine.speculator.stats
        seen = self._spec_seen or (0, 0, 0, 0, [], 0, 0, 0)
        self.of(self.num_verify_steps).inc(stats.num_steps - seen[0])
        self.of(self.num_emitted_tokens).inc(stats.num_emitted - seen[1])
        self.of(self.num_drafts).inc(stats.num_drafts - seen[2])
        self.of(self.num_draft_tokens).inc(stats.num_draft_tokens - seen[3])
        self.of(self.num_accepted_tokens).inc(sum(stats.accepted) - sum(seen[4]))
        for position, accepted in enumerate(stats.accepted):
            before = seen[4][position] if position < len(seen[4]) else 0
            self.of(self.num_accepted_tokens_per_pos, position=str(position)).inc(accepted - before)
        self.of(self.num_invalid_spec_tokens).inc(stats.num_invalid_spec_tokens - seen[5])
        self.of(self.num_grammar_draft_tokens).inc(stats.num_grammar_draft_tokens - seen[6])
        self.of(self.num_accepted_grammar_draft_tokens).inc(stats.num_accepted_grammar_draft_tokens - seen[7])
        self._spec_seen = (stats.num_steps, stats.num_emitted, stats.num_drafts, stats.num_draft_tokens,
                           list(stats.accepted), stats.num_invalid_spec_tokens, stats.num_grammar_draft_tokens,
                           stats.num_accepted_grammar_draft_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
