"""What the harnesses share: the stack a result belongs to and the command that made it, bandwidth against a copy,
the float64 check, the order in which variants take turns and the statistics of their pairs, and the files they
write (JSON, markdown tables, plots)."""

import datetime
import importlib.metadata
import json
import os
import random
import re
import shlex
import statistics
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


# --- where a result belongs and how it was made

def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that reruns this harness: `python -m MODULE ARGS`, under torchrun where it launched us."""
    argv = sys.argv[1:] if argv is None else argv
    launcher = (["torchrun", "--nproc-per-node", os.environ.get("WORLD_SIZE", "1")]
                if "TORCHELASTIC_RUN_ID" in os.environ else ["python"])
    return shlex.join([*launcher, "-m", module, *argv])


def version(dist: str) -> str | None:
    """An installed distribution's version from its metadata (nothing imported), None where it is missing."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_name(device_name: str) -> str:
    """A GPU's short name for the results folder: "NVIDIA H100 80GB HBM3" -> "h100"."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device_name)
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "", device_name.lower().replace("nvidia", ""))


def require_cuda(parser, what: str) -> None:
    """Refuse, through `parser`'s usage error, a run that measures GPU kernels on a machine without CUDA."""
    if not torch.cuda.is_available():
        parser.error(f"{what} needs a CUDA GPU; this torch ({torch.__version__}) sees none")


def stack(device: str, count: int = 1) -> str:
    """The results folder of this hardware and software: `<gpu>[x<count>]-torch<ver>-triton<ver>` (major.minor)."""
    hardware = gpu_name(torch.cuda.get_device_name()) if device == "cuda" else "cpu"
    short = lambda v: ".".join(v.split("+")[0].split(".")[:2])  # noqa: E731
    triton = version("triton")
    return (f"{hardware}{f'x{count}' if count > 1 else ''}-torch{short(torch.__version__)}"
            + (f"-triton{short(triton)}" if triton else ""))


def environment(device: str, count: int = 1) -> dict:
    """What a result's JSON records about where it ran."""
    return {"stack": stack(device, count), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "devices": count, "torch": torch.__version__, "triton": version("triton"),
            "date": datetime.date.today().isoformat()}


# --- bandwidth and correctness

def copy_gbs() -> float:
    """GB/s of a 1 GiB device-to-device copy: the ceiling a memory-bound kernel is read against."""
    from triton.testing import do_bench

    src = torch.randn(512 * 2**20, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def gbs(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """|x - ref| / |ref| in float64 (Frobenius norms): how far a result is from its reference."""
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm()).item()


# --- taking turns, and the statistics of pairs

def turns(items: list, round_: int) -> list:
    """Round `round_`'s order: `items` rotated by one more each round, so that neither a slow stretch of the machine
    nor going first falls on one of them (A, B then B, A for two)."""
    k = round_ % len(items)
    return list(items[k:]) + list(items[:k])


def median_range(values: list[float]) -> dict:
    """Median, min and max of per-pair ratios (or differences): what one pair alone cannot say, its spread."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else \
        {"median": float("nan"), "min": float("nan"), "max": float("nan")}


def bootstrap_interval(values: list[float], confidence: float = 0.95, resamples: int = 5000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of `values` (fixed seed, so a table re-renders the same)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


# --- files

def write_json(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def pyplot():
    """matplotlib's pyplot on the file backend, or None where matplotlib is not installed (the plot is skipped)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """A plot as a PNG of 64 colours (Pillow comes with matplotlib): line plots look the same at a quarter of the
    bytes, which keeps results/ small."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
