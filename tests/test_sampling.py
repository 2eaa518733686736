"""Speculative decoding must not change the output distribution under sampling.

Temperature 0.8 / top-p 0.95, many samples of the first generated tokens of fixed prompts, with
and without speculation, compared by a two-sample chi-square test of homogeneity per prompt and
position. The false-alarm rate of the whole test is ALPHA (Bonferroni over its comparisons); the
same test, run on a deliberately broken rejection sampler that accepts every draft, must fail,
which shows that it has the power to see a wrong sampling path.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from pathlib import Path
from statistics import NormalDist

import pytest

from kvshot_vllm.models.oracle import build_oracle
from kvshot_vllm.models.registry import paradigm_names
from kvshot_vllm.models.weights import init_checkpoint

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the broken sampler's rpc

ALPHA = 1e-3  # chance that the whole test fails on a correct sampler
SAMPLES = 300  # per prompt and configuration
NEW_TOKENS = 4  # positions 1..3 are the ones speculation can touch at k = 3
MIN_POOLED = 10  # tokens seen fewer times in both samples together are pooled into one cell
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=128, enable_prefix_caching=True)


def chi2_quantile(q: float, df: int) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile (within 1% for df >= 3)."""
    z = NormalDist().inv_cdf(q)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples over the same categories;
    categories with fewer than MIN_POOLED observations in both together share one cell, so
    that every expected count is large enough for the chi-square law."""
    keys = set(a) | set(b)
    big = [k for k in keys if a[k] + b[k] >= MIN_POOLED]
    cells = [(a[k], b[k]) for k in big]
    rest = (sum(a[k] for k in keys - set(big)), sum(b[k] for k in keys - set(big)))
    if sum(rest):
        cells.append(rest)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in cells:
        for observed, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


def differs(samples: dict, reference: dict) -> list[str]:
    """The (prompt, position) pairs whose token distributions differ at the test's level."""
    tests = [(p, j) for p in reference for j in range(1, NEW_TOKENS)]
    failed = []
    for p, j in tests:
        stat, df = homogeneity(Counter(s[j] for s in samples[p]),
                               Counter(s[j] for s in reference[p]))
        if df > 0 and stat > chi2_quantile(1 - ALPHA / len(tests), df):
            failed.append(f"prompt {p} position {j}: chi2 {stat:.1f} with {df} df")
    return failed


def test_homogeneity_holds_its_level_and_sees_a_shift() -> None:
    """Pure logic: equal multinomials pass at about the stated rate, a shifted one fails."""
    rng = random.Random(0)
    weights = [0.4, 0.2, 0.15, 0.1, 0.05, 0.05, 0.03, 0.02]
    shifted = [0.55, 0.15, 0.1, 0.07, 0.05, 0.04, 0.02, 0.02]

    def draw(w):
        return Counter(rng.choices(range(len(w)), w, k=SAMPLES))

    level = chi2_quantile(0.99, 7)
    false_alarms = sum(homogeneity(draw(weights), draw(weights))[0] > level for _ in range(500))
    assert false_alarms <= 15  # 1% of 500 is 5; 15 is far in the binomial's tail
    assert homogeneity(draw(weights), draw(shifted))[0] > level
    assert abs(chi2_quantile(0.999, 10) - 29.588) < 0.3  # the table value


def _accept_every_draft(worker) -> None:
    """In the worker: every uniform draw of the rejection sampler is 0, so every draft the
    target gives any probability is accepted."""
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    rs.generate_uniform_probs = lambda num_tokens, num_draft, generators, device: torch.zeros(
        num_tokens, dtype=torch.float64, device=device)


def sample(target: Path, data_dir: Path, prompts: list[list[int]], spec: dict | None,
           broken_too: bool = False) -> tuple[dict, dict | None]:
    """SAMPLES sampled continuations of NEW_TOKENS tokens per prompt (and, with `broken_too`,
    the same again from the same engine after breaking its rejection sampler)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.engine import make_llm

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(SAMPLES)]

    def run(llm) -> dict:
        outs = llm.generate(batch, params, use_tqdm=False)
        by_prompt: dict[int, list[list[int]]] = {}
        for i, o in enumerate(outs):
            by_prompt.setdefault(i // SAMPLES, []).append(list(o.outputs[0].token_ids))
        return by_prompt

    llm = make_llm(target, data_dir, speculative_config=spec, **ENGINE)
    try:
        good = run(llm)
        broken = None
        if broken_too:
            llm.collective_rpc(_accept_every_draft)
            broken = run(llm)
    finally:
        del llm
    return good, broken


@pytest.fixture(scope="module")
def sampling_prompts(target_fp32: Path) -> list[list[int]]:
    """Three short chat prompts whose next tokens are not nearly certain."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_fp32)
    questions = ["Tell me a story about a dragon.", "What should I cook tonight?",
                 "Write a poem about the sea."]
    return [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                         add_generation_prompt=True)["input_ids"])
            for q in questions]


@pytest.fixture(scope="module")
def no_spec_samples(target_fp32, data_dir, sampling_prompts):
    return sample(target_fp32, data_dir, sampling_prompts, None)[0]


def _spec(model: Path) -> dict:
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": 3,
            "disable_padded_drafter_batch": True}


# Slow: about 15 minutes on 2 cores, too long for the default run. It FAILS as of this writing
# (every prompt and position differs from no speculation, chi2 95 on 10 df and more), and the
# cause is not known yet: the control (two no-speculation engines against each other, and stock
# EAGLE-3 served by vLLM's own code) has not been run. README, "Known limitations".
@pytest.mark.slow
def test_oracle_sampling_keeps_the_distribution_and_a_broken_sampler_does_not(
        target_fp32, data_dir, sampling_prompts, no_spec_samples, tmp_path) -> None:
    """The oracle proposes the target's own greedy tokens, so under sampling its drafts are
    accepted only as often as the target would pick them: the rejection path decides every
    token after the first."""
    good, broken = sample(target_fp32, data_dir, sampling_prompts,
                          _spec(build_oracle(target_fp32, tmp_path / "oracle")), broken_too=True)
    assert differs(good, no_spec_samples) == []
    assert len(differs(broken, no_spec_samples)) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("paradigm", paradigm_names())
def test_sampling_keeps_the_distribution(paradigm, target_fp32, data_dir, sampling_prompts,
                                         no_spec_samples, tmp_path) -> None:
    drafter = init_checkpoint(target_fp32, tmp_path / paradigm, paradigm=paradigm)
    good, _ = sample(target_fp32, data_dir, sampling_prompts, _spec(drafter))
    assert differs(good, no_spec_samples) == []
