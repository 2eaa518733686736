"""The plugin's own linear layers on a CPU: torch's matmul against the kernels vLLM's CPU build
runs its own layers with (`dispatch_cpu_unquantized_gemm`: oneDNN or sgl, weights prepacked),
which the served drafters now use (`serving/drafter.use_platform_gemm`). Side by side in one
run, for every plugin linear layer of the shipped drafters (vLLM's own fc and lm_head aside), at
the rows of one draft pass: 1 (concurrency 1), k + 1 = 4 (a block drafter's rows), 16
(concurrency 16); in the served dtypes.

    python bench/cpu_gemm.py [--out bench/results/cpu_gemm]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROWS = (1, 4, 16)


def median_us(fn, repeats: int = 7, calls: int = 200) -> float:
    """Median over `repeats` of the mean time of `calls` calls, in microseconds."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def plugin_layers(drafter: Path, target: Path) -> dict[str, torch.Tensor]:
    """name -> weight [out, in] of each plugin linear layer of a shipped drafter (none where
    vLLM's own EAGLE-3 layers serve it)."""
    from kvshot_vllm.models.config import load_drafter_config
    from kvshot_vllm.models.drafter import load_drafter
    from kvshot_vllm.models.parallel import Linear
    from kvshot_vllm.models.registry import KVSHOT_ARCH

    if load_drafter_config(drafter).architecture != KVSHOT_ARCH:
        return {}
    model = load_drafter(drafter, target)
    return {name: m.weight.detach() for name, m in model.named_modules() if isinstance(m, Linear)}


def time_layer(weight: torch.Tensor, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """Per row count: torch's F.linear and the platform kernel, in microseconds per call."""
    from kvshot_vllm.models.parallel import Linear
    from kvshot_vllm.serving.drafter import use_platform_gemm

    linear = Linear(weight.shape[1], weight.shape[0]).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    torch_gemm = linear.gemm
    use_platform_gemm([linear])
    out = {}
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=dtype)
        with torch.no_grad():
            out[rows] = {"torch": median_us(lambda: torch_gemm(x, linear.weight, None)),
                         "platform": median_us(lambda: linear(x))}
    return out


def main() -> None:
    from kvshot_vllm.engine import cpu_has_native_bf16
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", type=Path,
                    default=sorted(Path("drafters/smollm2-135m-instruct").iterdir()))
    ap.add_argument("--out", default="bench/results/cpu_gemm")
    a = ap.parse_args()
    target, _ = prepare_target(resolve_data_dir(), "float32")
    dtypes = [torch.bfloat16, torch.float32] if cpu_has_native_bf16() else [torch.float32]
    shapes: dict[tuple[int, int], list[str]] = {}
    for drafter in a.drafters:
        for name, w in plugin_layers(drafter, target).items():
            shapes.setdefault(tuple(w.shape), []).append(f"{drafter.name}.{name}")
    weights = {shape: torch.randn(shape) / shape[1] ** 0.5 for shape in shapes}
    runs = {str(dt).removeprefix("torch."): {f"{o}x{i}": time_layer(w, dt)
                                              for (o, i), w in weights.items()}
            for dt in dtypes}
    served = sorted({name.split(".")[0] for names in shapes.values() for name in names})
    lines = [f"Plugin linear layers of {', '.join(served)}: torch's matmul "
             "against vLLM's CPU kernels, microseconds per call (median of 7 x 200 calls), "
             f"torch threads {torch.get_num_threads()}.",
             "Regenerate: `python bench/cpu_gemm.py`", "",
             "| dtype | weight [out x in] | rows | torch us | vLLM kernel us | speedup | layers |",
             "|---|---|---|---|---|---|---|"]
    speedups = {dt: [] for dt in runs}
    for dt, layers in runs.items():
        for (o, i) in shapes:
            for rows, t in layers[f"{o}x{i}"].items():
                speedups[dt].append(t["torch"] / t["platform"])
                names = ", ".join(shapes[(o, i)][:3]) + (" ..." if len(shapes[(o, i)]) > 3 else "")
                lines.append(f"| {dt} | {o} x {i} | {rows} | {t['torch']:.1f} | "
                             f"{t['platform']:.1f} | {t['torch'] / t['platform']:.2f}x | {names} |")
    lines += ["", "Median speedup over every layer and row count: " + ", ".join(
        f"{dt} {statistics.median(s):.2f}x" for dt, s in speedups.items())]
    write_results(a.out, {"runs": runs, "layers": {f"{o}x{i}": n for (o, i), n in shapes.items()},
                          "torch_threads": torch.get_num_threads()}, lines)


if __name__ == "__main__":
    main()
