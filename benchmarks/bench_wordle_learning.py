"""Does the Wordle demo learn? `make demo`'s asynchronous run over several seeds: the reward's first- and
last-quarter means with their standard errors, and a smoothed curve per seed (a benchmark, run by hand).

    python benchmarks/bench_wordle_learning.py [--seeds 0 1 2] [--steps 80] [--out bench-out/learning] [-- DEMO ARGS]

Each seed is one full `python -m examples.wordle.run_demo` (its own warm-up, vLLM, agent, trainer); arguments after
``--`` go to it (e.g. ``--learning-rate 3e-4``). The standard error of a quarter's mean is over the seeds' means
(n = seeds), so it includes the run-to-run spread, not only the step-to-step noise. The rise is the last quarter's
mean minus the first's, per seed; the demo learns when its mean is above zero by more than twice its standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing moving average."""
    return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error (0 for one value)."""
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def quarters(rewards: list[float]) -> tuple[float, float]:
    q = max(1, len(rewards) // 4)
    return statistics.fmean(rewards[:q]), statistics.fmean(rewards[-q:])


def run_seed(seed: int, steps: int, out: Path, extra: list[str]) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "examples.wordle.run_demo", "--out", str(out), "--seed", str(seed)]
    cmd += ["--steps", str(steps), *extra]
    print(f"[learning] seed {seed}: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (out.parent / f"seed{seed}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({done.returncode}); see {out.parent / f'seed{seed}.log'}")
    rows: list[dict[str, Any]] = json.loads((out / "report.json").read_text())["steps"]
    return rows


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=10, help="moving-average window of the plotted curve")
    parser.add_argument("--out", type=Path, default=Path("bench-out/learning"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[int, list[float]] = {}
    drops: dict[int, int] = {}
    for seed in args.seeds:
        rows = run_seed(seed, args.steps, args.out / f"seed{seed}", extra)
        curves[seed] = [r["reward"] for r in rows]
        drops[seed] = rows[-1]["dropped_total"] if rows else 0
        first, last = quarters(curves[seed])
        print(f"[learning] seed {seed}: first quarter {first:.3f}, last quarter {last:.3f}, dropped {drops[seed]}")
    firsts, lasts = zip(*(quarters(c) for c in curves.values()), strict=True)
    rises = [b - a for a, b in zip(firsts, lasts, strict=True)]
    (f_m, f_se), (l_m, l_se), (r_m, r_se) = mean_se(list(firsts)), mean_se(list(lasts)), mean_se(rises)
    print(f"\nWordle demo, {len(curves)} seeds x {args.steps} steps, demo args {extra or '(defaults)'}:")
    print(f"  reward, first quarter  {f_m:.3f} +- {f_se:.3f} (SE over seeds)")
    print(f"  reward, last quarter   {l_m:.3f} +- {l_se:.3f}")
    print(f"  rise                   {r_m:+.3f} +- {r_se:.3f}  ({'learns' if r_m > 2 * r_se else 'not beyond noise'})")
    print(f"  dropped groups per run {statistics.fmean(drops.values()):.1f}")
    summary = {"seeds": args.seeds, "steps": args.steps, "demo_args": extra, "curves": curves, "dropped": drops}
    summary |= {"first": [f_m, f_se], "last": [l_m, l_se], "rise": [r_m, r_se]}
    (args.out / "learning.json").write_text(json.dumps(summary, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for seed, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), smooth(curve, args.window), alpha=0.5, label=f"seed {seed}")
    n = min(map(len, curves.values()))
    mean = [statistics.fmean(c[i] for c in curves.values()) for i in range(n)]
    ax.plot(range(1, n + 1), smooth(mean, args.window), color="black", linewidth=2, label="mean over seeds")
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean reward ({args.window}-step moving average)")
    ax.set_title("Wordle GRPO with deltasync, asynchronous (K=2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "learning.png", dpi=90)
    print(f"  plot: {args.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
