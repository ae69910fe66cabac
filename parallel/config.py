"""Training configuration: a TOML file plus `section.key=value` overrides, checked at start-up.

Every key has a typed default below; a config file only lists what it changes. Unknown sections or
keys, wrong types and impossible values raise `ConfigError` naming the key, before any process
group or model exists. `python -m parallel.config CONFIG [overrides] --world-size N` checks a
config without training (launch/train.sh runs it before torchrun) and prints the resolved values.
"""

import argparse
import dataclasses
import difflib
import importlib.util
import json
import os
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from parallel import checkpoint_store

VOCAB_SIZE = 256  # byte-level tokens


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the key."""


@dataclass
class ModelConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 8  # fewer than n_heads: grouped-query attention
    ffn_dim: int = 704  # SwiGLU hidden size
    norm_eps: float = 1e-5
    # false: shardnorm's norms recompute their outputs in backward instead of keeping them (train.norm = shardnorm)
    norm_keep_output: bool = True
    rope_theta: float = 10000.0
    max_seq_len: int = 512
    tie_embeddings: bool = False


@dataclass
class DataConfig:
    path: str = ""  # a text file to train on; empty: the generated corpus (parallel/data.py)
    corpus_bytes: int = 200_000  # size of the generated corpus
    seq_len: int = 128
    batch_size: int = 8  # sequences per micro-batch on each data-parallel rank


@dataclass
class TrainConfig:
    steps: int = 30
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    seed: int = 0
    dtype: str = "float32"  # or "bfloat16": bf16 compute, fp32 params, grads reduced in fp32
    norm: str = "shardnorm"  # or "torch": torch.nn.RMSNorm + torch's SequenceParallel
    compile: bool = False  # torch.compile each transformer block
    check: bool = False  # after training, re-run single-process with torch norms; compare losses
    check_rtol: float = 1e-4  # allowed max relative loss difference for `check`
    timing_skip: int = 2  # first steps left out of the summary's throughput (warm-up, compile)
    profile_step: int = 0  # profile this step's norm-grad all-reduces (count, time); 0: none
    out_dir: str = ""  # empty: runs/<config name>-<engine>-<norm>[-compile][-check]
    tensorboard: bool = False  # also log the metrics to out_dir/tensorboard (needs tensorboard)


@dataclass
class CheckpointConfig:
    dir: str = ""  # where checkpoints go (step-<N>/ each); empty: no checkpoints, no auto-resume
    every: int = 0  # save every this many optimizer steps; 0: only at the end (with at_end)
    keep_last: int = 2  # complete checkpoints kept in `dir` (older ones are deleted); 0: all
    at_end: bool = True  # save after the last step too
    load: str = ""  # resume from this checkpoint (a step-<N> dir, or a dir of them: its latest);
    # empty: the latest complete checkpoint in `dir`, if any


@dataclass
class ParallelConfig:
    engine: str = "fsdp_tp"  # or "deepspeed" (launch/deepspeed.sh sets it)
    dp: int = -1  # data-parallel (FSDP2) degree; -1: world size / tp
    tp: int = 1  # tensor/sequence-parallel degree
    deepspeed_config: str = "configs/deepspeed/zero2.json"
    timeout_s: float = 600.0  # a collective waiting longer than this ends the job with an error


@dataclass
class Config:
    name: str = "config"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def out_dir(self) -> Path:
        if self.train.out_dir:
            return Path(self.train.out_dir)
        # a --check run has a folder of its own: it must not overwrite the plain run's files
        suffix = ("-compile" if self.train.compile else "") + ("-check" if self.train.check else "")
        return Path("runs") / f"{self.name}-{self.parallel.engine}-{self.train.norm}{suffix}"

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(dp, tp) for `world_size` processes; raises ConfigError if they do not multiply to it."""
        tp, dp = self.parallel.tp, self.parallel.dp
        if world_size % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide the world size {world_size}")
        if dp == -1:
            dp = world_size // tp
        if dp * tp != world_size:
            raise ConfigError(f"parallel.dp × parallel.tp = {dp} × {tp} = {dp * tp}, "
                              f"but the world size is {world_size}")
        return dp, tp


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "parallel": ParallelConfig, "checkpoint": CheckpointConfig}
CHOICES = {"train.dtype": ("float32", "bfloat16"), "train.norm": ("shardnorm", "torch"),
           "parallel.engine": ("fsdp_tp", "deepspeed")}


# settings that name a file or directory
PATH_KEYS = ("data.path", "train.out_dir", "checkpoint.dir", "checkpoint.load", "parallel.deepspeed_config")


def _expand_home(cfg: Config) -> None:
    """`~/…` in a path setting is the home directory's: the shell leaves `train.out_dir=~/runs` as it is (not a
    variable assignment), and a TOML string is never expanded; taken literally, it names a directory `~` here."""
    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        table = getattr(cfg, section)
        setattr(table, key, os.path.expanduser(getattr(table, key)))


def parse_override(text: str) -> tuple[str, str, object]:
    """`section.key=value` -> (section, key, value); the value is read as TOML, else a string."""
    dotted, sep, raw = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not (sep and dot and key):
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. train.steps=20")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key.strip(), value


def _typed(key: str, value, expected: type):
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:  # bool is not accepted where an int is expected
        raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__} "
                          f"{value!r}{_toml_hint(value, expected)}")
    return value


def _toml_hint(value, expected: type) -> str:
    """How to write a number or a bool: a value TOML does not read as one (`.001`, `True`) arrives as a string."""
    if type(value) is not str:
        return ""
    if expected is bool:
        return ": write true or false"
    return ": write a TOML number (0.001, 1e-3, 20)" if expected in (int, float) else ""


def _meant(section: str, key: str) -> str:
    """The key a misspelled or misplaced one most likely is: the same key in another section, else a close one."""
    elsewhere = [f"{name}.{key}" for name, cls in SECTIONS.items()
                 if name != section and key in {f.name for f in dataclasses.fields(cls)}]
    close = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(SECTIONS[section])], n=1)
    meant = elsewhere[:1] or [f"{section}.{name}" for name in close]
    return f" (did you mean {meant[0]}?)" if meant else ""


def _section(name: str, cls, table: dict):
    if not isinstance(table, dict):
        raise ConfigError(f"{name}: expected a [{name}] table, got {table!r}")
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in types:
            raise ConfigError(f"{name}.{key}: unknown key{_meant(name, key)}; [{name}] has {', '.join(types)}")
        values[key] = _typed(f"{name}.{key}", value, types[key])
    return cls(**values)


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


def _write_error(directory: Path) -> str | None:
    """Why nothing can be created in `directory`, or None. A directory made and removed there, not os.access: that
    says yes to root whatever the permission bits, and to anyone for /proc or a read-only mount's directories, where
    the job's first write then fails."""
    try:
        tempfile.TemporaryDirectory(dir=directory).cleanup()
    except OSError as e:
        return e.strerror or str(e)
    return None


def _check_directory(key: str, path: Path) -> None:
    """`path` is a directory the job can write in, or one it can create (the job makes it, parents included)."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    _check(existing.is_dir(), key, f"{path} is a file, not a directory: name a directory (created if missing)"
           if existing == path else f"{path} cannot be created: {existing} is a file; name a directory")
    error = _write_error(existing)
    _check(error is None, key, f"{existing} is not writable (creating a directory in it fails: {error}): name a "
           "directory you can write")


def _check_deepspeed_json(path: str) -> None:
    """The DeepSpeed config is a JSON object (its "shardnorm" section is checked where shardnorm reads it: the
    engine, parallel/engines.py)."""
    key = "parallel.deepspeed_config"
    _check(Path(path).is_file(), key, f"{path} is not a file")
    try:
        config = json.loads(Path(path).read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{key}: {path} is not valid JSON: {e}") from None
    _check(isinstance(config, dict), key, f"{path} holds {type(config).__name__}, not a JSON object of settings")


def validate(cfg: Config) -> None:
    """Value checks that do not depend on the world size."""
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        _check(value in allowed, dotted, f"{value!r} is not one of {', '.join(allowed)}")
    m, d, t, p = cfg.model, cfg.data, cfg.train, cfg.parallel
    for key, value in [("model.dim", m.dim), ("model.n_layers", m.n_layers),
                       ("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                       ("model.ffn_dim", m.ffn_dim), ("data.seq_len", d.seq_len),
                       ("data.batch_size", d.batch_size), ("train.steps", t.steps),
                       ("train.grad_accum", t.grad_accum), ("parallel.tp", p.tp)]:
        _check(value > 0, key, f"must be positive, got {value}")
    _check(m.dim % m.n_heads == 0, "model.dim", f"{m.dim} is not a multiple of model.n_heads "
           f"({m.n_heads})")
    _check((m.dim // m.n_heads) % 2 == 0, "model.dim", "head size dim / n_heads must be even (RoPE)")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
           f"{m.n_kv_heads} does not divide model.n_heads ({m.n_heads})")
    _check(d.seq_len <= m.max_seq_len, "data.seq_len", f"{d.seq_len} exceeds model.max_seq_len "
           f"({m.max_seq_len})")
    _check(p.dp == -1 or p.dp > 0, "parallel.dp", f"must be positive or -1, got {p.dp}")
    for key, value in [("model.n_kv_heads", m.n_kv_heads), ("model.ffn_dim", m.ffn_dim),
                       ("data.seq_len", d.seq_len)]:
        _check(value % p.tp == 0, key, f"{value} is not divisible by parallel.tp ({p.tp})")
    _check(VOCAB_SIZE % p.tp == 0, "parallel.tp", f"{p.tp} does not divide the byte vocabulary "
           f"({VOCAB_SIZE})")
    _check(p.engine != "deepspeed" or p.tp == 1, "parallel.tp",
           "must be 1 with parallel.engine = deepspeed (DeepSpeed runs data parallel only here)")
    _check(p.engine != "deepspeed" or not t.compile, "train.compile",
           "the DeepSpeed engine does not compile the model here (--compile runs with parallel.engine = "
           "fsdp_tp: launch/train.sh)")
    if p.engine == "deepspeed":
        _check_deepspeed_json(p.deepspeed_config)
    _check(not d.path or Path(d.path).is_file(), "data.path", f"{d.path} is not a file")
    # a window is seq_len + 1 tokens (the targets are the inputs one token on) at a random offset: the corpus needs more
    window = d.seq_len + 1
    if d.path:
        size = Path(d.path).stat().st_size
        _check(size > window, "data.path", f"{d.path} has {size} bytes, too few for windows of data.seq_len + 1 = "
               f"{window} tokens: use a text of more than {window} bytes or lower data.seq_len")
    else:
        _check(d.corpus_bytes > window, "data.corpus_bytes", f"{d.corpus_bytes} bytes are too few for windows of "
               f"data.seq_len + 1 = {window} tokens: set data.corpus_bytes above {window} or lower data.seq_len")
    for key, value in [("train.lr", t.lr), ("train.warmup_steps", t.warmup_steps),
                       ("train.weight_decay", t.weight_decay), ("train.adam_eps", t.adam_eps),
                       ("train.max_grad_norm", t.max_grad_norm), ("train.check_rtol", t.check_rtol),
                       ("train.timing_skip", t.timing_skip), ("model.norm_eps", m.norm_eps)]:
        _check(value >= 0, key, f"must not be negative, got {value}")
    _check(0 <= t.seed < 2**64, "train.seed", f"must be from 0 to 2**64 - 1 (torch's seeds), got {t.seed}")
    _check(0 <= t.profile_step <= t.steps, "train.profile_step",
           f"must be 0 (off) or a step number up to train.steps ({t.steps}), got {t.profile_step}")
    _check(p.timeout_s > 0, "parallel.timeout_s", f"must be positive, got {p.timeout_s}")
    _check(m.norm_keep_output or t.norm == "shardnorm", "model.norm_keep_output",
           f"false needs train.norm = shardnorm (torch's norms keep their outputs), got train.norm = {t.norm}")
    c = cfg.checkpoint
    for key, value in [("checkpoint.dir", c.dir), ("train.out_dir", str(cfg.out_dir))]:
        if value:
            _check_directory(key, Path(value))
    for key, value in [("checkpoint.every", c.every), ("checkpoint.keep_last", c.keep_last)]:
        _check(value >= 0, key, f"must not be negative, got {value}")
    _check(not c.every or c.dir, "checkpoint.dir",
           "is empty, so checkpoint.every has nowhere to save: set checkpoint.dir=DIR")
    _check(c.every or c.at_end or not c.dir, "checkpoint.at_end",
           "false with checkpoint.every = 0 saves no checkpoint to checkpoint.dir: set checkpoint.every=N to save "
           "every N steps, or checkpoint.load=PATH (without checkpoint.dir) to resume without saving")
    if c.load:  # an explicit checkpoint that cannot be read is an error, never a fresh start
        try:
            checkpoint_store.resolve(c.load)
        except checkpoint_store.CheckpointError as e:
            raise ConfigError(f"checkpoint.load: {e}") from None
    _check(not t.tensorboard or importlib.util.find_spec("tensorboard") is not None,
           "train.tensorboard", "needs the tensorboard package (pip install 'shardnorm[train]')")
    _check(t.timing_skip < t.steps, "train.timing_skip",
           f"{t.timing_skip} leaves no timed step out of train.steps ({t.steps})")


def _read_tables(path: Path) -> dict:
    """The TOML file's tables; ConfigError naming the file for one that cannot be read as TOML."""
    fix = "name a TOML file, e.g. configs/tiny_cpu.toml"
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        order = " (the config file comes first: CONFIG [section.key=value ...])" if "=" in path.name else ""
        raise ConfigError(f"config file {path} does not exist{order}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory: {fix}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not a UTF-8 text file: {fix}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror}): {fix}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a TOML config, apply `section.key=value` overrides, validate; raise ConfigError."""
    path = Path(path)
    tables = _read_tables(path)
    for text in overrides:
        section, key, value = parse_override(text)
        tables.setdefault(section, {})[key] = value
    unknown = set(tables) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section; known: {', '.join(SECTIONS)}")
    cfg = Config(name=path.stem, **{name: _section(name, cls, tables.get(name, {}))
                                    for name, cls in SECTIONS.items()})
    _expand_home(cfg)
    validate(cfg)
    return cfg


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The training command line: CONFIG [section.key=value ...] [--norm N] [--check] [--compile]."""
    parser = argparse.ArgumentParser(
        prog="parallel.train", description=__doc__.split("\n")[0],
        epilog="Overrides: section.key=value, values in TOML syntax (train.lr=1e-3, "
               "train.compile=true, data.path=\"corpus.txt\"); bare words are strings.")
    parser.add_argument("config", help="TOML file, e.g. configs/tiny_cpu.toml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="optional overrides of the config's values, e.g. train.steps=20")
    parser.add_argument("--norm", choices=CHOICES["train.norm"], help="same as train.norm=…")
    parser.add_argument("--check", action="store_true", help="same as train.check=true")
    parser.add_argument("--compile", action="store_true", help="same as train.compile=true")
    parser.add_argument("--world-size", type=int, help="check the mesh against this world size")
    args = parser.parse_intermixed_args(argv)
    flags = ([f"train.norm={args.norm}"] if args.norm else []) + \
            (["train.check=true"] if args.check else []) + \
            (["train.compile=true"] if args.compile else [])
    cfg = load(args.config, args.overrides + flags)
    if args.world_size:
        cfg.mesh_shape(args.world_size)
    return cfg, args


def main() -> None:
    try:
        cfg, _ = parse_args()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)  # as the job's (parallel/train.py)
    for name in SECTIONS:
        print(f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in vars(getattr(cfg, name)).items()),
              sep="\n", end="\n\n")


if __name__ == "__main__":
    main()
