"""Training and diagnostics on the real embedded target: features against transformers' own
cache, the oracle offline, loss going down, checkpoints round-tripping and resuming after a
kill, bad checkpoints refused, and a trained checkpoint served losslessly by vLLM."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.drafter import load_drafter
from kvshot_vllm.models.files import target_spec
from kvshot_vllm.models.oracle import build_oracle
from kvshot_vllm.training.diagnostics import (acceptance_length, simulated_vllm_counters,
                                              stepwise_acceptance, training_stats)
from kvshot_vllm.training.features import (FeatureSet, FeatureSpec, bytes_per_token, check_room,
                                           extract_features)
from kvshot_vllm.training.pipeline import drafter_config, feature_spec, features_for
from kvshot_vllm.training.ttt import Trainer, TrainConfig, ttt_loss, warm_start
from tests.conftest import KVSHOT, assert_one_line_error, run_kvshot

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def dataset(target_fp32: Path, tmp_path_factory) -> Path:
    """8 ShareGPT prompts (6 train, 2 held out) with greedy responses from the target (HF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvshot_vllm.data import PrepareArgs, SourceStats, packaged_sharegpt, first_turn_prompts

    tok = AutoTokenizer.from_pretrained(target_fp32)
    model = AutoModelForCausalLM.from_pretrained(target_fp32, dtype=torch.float32)
    sel = first_turn_prompts(packaged_sharegpt(), tok,
                             PrepareArgs(num_prompts=6, num_heldout=2, max_prompt_tokens=120),
                             SourceStats())
    out = tmp_path_factory.mktemp("dataset")
    for split, items in sel.items():
        with (out / f"{split}.jsonl").open("w") as f:
            for s in items:
                gen = model.generate(torch.tensor([s.prompt_token_ids]), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
                f.write(json.dumps({"id": s.id, "prompt_token_ids": s.prompt_token_ids,
                                    "response_token_ids": gen[0, len(s.prompt_token_ids):]
                                    .tolist()}) + "\n")
    return out


@pytest.fixture(scope="module")
def train_features(data_dir, target_fp32, dataset) -> FeatureSet:
    return features_for(data_dir, target_fp32, dataset, "train", feature_spec(target_fp32))


def test_features_equal_what_the_target_caches(target_fp32, dataset, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    spec = FeatureSpec(aux_layers=(2, 15, 27), kv_layers=(0, 14, 29), dtype="float32",
                       teacher_topk=8)
    fs = FeatureSet(extract_features(target_fp32, dataset, "heldout", tmp_path, spec))
    assert fs.path.name.endswith("-top8")
    item = fs.item(1)
    model = AutoModelForCausalLM.from_pretrained(target_fp32, dtype=torch.float32)
    with torch.no_grad():
        out = model(item["input_ids"][None].long(), use_cache=True, output_hidden_states=True)
    # extraction runs padded batches (`EXTRACT_BATCH_TOKENS`), this one sequence alone: the
    # matmuls block differently, so fp32 values agree to rounding and a near-tie may flip
    close = dict(rtol=1e-3, atol=1e-4)
    for layer in spec.kv_layers:
        cache = out.past_key_values.layers[layer]
        torch.testing.assert_close(item[f"k.{layer}"], cache.keys[0].transpose(0, 1), **close)
        torch.testing.assert_close(item[f"v.{layer}"], cache.values[0].transpose(0, 1), **close)
    torch.testing.assert_close(item["aux"][:, 576:1152], out.hidden_states[15][0], **close)
    assert (item["labels"] == out.logits[0].argmax(-1).int()).float().mean() > 0.99
    top = out.logits[0].topk(8)
    assert (item["teacher_ids"] == top.indices.int()).float().mean() > 0.99
    torch.testing.assert_close(item["teacher_logits"].sort(-1).values,
                               top.values.sort(-1).values, **close)
    # what the disk check before an extraction counts: the shards' bytes, less their headers,
    # offsets and prompt lengths
    manifest = json.loads((fs.path / "manifest.json").read_text())
    overhead = manifest["bytes"] - bytes_per_token(spec, target_spec(target_fp32)) * fs.num_tokens
    assert 0 <= overhead < 4096 * manifest["shards"], overhead
    with pytest.raises(KVShotError, match="--features live"):
        check_room(tmp_path, shutil.disk_usage(tmp_path).free + 10**12)


def test_batched_extraction_equals_one_sequence_at_a_time(target_fp32, dataset) -> None:
    """`forward_sequences` in padded batches gives each sequence its own features, in its own
    order and length, as one forward per sequence does (fp32: up to matmul blocking)."""
    from kvshot_vllm.training.features import forward_sequences, load_target, sequences

    spec = FeatureSpec(aux_layers=(2, 15, 27), kv_layers=(0, 29), dtype="float32")
    seqs = [ids for _, ids, _ in sequences(dataset, "train", spec.max_len)]
    seqs = [seqs[0][:70], *seqs[1:]]  # lengths that differ: padding within a batch
    model = load_target(target_fp32, spec, "cpu")
    alone = forward_sequences(model, seqs, spec)
    lengths = sorted(map(len, seqs))
    assert 2 * lengths[1] <= 256 < len(seqs) * lengths[-1]  # batches of several, and several
    batched = forward_sequences(model, seqs, spec, batch_tokens=256)
    assert len(batched) == len(seqs)
    labels_equal = total = 0
    for ids, a, b in zip(seqs, alone, batched):
        assert a.keys() == b.keys() and a["aux"].shape == b["aux"].shape == (len(ids), 3 * 576)
        assert b["k.29"].shape == (len(ids), 3, 64)
        for name in a:
            if name != "labels":
                torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-3)
        labels_equal += int((a["labels"] == b["labels"]).sum())
        total += len(ids)
    assert labels_equal / total > 0.99


def test_extraction_links_the_shards_another_data_set_holds(target_fp32, dataset,
                                                             tmp_path) -> None:
    """A grown data set's extraction links every shard whose sequences another finished
    extraction of the same settings holds, token for token, and computes the rest."""
    import os

    spec = FeatureSpec(aux_layers=(2,), kv_layers=(0,), dtype="float32", shard_size=2)
    root = tmp_path / "features"
    small = FeatureSet(extract_features(target_fp32, dataset, "train", root / "small", spec))
    grown = tmp_path / "grown"
    grown.mkdir()
    records = [json.loads(line) for line in (dataset / "train.jsonl").open()]
    records[4]["response_token_ids"][0] += 1  # same id, other tokens: not the same shard
    (grown / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = extract_features(target_fp32, grown, "train", root / "grown", spec)
    same = [os.path.samefile(out / f"shard-{i:05d}.safetensors",
                             small.path / f"shard-{i:05d}.safetensors") for i in range(3)]
    assert same == [True, True, False]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["last_run"]["linked_sequences"] == 4
    assert manifest["last_run"]["extracted_tokens"] == sum(
        len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in records[4:])
    assert FeatureSet(out).item(4)["input_ids"][len(records[4]["prompt_token_ids"])] == \
        records[4]["response_token_ids"][0]


def test_live_features_equal_cached_ones(target_fp32, dataset, train_features,
                                        tmp_path) -> None:
    """Features computed as batches ask (`--features live`, a GPU's default) are the cached
    ones: the same batch from one padded forward as from one forward per sequence, the same
    draft vocabulary, and a live run trains, ships and counts its tokens like a cached one."""
    from kvshot_vllm.training.features import LiveFeatures, open_features
    from kvshot_vllm.training.ttt import draft_vocabulary

    spec = FeatureSpec(**{k: v for k, v in train_features.params.items()
                          if k in ("max_len", "dtype", "shard_size", "forward_dtype")},
                       aux_layers=tuple(train_features.aux_layers),
                       kv_layers=tuple(train_features.kv_layers))
    # A data directory of its own: a live directory claims its data set's path, which is
    # another temporary one in every pytest session.
    live_data = tmp_path / "data"
    live = features_for(live_data, target_fp32, dataset, "train", spec, live=True)
    assert isinstance(live, LiveFeatures) and len(live) == len(train_features) == 6
    assert isinstance(open_features(live.path), LiveFeatures)
    assert isinstance(open_features(train_features.path), FeatureSet)
    n = len(live)
    assert [live.length(i) for i in range(n)] == [train_features.length(i) for i in range(n)]
    assert [live.prompt_length(i) for i in range(n)] == [train_features.prompt_length(i)
                                                          for i in range(n)]
    batch = [3, 0, 5]  # of different lengths: right padding
    (lf, ll, lt), (cf, cl, ct) = (f.batch(batch, list(spec.kv_layers), True)
                                  for f in (live, train_features))
    assert torch.equal(lf.input_ids, cf.input_ids) and torch.equal(lt, ct)
    # live labels where a draft step reads them (trainable), none elsewhere; a padded batch
    # may flip a rare fp32 near-tie
    assert (ll[lt] == cl[lt]).float().mean() > 0.99 and not ll[~lt].any()
    # The two fp32 forwards differ in matmul blocking (one padded batch against one sequence
    # at a time; oneDNN blocks by row count, differently on AMX and AVX-512 CPUs), so a value
    # may round to the neighbouring stored bf16: one unit in the last place, 2^-7 of it at
    # most (an Intel AMX CPU flips about 1 in 15,000 of them).
    assert spec.dtype == "bfloat16"
    close = dict(atol=2e-2, rtol=2**-7)
    torch.testing.assert_close(lf.aux_hidden, cf.aux_hidden, **close)
    for layer in spec.kv_layers:
        for a, b in zip(lf.target_kv[layer], cf.target_kv[layer]):
            torch.testing.assert_close(a, b, **close)
    assert torch.equal(draft_vocabulary(live, 512, 49152),
                       draft_vocabulary(train_features, 512, 49152))

    run = tmp_path / "live-run"
    proc = run_kvshot("train", "--paradigm", "kv", "--steps", "2", "--batch-size", "2",
                      "--features", "live", "--target", str(target_fp32), "--dataset",
                      str(dataset), "--data-dir", str(live_data), "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "run.json").read_text())["features"] == str(live.path.resolve())
    proc = run_kvshot("ship", str(run), "--name", "kv", "--out", str(tmp_path / "kv"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    assert manifest["data"]["sequences"] == 6 and manifest["budget"]["loss_tokens"] > 0
    # A warm start brings its draft vocabulary, so none is chosen from the data: with live
    # features that would be a target forward over the whole set. The target is not loaded.
    unread = open_features(live.path)
    warm = _trainer(tmp_path / "live-warm", target_fp32, unread, "kv", init=run / "checkpoint")
    assert unread._model is None
    shipped = load_drafter(run / "checkpoint", target_fp32)
    assert torch.equal(warm.drafter.d2t, shipped.d2t)
    # A larger one grows it by the data set's response tokens: still no target forward.
    size = 2 * len(shipped.d2t)
    grown = _trainer(tmp_path / "live-grown", target_fp32, unread, "kv", steps=1,
                     init=run / "checkpoint", draft_vocab_size=size)
    assert unread._model is None and len(grown.drafter.d2t) == size
    kept = grown.drafter.draft_ids()[shipped.target_ids(torch.arange(len(shipped.d2t)))]
    assert (kept >= 0).all()
    torch.testing.assert_close(grown.drafter.lm_head.weight[kept], shipped.lm_head.weight)
    # and a killed grown run resumes with the vocabulary its state saved
    grown.train(progress=False)
    resumed = _trainer(tmp_path / "live-grown", target_fp32, unread, "kv", steps=1,
                       init=run / "checkpoint", draft_vocab_size=size)
    assert resumed.step == 1 and torch.equal(resumed.drafter.d2t, grown.drafter.d2t)


def test_oracle_is_accepted_offline(data_dir, target_fp32, dataset, tmp_path) -> None:
    """The oracle (the target's own layers over its cached K/V) through the training-side
    KV-only drafter: the chain math, positions and features agree with the target."""
    features = features_for(data_dir, target_fp32, dataset, "heldout",
                            feature_spec(target_fp32, kv_layers=list(range(30))))
    oracle = load_drafter(build_oracle(target_fp32, tmp_path / "oracle"), target_fp32)
    result = stepwise_acceptance(oracle.eval(), features, steps=4, progress=False)
    assert min(result["alive"]) > 50, result
    # fp32 near-ties between the target's logits and the oracle's recomputation (another
    # summation order) may flip a rare argmax; a wrong read or position costs far more.
    assert min(result["a"]) >= 0.97, result
    # served as vLLM counts, nearly every proposal accepts all k drafts (a response's last one
    # may have fewer labels left to match)
    served = simulated_vllm_counters(oracle, features, 2)
    assert served["num_drafts"] >= 20 and acceptance_length(served) >= 2.8, served


def _trainer(run_dir, target, features, paradigm, steps=12, snapshot_every=None, init=None,
             soft_targets=0, **options) -> Trainer:
    cfg = TrainConfig(steps=steps, batch_size=2, lr=3e-3, warmup=2, draft_vocab_size=2048,
                      checkpoint_every=4, log_every=2, ttt_steps=4,
                      snapshot_every=snapshot_every, soft_targets=soft_targets)
    dcfg = drafter_config(target, cfg, init, paradigm=paradigm, **options)
    return Trainer(run_dir, dcfg, cfg, target, features, init=init)


def _loss(trainer: Trainer, features: FeatureSet) -> float:
    feats, labels, trainable = features.batch(list(range(len(features))),
                                              trainer.drafter.cfg.kv_layers,
                                              trainer.drafter.cfg.uses_aux_hidden)
    with torch.no_grad():
        return float(ttt_loss(trainer.drafter, feats, labels, trainable, trainer.cfg,
                              trainer.t2d)[0])


@pytest.mark.parametrize("paradigm", ["hidden", "kv"])
def test_training_reduces_loss(paradigm, target_fp32, train_features, tmp_path) -> None:
    trainer = _trainer(tmp_path / paradigm, target_fp32, train_features, paradigm)
    before = _loss(trainer, train_features)
    trainer.train(progress=False)
    after = _loss(trainer, train_features)
    assert after < 0.8 * before, (before, after)
    log = [json.loads(line) for line in (tmp_path / paradigm / "metrics.jsonl").open()]
    assert [r["step"] for r in log] == [2, 4, 6, 8, 10, 12]
    assert log[-1]["grad_rms"]["cross.kv" if paradigm == "kv" else "self.kv"] > 0


def test_soft_targets_train_from_features_that_hold_them(data_dir, target_fp32, dataset,
                                                        train_features, tmp_path) -> None:
    """`--soft-targets K` extracts features with the target's top K and trains against them;
    the loss goes down as with hard targets. Features without them are refused by name."""
    with pytest.raises(KVShotError, match="soft targets over the top 16 tokens need features"):
        _trainer(tmp_path / "refused", target_fp32, train_features, "hidden", soft_targets=16)
    run = tmp_path / "cli"
    proc = run_kvshot("train", "--paradigm", "hidden", "--steps", "2", "--batch-size", "2",
                      "--soft-targets", "16", "--target", str(target_fp32), "--dataset",
                      str(dataset), "--data-dir", str(data_dir), "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = json.loads((run / "run.json").read_text())
    assert recorded["train"]["soft_targets"] == 16
    features = FeatureSet(Path(recorded["features"]))
    assert features.path.name.endswith("-top16") and features.params["teacher_topk"] == 16

    trainer = _trainer(tmp_path / "soft", target_fp32, features, "hidden", soft_targets=16)
    before = _loss(trainer, features)
    trainer.train(progress=False)
    after = _loss(trainer, features)
    assert after < 0.8 * before, (before, after)


def test_learning_curve_of_snapshots(data_dir, target_fp32, dataset, train_features,
                                     tmp_path) -> None:
    """Snapshots every 4 steps of a 12-step run over 6 sequences in batches of 2 (4 epochs):
    the curve has their rows, counts the tokens trained so far, and its last point is the
    run's final checkpoint."""
    from kvshot_vllm.training.curve import learning_curve

    run_dir = tmp_path / "curve-run"
    ckpt = _trainer(run_dir, target_fp32, train_features, "kv", snapshot_every=4).train(
        progress=False)
    heldout = features_for(data_dir, target_fp32, dataset, "heldout", feature_spec(target_fp32))
    rows = learning_curve(run_dir, target_fp32, heldout, steps=4, progress=False)
    assert [r["step"] for r in rows] == [4, 8, 12]
    # each snapshot's acceptance is kept as it is measured, and a rerun reuses it (a marked
    # copy shows it was read back), for the same held-out features and chain length only
    kept = run_dir / "curve-points" / "step-000004.json"
    assert sorted(p.name for p in (run_dir / "curve-points").iterdir()) == [
        "step-000004.json", "step-000008.json", "step-000012.json"]
    original = kept.read_text()
    marked = json.loads(original)
    marked["acceptance"]["mat"] = -1.0
    kept.write_text(json.dumps(marked))
    assert learning_curve(run_dir, target_fp32, heldout, steps=4, progress=False)[0]["mat"] == -1
    shorter = learning_curve(run_dir, target_fp32, heldout, steps=3, progress=False)
    assert shorter[0]["mat"] > 1 and len(shorter[0]["a"]) == 3
    kept.write_text(original)
    # diagnose under sparse views: one that holds every held-out sequence changes nothing
    from kvshot_vllm.models.budget import KVBudget
    from kvshot_vllm.training.diagnostics import diagnose

    longest = max(heldout.length(i) for i in range(len(heldout)))
    whole, small = KVBudget(tokens=32 * (longest // 32 + 3), block_size=32), KVBudget(
        tokens=48, block_size=16)
    viewed = diagnose({"kv": ckpt}, target_fp32, heldout, steps=4, progress=False,
                      views=[whole, small], served_k=2)
    assert list(viewed) == ["kv", f"kv@{whole.tokens}", "kv@48"]
    assert viewed[f"kv@{whole.tokens}"]["a"] == viewed["kv"]["a"] == rows[-1]["a"]
    served = viewed["kv"]["served"]
    assert served["k"] == 2 and viewed[f"kv@{whole.tokens}"]["served"] == served
    # a proposal gives at most k + 1 tokens of each response, whose first is the prefill's
    assert served["num_drafts"] >= sum(heldout.length(i) - heldout.prompt_length(i) - 1
                                       for i in range(len(heldout))) / 3
    assert viewed["kv@48"]["view"]["tokens"] == 48
    n = len(train_features)
    per_epoch = sum(train_features.length(i) - train_features.prompt_length(i) for i in range(n))
    assert rows[-1]["loss_tokens"] == 4 * per_epoch and rows[-1]["epochs"] == pytest.approx(4)
    assert rows[0]["tokens"] < rows[1]["tokens"] < rows[2]["tokens"]
    final = load_file(ckpt / "model.safetensors")
    last = load_file(Path(rows[-1]["checkpoint"]) / "model.safetensors")
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    direct = stepwise_acceptance(load_drafter(ckpt, target_fp32).eval(), heldout, 4,
                                 progress=False)
    assert rows[-1]["a"] == direct["a"] and rows[-1]["alive"] == direct["alive"]
    assert all(r["alive"][0] > 0 and 1.0 <= r["mat"] <= 5.0 for r in rows)

    proc = run_kvshot("curve", str(run_dir), "--data-dir", str(data_dir), "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (run_dir / "curve.md").read_text()
    assert sum(line.startswith("| ") and line[2].isdigit() for line in report.splitlines()) == 3
    assert (run_dir / "curve.png").stat().st_size > 10_000
    assert_one_line_error(run_kvshot("curve", str(tmp_path)), "no training run at")

    # A warm start counts what its checkpoint was trained on: 8 + 4 steps of 2 over 6
    # sequences are 4 epochs, as many as the 12-step run's.
    warm_dir = tmp_path / "warm-run"
    _trainer(warm_dir, target_fp32, train_features, "kv", steps=4, snapshot_every=4,
             init=run_dir / "snapshots" / "step-000008").train(progress=False)
    (warm,) = learning_curve(warm_dir, target_fp32, heldout, steps=4, progress=False)
    assert warm["epochs"] == pytest.approx(4)
    assert rows[1]["loss_tokens"] < warm["loss_tokens"] < rows[1]["loss_tokens"] + 2 * per_epoch
    # ... as recorded when the warm run started: its init's run may be gone since
    (run_dir / "run.json").rename(tmp_path / "first-run.json")
    assert learning_curve(warm_dir, target_fp32, heldout, steps=4, progress=False) == [warm]
    (tmp_path / "first-run.json").rename(run_dir / "run.json")
    outside = tmp_path / "outside"
    shutil.copytree(run_dir / "snapshots" / "step-000004", outside)
    _trainer(tmp_path / "warm-outside", target_fp32, train_features, "kv", steps=4,
             snapshot_every=4, init=outside).train(progress=False)
    with pytest.raises(KVShotError, match="not a kvshot run's checkpoint"):
        learning_curve(tmp_path / "warm-outside", target_fp32, heldout, steps=4, progress=False)


def test_hybrid_checkpoint_round_trips_and_warm_starts(target_fp32, train_features,
                                                       tmp_path) -> None:
    trainer = _trainer(tmp_path / "hybrid", target_fp32, train_features, "hybrid", steps=2)
    ckpt = trainer.train(progress=False)
    loaded = load_drafter(ckpt, target_fp32)
    feats, _, _ = train_features.batch([0, 1], loaded.cfg.kv_layers, True)
    with torch.no_grad():
        for a, b in zip(trainer.drafter.chain(feats, 3), loaded.chain(feats, 3)):
            assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, trainer.drafter.d2t) and loaded.d2t.abs().sum() > 0
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["KVShotLlamaEagle3"]

    # warm start of a hybrid from it: every EAGLE-3 weight kept, the cross branch fresh
    fresh = _trainer(tmp_path / "warm", target_fp32, train_features, "hybrid", steps=2,
                     gate_init=0.1)
    left = warm_start(fresh.drafter, ckpt)
    assert left == []  # a hybrid checkpoint fills a hybrid entirely
    saved = load_file(ckpt / "model.safetensors")
    assert torch.equal(fresh.drafter.layers[0].self_attn.q_proj.weight,
                       saved["layers.0.self_attn.q_proj.weight"])


BAD = {
    "hidden size": (lambda c: c["kvshot"]["target"].update(hidden_size=960),
                    "hidden_size: drafter was trained for 960, target has 576"),
    "vocabulary": (lambda c: c["kvshot"]["target"].update(vocab_size=32000),
                   "vocab_size: drafter was trained for 32000, target has 49152"),
    "layer count": (lambda c: c["kvshot"]["target"].update(num_layers=40),
                    "num_layers: drafter was trained for 40, target has 30"),
    "sampled layer": (lambda c: c["kvshot"].update(kv_layers=[3, 30]),
                      "kv_layers [30] out of range for a target with 30 layers"),
}


def test_bad_checkpoints_fail_at_load(data_dir, target_fp32, dataset, train_features,
                                      tmp_path) -> None:
    import shutil

    good = _trainer(tmp_path / "kv", target_fp32, train_features, "kv", steps=1).train(
        progress=False)
    for case, (edit, message) in BAD.items():
        bad = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, bad)
        cfg = json.loads((bad / "config.json").read_text())
        edit(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(KVShotError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_drafter(bad, target_fp32)
    proc = run_kvshot("diagnose", str(tmp_path / "hidden-size"), "--target", str(target_fp32),
                      "--dataset", str(dataset), "--out", str(tmp_path / "report"),
                      "--data-dir", str(data_dir))
    assert_one_line_error(proc, BAD["hidden size"][1])


def test_shipped_drafter_carries_provenance_and_refuses_bad_files(data_dir, target_fp32,
                                                                  dataset, tmp_path) -> None:
    """`kvshot train` then `kvshot ship`: bf16 weights equal to the run's, a manifest naming the
    command, data, budget and seed, and a load that names the file that no longer matches."""
    import shutil

    run = tmp_path / "run"
    proc = run_kvshot("train", "--paradigm", "hidden", "--steps", "2", "--batch-size", "2",
                      "--target", str(target_fp32), "--dataset", str(dataset),
                      "--data-dir", str(data_dir), "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    shipped = tmp_path / "drafters" / "hidden"
    proc = run_kvshot("ship", str(run), "--name", "hidden", "--out", str(shipped))
    assert proc.returncode == 0, proc.stderr[-2000:]

    manifest = json.loads((shipped / "manifest.json").read_text())
    assert manifest["command"].startswith("kvshot train --paradigm hidden --steps 2")
    assert manifest["budget"]["steps"] == 2 and manifest["seed"] == 0
    assert manifest["budget"]["tokens"] > manifest["budget"]["loss_tokens"] > 0
    assert manifest["data"]["dataset"] == dataset.name and manifest["data"]["sequences"] == 6
    assert sorted(manifest["files"]) == ["config.json", "metrics.jsonl", "model.safetensors"]
    # diagnose reads the shipped drafter's own training log: the run's statistics
    assert training_stats(shipped) == training_stats(run / "checkpoint")
    assert training_stats(shipped)["steps"] == 2
    ours, theirs = (load_file(d / "model.safetensors") for d in (shipped, run / "checkpoint"))
    assert ours.keys() == theirs.keys()
    for name, w in ours.items():
        assert w.dtype == (torch.long if name == "d2t" else torch.bfloat16), name
        assert torch.equal(w, theirs[name].to(w.dtype)), name
    load_drafter(shipped, target_fp32)

    for broken, damage in (("flipped", lambda p: p.write_bytes(_flip_last_byte(p))),
                           ("missing", lambda p: p.unlink())):
        bad = tmp_path / broken
        shutil.copytree(shipped, bad)
        damage(bad / "model.safetensors")
        message = "does not match its checksum" if broken == "flipped" else "is missing"
        with pytest.raises(KVShotError, match=f"{bad / 'model.safetensors'} {message}"):
            load_drafter(bad, target_fp32)
    proc = run_kvshot("ship", str(tmp_path / "no-run"), "--name", "x",
                      "--out", str(tmp_path / "x"))
    assert_one_line_error(proc, "no training run at")
    # a warm start keeps its vocabulary, whatever the preset's: the manifest says the drafter's
    warm = tmp_path / "warm"
    proc = run_kvshot("train", "--paradigm", "hidden", "--preset", "full", "--steps", "1",
                      "--batch-size", "2", "--init", str(run / "checkpoint"), "--target",
                      str(target_fp32), "--dataset", str(dataset), "--data-dir", str(data_dir),
                      "--out", str(warm))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_kvshot("ship", str(warm), "--name", "warm", "--out", str(tmp_path / "warm-ship"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    warm_manifest = json.loads((tmp_path / "warm-ship" / "manifest.json").read_text())
    assert warm_manifest["budget"]["draft_vocab_size"] == json.loads(
        (run / "checkpoint" / "config.json").read_text())["draft_vocab_size"] != 8192


def test_training_on_a_mix_of_data_sets_records_each(data_dir, target_fp32, dataset,
                                                     tmp_path) -> None:
    """`kvshot train --dataset A B --mix 1 1`: half the steps from each set, whose features
    run.json lists with the weights, and a shipped manifest that counts each set's steps and
    the tokens of both."""
    other = tmp_path / "other"
    other.mkdir()
    lines = (dataset / "train.jsonl").read_text().splitlines(keepends=True)
    (other / "train.jsonl").write_text("".join(lines[:4]))
    shutil.copy(dataset / "heldout.jsonl", other / "heldout.jsonl")
    run = tmp_path / "run"
    common = ["--paradigm", "hidden", "--steps", "4", "--batch-size", "2", "--target",
              str(target_fp32), "--data-dir", str(data_dir), "--out", str(run), "--dataset",
              str(dataset), str(other)]
    assert_one_line_error(run_kvshot("train", *common, "--mix", "1"),
                          "--mix takes one weight per --dataset: 2 data sets, 1 weights")
    proc = run_kvshot("train", *common, "--mix", "1", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = json.loads((run / "run.json").read_text())
    assert recorded["mix"] == [1.0, 1.0] and len(recorded["features"]) == 2
    parts = [FeatureSet(Path(p)) for p in recorded["features"]]
    assert [len(p) for p in parts] == [6, 4]
    proc = run_kvshot("ship", str(run), "--name", "mixed", "--out", str(tmp_path / "mixed"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "mixed" / "manifest.json").read_text())
    sets = manifest["data"]["mix"]
    assert [(s["dataset"], s["sequences"], s["steps"]) for s in sets] == [
        (dataset.name, 6, 2), ("other", 4, 2)]
    # each set's two batches of two are four of its sequences (6 // 2 batches an epoch)
    assert manifest["budget"]["loss_tokens"] == 8 * NEW_TOKENS


def _flip_last_byte(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    return bytes(data)


def _train_cmd(data_dir, target, dataset, out) -> list[str]:
    return [*KVSHOT, "train", "--paradigm", "hybrid", "--preset", "quick", "--steps", "8",
            "--batch-size", "2", "--checkpoint-every", "2", "--target", str(target), "--dataset", str(dataset),
            "--data-dir", str(data_dir), "--out", str(out)]


@pytest.mark.slow
def test_training_resumes_after_kill_with_nothing_lost(data_dir, target_fp32, dataset,
                                                       train_features, tmp_path) -> None:
    """SIGKILL once a checkpoint exists, rerun: the weights equal an uninterrupted run's."""
    whole = subprocess.run(_train_cmd(data_dir, target_fp32, dataset, tmp_path / "whole"),
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    cut = tmp_path / "cut"
    proc = subprocess.Popen(_train_cmd(data_dir, target_fp32, dataset, cut),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (cut / "state.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = torch.load(cut / "state.pt", weights_only=True)["step"]
    assert step < 8, "the kill came too late to test resumption"
    resumed = subprocess.run(_train_cmd(data_dir, target_fp32, dataset, cut),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = load_file(tmp_path / "whole" / "checkpoint" / "model.safetensors")
    b = load_file(cut / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").open()]
    assert steps == sorted(set(steps)) and steps[-1] == 8


@pytest.mark.slow
def test_trained_checkpoints_serve_losslessly(data_dir, target_fp32, dataset, train_features,
                                              tmp_path) -> None:
    """Trained checkpoints with a reduced draft vocabulary (d2t): the hybrid through the plugin,
    the hidden-only one through stock vLLM with the plugin disabled; greedy outputs equal
    generation without speculation."""
    import openai

    from kvshot_vllm.server import VLLMServer, free_port, serve_command
    from tests.test_plugin import NON_PADDED, generate, spec

    prompts = [json.loads(line)["prompt_token_ids"]
               for split in ("train", "heldout") for line in (dataset / f"{split}.jsonl").open()]
    hybrid = _trainer(tmp_path / "hybrid", target_fp32, train_features, "hybrid", steps=4).train(
        progress=False)
    hidden = _trainer(tmp_path / "hidden", target_fp32, train_features, "hidden", steps=4).train(
        progress=False)
    baseline, _, _ = generate(target_fp32, data_dir, prompts)
    served, counters, _ = generate(target_fp32, data_dir, prompts, spec(hybrid, 3, **NON_PADDED))
    assert served == baseline
    assert counters["num_drafts"] > 0

    port = free_port()
    cmd = serve_command(target_fp32, port, spec(hidden, 3), dtype="float32", max_model_len=512,
                        served_model_name="t")
    with VLLMServer(cmd, port, tmp_path / "stock.log", data_dir,
                    env={"VLLM_PLUGINS": "none-kvshot-disabled"}) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        for prompt, expected in zip(prompts, baseline):
            out = client.completions.create(model="t", prompt=prompt, max_tokens=len(expected),
                                            temperature=0, extra_body={"ignore_eos": True,
                                                                       "return_token_ids": True})
            assert out.choices[0].token_ids == expected
    # ... and that environment really is stock vLLM: it does not know the KV-reuse drafters
    cmd = serve_command(target_fp32, free_port(), spec(hybrid, 3, **NON_PADDED),
                        dtype="float32", max_model_len=512)
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={
        **VLLMServer(cmd, 0, tmp_path / "x.log", data_dir).env,
        "VLLM_PLUGINS": "none-kvshot-disabled"})
    assert refused.returncode != 0 and "KVShotLlamaEagle3" in refused.stdout + refused.stderr
