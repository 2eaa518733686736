"""The target's attention in a verify step on the CPU: k + 1 query rows per request, as vLLM
hands them to its CPU kernel, against the same rows split into one-row requests.

A verify step attends k + 1 rows per request over the request's whole prefix, and at long
prefixes vLLM's CPU kernel takes far longer for it than for a decode row (docs/long-context.md,
the long-context runs). This measures where that goes: the kernel's time for one and for k + 1 rows
per request, as vLLM passes them, and for the same rows handed over as one-row requests. Row r
of a request with R rows and S keys attends keys [0, S - R + r], exactly what a one-row request
of S - R + r + 1 keys attends through the same block table (`rows_as_requests`), and the kernel
schedules such requests as decode rows, splitting a long key range over threads. Side by side in
one run, on the target's heads and vLLM's default CPU block size, per prefix length, rows per
request, concurrency and thread count: the kernel's time per call (median) both ways, and the
largest difference between their outputs.

    python bench/verify_attention.py [--threads N ...] [--out bench/results/verify_attention]
"""

from __future__ import annotations

import argparse

import torch

from cpu_gemm import median_us

PREFIXES = (512, 1024, 4096, 7168)
ROWS = (1, 4)  # a decode step; a verify step at k = 3
LEVELS = (1, 8)


def rows_as_requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every query row as a request of its own: row r of a request of R rows over S keys
    attends keys [0, S - R + r], what a one-row request of S - R + r + 1 keys attends through
    the same block table. query_start_loc [n + 1], seq_lens [n], block_table [n, W] -> the
    same for the T = query_start_loc[-1] one-row requests."""
    rows = (query_start_loc[1:] - query_start_loc[:-1]).long()
    request = torch.repeat_interleave(torch.arange(rows.shape[0]), rows)
    row = torch.arange(request.shape[0]) - (torch.cumsum(rows, 0) - rows)[request]
    keys = seq_lens[request].long() - rows[request] + 1 + row
    starts = torch.arange(request.shape[0] + 1, dtype=query_start_loc.dtype)
    return starts, keys.to(seq_lens.dtype), block_table[request]


def main() -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvshot_vllm.engine import default_dtype
    from kvshot_vllm.models.files import target_spec
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch threads (vLLM's CPU worker runs on the cores it does not "
                    "reserve: one of two)")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    ap.add_argument("--out", default="bench/results/verify_attention")
    a = ap.parse_args()
    spec = target_spec(prepare_target(resolve_data_dir(), "float32")[0])
    dtype = torch.float32 if default_dtype() == "float32" else torch.bfloat16
    heads, kv_heads, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    bs = a.block_size
    isa = _get_attn_isa(dtype, bs, d)
    blocks_per_request = -(-(max(PREFIXES) + max(ROWS)) // bs)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(max(LEVELS) * blocks_per_request, kv_heads, bs, 2 * d, generator=gen
                        ).to(dtype)
    key_cache, value_cache = cache.view(cache.shape[0], kv_heads, 2 * bs, d).chunk(2, dim=2)

    def attend(query, query_start_loc, seq_lens, block_table):
        out = torch.empty_like(query)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=d**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        return out

    runs = []
    for threads in a.threads:
        torch.set_num_threads(threads)
        for prefix in PREFIXES:
            for rows in ROWS:
                for n in LEVELS:
                    query = torch.randn(n * rows, heads, d, generator=gen).to(dtype)
                    qsl = torch.arange(n + 1, dtype=torch.int32) * rows
                    seq_lens = torch.full((n,), prefix + rows, dtype=torch.int32)
                    table = torch.arange(n * blocks_per_request, dtype=torch.int32).view(n, -1)
                    split = rows_as_requests(qsl, seq_lens, table)
                    as_vllm = median_us(lambda: attend(query, qsl, seq_lens, table), calls=20) / 1e3
                    as_rows = median_us(lambda: attend(query, *split), calls=20) / 1e3
                    diff = (attend(query, qsl, seq_lens, table).float()
                            - attend(query, *split).float()).abs().max().item()
                    runs.append({"threads": threads, "prefix": prefix, "rows": rows,
                                 "requests": n, "vllm_ms": as_vllm, "split_ms": as_rows,
                                 "max_abs_diff": diff})
    lines = [f"The target's attention ({heads} query / {kv_heads} KV heads of {d}, "
             f"{str(dtype).removeprefix('torch.')}, block size {bs}, ISA {isa}) in vLLM's CPU "
             f"kernel: a step's rows per request as vLLM passes them, against the same rows as "
             f"one-row requests (`rows_as_requests`). Milliseconds per call, median "
             f"of 7 x 20 calls; max |diff| between the two outputs.",
             "Regenerate: `python bench/verify_attention.py`", "",
             "| torch threads | prefix | rows per request | requests | as vLLM ms | one-row "
             "requests ms | speedup | max abs diff |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['prefix']} | {r['rows']} | {r['requests']} | "
              f"{r['vllm_ms']:.3f} | {r['split_ms']:.3f} | {r['vllm_ms'] / r['split_ms']:.2f}x | "
              f"{r['max_abs_diff']:.2e} |" for r in runs]
    write_results(a.out, {"runs": runs, "dtype": str(dtype), "block_size": bs, "isa": isa},
                  lines)


if __name__ == "__main__":
    main()
