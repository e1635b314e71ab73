"""Bench results as a picture: per-position conditional acceptance per drafter, and tau per prompt category."""
from __future__ import annotations

from pathlib import Path


def plot_acceptance(results: list[dict], path: str | Path) -> Path:
    """results: bench results (`serving.bench.run_bench`), one per prompt set; rows of the same method merge by label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    categories, taus = [], {}
    for result in results:
        for row in result["rows"]:
            if not row["per_position"]:
                continue
            label = f"{row['method']} ({result.get('name', result['num_prompts'])})"
            reached = [p for p in row["per_position"] if p["reached"]]  # unreached positions have no rate
            left.plot([p["position"] for p in reached], [p["conditional"] for p in reached], marker="o", label=label)
            for category, stats in row.get("per_category", {}).items():
                if category not in categories:
                    categories.append(category)
                taus.setdefault(row["method"], {})[category] = stats["tau"]
    left.set(xlabel="draft depth", ylabel="conditional acceptance", ylim=(0, 1.02), title="accepted_i / reached_i")
    left.set_xticks(range(1, 1 + max((len(r["per_position"]) for res in results for r in res["rows"]), default=1)))
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    width = 0.8 / max(len(taus), 1)
    for n, (method, per_category) in enumerate(taus.items()):
        right.bar([i + n * width for i in range(len(categories))], [per_category.get(c, 0) for c in categories],
                  width, label=method)
    right.set_xticks([i + width * (len(taus) - 1) / 2 for i in range(len(categories))], categories, rotation=30, ha="right")
    right.set(ylabel="tau (tokens per verify step)", title="mean acceptance length per category")
    right.axhline(1.0, color="gray", lw=0.8)
    right.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
