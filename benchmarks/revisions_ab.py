"""`engine_throughput.py` from two git revisions of this repo, alternately, in one run.

A change that should not change speed (a refactor) is checked by running the same benchmark from
a worktree of the revision before it and from the working tree, one after the other, `--rounds`
times (each round starts with the other revision than the last), and comparing within each round:
the median over rounds of new / old tokens per second at each concurrency. Each run is its own
process importing its own tree's `tandem` (`PYTHONPATH`), on the same model and threads.

    python benchmarks/revisions_ab.py --before 978d07c --rounds 3   # -> benchmarks/results/revisions_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import cpu, log, write_result

REPO = Path(__file__).resolve().parent.parent


def worktree(revision: str, root: Path) -> Path:
    """A detached worktree of `revision` under `root` (removed by `git worktree prune` later)."""
    path = root / f"rev-{revision}"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=REPO, check=True)
    return path


def run_once(tree: Path, concurrency: list[int], output: Path, extra: list[str]) -> dict[int, float]:
    """Generated tokens per second at each concurrency, `tree`'s engine with its defaults."""
    command = [
        sys.executable, str(tree / "benchmarks" / "engine_throughput.py"),
        "--concurrency", *map(str, concurrency), "--skip-hf", "--skip-llama-cpp", "--skip-no-spec",
        "--output", str(output), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run(command, cwd=tree, env=env, check=True)
    rows = json.loads(output.read_text())["results"]
    return {int(row["concurrency"]): float(row["tandem"]["tokens_per_s"]) for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="the revision to compare the working tree with")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-arg", action="append", default=[], help="passed to engine_throughput.py")
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "revisions_ab.json"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-ab-") as tmp:
        root = Path(tmp)
        trees = {"before": worktree(args.before, root), "after": REPO}
        runs: dict[str, list[dict[int, float]]] = {"before": [], "after": []}
        try:
            for index in range(args.rounds):
                order = ["before", "after"] if index % 2 == 0 else ["after", "before"]
                for name in order:
                    result = run_once(
                        trees[name], args.concurrency, root / f"{name}-{index}.json", args.engine_arg
                    )
                    runs[name].append(result)
                    log(
                        f"round {index + 1} {name}: "
                        + ", ".join(f"{n}: {v:.1f} tok/s" for n, v in result.items())
                    )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(trees["before"])], cwd=REPO, check=False
            )
    rows = []
    for n in args.concurrency:
        ratios = [a[n] / b[n] for a, b in zip(runs["after"], runs["before"], strict=True)]
        rows.append(
            {
                "concurrency": n,
                "before_tokens_per_s": [r[n] for r in runs["before"]],
                "after_tokens_per_s": [r[n] for r in runs["after"]],
                "after_over_before_rounds": ratios,
                "after_over_before": statistics.median(ratios),
            }
        )
        log(f"concurrency {n}: after / before {statistics.median(ratios):.3f} (rounds {ratios})")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    write_result(
        args.output,
        {
            "benchmark": "revisions_ab",
            "before": args.before,
            "after": head.stdout.strip() + " (working tree)",
            "rounds": args.rounds,
            "cpu": cpu(),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
