"""The vLLM plugin through a real vLLM engine on CPU, fp32 (where greedy outputs are exact).

Lossless: every drafter's greedy outputs equal generation without speculation, for 16 prompts of
varied length in one batch, with prefix caching and chunked prefill on (a small token budget
splits the longer prompts into chunks). Oracle: the target's own layers reading its cache in
place are accepted at every position; a sabotaged position shows up exactly there.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvshot_vllm.models.config import load_drafter_config
from kvshot_vllm.models.oracle import build_oracle
from kvshot_vllm.models.registry import choices_message, paradigm_names
from kvshot_vllm.models.weights import init_checkpoint
from kvshot_vllm.server import VLLMServer, free_port, serve_command

# collective_rpc with a function (the cache-binding probe) needs pickled callables
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

# The drafters the repository ships for the embedded target (`kvshot ship`).
SHIPPED = {f"shipped-{m.parent.name}": m.parent for m in
           sorted((Path(__file__).parents[1] / "drafters/smollm2-135m-instruct").glob("*/manifest.json"))}

MAX_TOKENS = 24
PREEMPTION_TOKENS = 96
ENGINE = dict(dtype="float32", max_model_len=512, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=64, disable_log_stats=False)
NON_PADDED = {"disable_padded_drafter_batch": True}
# Sparse views of the target's KV (issue 15): sink block + two recent blocks of 32 tokens.
VIEW = {"tokens": 96, "sink_tokens": 32, "block_size": 32}
RETRIEVAL_VIEW = {"policy": "retrieval", "tokens": 160, "sink_tokens": 32, "block_size": 32}
# The same view with what it leaves out summarised: each cache block as 4 memory slots (issue 16)
MEMORY_VIEW = {**VIEW, "memory": {"chunk_tokens": 32, "slots": 4}}


@pytest.fixture(scope="module")
def prompts(target_fp32: Path) -> list[list[int]]:
    """16 chat prompts of varied length (ShareGPT first turns), two sharing a long prefix."""
    from transformers import AutoTokenizer

    from kvshot_vllm.data import PrepareArgs, SourceStats, packaged_sharegpt, first_turn_prompts

    tok = AutoTokenizer.from_pretrained(target_fp32)
    sel = first_turn_prompts(packaged_sharegpt(), tok,
                             PrepareArgs(num_prompts=15, num_heldout=0, max_prompt_tokens=300),
                             SourceStats())["train"]
    ids = sorted((s.prompt_token_ids for s in sel), key=len)
    lengths = [len(p) for p in ids]
    assert lengths[0] < 40 and lengths[-1] > 64, lengths  # short, and longer than a chunk
    return ids + [ids[-1][:-3] + ids[0][-3:]]


def _shared_caches(worker) -> list[tuple[str, str, bool]]:
    """In the worker: (cross layer, target layer, same storage?) for every KV-reuse layer."""
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return [(name, layer.kv_sharing_target_layer_name,
             layer.kv_cache.data_ptr() == ctx[layer.kv_sharing_target_layer_name].kv_cache.data_ptr())
            for name, layer in ctx.items() if name.startswith("kvshot_cross.")]


def generate(target: Path, data_dir: Path, prompts: list[list[int]], spec: dict | None = None,
             max_tokens: int = MAX_TOKENS, **engine):
    """Greedy token ids per prompt, spec-decode (and preemption) counters, KV cache blocks, and
    the KV-reuse layers' cache bindings."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.engine import make_llm, spec_decode_counters

    llm = make_llm(target, data_dir, speculative_config=spec, **{**ENGINE, **engine})
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        counters = spec_decode_counters(llm)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        counters["shared_caches"] = llm.collective_rpc(_shared_caches)[0]
    finally:
        del llm
    return [list(o.outputs[0].token_ids) for o in outs], counters, blocks


@pytest.fixture(scope="module")
def long_baseline(target_fp32: Path, data_dir: Path, prompts):
    """Generation without speculation, long enough for the preemption test."""
    return generate(target_fp32, data_dir, prompts, max_tokens=PREEMPTION_TOKENS)


@pytest.fixture(scope="module")
def baseline(long_baseline):
    """The same, cut to MAX_TOKENS: greedy outputs are prefixes of longer greedy outputs."""
    tokens, counters, blocks = long_baseline
    return [t[:MAX_TOKENS] for t in tokens], counters, blocks


@pytest.fixture(scope="module")
def drafters(target_fp32: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    paths = {p: init_checkpoint(target_fp32, root / p, paradigm=p)
             for p in paradigm_names()}
    paths["block-ssm"] = init_checkpoint(target_fp32, root / "block-ssm", paradigm="block",
                                         ssm_state_size=4)
    paths["oracle"] = build_oracle(target_fp32, root / "oracle")
    paths["hybrid-budget"] = init_checkpoint(target_fp32, root / "hybrid-budget",
                                             paradigm="hybrid",
                                             kv_budget={**VIEW, "draft_cache": True})
    paths["hidden-budget"] = init_checkpoint(target_fp32, root / "hidden-budget",
                                             paradigm="hidden",
                                             kv_budget={**VIEW, "draft_cache": True})
    # one block retrieved from the gap between sink and recent window
    paths["kv-retrieval"] = init_checkpoint(target_fp32, root / "kv-retrieval", paradigm="kv",
                                            kv_budget={**RETRIEVAL_VIEW, "tokens": 128})
    paths["kv-memory"] = init_checkpoint(target_fp32, root / "kv-memory", paradigm="kv",
                                         kv_budget=MEMORY_VIEW)
    paths["hybrid-memory"] = init_checkpoint(
        target_fp32, root / "hybrid-memory", paradigm="hybrid",
        kv_budget={**MEMORY_VIEW, "draft_cache": True,
                   "memory": {**MEMORY_VIEW["memory"], "caches": "both"}})
    return {**paths, **SHIPPED}


def spec(model: Path, k: int, **extra) -> dict:
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def k3_runs(target_fp32, data_dir, prompts, drafters):
    """generate() with each drafter at k=3, run once and shared by the tests below."""
    cache: dict[str, tuple] = {}

    def run(paradigm: str):
        if paradigm not in cache:
            cache[paradigm] = generate(target_fp32, data_dir, prompts,
                                       served_spec(drafters[paradigm], 3))
        return cache[paradigm]

    return run


def served_spec(drafter: Path, k: int) -> dict:
    """The speculative config a drafter is served with (as serving_configs/ serve them): greedy
    drafts by the argmax over the draft vocabulary (the parity test below drafts through
    vLLM's argmax over the target's), KV-reuse ones with the drafter batch unpadded (the
    plugin warns otherwise)."""
    hidden = json.loads((drafter / "config.json").read_text())["kvshot"]["paradigm"] == "hidden"
    return spec(drafter, k, use_local_argmax_reduction=True, **({} if hidden else NON_PADDED))


# Every registered paradigm, the block drafter's recurrent variant, and the test instrument.
SERVED = [*paradigm_names(), "block-ssm", "oracle"]


# The shipped hybrid's losslessness is served compiled, as users serve it (below); the plain
# block drafter's one-pass path is block-ssm's without the mixer; the untrained hidden-only and
# KV-only drafters take the paths of the shipped ones, which accept more of their drafts.
@pytest.mark.parametrize("paradigm", [
    pytest.param(p, marks=pytest.mark.slow)
    if p in ("shipped-hybrid", "block", "hidden", "kv") else p
    for p in [*SERVED, *SHIPPED]])
def test_lossless_k3(paradigm, baseline, k3_runs, drafters) -> None:
    tokens, counters, blocks = k3_runs(paradigm)
    assert tokens == baseline[0]
    assert counters["num_drafts"] > 0
    if paradigm != "oracle" and load_drafter_config(drafters[paradigm]).reads_only_kv:
        # In place: the cross layers of KV-only and block drafters own no cache, so vLLM fits
        # exactly as many blocks as without speculation in the same KV cache space, and each
        # reads its target layer's tensor itself (the same storage, not a copy).
        assert blocks == baseline[2]
        shared = counters["shared_caches"]
        assert [t for _, t, _ in shared] == [f"model.layers.{i}.self_attn.attn" for i in (0, 14, 29)]
        assert all(same for _, _, same in shared), shared
    if paradigm == "oracle":
        per_pos = counters["num_accepted_tokens_per_pos"]
        assert min(per_pos) >= 0.99 * counters["num_drafts"], (per_pos, counters)


@pytest.fixture(scope="module")
def compiled_baseline(target_fp32, data_dir, prompts):
    return generate(target_fp32, data_dir, prompts, enforce_eager=False)


# vLLM's compiled path, the default outside the tests (`engine_kwargs`), where the target and
# stock EAGLE-3 layers run compiled and the plugin's own layers run around them. Each engine
# compiles for about a minute on 2 cores: the shipped hybrid in the default run.
@pytest.mark.parametrize("paradigm", [
    p if p == "shipped-hybrid" else pytest.param(p, marks=pytest.mark.slow)
    for p in [*SERVED, *SHIPPED]])
def test_lossless_compiled(paradigm, compiled_baseline, target_fp32, data_dir, prompts,
                           drafters) -> None:
    tokens, counters, _ = generate(target_fp32, data_dir, prompts,
                                   served_spec(drafters[paradigm], 3), enforce_eager=False)
    assert tokens == compiled_baseline[0]
    assert counters["num_drafts"] > 0


# vLLM's dynamic speculation, which the shipped serving configs use to stop speculating above a
# batch size: under chunked prefill the prompts start decoding a few at a time, so the batch
# crosses the threshold and proposals stop and resume mid-request. The oracle (KV-reuse path,
# every draft right if its reads are) and the block drafter (its one-pass path) stay lossless.
@pytest.mark.parametrize("paradigm", ["oracle", pytest.param("block", marks=pytest.mark.slow)])
def test_lossless_with_speculation_off_above_a_batch_size(paradigm, baseline, k3_runs, target_fp32,
                                                          data_dir, prompts, drafters) -> None:
    schedule = {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 3, 0]]}
    tokens, counters, _ = generate(target_fp32, data_dir, prompts,
                                   {**served_spec(drafters[paradigm], 3), **schedule})
    assert tokens == baseline[0]
    drafts = counters["num_drafts"]
    assert 0 < drafts < 0.8 * k3_runs(paradigm)[1]["num_drafts"], drafts
    if paradigm == "oracle":
        assert min(counters["num_accepted_tokens_per_pos"]) >= 0.99 * drafts, counters


def test_hybrid_cross_layers_add_no_cache(k3_runs) -> None:
    """The hybrid's only cache is its EAGLE-3 layer's: as many blocks as hidden-only."""
    assert k3_runs("hybrid")[2] == k3_runs("shipped-hidden")[2]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 7])
@pytest.mark.parametrize("paradigm", SERVED)
def test_lossless_k1_k7(paradigm, k, target_fp32, data_dir, prompts, baseline, drafters) -> None:
    extra = {} if paradigm == "hidden" else NON_PADDED
    tokens, counters, _ = generate(target_fp32, data_dir, prompts,
                                   spec(drafters[paradigm], k, **extra))
    assert tokens == baseline[0]
    if paradigm == "oracle":
        assert min(counters["num_accepted_tokens_per_pos"]) >= 0.99 * counters["num_drafts"]


def test_oracle_sabotage_shows_at_its_position(target_fp32, data_dir, prompts, baseline,
                                               tmp_path) -> None:
    oracle = build_oracle(target_fp32, tmp_path / "oracle-sab", sabotage_step=1)
    tokens, counters, _ = generate(target_fp32, data_dir, prompts, spec(oracle, 3, **NON_PADDED))
    assert tokens == baseline[0]
    drafts, per_pos = counters["num_drafts"], counters["num_accepted_tokens_per_pos"]
    assert per_pos[0] >= 0.99 * drafts, (per_pos, drafts)  # before the sabotage: all
    assert 0.3 * drafts < per_pos[1] < 0.7 * drafts, (per_pos, drafts)  # every other proposal
    # after it, every proposal that survived position 1 is accepted: stale slots are handled
    assert per_pos[2] >= 0.99 * per_pos[1], (per_pos, drafts)


@pytest.mark.parametrize("paradigm", ["hybrid-budget",
                                      *(pytest.param(p, marks=pytest.mark.slow) for p in
                                        ("oracle", "kv", "kv-retrieval", "hidden-budget",
                                         "kv-memory", "hybrid-memory"))])
def test_lossless_under_preemption(paradigm, target_fp32, data_dir, prompts, long_baseline,
                                   drafters) -> None:
    """A KV cache too small for 16 growing requests: vLLM preempts and recomputes; every
    request still completes with the same tokens. The budgeted hybrid reads sparse views of
    prefixes up to twice its budget, the retrieval drafter chooses among the blocks between
    sink and recent window, the memory drafters summarise them (of the target's cache, and of
    both caches), with prefix caching and chunked prefill on."""
    tokens, counters, blocks = generate(target_fp32, data_dir, prompts,
                                        spec(drafters[paradigm], 3, **NON_PADDED),
                                        max_tokens=PREEMPTION_TOKENS,
                                        num_gpu_blocks_override=24, block_size=32)
    assert blocks == 24
    assert counters["vllm:num_preemptions"] > 0, counters
    assert tokens == long_baseline[0]
    if paradigm == "oracle":
        assert sum(counters["num_accepted_tokens_per_pos"]) >= 0.97 * 3 * counters["num_drafts"]


def _refused(target: Path, data_dir: Path, drafter: Path, tmp_path: Path) -> str:
    """Output of a `vllm serve` that must refuse to start."""
    port = free_port()
    cmd = serve_command(target, port, spec(drafter, 3, **NON_PADDED), dtype="float32",
                        max_model_len=256)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=VLLMServer(cmd, port, tmp_path / "x.log", data_dir).env)
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def _edit_config(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


BAD_CONFIGS = {
    "other-target": (lambda c: c["kvshot"]["target"].update(hidden_size=960),
                     "hidden_size: drafter was trained for 960, target has 576"),
    "layer-out-of-range": (lambda c: c["kvshot"].update(kv_layers=[3, 40]),
                           "kv_layers [40] out of range for a target with 30 layers"),
    "unknown-paradigm": (lambda c: c["kvshot"].update(paradigm="bogus"),
                         f"paradigm: {choices_message()}"),
    "budget-whole-context": (lambda c: c["kvshot"].update(kv_budget={**VIEW, "tokens": 256}),
                             "kv_budget.tokens 256 is the whole context or more"),
    # a view of a hidden-only drafter's own cache, written by hand under vLLM's own
    # architecture, which would read all of it
    "view-under-stock-name": (lambda c: c["kvshot"].update(kv_budget={**VIEW,
                                                                       "draft_cache": True}),
                              "but config.json names Eagle3LlamaForCausalLM"),
}


@pytest.mark.parametrize("case,paradigm", [
    ("other-target", "kv"),
    # hidden-only drafters run vLLM's own EAGLE-3 code, behind the plugin's checks
    ("other-target", "hidden"),
    pytest.param("layer-out-of-range", "kv", marks=pytest.mark.slow),
    pytest.param("unknown-paradigm", "kv", marks=pytest.mark.slow),
    pytest.param("budget-whole-context", "kv", marks=pytest.mark.slow),
    pytest.param("view-under-stock-name", "hidden", marks=pytest.mark.slow),
])
def test_bad_drafter_refuses_to_start(case, paradigm, target_fp32, data_dir, drafters,
                                      tmp_path) -> None:
    edit, message = BAD_CONFIGS[case]
    bad = _edit_config(drafters[paradigm], tmp_path / case, edit)
    assert message in _refused(target_fp32, data_dir, bad, tmp_path)


def test_serving_configs_name_shipped_drafters() -> None:
    """A new user serves the shipped drafters with no training: the configs point at them."""
    root = Path(__file__).parents[1]
    named = {json.loads((root / "serving_configs" / f"{n}.json").read_text())["model"]
             for n in paradigm_names()}
    shipped = {str(p.relative_to(root)) for p in SHIPPED.values()}
    assert shipped and shipped <= named, (shipped, named)


@pytest.mark.parametrize("name", list(SHIPPED)[:1])
def test_corrupt_shipped_drafter_refuses_to_start(name, target_fp32, data_dir,
                                                  tmp_path) -> None:
    import shutil

    bad = tmp_path / name
    shutil.copytree(SHIPPED[name], bad)
    weights = bytearray((bad / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(weights))
    assert f"{bad / 'model.safetensors'} does not match its checksum" in _refused(
        target_fp32, data_dir, bad, tmp_path)


@pytest.mark.slow
def test_drafter_missing_a_weight_refuses_to_start(target_fp32, data_dir, drafters,
                                                   tmp_path) -> None:
    missing = _edit_config(drafters["kv"], tmp_path / "missing", lambda c: None)
    weights = load_file(missing / "model.safetensors")
    del weights["kv_layers.0.cross.k_proj.weight"]
    save_file(weights, missing / "model.safetensors")
    assert "missing weight 'kv_layers.0.cross.k_proj.weight'" in _refused(
        target_fp32, data_dir, missing, tmp_path)


def _record_proposals(worker) -> None:
    """In the worker: keep, per proposal and request, the verified tokens of this step, the
    bonus token, the drafts, and whether the engine uses them (it discards the drafts of a
    prefill chunk that does not end the prompt)."""
    runner = worker.model_runner
    drafter = runner.drafter
    original = drafter.propose
    drafter.kvshot_proposals = []

    def recorded(**kw):
        # Read before proposing: the draft passes rewrite the metadata in place.
        starts = kw["common_attn_metadata"].query_start_loc_cpu.tolist()
        chunks = [kw["target_token_ids"][a:b].tolist() for a, b in zip(starts, starts[1:])]
        ends = [int(kw["target_positions"][b - 1]) for b in starts[1:]]
        bonus = kw["next_token_ids"].tolist()
        used = (~runner.discard_request_mask.np[:len(chunks)]).tolist()
        drafts = original(**kw)
        drafter.kvshot_proposals += zip(chunks, ends, bonus, drafts.tolist(), used)
        return drafts

    drafter.propose = recorded


def _proposals(worker) -> list:
    return worker.model_runner.drafter.kvshot_proposals


# Every drafter the plugin serves, by its checkpoint options.
PARITY_DRAFTERS = {**{name: {"paradigm": name} for name in paradigm_names()},
                   "block-ssm": {"paradigm": "block", "ssm_state_size": 4}}
BUDGETED_DRAFTERS = {**{f"{name}-budget": {"paradigm": name, "kv_budget": VIEW}
                        for name in ("kv", "hybrid", "block")},
                     # the hybrid's own EAGLE-3 cache in view too
                     "hybrid-budget-draft": {"paradigm": "hybrid",
                                             "kv_budget": {**VIEW, "draft_cache": True}},
                     # a hidden-only drafter's only view: its own EAGLE-3 cache (BudgetDraft's)
                     "hidden-budget-draft": {"paradigm": "hidden",
                                             "kv_budget": {**VIEW, "draft_cache": True}},
                     # sink, 2 recent blocks and the 2 best-scoring blocks between them
                     **{f"{name}-retrieval": {"paradigm": name, "kv_budget": RETRIEVAL_VIEW}
                        for name in ("kv", "block")},
                     # sink, 2 recent blocks and the memory slots of the blocks between them:
                     # of the target's cache, of a hidden-only drafter's own, and of both
                     **{f"{name}-memory": {"paradigm": name, "kv_budget": MEMORY_VIEW}
                        for name in ("kv", "block")},
                     **{f"{name}-memory-{caches}": {"paradigm": name, "kv_budget": {
                         **MEMORY_VIEW, "draft_cache": True,
                         "memory": {**MEMORY_VIEW["memory"], "caches": caches}}}
                        for name, caches in (("hidden", "draft"), ("hybrid", "both"))}}


@pytest.fixture(scope="module")
def tp_target(target_fp32: Path, tmp_path_factory) -> Path:
    """A random Llama target whose heads split over two ranks (SmolLM2-135M's 9 heads and 3
    KV heads do not, and vLLM refuses it at tensor-parallel size 2), with SmolLM2's tokenizer
    and head size (vLLM's CPU attention kernel takes only some head sizes)."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tp-target")
    config = AutoConfig.from_pretrained(target_fp32)
    config.update(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       initializer_range=0.1))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in target_fp32.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def random_drafter(target: Path, options: dict, out: Path) -> Path:
    """A drafter with random weights large enough that attention over the target's K/V and
    over its chain decides the drafts, and the target's lm_head. A memory adaptor's queries are
    random too, so that each slot leans to a few keys of its block rather than averaging it."""
    import torch

    from kvshot_vllm.models.config import validated
    from kvshot_vllm.models.files import target_lm_head, target_spec
    from kvshot_vllm.models.weights import init_weights, save_checkpoint

    cfg = validated({"target": target_spec(target), **options})
    weights = init_weights(cfg, seed=3, std=0.08, lm_head=target_lm_head(target))
    gen = torch.Generator().manual_seed(4)
    for name in [n for n in weights if n.endswith("memory.query")]:
        weights[name] = torch.randn(weights[name].shape, generator=gen)
    return save_checkpoint(cfg, weights, out)


def served_proposals(target: Path, drafter: Path | None, k: int, batch: list[list[int]],
                     data_dir: Path, tp: int = 1, waves: int = 1,
                     **engine) -> tuple[list[list[int]], list]:
    """Greedy outputs of `batch` and every proposal the engine made (`_record_proposals`), at
    tensor-parallel size `tp` (one vLLM CPU rank per core); no speculation without a drafter.
    The batch is served in `waves` consecutive parts, on one engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.engine import make_llm

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
    try:
        llm = make_llm(target, data_dir, tensor_parallel_size=tp, **{**ENGINE, **engine},
                       speculative_config=drafter and spec(drafter, k, **NON_PADDED))
        if drafter:
            llm.collective_rpc(_record_proposals)
        size = -(-len(batch) // waves)
        outs = [out for i in range(0, len(batch), size) for out in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in batch[i:i + size]],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False)]
        proposals = llm.collective_rpc(_proposals)[0] if drafter else []
        del llm
    finally:
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return [list(o.outputs[0].token_ids) for o in outs], proposals


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "hybrid" else pytest.mark.slow)
                                  for n in PARITY_DRAFTERS])
def test_tensor_parallel_ranks_draft_what_one_rank_drafts(name, tp_target, data_dir, prompts,
                                                          tmp_path) -> None:
    """At tensor-parallel size 2 (vLLM's CPU build, one rank per core) each rank's drafter holds
    its shards of the layers and reads its own KV heads of the target's cache in place; the
    engine makes exactly the proposals of size 1, and the outputs stay lossless. The hybrid is
    in the default run: it holds every sharded layer kind (paged self-attention,
    cross-attention, MLP). The sharded math against the unsharded training side:
    tests/test_parallel_unit.py."""
    drafter = random_drafter(tp_target, PARITY_DRAFTERS[name], tmp_path / name)
    batch = prompts[:6]
    one_outs, one = served_proposals(tp_target, drafter, 4, batch, data_dir, tp=1)
    two_outs, two = served_proposals(tp_target, drafter, 4, batch, data_dir, tp=2)
    plain_outs, _ = served_proposals(tp_target, None, 0, batch, data_dir, tp=2)
    assert two_outs == one_outs == plain_outs

    # The two executors may cut the prompts into different prefill chunks (the chunks and the
    # discarded drafts of a chunk that does not end its prompt follow the scheduling, not the
    # drafter), so what must match is each used proposal: its position, bonus token and drafts.
    def used(proposals: list) -> list:
        return sorted((p, bonus, drafts) for _, p, bonus, drafts, use in proposals if use)

    assert len(used(one)) >= 30 and len({tuple(d) for *_, d, _ in one}) > 5  # drafts vary
    assert used(two) == used(one)


# The plain block drafter's serving path is the block-ssm one's without the mixer, and the
# streaming views of the budgeted KV-only, hybrid and block drafters are built by the builder
# path that also builds the retrieval views (which then choose their blocks) and the hybrid's
# viewed own cache; the hybrid's memory of both caches covers the memory paths of the others:
# slow set.
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow)
    if n in ("block", "kv-budget", "hybrid-budget", "block-budget", "kv-memory", "block-memory",
             "hidden-memory-draft")
    else n for n in [*PARITY_DRAFTERS, *BUDGETED_DRAFTERS]])
def test_served_drafts_equal_training_side_drafts(name, target_fp32, data_dir, prompts,
                                                 tmp_path) -> None:
    """What vLLM drafts is what the training-side drafter drafts: for every proposal of a
    batch, the k drafted tokens equal `Drafter.chain` at the proposal's anchor p, fed the
    verified sequence up to the bonus token and then the served drafts, over transformers' KV
    cache and hidden states of the finished sequence (row p reads positions <= p only). So the
    serving path computes the training math, and what the cross layers read in place from
    vLLM's paged cache is what transformers computes. Losslessness alone cannot show this: it
    holds for any drafter. Budgeted drafters read a sparse view through a shorter block table
    in vLLM and a mask in training, over prefixes longer than the budget; a retrieval view's
    blocks are chosen by the served query against the paged cache, and by the training query
    against transformers' keys."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvshot_vllm.models.config import load_drafter_config
    from kvshot_vllm.models.drafter import TargetFeatures, load_drafter
    from kvshot_vllm.training.features import FeatureSpec, target_forward

    k = 4
    options = {**PARITY_DRAFTERS, **BUDGETED_DRAFTERS}[name]
    ckpt = random_drafter(target_fp32, options, tmp_path / name)
    cfg = load_drafter_config(ckpt)
    budget = cfg.kv_budget
    # budgeted: 4 prompts of about 250 tokens, the 16 prompts end to end
    batch = [sum(prompts[i::4], []) for i in range(4)] if budget else prompts[:6]
    engine = {"block_size": budget.block_size} if budget else {}
    if budget and (budget.policy == "retrieval" or budget.memory):
        # Two waves of two requests through a pool that holds one wave: the second wave's
        # requests get blocks whose K/V the first wave's proposals summarised (the builder keeps
        # each block's mean key or memory slots across proposals, and must forget them when the
        # block is rewritten).
        need = [-(-(len(p) + MAX_TOKENS + k) // budget.block_size) for p in batch]
        pool = max(need[0] + need[1], need[2] + need[3],
                   ENGINE["max_model_len"] // budget.block_size) + 2
        assert sum(need) > pool, (need, pool)
        engine.update(waves=2, num_gpu_blocks_override=pool)
    outs, served = served_proposals(target_fp32, ckpt, k, batch, data_dir, **engine)
    sequences = [p + o for p, o in zip(batch, outs)]

    drafter = load_drafter(ckpt, target_fp32).eval()
    model = AutoModelForCausalLM.from_pretrained(target_fp32, torch_dtype=torch.float32).eval()
    fspec = FeatureSpec(aux_layers=tuple(cfg.aux_layers), kv_layers=tuple(cfg.kv_layers),
                        max_len=4096, dtype="float32")
    with torch.no_grad():
        features = [target_forward(model, seq, fspec) for seq in sequences]

    def offline_drafts(i: int, p: int, drafts: list[int]) -> list[int]:
        """The chain at anchor p of sequence i, fed the served drafts; features past p are the
        finished sequence's, which no row <= p reads."""
        ids = sequences[i][:p + 2] + drafts[:-1]
        n, f = len(ids), features[i]
        kv = {layer: (f[f"k.{layer}"][:n].transpose(0, 1)[None],
                      f[f"v.{layer}"][:n].transpose(0, 1)[None]) for layer in cfg.kv_layers}
        feats = TargetFeatures(torch.tensor([ids]), f["aux"][None, :n], kv)
        steps = drafter.chain(feats, k, first_row=p)  # each [1, >= n - p, hidden]: the last rows
        return [int(drafter.target_ids(drafter.lm_head(r[0, p - n]).argmax(-1))) for r in steps]

    compared = equal = sparse = 0
    with torch.no_grad():
        for chunk, p, bonus, drafts, _ in served:
            owners = [i for i, s in enumerate(sequences) if p + 1 < len(s) and s[p + 1] == bonus
                      and s[p + 1 - len(chunk):p + 1] == chunk]
            if len(owners) != 1 or p + 1 + k > len(sequences[owners[0]]):
                continue
            compared += 1
            sparse += bool(budget) and p + 1 > budget.tokens
            equal += drafts == offline_drafts(owners[0], p, drafts)
    assert compared >= 30, compared
    assert not budget or sparse >= 30, (sparse, compared)  # views that leave blocks out
    assert equal == compared, f"{compared - equal} of {compared} proposals differ"
