"""lm_eval.jsonl, where eval_tasks (in the loop) and evaluate_lm.py (on an export) write their scores keyed by step, and
its plot beside loss.png."""
import json

LM_EVAL_FILE, LM_EVAL_PLOT_FILE = "lm_eval.jsonl", "lm_eval.png"  # eval_tasks' and evaluate_lm.py's scores


def plot_lm_eval(results_path, png_path):
    """loss.png's companion: each lm-eval metric against the step, one panel per metric, the in-loop scores
    (source 'pipeline') as a line and the export's (evaluate_lm.py) as markers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    names = sorted({key for record in records for key in record if key.startswith("lm_eval/")})
    if not names:
        return
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.5 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for source, style in (("pipeline", "o-"), ("hf_export", "x")):
            points = sorted((r["step"], r[name]) for r in records if r.get("source") == source and name in r)
            if points:
                ax.plot(*zip(*points), style, label=source)
        ax.set_title(name, fontsize=9)
        if "perplexity" in name:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
