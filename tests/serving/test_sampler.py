"""The sampler: `target_probs` (temperature, top-k, top-p, min-p) on hand-made logits with exact expected
probabilities and against transformers' logits warpers; penalties and biases against hand computation;
greedy and seeded sampling through `next_token`, including the sampled law (total variation distance)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from serving.request import Request, SamplingParams
from serving.sampler import (apply_penalties, inverse_cdf, make_generator, next_token, sample, target_probs,
                             token_logprobs)


# probabilities 0.1, 0.2, 0.3, 0.4 at temperature 1
LOGITS = torch.tensor([[math.log(0.1), math.log(0.2), math.log(0.3), math.log(0.4)]])


def probs(**kwargs):
    return target_probs(LOGITS, SamplingParams(**{"temperature": 1.0, **kwargs}))


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor([expected], dtype=torch.float32))


# ---- target_probs: each filter alone -------------------------------------------------------------------


def test_temperature_one_is_softmax():
    close(probs(), [0.1, 0.2, 0.3, 0.4])


def test_temperature_sharpens_and_flattens():
    # softmax(log(p) / T) is proportional to p ** (1 / T)
    close(probs(temperature=0.5), [x / 0.3 for x in (0.01, 0.04, 0.09, 0.16)])
    roots = [math.sqrt(x) for x in (0.1, 0.2, 0.3, 0.4)]
    close(probs(temperature=2.0), [r / sum(roots) for r in roots])
    logits = torch.tensor([[0.0, 1.0, 3.0]])
    e = [math.exp(x / 0.7) for x in (0.0, 1.0, 3.0)]
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=0.7)), torch.tensor([[x / sum(e) for x in e]]))


def test_top_k_keeps_the_k_most_likely():
    close(probs(top_k=1), [0, 0, 0, 1])
    close(probs(top_k=2), [0, 0, 3 / 7, 4 / 7])
    close(probs(top_k=3), [0, 2 / 9, 3 / 9, 4 / 9])
    close(probs(top_k=4), [0.1, 0.2, 0.3, 0.4])
    close(probs(top_k=100), [0.1, 0.2, 0.3, 0.4])  # more than the vocabulary keeps everything
    close(probs(top_k=0), [0.1, 0.2, 0.3, 0.4])  # 0 disables it


def test_top_p_keeps_the_smallest_set_reaching_p():
    close(probs(top_p=1.0), [0.1, 0.2, 0.3, 0.4])
    close(probs(top_p=0.4 - 1e-4), [0, 0, 0, 1])  # 0.4 alone reaches p
    close(probs(top_p=0.4 + 1e-4), [0, 0, 3 / 7, 4 / 7])  # 0.4 falls short, 0.4 + 0.3 reaches it
    close(probs(top_p=0.5), [0, 0, 3 / 7, 4 / 7])
    close(probs(top_p=0.7 + 1e-4), [0, 2 / 9, 3 / 9, 4 / 9])
    close(probs(top_p=0.95), [0.1, 0.2, 0.3, 0.4])


def test_top_p_always_keeps_the_top_token():
    close(probs(top_p=1e-6), [0, 0, 0, 1])
    peaked = torch.tensor([[0.0, 0.0, 10.0, 0.0]])
    out = target_probs(peaked, SamplingParams(temperature=1.0, top_p=1e-6))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))


def test_top_p_works_row_by_row_whatever_the_order_of_the_vocabulary():
    logits = torch.tensor([
        [math.log(0.4), math.log(0.1), math.log(0.3), math.log(0.2)],
        [math.log(0.2), math.log(0.3), math.log(0.45), math.log(0.05)],
    ])
    out = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    expected = torch.tensor([[4 / 7, 0, 3 / 7, 0], [0, 0.3 / 0.75, 0.45 / 0.75, 0]])
    torch.testing.assert_close(out, expected)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    close(probs(min_p=0.0), [0.1, 0.2, 0.3, 0.4])
    close(probs(min_p=0.2), [0.1, 0.2, 0.3, 0.4])  # threshold 0.08
    close(probs(min_p=0.45), [0, 2 / 9, 3 / 9, 4 / 9])  # threshold 0.18
    close(probs(min_p=0.6), [0, 0, 3 / 7, 4 / 7])  # threshold 0.24
    close(probs(min_p=1.0), [0, 0, 0, 1])


def test_filters_compose_in_order_temperature_top_k_top_p_min_p():
    # top_k=3 leaves 0.2, 0.3, 0.4 (renormalized 2/9, 3/9, 4/9); top_p=0.5 then keeps 4/9 and 3/9.
    close(probs(top_k=3, top_p=0.5), [0, 0, 3 / 7, 4 / 7])
    # temperature 0.5: 0.01, 0.04, 0.09, 0.16 over 0.3; min_p 0.2 of 0.16 / 0.3 drops only the first,
    # min_p 0.3 drops the first two.
    close(probs(temperature=0.5, min_p=0.2), [0, 0.04 / 0.29, 0.09 / 0.29, 0.16 / 0.29])
    close(probs(temperature=0.5, min_p=0.3), [0, 0, 0.09 / 0.25, 0.16 / 0.25])
    # top-k after temperature: top_k=2 at temperature 2 keeps 0.3 and 0.4 in proportion sqrt(0.3) : sqrt(0.4)
    r3, r4 = math.sqrt(0.3), math.sqrt(0.4)
    close(probs(temperature=2.0, top_k=2), [0, 0, r3 / (r3 + r4), r4 / (r3 + r4)])


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.8),
        dict(temperature=0.8, top_k=50),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=0.8, min_p=0.05),
        dict(temperature=1.3, top_k=20, top_p=0.7, min_p=0.1),
        dict(temperature=0.6, top_k=100, top_p=0.95, min_p=0.02),
    ],
)
def test_target_probs_matches_transformers_warpers(settings):
    """transformers' generate applies temperature, top-k, top-p, min-p in this order; same law."""
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)) * 3
    scores = logits.clone()
    warpers = [TemperatureLogitsWarper(settings["temperature"])]
    if settings.get("top_k"):
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p"):
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    if settings.get("min_p"):
        warpers.append(MinPLogitsWarper(settings["min_p"]))
    for warper in warpers:
        scores = warper(None, scores)
    expected = torch.softmax(scores, dim=-1)
    actual = target_probs(logits, SamplingParams(**settings))
    torch.testing.assert_close(actual, expected)
    assert ((actual > 0) == (expected > 0)).all()  # the same support, exactly


# ---- penalties and biases ------------------------------------------------------------------------------


def make_request(prompt, output, **params):
    request = Request("r", prompt, SamplingParams(**params))
    request.token_ids.extend(output)
    return request


BASE = torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0, 1.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    request = make_request([0, 1, 1], [3, 0], repetition_penalty=2.0)  # seen: 0, 1, 3 (prompt and output)
    out = apply_penalties(BASE, request)
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 0.5, -6.0, 4.0, 1.0]))
    torch.testing.assert_close(BASE, torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0, 1.0]))  # input untouched


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    history = [3, 7, 7, 12, 40, 3, 49, 0]
    request = make_request(history[:5], history[5:], repetition_penalty=1.3)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits.clone())
    torch.testing.assert_close(apply_penalties(logits[0], request), expected[0])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    # output: token 4 twice, token 2 once; token 0 only in the prompt is not penalized
    request = make_request([0, 0, 5], [4, 2, 4], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(BASE, request)
    expected = BASE.clone()
    expected[4] -= 0.5 + 2 * 0.25
    expected[2] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(out, expected)


def test_negative_presence_and_frequency_penalties_encourage_repeats():
    request = make_request([1], [3, 3, 3], presence_penalty=-1.0, frequency_penalty=-0.5)
    expected = BASE.clone()
    expected[3] += 1.0 + 3 * 0.5
    torch.testing.assert_close(apply_penalties(BASE, request), expected)


def test_logit_bias_adds_per_token():
    request = make_request([1], [], logit_bias={0: -5.0, 5: 2.5, "3": 1.0})
    torch.testing.assert_close(apply_penalties(BASE, request), torch.tensor([-3.0, -1.0, 0.5, -2.0, 4.0, 3.5]))


def test_all_penalties_together():
    request = make_request([0, 1], [1, 4], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=1.0,
                           logit_bias={2: 1.0})
    # repetition on 0, 1, 4; then presence + frequency on output tokens 1 and 4; then the bias on 2
    expected = torch.tensor([1.0, -2.0 - 1.5, 1.5, -3.0, 2.0 - 1.5, 1.0])
    torch.testing.assert_close(apply_penalties(BASE, request), expected)


# ---- next_token ----------------------------------------------------------------------------------------


def test_greedy_next_token_is_the_argmax_after_penalties():
    request = make_request([0], [4], repetition_penalty=10.0)  # 4.0 -> 0.4 and 2.0 -> 0.2: 5 (1.0) wins
    assert next_token(BASE, request, None) == 5
    plain = make_request([0], [4])
    assert next_token(BASE, plain, None) == 4
    biased = make_request([0], [4], logit_bias={3: 10.0}, logprobs=True)
    assert next_token(BASE, biased, None) == 3


def test_token_logprobs_are_the_raw_rows_and_their_likeliest_tokens():
    """As vLLM's default raw_logprobs: the row's log-softmax, before penalties, biases and temperature."""
    rows = torch.stack([BASE, BASE.flip(0)])
    logprobs, top = token_logprobs(rows, [3, 0], 2)
    expected = torch.log_softmax(rows, -1)
    assert logprobs == pytest.approx([float(expected[0, 3]), float(expected[1, 0])])
    order = expected.argsort(-1, descending=True)[:, :2]
    assert [[t for t, _ in alternatives] for alternatives in top] == order.tolist()
    assert [lp for _, lp in top[0]] == pytest.approx(expected[0, order[0]].tolist())
    assert token_logprobs(rows, [3, 0], 0)[1] == [[], []]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.zeros(1000)
    request = make_request([0], [], temperature=1.0)

    def draw(seed, n=20):
        generator = make_generator(seed)
        return [next_token(logits, request, generator) for _ in range(n)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert draw(None) != draw(None)  # no seed: fresh randomness each time


def test_top_k_one_sampling_is_greedy():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(3))
    request = make_request([0], [], temperature=1.5, top_k=1)
    generator = make_generator(0)
    assert {next_token(logits, request, generator) for _ in range(20)} == {int(logits.argmax())}


def test_sampled_frequencies_follow_target_probs():
    """Total variation distance between 20k draws and the target law stays small."""
    logits = torch.tensor([0.3, -1.0, 2.0, 0.0, 1.2, -0.4, 0.9, 1.8])
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.1)
    target = target_probs(logits[None], params)[0]
    generator = make_generator(123)
    draws = torch.tensor([sample(target, generator) for _ in range(20000)])
    freq = torch.bincount(draws, minlength=len(logits)).float() / len(draws)
    assert (freq[target == 0] == 0).all()  # never a filtered token
    assert 0.5 * (freq - target).abs().sum().item() < 0.02


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.75, 0.0])
    for scale in (1.0, 3.0):  # any positive total
        p = probs * scale
        assert inverse_cdf(p, 0.0) == 2  # past the leading zeros
        assert inverse_cdf(p, 0.25 - 1e-12) == 2
        assert inverse_cdf(p, 0.25) == 4  # the zero between owns no interval
        assert inverse_cdf(p, 1 - 2**-53) == 4
        assert inverse_cdf(p, 1.0) == 4  # u * total rounded up to the total: the last token with mass, not past it


@pytest.mark.parametrize("bad", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_sampling_from_no_probability_mass_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="cannot sample"):
        sample(torch.tensor(bad), make_generator(0))
