"""The names the documentation's Python examples use without defining them, bound to tiny CPU objects.

`tests/test_docs_examples.py` runs every ```python block of README.md and docs/ in a fresh namespace holding
`namespace(...)`: the placeholders a reader fills in (`x`, `weight`, `model`, `path`, `micro_batches`, ...),
sized so that all examples run in seconds on two CPU cores. `device="cuda"` in an example runs on the CPU where
there is no GPU (`cuda_as_cpu`), so the examples stay what a GPU user pastes.
"""

import contextlib
import os
import re
import types

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

HIDDEN, SEQ, ROWS, WIDE = 16, 4, 2, 4096


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.wo(torch.tanh(self.wq(x)))


class Block(nn.Module):
    """A pre-norm block with the attribute names the docs' plans use (`attn_norm`, `attn.wq`, `attn.wo`)."""

    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(HIDDEN)
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(self.attn_norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.out(self.norm(x))


def lazy_names(code: str, root: str) -> dict:
    """Placeholders that cost an import or a file, bound only where the example mentions them:
    `path` (a tiny Qwen3 checkpoint), `trainer` (a Trainer on it, where the example uses one it did not
    build) and, where the example calls `model(**batch)`, `micro_batches` of token dicts."""
    names = {}
    if uses_path(code):
        names["path"] = tiny_hf_model_dir(root)
    if "AutoModelForCausalLM" in code:
        from transformers import AutoModelForCausalLM

        names["AutoModelForCausalLM"] = AutoModelForCausalLM
    if re.search(r"\btrainer\b", _without_comments(code)) and not re.search(r"\btrainer\s*=", code):
        names["trainer"] = tiny_trainer(root)
    if "**batch" in code:
        data = Tokens()
        names["micro_batches"] = [torch.utils.data.default_collate([data[i], data[i + 1]]) for i in (0, 2)]
    return names


def uses_path(code: str) -> bool:
    return re.search(r"\bpath\b", _without_comments(code)) is not None


def _without_comments(code: str) -> str:
    return re.sub(r"#.*", "", code)


class cuda_as_cpu(TorchFunctionMode):
    """Tensors and modules asked for on "cuda" land on the CPU (machines without a GPU run the GPU examples),
    and so do device meshes (`init_device_mesh("cuda", ...)`: a CPU mesh over the gloo group)."""

    def __enter__(self):
        import torch.distributed.device_mesh as device_mesh

        self._init_device_mesh = init_device_mesh = device_mesh.init_device_mesh
        device_mesh.init_device_mesh = lambda device_type, *args, **kwargs: init_device_mesh(
            "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed.device_mesh as device_mesh

        device_mesh.init_device_mesh = self._init_device_mesh
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.cuda, torch.Tensor.cuda.__get__) or getattr(func, "__name__", "") == "cuda":
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


def tiny_hf_model_dir(root: str) -> str:
    """A tiny Qwen3 (per-head q/k norms, which `tp_plan` shards) saved with save_pretrained (no download): what
    `from_pretrained(path)` loads. Written once per `root`."""
    path = f"{root}/tiny-qwen3"
    if os.path.exists(f"{path}/config.json"):
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def tiny_trainer(root: str):
    """A Trainer on the tiny checkpoint, one step, for the examples that take `trainer` as given."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=f"{root}/trainer", max_steps=1, per_device_train_batch_size=2,
                             report_to=[])
    return Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir(root)), args=args,
                   train_dataset=Tokens())


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def namespace(root: str, seed: int) -> dict:
    """The placeholders, fresh for one example."""
    torch.manual_seed(seed)
    model = Model()
    x = torch.randn(ROWS, WIDE, dtype=torch.bfloat16)
    import shardnorm

    return {
        "torch": torch, "nn": nn, "contextlib": contextlib, "shardnorm": shardnorm,
        "x": x, "r": torch.randn_like(x), "residual": torch.randn_like(x),
        "weight": torch.randn(WIDE), "bias": torch.randn(WIDE),
        "model": model, "block": model.layers[0], "Block": Block, "MyBlock": Block,
        "micro_batches": [torch.randn(ROWS, SEQ, HIDDEN) for _ in range(2)],
        "loss_fn": lambda y, target=None: y.square().mean(),
        "loss": lambda y: y.square().mean(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "clip_and_step": lambda: None,
        "out": f"{root}/out", "data": Tokens(),
        "steps": range(1), "scheduler": types.SimpleNamespace(state_dict=dict),
    }
