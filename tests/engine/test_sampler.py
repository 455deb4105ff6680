"""The sampler draws from the distribution users ask for: temperature, top-k, top-p, min-p, each alone and
together, checked token by token against a plain sort-based reference over many draws; seeded rows draw the
same tokens in any batch; logprobs are those of the raw logits."""

import pytest
import torch
from logprob_checks import assert_rank_matches, assert_top_matches

from kvserve.engine.request import Request
from kvserve.engine.sampler import sample
from kvserve.engine.sampling_params import SamplingParams

NUM_DRAWS = 20_000
# Logprobs of the same logits computed twice (the sampler's, this test's) differ by rounding alone.
SAME_LOGITS_TIE_TOLERANCE = 1e-5


def request(params: SamplingParams, name: str = "r") -> Request:
    return Request(name, [1, 2, 3], params, eos_token_ids=[], detokenizer=None, max_model_len=1 << 20)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = logits / params.temperature
    if params.top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1:
        ordered, order = probs.sort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, (ordered.cumsum(0) - ordered) < params.top_p)
        probs = probs * keep
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def draw_counts(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    rows = logits.expand(NUM_DRAWS, -1)
    tokens = [s.token_id for s in sample(rows, [request(params)] * NUM_DRAWS)]
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).double()


CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=1.0, top_k=12),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8),
    "min-p": SamplingParams(temperature=1.3, min_p=0.02),
    "all together": SamplingParams(temperature=0.9, top_k=200, top_p=0.9, min_p=0.01),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("vocab", [600, 2000])  # 600: not a multiple of the CDF block; 2000: a cut past 1024
def test_draws_follow_the_requested_distribution(case, vocab):
    torch.manual_seed(0)
    scale = 2.0 if vocab == 600 else 0.3  # the flat one needs most of the vocabulary for top-p's mass
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    expected = reference_probs(logits, CASES[case]) * NUM_DRAWS
    counts = draw_counts(logits, CASES[case])
    assert counts[expected == 0].sum() == 0, "a token outside the kept set was drawn"
    # Every token within 5 standard deviations of its expected count.
    sigma = (expected * (1 - expected / NUM_DRAWS)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 3).all()


def test_top_p_cut_beyond_the_partial_sort_candidates_is_exact():
    logits = -0.0005 * torch.arange(3000.0)  # nearly flat: top_p 0.9 keeps ~2,690 tokens
    params = SamplingParams(temperature=1.0, top_p=0.9)
    kept = int((reference_probs(logits, params) > 0).sum())
    assert kept > 2000
    torch.manual_seed(0)
    tokens = torch.tensor([s.token_id for s in sample(logits.expand(NUM_DRAWS, -1), [request(params)] * NUM_DRAWS)])
    assert int(tokens.max()) == kept - 1  # the last kept token is drawn, nothing past it


def test_seeded_rows_draw_the_same_tokens_in_any_batch():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 500, generator=generator) * 2
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=100, seed=42)
    alone = [sample(logits[i:i + 1], [request(params, str(i))])[0].token_id for i in range(20)]
    mixed = [request(params, str(i)) if i % 2 else request(SamplingParams(temperature=0.8), str(i)) for i in range(20)]
    together = [s.token_id for s in sample(logits, mixed)]
    assert [together[i] for i in range(1, 20, 2)] == [alone[i] for i in range(1, 20, 2)]


def test_logprobs_are_those_of_the_raw_logits():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)) * 3
    requests = [request(SamplingParams(temperature=1.0, top_k=5, logprobs=4, seed=7)),
                request(SamplingParams(temperature=0.0)),
                request(SamplingParams(temperature=0.0, logprobs=0))]
    out = sample(logits, requests)
    raw = logits.log_softmax(-1)
    first = out[0].logprobs
    assert first.logprob == pytest.approx(float(raw[0, out[0].token_id]))
    # The sampler's log-softmax need not round as this one does: ranks and order are checked up to near-ties.
    assert_rank_matches(first.rank, raw[0], out[0].token_id, tolerance=SAME_LOGITS_TIE_TOLERANCE)
    assert_top_matches([t for t, _ in first.top], raw[0], 4, tolerance=SAME_LOGITS_TIE_TOLERANCE)
    assert out[1].logprobs is None
    assert out[2].token_id == int(logits[2].argmax()) and out[2].logprobs.rank == 1 and out[2].logprobs.top == []


def test_a_row_without_mass_takes_its_most_likely_token_and_spares_the_batch():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    logits[1] = float("-inf")
    logits[1, 17] = float("nan")
    logits[2, 5] = float("-inf")
    logits[3, 40] = float("nan")
    requests = [request(SamplingParams(temperature=1.0)), request(SamplingParams(temperature=1.0)),
                request(SamplingParams(temperature=1e300)),  # inf in fp32: -inf / inf would be NaN
                request(SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1))]  # NaN through every filter
    tokens = [s.token_id for s in sample(logits, requests)]
    assert all(0 <= t < 300 for t in tokens)
    assert tokens[2] != 5


def test_penalties_match_their_definitions_row_by_row():
    from kvserve.engine.sampler import _apply_presence_and_frequency_penalties, _apply_repetition_penalties

    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 50, generator=generator) * 3
    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
                dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.0), dict()]
    requests = []
    for row, setting in enumerate(settings):
        r = Request(str(row), [1, 2, 3, 3, 10 + row], SamplingParams(**setting), [], None, 1 << 20)
        for token in [3, 7, 7, 7, 20 + row]:
            r.append_output_token(token)
        requests.append(r)
    expected = logits.clone()
    for row, r in enumerate(requests):
        p = r.sampling_params
        for token in set(r.all_token_ids):  # repetition: prompt and output, once per distinct token
            value = expected[row, token]
            expected[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(r.output_token_ids):  # presence and frequency: generated tokens only
            count = r.output_token_ids.count(token)
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty
    got = logits.clone()
    _apply_repetition_penalties(got, requests)
    _apply_presence_and_frequency_penalties(got, requests)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[3], logits[3])


def test_bf16_logits_sample_as_their_fp32_values_do():
    """The model hands over logits in its dtype; every path reads them as their exact fp32 values."""
    logits = (torch.randn(6, 700, generator=torch.Generator().manual_seed(5)) * 4).bfloat16()
    settings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
                SamplingParams(temperature=0.9, top_p=0.9, seed=1),
                SamplingParams(temperature=0.0, repetition_penalty=1.5),
                SamplingParams(temperature=1.0, top_k=20, seed=2, logprobs=2), SamplingParams(temperature=0.0)]
    got = sample(logits, [request(p, str(i)) for i, p in enumerate(settings)])
    expected = sample(logits.float(), [request(p, str(i)) for i, p in enumerate(settings)])
    assert got == expected


def test_logit_bias_is_added_before_everything_else():
    logits = torch.zeros(2, 100)
    logits[:, 3] = 5.0
    requests = [request(SamplingParams(temperature=0.0, logit_bias={42: 100.0, 3: -100.0}, logprobs=1)),
                request(SamplingParams(temperature=0.5, top_k=1, logit_bias={9: 6.0}))]
    out = sample(logits, requests)
    assert [s.token_id for s in out] == [42, 9]
    assert out[0].logprobs.top[0][0] == 3  # logprobs stay those of the raw logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_kernel_picks_what_torch_max_picks(dtype):
    """The CPU kernel behind greedy decoding gives torch.max's indices: the first of tied maxima, a NaN first."""
    from kvserve.model.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=generator).to(dtype)
    logits[1, [10, 700]] = 50.0  # a tie: the first wins
    logits[2, 300] = float("nan")
    logits[2, 0] = 100.0
    logits[3] = float("-inf")
    logits[4, 0] = float("nan")
    logits[5, [5, 9]] = float("nan")
    expected = logits.max(dim=-1).indices
    assert torch.equal(kernels.first_argmax(logits), expected)
    assert expected.tolist()[1:] == [10, 300, 0, 0, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49157, 151936])
def test_greedy_kernel_over_vocabulary_rows(dtype, vocab):
    """Rows of a real vocabulary (scanned in vectors, a tail past them, rows split over threads): ties across
    vectors, a maximum in the tail, infinities, signed zeros and a late NaN give torch.max's indices."""
    from kvserve.model.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(33, vocab, generator=generator).to(dtype)
    logits[1, [17, 33, 40000]] = 20.0  # tied across vectors
    logits[2, vocab - 1] = 20.0  # in the tail
    logits[3, 1234] = float("inf")
    logits[4] = 0.0
    logits[4, 3] = -0.0
    logits[5, vocab - 2] = float("nan")
    logits[6] = float("-inf")
    expected = logits.max(dim=-1).indices
    assert torch.equal(kernels.first_argmax(logits), expected)
    assert expected.tolist()[1:7] == [17, vocab - 1, 1234, 0, vocab - 2, 0]
