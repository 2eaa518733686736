"""Does speculation keep the output distribution? A two-sample test of sampled tokens.

Temperature 0.8 / top-p 0.95, many samples of the first generated tokens of fixed prompts, with
and without speculation, compared by a chi-square test of homogeneity per prompt and position.
The false-alarm rate of a whole comparison is ALPHA (Bonferroni over its prompts and
positions). `tests/test_sampling.py` runs it for every drafter and against a deliberately
broken rejection sampler; `bench/sampling_controls.py` runs the controls that say where a
difference comes from.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from statistics import NormalDist

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


def goodness_of_fit(counts: Counter, probs: dict) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of a sample against known probabilities
    (category -> p); categories expected fewer than MIN_POOLED times share one cell, and so
    does everything observed outside `probs`."""
    n = sum(counts.values())
    big = [k for k, p in probs.items() if n * p >= MIN_POOLED]
    cells = [(counts[k], n * probs[k]) for k in big]
    rest = (n - sum(counts[k] for k in big), n * (1 - sum(probs[k] for k in big)))
    if rest[1] > 1e-9 or rest[0]:
        cells.append(rest)
    stat = sum((o - e) ** 2 / e if e > 0 else math.inf * (o > 0) for o, e in cells)
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


def _accept_every_draft(worker) -> None:
    """In the worker: every uniform draw of the rejection sampler is 0, so every draft the
    target gives any probability is accepted."""
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    rs.generate_uniform_probs = lambda num_tokens, num_draft, generators, device: torch.zeros(
        num_tokens, dtype=torch.float64, device=device)


def sample(target: Path, data_dir: Path, prompts: list[list[int]], spec: dict | None,
           broken_too: bool = False, **engine) -> tuple[dict, dict | None]:
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

    llm = make_llm(target, data_dir, speculative_config=spec, **{**ENGINE, **engine})
    try:
        good = run(llm)
        broken = None
        if broken_too:
            llm.collective_rpc(_accept_every_draft)
            broken = run(llm)
    finally:
        del llm
    return good, broken


def chat_prompts(target: Path, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                         add_generation_prompt=True)["input_ids"])
            for q in questions]


# Three short chat prompts whose next tokens are not nearly certain.
QUESTIONS = ["Tell me a story about a dragon.", "What should I cook tonight?",
             "Write a poem about the sea."]
