"""Pure-logic tests of the training-side drafters on a tiny synthetic Llama target (no files):
what each row of a TTT chain may see, against hand-built references."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from kvshot_vllm.models.config import TargetSpec, validated
from kvshot_vllm.models.drafter import Drafter, TargetFeatures
from kvshot_vllm.models.layers import draft_attention
from kvshot_vllm.models.weights import init_weights
from kvshot_vllm.errors import KVShotError
from kvshot_vllm.training.schedule import TrainingData, batch_order, mix_steps, trained_tokens
from kvshot_vllm.training.ttt import TrainConfig, lr_at, shifted

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50,
                   rms_norm_eps=1e-6)


def tiny_drafter(paradigm: str, **options):
    spec = TargetSpec.from_hf_config(TINY, "tiny")
    cfg = validated({"paradigm": paradigm, "target": spec, **options})
    torch.manual_seed(0)
    drafter = Drafter(cfg, TINY, torch.randn(TINY.vocab_size, TINY.hidden_size))
    drafter.load_checkpoint_weights(init_weights(cfg, std=0.3))
    return drafter.eval()


def tiny_batch(drafter, t: int = 40):
    """(features, labels, trainable, t2d) of one tiny sequence whose positions 10.. are
    scored, over the whole vocabulary."""
    labels = torch.randint(0, TINY.vocab_size, (1, t), generator=torch.Generator().manual_seed(3))
    trainable = torch.zeros(1, t, dtype=torch.bool)
    trainable[0, 10:] = True
    return tiny_features(drafter, t), labels, trainable, torch.arange(TINY.vocab_size)


def tiny_features(drafter, t: int, seed: int = 0) -> TargetFeatures:
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.cfg
    kv = {layer: (torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g))
          for layer in cfg.kv_layers}
    return TargetFeatures(torch.randint(0, TINY.vocab_size, (1, t), generator=g),
                          torch.randn(1, t, len(cfg.aux_layers) * 32, generator=g), kv)


def test_draft_attention_row_sees_its_prefix_and_own_chain_only() -> None:
    """Against a per-row loop over the keys the row may see: context rows 0..p, then its own
    chain keys in order."""
    g = torch.Generator().manual_seed(1)
    b, t, h, kvh, d = 2, 5, 4, 2, 8
    q = torch.randn(b, t, h, d, generator=g)
    ctx = (torch.randn(b, kvh, t, d, generator=g), torch.randn(b, kvh, t, d, generator=g))
    diag = [(torch.randn(b, t, kvh, d, generator=g), torch.randn(b, t, kvh, d, generator=g))
            for _ in range(3)]
    out = draft_attention(q, ctx, diag).view(b, t, h, d)
    for bi in range(b):
        for p in range(t):
            for head in range(h):
                kv_head = head // (h // kvh)
                keys = torch.cat([ctx[0][bi, kv_head, : p + 1]] +
                                 [k[bi, p, kv_head][None] for k, _ in diag])
                vals = torch.cat([ctx[1][bi, kv_head, : p + 1]] +
                                 [v[bi, p, kv_head][None] for _, v in diag])
                w = torch.softmax(keys @ q[bi, p, head] * d**-0.5, dim=0)
                torch.testing.assert_close(out[bi, p, head], w @ vals)


@pytest.mark.parametrize("paradigm,options", [
    ("hidden", {}), ("kv", {"num_layers": 2}), ("hybrid", {}),
    ("kv", {"kv_projection": "linear", "reapply_rope": True}),
    ("hybrid", {"kv_projection": "linear"}),
])
def test_chain_row_depends_on_nothing_beyond_its_draft(paradigm: str, options: dict) -> None:
    """Row p at step j drafts token p + 2 + j from tokens <= p + 1 + j and target features of
    positions <= p. Changing anything later leaves it unchanged; changing its own input token
    changes it."""
    drafter = tiny_drafter(paradigm, **options)
    t, steps, p = 12, 4, 5
    base = tiny_features(drafter, t)
    with torch.no_grad():
        ref = drafter.chain(base, steps)
    for j in range(steps):
        later = tiny_features(drafter, t, seed=7)
        later.input_ids[:, : p + 2 + j] = base.input_ids[:, : p + 2 + j]
        later.aux_hidden[:, : p + 1] = base.aux_hidden[:, : p + 1]
        for layer, (k, v) in later.target_kv.items():
            k[:, :, : p + 1] = base.target_kv[layer][0][:, :, : p + 1]
            v[:, :, : p + 1] = base.target_kv[layer][1][:, :, : p + 1]
        with torch.no_grad():
            out = drafter.chain(later, steps)
        torch.testing.assert_close(out[j][:, : p + 1], ref[j][:, : p + 1])

        own_token = tiny_features(drafter, t)
        own_token.input_ids[0, p + 1 + j] = (base.input_ids[0, p + 1 + j] + 1) % TINY.vocab_size
        with torch.no_grad():
            changed = drafter.chain(own_token, steps)
        assert not torch.allclose(changed[j][0, p], ref[j][0, p])


def test_hidden_only_ignores_target_kv_and_kv_only_ignores_hidden() -> None:
    hidden, kv = tiny_drafter("hidden"), tiny_drafter("kv")
    f = tiny_features(kv, 8)
    g = TargetFeatures(f.input_ids, torch.zeros_like(f.aux_hidden),
                       {n: (k * 2, v) for n, (k, v) in f.target_kv.items()})
    with torch.no_grad():
        torch.testing.assert_close(kv.chain(f, 3)[2], kv.chain(
            TargetFeatures(f.input_ids, torch.zeros_like(f.aux_hidden), f.target_kv), 3)[2])
        assert not torch.allclose(kv.chain(f, 1)[0], kv.chain(g, 1)[0])
        fh = tiny_features(hidden, 8)
        assert not torch.allclose(hidden.chain(fh, 1)[0], hidden.chain(
            TargetFeatures(fh.input_ids, fh.aux_hidden * 2, {}), 1)[0])


def test_gate_zero_hybrid_is_eagle3() -> None:
    """gate = 0: the cross-attention correction vanishes and the hybrid computes EAGLE-3."""
    hybrid = tiny_drafter("hybrid", gate_init=0.0)
    hidden = tiny_drafter("hidden")
    hidden.load_state_dict({n: w for n, w in hybrid.state_dict().items()
                            if not n.startswith(("cross.", "merge."))})
    f = tiny_features(hybrid, 10)
    with torch.no_grad():
        for a, b in zip(hybrid.chain(f, 3), hidden.chain(f, 3)):
            torch.testing.assert_close(a, b)


def test_shifted_labels_and_schedule() -> None:
    x = torch.tensor([[1, 2, 3, 4]])
    assert shifted(x, 1).tolist() == [[2, 3, 4, 0]]
    assert shifted(x, 3, fill=-1).tolist() == [[4, -1, -1, -1]]
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.5) and lr_at(99, cfg) < 0.01
    # the same step gives the same batch whatever the process's random state: a resumed run
    # (a fresh process, other seeds drawn before) replays the uninterrupted one
    lengths = [(7 * i) % 23 for i in range(64)]
    first = batch_order(lengths, cfg, 7)
    random.seed(1)
    torch.manual_seed(1)
    random.random(), torch.rand(3)
    assert batch_order(lengths, cfg, 7) == first
    for bucket in (1, 4):
        small = TrainConfig(steps=9, batch_size=4, bucket=bucket)
        epoch = [batch_order(lengths, small, s) for s in range(16)]
        assert sorted(i for b in epoch for i in b) == list(range(64))  # each sequence once
        assert epoch != [batch_order(lengths, small, s) for s in range(16, 32)]  # reshuffled
        spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in epoch)
        if bucket == 1:
            random_spread = spread
    assert spread < random_spread / 2  # bucketed batches pad much less
    # `kvshot train --seed 1`: the same sequences in another order (a further pass, reordered)
    from kvshot_vllm.cli import build_parser
    from kvshot_vllm.training.pipeline import train_config
    args = build_parser().parse_args(["train", "--paradigm", "hidden", "--preset", "full",
                                      "--seed", "1"])
    reseeded = train_config(args.preset, seed=args.seed)
    assert reseeded.seed == 1 and train_config("full").seed == 0
    again = [batch_order(lengths, reseeded, s) for s in range(8)]
    assert sorted(i for b in again for i in b) == list(range(64))
    assert again != [batch_order(lengths, train_config("full"), s) for s in range(8)]


class _Lengths:
    """A data set's features as the schedule sees them: lengths, prompts, and batches of
    (part name, sequence indices)."""

    def __init__(self, name: str, lengths: list[int]) -> None:
        self.name, self.lengths = name, lengths
        self.path, self.params = Path(name), {}

    def __len__(self) -> int:
        return len(self.lengths)

    def length(self, i: int) -> int:
        return self.lengths[i]

    def prompt_length(self, i: int) -> int:
        return self.lengths[i] - 3

    def batch(self, indices, kv_layers, uses_aux):
        return self.name, indices, None


def test_a_mix_draws_whole_batches_from_each_set_in_proportion() -> None:
    """One set: exactly the batches a run trained before mixes existed (a resumed run goes on
    as it began). Two sets at 3:1: every 4 steps three batches of the first and one of the
    second, each set through its own epochs, and the tokens counted per set."""
    cfg = TrainConfig(steps=64, batch_size=4)
    short, long = _Lengths("short", [(7 * i) % 23 + 5 for i in range(48)]), _Lengths(
        "long", [400 + i for i in range(8)])
    one = TrainingData([short])
    assert one.record() == {"features": str(Path("short").resolve())}
    assert [one.batch(cfg, s, [], False)[1] for s in range(30)] == [
        batch_order(short.lengths, cfg, s) for s in range(30)]
    assert one.trained_tokens(cfg, 30) == trained_tokens(
        short.lengths, [n - 3 for n in short.lengths], cfg, 30)

    assert mix_steps([3, 1], 8) == [0, 0, 1, 0, 0, 0, 1, 0]
    mix = TrainingData([short, long], [3, 1])
    batches = [mix.batch(cfg, s, [], False) for s in range(48)]
    assert all([b[0] for b in batches[s:s + 4]].count("long") == 1 for s in range(0, 48, 4))
    firsts = [b[1] for b in batches if b[0] == "short"]
    assert firsts == [batch_order(short.lengths, cfg, s) for s in range(36)]
    longs = [i for b in batches if b[0] == "long" for i in b[1]]
    assert sorted(longs[:8]) == sorted(longs[8:16]) == list(range(8))  # an epoch each 2 batches
    assert mix.steps_per_part(48) == [36, 12]
    assert mix.trained_tokens(cfg, 48) == {
        "tokens": trained_tokens(short.lengths, [n - 3 for n in short.lengths], cfg, 36)[
            "tokens"] + sum(long.lengths[i] for i in longs), "loss_tokens": 3 * 48 * 4}
    assert mix.record()["mix"] == [3.0, 1.0]
    # by default a set's share is its share of the sequences, as one set made of both
    assert TrainingData([short, long]).steps_per_part(56) == [48, 8]
    with pytest.raises(KVShotError, match="takes 2 positive weights"):
        TrainingData([short, long], [1, 0])


@pytest.mark.parametrize("reapply_rope", [True, False])
def test_linear_projection_starts_as_the_mean_of_the_sampled_layers(reapply_rope) -> None:
    """Fresh k_merge / v_merge average the sampled layers: three copies of one layer's cached
    K/V come back as that layer's (so the RoPE undo/redo round-trips exactly)."""
    drafter = tiny_drafter("kv", kv_projection="linear", reapply_rope=reapply_rope)
    cross = drafter.kv_layers[0].cross
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    with torch.no_grad():
        (mk, mv), = cross.target_context([(k, v)] * 3, drafter.rope)
    torch.testing.assert_close(mk, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mv, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ssm_state_size", [0, 4])
def test_block_rows_see_the_prefix_and_earlier_block_rows_only(ssm_state_size: int) -> None:
    """Block anchored at p (last verified position): row j sits at p + 1 + j. It sees the
    target's K/V and hidden state up to p, the bonus token p + 1 (through row 0) and block rows
    0..j; never a token after p + 1 (rows 1.. carry the mask), nor later block rows. The same
    with the recurrent mixer, whose state starts from the hidden state at p."""
    drafter = tiny_drafter("block", num_layers=2, ssm_state_size=ssm_state_size)
    t, k, p = 12, 4, 4
    base = tiny_features(drafter, t)
    with torch.no_grad():
        ref = torch.stack(drafter.chain(base, k))[:, 0, p]  # [k, hidden]: rows of the block

        def rows(edit) -> torch.Tensor:
            f = tiny_features(drafter, t)  # the same draws as base
            edit(f)
            return torch.stack(drafter.chain(f, k))[:, 0, p]

        def changed(edit) -> list[bool]:
            return [not torch.allclose(a, b) for a, b in zip(rows(edit), ref)]

        later_tokens = lambda f: f.input_ids[0, p + 2:].random_(0, TINY.vocab_size)  # noqa
        assert changed(later_tokens) == [False] * k
        later_target = lambda f: [kv[0][:, :, p + 1:].normal_() for kv in f.target_kv.values()]  # noqa
        assert changed(later_target) == [False] * k
        later_hidden = lambda f: f.aux_hidden[:, p + 1:].normal_()  # noqa
        assert changed(later_hidden) == [False] * k
        bonus = lambda f: f.input_ids[0, p + 1].add_(1).remainder_(TINY.vocab_size)  # noqa
        assert changed(bonus) == [True] * k
        prefix_target = lambda f: [kv[1][:, :, p].normal_() for kv in f.target_kv.values()]  # noqa
        assert changed(prefix_target) == [True] * k
        own_hidden = lambda f: f.aux_hidden[:, p].normal_()  # noqa
        assert changed(own_hidden) == [True] * k


def test_warm_start_reads_eagle3_checkpoint_names(tmp_path) -> None:
    """An EAGLE-3 checkpoint (`midlayer.*`, with t2d and embed_tokens) warm-starts a hybrid:
    its layer, fc, norm and lm_head are copied; the cross branch and gate stay fresh."""
    from safetensors.torch import save_file

    from kvshot_vllm.training.ttt import warm_start

    source = tiny_drafter("hidden")
    eagle = {n.replace("layers.0.", "midlayer."): w.clone() + 1.0
             for n, w in source.state_dict().items() if n not in ("embed", "d2t")}
    eagle["t2d"] = torch.ones(TINY.vocab_size, dtype=torch.bool)
    eagle["embed_tokens.weight"] = torch.zeros(TINY.vocab_size, TINY.hidden_size)
    save_file(eagle, tmp_path / "model.safetensors")
    hybrid = tiny_drafter("hybrid")
    gate = hybrid.merge.gate.clone()
    fresh = warm_start(hybrid, tmp_path)
    assert fresh == sorted(n for n, _ in hybrid.named_parameters()
                           if n.startswith(("cross.", "merge.")))
    torch.testing.assert_close(hybrid.layers[0].self_attn.q_proj.weight,
                               eagle["midlayer.self_attn.q_proj.weight"])
    torch.testing.assert_close(hybrid.fc.weight, eagle["fc.weight"])
    assert torch.equal(hybrid.merge.gate, gate)


def test_a_warm_start_grows_its_draft_vocabulary(tmp_path) -> None:
    """`--draft-vocab-size` above a warm start's: its tokens stay, the most frequent others
    join, each trained lm_head row moves to its token's new draft id, and the new rows keep
    their fresh values. A vocabulary that drops one of its tokens is refused."""
    from safetensors.torch import save_file

    from kvshot_vllm.training.ttt import grown_vocabulary, warm_start

    small = tiny_drafter("hidden", draft_vocab_size=20)
    tokens = torch.arange(1, 41, 2)  # the odd ones
    small.d2t.copy_(tokens - torch.arange(20))
    save_file({n: t.contiguous() for n, t in small.checkpoint_weights().items()},
              tmp_path / "model.safetensors")
    counts = torch.arange(TINY.vocab_size).flip(0)  # token 0 the most frequent
    grown = grown_vocabulary(small.d2t, 30, counts)
    ids = torch.arange(30) + grown
    assert ids.tolist() == sorted(set(tokens.tolist()) | set(range(0, 20, 2)))
    big = tiny_drafter("hidden", draft_vocab_size=30)
    big.d2t.copy_(grown)
    fresh_rows = big.lm_head.weight.detach().clone()
    fresh = warm_start(big, tmp_path)
    assert "lm_head.weight" not in fresh and torch.equal(big.d2t, grown)
    moved = big.draft_ids()[tokens]
    torch.testing.assert_close(big.lm_head.weight[moved], small.lm_head.weight)
    new = torch.ones(30, dtype=torch.bool)
    new[moved] = False
    assert torch.equal(big.lm_head.weight[new], fresh_rows[new])
    torch.testing.assert_close(big.fc.weight, small.fc.weight)
    other = tiny_drafter("hidden", draft_vocab_size=30)  # tokens 0..29: no 31..39
    with pytest.raises(KVShotError, match="does not hold"):
        warm_start(other, tmp_path)


def test_report_compares_retention_only_where_chains_suffice() -> None:
    from kvshot_vllm.training.diagnostics import MIN_CHAINS, report_lines, summarize

    enough, few = MIN_CHAINS, MIN_CHAINS - 1
    results = {
        "deep": summarize([50, 40, 30, 20], [100, enough, enough, enough]),
        "shallow": summarize([50, 10, 5, 0], [100, enough, enough, few]),
        "dead": summarize([50, 0, 0, 0], [100, enough, enough, 0]),
    }
    for r in results.values():
        r["training"] = None
    lines = report_lines(results, "cmd")
    head = next(i for i, line in enumerate(lines) if line.startswith("| drafter | a0 |"))
    first_table = [lines[head], *lines[head + 2:head + 2 + len(results)]]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in first_table}
    # header: drafter, a0..a3, MAT, MAT vs deep, retention a3/a0, a2/a0: step 3 lacks chains
    # for two drafters
    assert rows["drafter"][5:9] == ["MAT", "MAT vs deep", "retention a3/a0", "a2/a0"]
    assert rows["deep"][6] == "+0.0%"
    assert rows["dead"][6] == f"{results['dead']['mat'] / results['deep']['mat'] - 1:+.1%}"
    assert rows["deep"][7] == f"{(20 / enough) / 0.5:.1%}"
    assert rows["shallow"][7] == f"n/a (n={few})"
    assert rows["deep"][8] == f"{(30 / enough) / 0.5:.1%}"
    assert rows["dead"][4] == "-" and rows["dead"][2] == "0.000"
    # with no step beyond a0 that every drafter reaches, there is nothing to compare at
    results["dead"]["alive"][1] = 0
    assert all("/a0 |" not in line.replace("a3/a0 |", "") for line in report_lines(results, "cmd"))


def test_served_proposals_step_as_vllm_does() -> None:
    """A proposal anchored at p accepts its drafts up to the first miss and moves on by them
    and the bonus token; generation stops once the response is complete."""
    from kvshot_vllm.training.diagnostics import served_proposals

    prompt, length, k = 5, 15, 3  # a response of 10 tokens, the prefill's first included
    assert served_proposals(torch.zeros(k, length, dtype=torch.bool), prompt, length) == [0] * 9
    assert served_proposals(torch.ones(k, length, dtype=torch.bool), prompt, length) == [3, 3, 3]
    hits = torch.zeros(k, length, dtype=torch.bool)
    hits[:2, 4] = True  # the first proposal (anchor 4) accepts 2, the next anchors at 7
    hits[:, 7] = True  # all 3, the next at 11
    hits[1:, 11] = True  # a miss at draft 0 ends it whatever follows
    # anchors 4, 7, 11 and 12, which gives the tenth token
    assert served_proposals(hits, prompt, length) == [2, 3, 0, 0]


def test_diagnose_refuses_a_negative_served_k() -> None:
    from tests.conftest import assert_one_line_error, run_kvshot

    assert_one_line_error(run_kvshot("diagnose", "x=y", "--served-k", "-1"),
                          "--served-k takes a number of draft tokens (0: none), got -1")


def test_report_shows_served_acceptance_where_simulated() -> None:
    from kvshot_vllm.training.diagnostics import report_lines, summarize

    results = {"a": summarize([50, 40], [100, 50]), "b": summarize([60, 40], [100, 60])}
    for r in results.values():
        r["training"] = None
    assert not any("As a server counts" in line for line in report_lines(results, "cmd"))
    results["a"]["served"] = {"k": 2, "num_drafts": 200, "accepted_per_pos": [100, 40]}
    results["b"]["served"] = None  # e.g. rewritten from a report made before simulation
    lines = report_lines(results, "cmd")
    rows = [line for line in lines if line.startswith("| a | 200 |")]
    assert rows == ["| a | 200 | 0.500 | 0.200 | 1.70 |"]
    assert not any(line.startswith("| b | ") and line.count("|") == 6 for line in lines)


@pytest.mark.parametrize("paradigm,options", [
    ("hidden", {}), ("kv", {"num_layers": 2}), ("hybrid", {}), ("block", {}),
    ("block", {"ssm_state_size": 4}), ("kv", {"kv_projection": "linear"}),
])
def test_rows_without_loss_are_skipped_without_changing_the_loss(paradigm, options) -> None:
    """Training computes only the rows some draft step scores (after the steps that need every
    row): the loss, its gradient and the accuracies equal those of the whole chain. A bug that
    cuts one row too many, or reads the wrong rows of a cached step, changes them."""
    from kvshot_vllm.training.ttt import first_scored_row, ttt_loss

    drafter = tiny_drafter(paradigm, **options).train()
    t = 24
    base = tiny_features(drafter, t)
    feats = TargetFeatures(base.input_ids.repeat(2, 1), base.aux_hidden.repeat(2, 1, 1),
                           {n: (k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1))
                            for n, (k, v) in base.target_kv.items()})
    labels = torch.randint(0, TINY.vocab_size, (2, t), generator=torch.Generator().manual_seed(3))
    trainable = torch.zeros(2, t, dtype=torch.bool)
    trainable[0, 14:22], trainable[1, 17:20] = True, True  # two prompts of other lengths
    assert first_scored_row(trainable, 4) == 10
    t2d = torch.arange(TINY.vocab_size)
    results = []
    for loss_rows_only in (False, True):
        drafter.zero_grad()
        cfg = TrainConfig(steps=1, ttt_steps=4, loss_rows_only=loss_rows_only)
        loss, accs = ttt_loss(drafter, feats, labels, trainable, cfg, t2d)
        loss.backward()
        results.append((loss.detach(), accs, [p.grad.clone() for p in drafter.parameters()
                                               if p.grad is not None]))
    (loss_all, acc_all, grad_all), (loss_cut, acc_cut, grad_cut) = results
    torch.testing.assert_close(loss_cut, loss_all)
    assert acc_cut == acc_all
    assert len(grad_cut) == len(grad_all)
    for a, b in zip(grad_cut, grad_all):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_curve_counts_the_tokens_of_a_shipped_drafter_it_started_from(tmp_path) -> None:
    """A run warm-started from a shipped drafter inherits the budget its manifest records (its
    total, when it was itself warm-started); a warm-started one without a total is refused
    rather than undercounted."""
    import json

    from kvshot_vllm.training.curve import shipped_budget

    budget = {"steps": 200, "batch_size": 8, "tokens": 672401, "loss_tokens": 341550}
    (tmp_path / "manifest.json").write_text(json.dumps({"budget": budget, "init": None}))
    assert shipped_budget(tmp_path) == {"sequences": 1600, "tokens": 672401,
                                        "loss_tokens": 341550}
    (tmp_path / "manifest.json").write_text(json.dumps({"budget": budget, "init": "elsewhere"}))
    with pytest.raises(KVShotError, match="no budget total"):
        shipped_budget(tmp_path)
    total = {"sequences": 3840, "tokens": 1593568, "loss_tokens": 809700}
    (tmp_path / "manifest.json").write_text(json.dumps({"budget": {**budget, "total": total},
                                                        "init": "elsewhere"}))
    assert shipped_budget(tmp_path) == total


@pytest.mark.parametrize("paradigm,policy", [("kv", "streaming"), ("hybrid", "streaming"),
                                             ("block", "streaming"), ("kv", "retrieval"),
                                             ("hidden", "streaming")])
def test_multi_view_loss_adds_the_sparse_views_divergence(paradigm: str, policy: str) -> None:
    """A view that holds the whole sequence adds nothing; a sparse one adds the KL of its chain
    from the full chain's, whose gradient reaches the drafter through the sparse branch only.
    A hidden-only drafter's views cover its own cache (BudgetDraft's setting)."""
    from kvshot_vllm.models.budget import KVBudget
    from kvshot_vllm.training.ttt import MultiView, ttt_loss

    drafter = tiny_drafter(paradigm).train()
    feats, labels, trainable, t2d = tiny_batch(drafter)
    tokens = 12 if policy == "streaming" else 16  # retrieval: sink, 1 block, 2 recent blocks
    own = not drafter.cfg.spec.reads_target_kv
    view = {"block_size": 4, "policy": policy, "draft_cache": own}
    cfg = TrainConfig(steps=1, ttt_steps=3, multi_view=MultiView(budgets={tokens: 1.0}, **view))
    plain, accs = ttt_loss(drafter, feats, labels, trainable, cfg, t2d)
    same, same_accs = ttt_loss(drafter, feats, labels, trainable, cfg, t2d,
                               KVBudget(tokens=40, **view))
    assert torch.equal(same, plain) and same_accs == accs
    sparse = KVBudget(tokens=tokens, **view)
    total, sparse_accs = ttt_loss(drafter, feats, labels, trainable, cfg, t2d, sparse)
    assert sparse_accs == accs  # accuracy is the full view's
    assert total > plain
    (total - plain).backward()  # the KL term alone
    viewed = "self_attn" if own else "cross"  # the attention that reads the view
    grads = [p.grad for n, p in drafter.named_parameters() if viewed in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_multi_view_draws_budgets_by_step() -> None:
    from kvshot_vllm.training.pipeline import train_config
    from kvshot_vllm.training.ttt import MultiView

    views = MultiView()
    draws = [views.draw(0, step).tokens for step in range(2000)]
    assert draws == [views.draw(0, step).tokens for step in range(2000)]  # resumable
    for tokens, p in views.budgets.items():
        assert abs(draws.count(tokens) / len(draws) - p) < 0.04, (tokens, draws.count(tokens))
    with pytest.raises(KVShotError, match="not a multiple of block_size"):
        train_config("quick", multi_view={"budgets": {100: 1.0}})
    assert MultiView(draft_cache=True).draw(0, 5).draft_cache and not views.draw(0, 5).draft_cache


def test_features_of_a_long_data_set_hold_its_sequences_whole(tmp_path) -> None:
    import json

    from kvshot_vllm.training.pipeline import MAX_LEN, sequence_limit

    (tmp_path / "params.json").write_text(json.dumps({"long_prefix": 4096,
                                                      "max_new_tokens": 128}))
    assert sequence_limit(tmp_path) == 4224
    (tmp_path / "params.json").write_text(json.dumps({"long_prefix": None,
                                                      "max_new_tokens": 256}))
    assert sequence_limit(tmp_path) == MAX_LEN


def test_hard_cross_entropy_leaves_out_the_rows_outside_the_draft_vocabulary() -> None:
    """The hard cross-entropy of bf16 logits is the fp32 one over the rows whose target the
    draft vocabulary holds; the other rows get no gradient, and with none left there is no
    loss."""
    from kvshot_vllm.training.ttt import hard_cross_entropy

    g = torch.Generator().manual_seed(0)
    t2d = torch.full((300,), -1)
    t2d[torch.randperm(300, generator=g)[:256]] = torch.arange(256)  # draft vocab 256
    target = torch.randint(0, 300, (64,), generator=g)
    inside = t2d[target] >= 0
    assert 0 < int(inside.sum()) < 64
    logits = (3 * torch.randn(64, 256, generator=g)).bfloat16()

    ref_logits = logits.float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits[inside], t2d[target][inside])
    ref.backward()
    bf16_logits = logits.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = hard_cross_entropy(bf16_logits, target, t2d)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(bf16_logits.grad, ref_logits.grad.bfloat16())
    assert not bf16_logits.grad[~inside].any()
    assert hard_cross_entropy(logits[~inside], target[~inside], t2d) is None


def test_soft_targets_are_the_targets_distribution_seen_by_the_draft_vocabulary() -> None:
    """Soft cross-entropy is the KL divergence from the target's top-K distribution,
    renormalised over the tokens the draft vocabulary holds, plus that distribution's entropy;
    rows whose top K are all outside the draft vocabulary leave it, and a teacher sure of one
    token gives back the hard cross-entropy."""
    from kvshot_vllm.training.ttt import hard_cross_entropy, soft_cross_entropy

    t2d = torch.tensor([-1, 0, 1, -1, 2, 3, 4, -1, 5, -1])  # target vocab 10, draft vocab 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, generator=g)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 1, 0, 4], [1, 2, 4, 5]])
    teacher = torch.randn(4, 4, generator=g)
    p = torch.zeros(4, 6)
    for r in range(4):
        inside = [k for k in range(4) if t2d[ids[r, k]] >= 0]
        probs = torch.softmax(teacher[r, inside], -1)
        for k, pk in zip(inside, probs):
            p[r, t2d[ids[r, k]]] = pk
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1).mean()
    kl = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), p, reduction="batchmean")
    torch.testing.assert_close(soft_cross_entropy(logits, ids, teacher, t2d), kl + entropy)

    outside = torch.tensor([[0, 3, 7, 9]])  # none in the draft vocabulary
    assert soft_cross_entropy(logits[:1], outside, teacher[:1], t2d) is None
    torch.testing.assert_close(
        soft_cross_entropy(torch.cat([logits, logits[:1]]), torch.cat([ids, outside]),
                           torch.cat([teacher, teacher[:1]]), t2d),
        soft_cross_entropy(logits, ids, teacher, t2d))

    sure = teacher.clone()
    sure[:, 1] = 100.0  # token ids[:, 1], inside the draft vocabulary in every row
    torch.testing.assert_close(soft_cross_entropy(logits, ids, sure, t2d),
                               hard_cross_entropy(logits, ids[:, 1], t2d))


@pytest.mark.parametrize("paradigm", ["hidden", "kv"])
def test_soft_targets_of_a_sure_teacher_give_the_chains_hard_loss(paradigm: str) -> None:
    """Each draft step's soft targets are the teacher's at that step's label position: with a
    teacher whose top token is the label and sure of it, the chain's soft loss is its hard
    loss. A teacher shifted by one position against the labels is not."""
    from kvshot_vllm.training.ttt import ttt_loss

    drafter = tiny_drafter(paradigm)
    feats, labels, trainable, t2d = tiny_batch(drafter)
    others = (labels[..., None] + torch.arange(1, 4)) % TINY.vocab_size
    ids = torch.cat([labels[..., None], others], -1)  # [1, T, 4]
    logits = torch.tensor([60.0, 0.0, -1.0, -2.0]).expand(*labels.shape, 4)
    hard = ttt_loss(drafter, feats, labels, trainable, TrainConfig(steps=1), t2d)[0]
    soft_cfg = TrainConfig(steps=1, soft_targets=4)
    feats.teacher = (ids, logits)
    torch.testing.assert_close(ttt_loss(drafter, feats, labels, trainable, soft_cfg, t2d)[0],
                               hard)
    feats.teacher = (ids.roll(1, dims=1), logits)
    assert (ttt_loss(drafter, feats, labels, trainable, soft_cfg, t2d)[0] - hard).abs() > 0.1
    # K of more: only the top K count (here the label alone, so sure even with a flat teacher)
    feats.teacher = (ids, torch.zeros(*labels.shape, 4))
    torch.testing.assert_close(
        ttt_loss(drafter, feats, labels, trainable, TrainConfig(steps=1, soft_targets=1), t2d)[0],
        hard)


# A step's worth of tensors of a few sizes, allocated, used and freed 20 times; prints the
# minor page faults the loop took. Run in a fresh process per setting (mallopt is per process).
_ALLOCATE_AND_FREE = """
import resource, sys, torch
from kvshot_vllm.allocator import keep_freed_memory, release_freed_memory
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def step():
    tensors = [torch.ones(int(n)) for n in (4e6, 9e6, 1e6, 2.5e6)]
    sum(t.sum() for t in tensors)
applied = keep_freed_memory()
step()  # the first step faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
kept = resident_mib()
release_freed_memory()
print(applied, faults, round(kept - resident_mib()))
"""


def test_kept_memory_goes_back_when_the_machine_runs_short() -> None:
    """Training hands kept memory back at once below 15% of the machine's memory available."""
    from kvshot_vllm.allocator import memory_is_low

    meminfo = "MemTotal:       24683740 kB\nMemFree:  1000 kB\nMemAvailable:   {} kB\n"
    assert memory_is_low(meminfo.format(3_000_000))
    assert not memory_is_low(meminfo.format(4_000_000))
    assert not memory_is_low("MemTotal: 1000 kB\n")  # nothing to judge by


def test_kept_freed_memory_is_not_faulted_in_again() -> None:
    """`keep_freed_memory` (what kvshot train, diagnose, curve and study run first): tensors
    of a training step, freed and allocated again, reuse their pages instead of faulting in
    fresh zeroed ones, as glibc's default mmap of large blocks does;
    KVSHOT_KEEP_FREED_MEMORY=0 leaves the default.
    `release_freed_memory` hands the kept pages back."""
    import os
    import subprocess
    import sys

    def faults(keep: str) -> tuple[str, int, int]:
        out = subprocess.run([sys.executable, "-c", _ALLOCATE_AND_FREE], check=True,
                             capture_output=True, text=True,
                             env={**os.environ, "KVSHOT_KEEP_FREED_MEMORY": keep}).stdout
        applied, count, released_mib = out.split()
        return applied, int(count), int(released_mib)

    (applied, kept, released), (default_applied, default, _) = faults("1"), faults("0")
    assert (applied, default_applied) == ("True", "False")
    # the kept 66 MB go back to the kernel when released (at every training checkpoint)
    assert released > 40, released
    # 66 MB, 16,000 pages a round: about 10,000 of them faulted in again each round by default
    # (glibc raises its mmap threshold past some sizes as they are freed), few once kept
    assert default > 20 * 5_000, default
    assert kept < default / 10, (kept, default)
