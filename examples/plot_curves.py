"""Loss curves of several examples/train_gpt.py runs in one PNG, and how far apart they are.

    python examples/plot_curves.py runs/train-torch.json runs/train-fastkern.json --out runs/loss.png \
        --bundle runs/curves.json

Prints, for each run after the first, the largest relative gap to the first run's loss at its
logged steps (every --log-every steps of the runs; the issue's bar: within 2% at every one).
An input is a train-*.json of train_gpt.py or a bundle ({"runs": [...]}) that --bundle wrote.
"""
import argparse
import json
import os


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="train-*.json files written by train_gpt.py --out-dir")
    p.add_argument("--out", default="loss.png")
    p.add_argument("--bundle", help="also write the runs as one JSON here")
    args = p.parse_args()
    runs = []
    for path in args.runs:
        data = json.load(open(path))
        runs += data["runs"] if "runs" in data else [data]
    if args.bundle:
        with open(args.bundle, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    first = runs[0]
    every = first["args"]["log_every"]

    def label(run):
        a = run["args"]
        return f"{a['kernels']}{' + compile' if a['compile'] else ''}" + (
            f" {a['dist']} x{run.get('world', 1)}" if a["dist"] != "none" else "")

    for run in runs[1:]:
        steps = range(0, min(len(first["losses"]), len(run["losses"])), every)
        gap = max(abs(run["losses"][s] - first["losses"][s]) / first["losses"][s] for s in steps)
        print(f"{label(run)} vs {label(first)}: largest gap {100 * gap:.2f}% over {len(steps)} logged steps")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot(range(len(run["losses"])), run["losses"], label=f"{label(run)}: {run['tokens_per_s'] / 1e3:.0f}k tok/s")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(f"GPT ({first['params'] / 1e6:.0f}M params) on stdlib bytes, {first['device']}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
