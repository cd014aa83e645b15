"""CPU: TTFT/TPOT percentiles of disaggregated serving (front -> context + generation
servers) vs one aggregated server, with `tllm bench serve` at a fixed request rate, median of
`--runs` short runs each. All servers are processes of this machine; on a small shared CPU
the two engines compete for the same cores, so read it as the overhead of the extra hop and
the KV transfer, not as a speed-up.

    python benchmarks/cpu_disagg.py [--model dummy:smollm2-135m] [--rate 2] [--runs 3]"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.disagg.conftest import disagg_specs, start_servers  # noqa: E402
from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app  # noqa: E402
from tllm.serve.testing import ServerThread  # noqa: E402

FLAGS = ("--max-seq-len", "1024", "--kv-cache-tokens", "16384", "--dtype", "float32")


def bench(url: str, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "tllm.cli", "bench", "serve", "--base-url", url,
                    "--isl", str(args.isl), "--osl", str(args.osl), "--num-prompts",
                    str(args.num_prompts), "--request-rate", str(args.rate), "--result-file",
                    str(out), "--plot-file", str(out.with_suffix(".png"))],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:smollm2-135m")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    context, generation, aggregated = start_servers(
        *disagg_specs(args.model, *FLAGS), (args.model, *FLAGS))
    results: dict[str, list[dict]] = {"aggregated": [], "disaggregated": []}
    config = DisaggFrontConfig(context_servers={"urls": [context.url]},
                               generation_servers={"urls": [generation.url]})
    try:
        with ServerThread(build_front_app(DisaggFront(config))) as front, \
                tempfile.TemporaryDirectory() as tmp:
            for run in range(args.runs):    # interleaved, so drift in load hits both alike
                results["aggregated"].append(bench(aggregated.url, args, Path(tmp, f"a{run}.json")))
                results["disaggregated"].append(bench(front.base_url, args,
                                                      Path(tmp, f"d{run}.json")))
    finally:
        for server in (context, generation, aggregated):
            server.stop()
    keys = [k for k in results["aggregated"][0]
            if ("ttft" in k or "tpot" in k) and not k.startswith("std")]
    print(f"\n{args.model}, ISL {args.isl}, OSL {args.osl}, {args.rate} req/s, "
          f"{args.num_prompts} prompts, median of {args.runs} runs (ms)")
    print(f"{'metric':>16} {'aggregated':>11} {'disaggregated':>14}")
    for key in keys:
        row = [statistics.median(r[key] for r in results[kind])
               for kind in ("aggregated", "disaggregated")]
        print(f"{key:>16} {row[0]:11.1f} {row[1]:14.1f}")
    Path("cpu_disagg.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
