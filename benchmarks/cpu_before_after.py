"""The same `tllm bench` command on two source trees of tllm, alternating, N times each, on
this machine: the before/after comparison of a change that must not slow the engine down.

    python benchmarks/cpu_before_after.py --before /tmp/before --after . --repeats 3

Each run is `python -m tllm.cli bench ...` with the tree as its working directory (so that
tree's `tllm` is imported); the table gives the median of each figure and every run's value."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMMANDS = {
    "latency": ["bench", "latency", "--batch-size", "1", "--isl", "128", "--osl", "64",
                "--iterations", "3", "--warmup", "1"],
    "throughput": ["bench", "throughput", "--isl", "128", "--osl", "64",
                   "--num-requests", "32", "--warmup", "2"],
}
FIGURES = {"latency": ("output_tokens_per_s", "latency_s"),
           "throughput": ("output_tokens_per_s", "requests_per_s")}


def run(tree: Path, name: str, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "tllm.cli", *COMMANDS[name], *extra, "--json", out.name]
        subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def figure(result: dict, key: str) -> float:
    """A figure from the bench JSON (top level or under "results")."""
    for scope in (result, result.get("results", {}), result.get("summary", {})):
        if isinstance(scope, dict) and key in scope:
            value = scope[key]
            return value["median"] if isinstance(value, dict) else value
    raise KeyError(f"{key} not in {sorted(result)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra", default="", help="more bench flags, e.g. '--model X'")
    parser.add_argument("--only", choices=sorted(COMMANDS), help="one benchmark of the two")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    names = [args.only] if args.only else list(COMMANDS)
    runs: dict = {(n, t): [] for n in names for t in trees}
    for i in range(args.repeats):
        for name in names:
            for label, tree in (trees.items() if i % 2 == 0 else reversed(trees.items())):
                runs[name, label].append(run(tree, name, args.extra.split()))
                print(f"repeat {i + 1} {name} {label}: "
                      f"{figure(runs[name, label][-1], FIGURES[name][0]):.2f} tok/s",
                      file=sys.stderr, flush=True)
    print("| benchmark | figure | before (median) | after (median) | after/before | runs "
          "before | runs after |\n|---|---|---:|---:|---:|---|---|")
    for name in names:
        for key in FIGURES[name]:
            values = {t: [figure(r, key) for r in runs[name, t]] for t in trees}
            med = {t: statistics.median(v) for t, v in values.items()}
            print(f"| {name} | {key} | {med['before']:.3f} | {med['after']:.3f} | "
                  f"{med['after'] / med['before']:.3f} | "
                  f"{', '.join(f'{v:.2f}' for v in values['before'])} | "
                  f"{', '.join(f'{v:.2f}' for v in values['after'])} |")


if __name__ == "__main__":
    main()
