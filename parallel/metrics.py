"""Per-step metrics on rank 0: log lines (a tqdm bar on a terminal), metrics.jsonl, summary, plot.

Files in the output dir: `metrics.jsonl` (one JSON object per step), `summary.json` (the final
summary line as JSON) and `loss.png` (loss per step; with --check also the reference run's); with
`train.tensorboard = true` also TensorBoard event files in `tensorboard/`.
"""

import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger("parallel")


def setup_logging(is_main: bool) -> None:
    """INFO lines on rank 0; other ranks only report warnings and errors. shardnorm's own log (e.g. what
    its compile passes fused) goes to the same place."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    for log in (logger, logging.getLogger("shardnorm")):
        log.addHandler(handler)
        log.setLevel(logging.INFO if is_main else logging.WARNING)
        log.propagate = False


def format_step(record: dict) -> str:
    return (f"step {record['step']:>4}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:>10,.0f} tok/s  {record['step_time_s'] * 1e3:8.1f} ms  "
            f"peak {record['peak_mem_gib']:.2f} GiB")


def format_summary(s: dict) -> str:
    keep_output = f" keep_output={s['norm_keep_output']}" if "norm_keep_output" in s else ""  # shardnorm's only
    return (f"summary: norm={s['norm']}{keep_output} engine={s['engine']} "
            f"dp={s['dp']} tp={s['tp']} "
            f"compile={s['compile']} dtype={s['dtype']} | {s['tokens_per_s']:,.0f} tokens/s  "
            f"step {s['step_time_s'] * 1e3:.1f} ms  peak {s['peak_mem_gib']:.2f} GiB "
            f"({s['memory_kind']})  final loss {s['final_loss']:.4f}")


class MetricsLogger:
    """Writes one record per step; does nothing on ranks other than 0."""

    def __init__(self, out_dir: Path, total_steps: int, enabled: bool, tensorboard: bool = False):
        self.out_dir, self.total_steps, self.enabled, self.records = out_dir, total_steps, enabled, []
        self.file = self.bar = self.tensorboard = None
        self.process_start = True  # the next record is this process's first step (a resumed run warms up again)
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"))

    def start(self, first_step: int, saved: list[dict] | None = None) -> None:
        """Write metrics.jsonl from `first_step` on, after `saved`: a resumed run's records of the steps before,
        from its checkpoint."""
        if not self.enabled:
            return
        self._remove_stale_files(resumed=first_step > 1)
        self.records = list(saved or [])
        self.file = (self.out_dir / "metrics.jsonl").open("w")
        for record in self.records:
            self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if sys.stderr.isatty():  # a progress bar on a terminal, log lines otherwise
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_steps, initial=first_step - 1, unit="step",
                            dynamic_ncols=True)

    def _remove_stale_files(self, resumed: bool) -> None:
        """The files of the run that last wrote in out_dir, other than metrics.jsonl (which start() rewrites): its
        summary.json and loss.png would otherwise stand beside this run's records until it finishes, or for good if
        it stops (parallel.compare takes a summary.json for a finished run's). Its checkpoints.jsonl stays only
        when this run resumes, as its lines may be of this run's earlier part."""
        stale = ["summary.json", "loss.png"] + ([] if resumed else ["checkpoints.jsonl"])
        for name in stale:
            (self.out_dir / name).unlink(missing_ok=True)

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.process_start:
            record, self.process_start = {**record, "process_start": True}, False
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard:
            for key in ("loss", "lr", "tokens_per_s", "step_time_s", "peak_mem_gib"):
                self.tensorboard.add_scalar(f"train/{key}", record[key], record["step"])
        if self.bar:
            self.bar.set_postfix_str(format_step(record), refresh=False)
            self.bar.update(1)
        else:
            logger.info(format_step(record))

    def summarize(self, timing_skip: int, extra: dict) -> dict:
        """Throughput and step time over the steps after the first `timing_skip` of each process that ran them (a
        resumed run compiles and warms up again), less a profiled one."""
        timed, warming = [], 0
        for i, record in enumerate(self.records):
            if i == 0 or record.get("process_start"):
                warming = timing_skip
            if warming:
                warming -= 1
            elif not record.get("profiled"):
                timed.append(record)
        timed = timed or self.records
        seconds = sum(r["step_time_s"] for r in timed) or float("nan")
        return {**extra,
                "steps": len(self.records),
                "timed_steps": len(timed),
                "tokens_per_s": sum(r["tokens"] for r in timed) / seconds,
                "step_time_s": seconds / len(timed),
                "peak_mem_gib": max(r["peak_mem_gib"] for r in self.records),
                "final_loss": self.records[-1]["loss"]}

    def finish(self, summary: dict, reference_losses: list[float] | None = None) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()
        self.file.close()
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        curves = {f"{summary['norm']} norms ({summary['engine']})": [r["loss"] for r in self.records]}
        if reference_losses:
            curves["torch norms, single process (--check)"] = reference_losses
        plot_losses(self.out_dir / "loss.png", curves)
        logger.info(format_summary(summary))
        logger.info("wrote %s/{metrics.jsonl,summary.json,loss.png}", self.out_dir)


def plot_losses(path: Path, curves: dict[str, list[float]]) -> None:
    """One line per labelled loss curve, steps numbered from 1."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("%s skipped: matplotlib is not installed (pip install 'shardnorm[train]')",
                       path)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, losses), style in zip(curves.items(), ["-", "--", "-.", ":"] * len(curves)):
        ax.plot(range(1, len(losses) + 1), losses, style, label=label)
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
