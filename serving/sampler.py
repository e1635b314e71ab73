"""Turning logits into tokens: penalties and biases, then the filtered target distribution
(temperature, top-k, top-p, min-p), then greedy or seeded sampling.

`target_probs` is the one definition of a request's sampling law; speculative verification
samples from the same function, so a request's output law is the same with and without speculation.
"""
from __future__ import annotations

import torch

from serving.request import Request, SamplingParams


def apply_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """logits: [vocab] float32 for the request's next token; returns a new tensor."""
    p = request.params
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        for token, bias in p.logit_bias.items():
            logits[int(token)] += bias
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [rows, vocab] float32 -> probabilities [rows, vocab] after temperature, top-k, top-p, min-p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = probs.topk(params.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        total = sorted_probs.sum(-1, keepdim=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep_sorted = mass_before < params.top_p * total  # the most likely token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(-1, keepdim=True).values, probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()  # on the host, whatever the engine's device: draws are the same on every device
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (), device="cpu").item()))
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from probs: [vocab] (non-negative, any positive total) with a uniform from `generator`.
    The law is torch.multinomial's; inverting the cumulative sum costs ~0.1 ms on a 49,152-token vocabulary on CPU,
    where multinomial costs ~1.2 ms."""
    return inverse_cdf(probs, torch.rand((), dtype=torch.float64, generator=generator, device="cpu"))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor | float) -> int:
    """The token whose interval of the cumulative distribution of probs: [vocab] holds u in [0, 1): zero-probability
    tokens have empty intervals, and a u * total that rounds up to the total gives the last token with mass."""
    cdf = probs.detach().to("cpu", torch.float64).cumsum(0)
    total = cdf[-1]
    if not 0 < float(total) < float("inf"):
        raise ValueError(f"cannot sample from probabilities summing to {float(total)}: they must be finite, "
                         "non-negative and not all zero (are the logits NaN or inf?)")
    return int(torch.minimum(torch.searchsorted(cdf, u * total, right=True), torch.searchsorted(cdf, total)))


def next_token(logits: torch.Tensor, request: Request, generator: torch.Generator | None,
               argmax: int | None = None) -> int:
    """One token for one request from its logits row [vocab]. `argmax`: the row's argmax when the caller computed
    it for the whole batch at once."""
    p = request.params
    if p.needs_history:
        logits, argmax = apply_penalties(logits, request), None
    if p.is_greedy:
        return int(logits.argmax()) if argmax is None else argmax
    return sample(target_probs(logits[None], p)[0], generator)


def prompt_ranks(rows: torch.Tensor, tokens: list[int]) -> list[int]:
    """Each token's rank among its row's logits, 1 for the likeliest (vLLM's Logprob.rank)."""
    chosen = rows.float().gather(-1, torch.tensor(tokens, device=rows.device)[:, None])
    return (1 + (rows.float() > chosen).sum(-1)).tolist()


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """rows: [len(tokens), vocab] the target's logits at the rows that emitted `tokens` (before penalties, biases and
    temperature, as vLLM's default raw_logprobs). Returns each token's logprob, and the k likeliest tokens of each
    row with theirs, likeliest first."""
    logprobs = torch.log_softmax(rows.float(), -1)
    chosen = logprobs[torch.arange(len(tokens), device=rows.device), torch.tensor(tokens, device=rows.device)].tolist()
    if not k:
        return chosen, [[] for _ in tokens]
    values, ids = logprobs.topk(k, -1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
