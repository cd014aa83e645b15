"""Where `tllm bench serve` writes its figures: the JSON result (every figure and request) and
the PNG plot. Nothing is written unless asked: --save-result (or --result-dir /
--result-filename) names a file in the result directory after the run, as vLLM's
`--save-result` does; --result-file and --plot-file take whole paths."""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

from tllm.bench.serve import BenchRun
from tllm.extras import MissingExtraError, require_extra


def result_name(run: BenchRun, now: float | None = None) -> str:
    """`tllm-serve-<dataset>-<rate>qps[-c<concurrency>]-<model>-<YYYYmmdd-HHMMSS>.json`."""
    config = run.config
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    concurrency = f"-c{config.max_concurrency}" if config.max_concurrency else ""
    model = re.sub(r"[^\w.-]+", "_", Path(run.model.rstrip("/")).name) or "model"
    date = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"tllm-serve-{config.dataset_name}-{rate}qps{concurrency}-{model}-{date}.json"


def output_paths(args, run: BenchRun) -> tuple[Path | None, Path | None]:
    """(the JSON result's path, the PNG's path); None where nothing is to be written."""
    if args.result_file is not None:
        result = Path(args.result_file) if args.result_file else None
    elif args.save_result or args.result_dir or args.result_filename or args.plot:
        result = Path(args.result_dir or ".") / (args.result_filename or result_name(run))
    else:
        result = None
    if args.plot_file is not None:
        plot = Path(args.plot_file) if args.plot_file else None
    else:
        plot = result.with_suffix(".png") if args.plot and result is not None else None
    return result, plot


def write_result(run: BenchRun, summary: dict, path: str | Path) -> None:
    requests = [{"start_s": r.start, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
                 "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                 "itl_s": r.itls, "error": r.error} for r in run.results]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_no_nan({"summary": summary, "requests": requests}), indent=1))
    print(f"wrote {path}", file=sys.stderr)


def write_plot(run: BenchRun, path: str | Path) -> None:
    """The PNG, when matplotlib is installed; otherwise one line saying so."""
    try:
        require_extra("bench", "--plot-file")
    except MissingExtraError as exc:
        print(f"no plot: {exc}", file=sys.stderr)
        return
    from tllm.bench.serve_plot import plot_run
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    plot_run(run, str(path))
    print(f"wrote {path}", file=sys.stderr)


def _no_nan(value):
    """JSON has no NaN or infinity: null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value
