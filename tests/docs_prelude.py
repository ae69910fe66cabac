"""The names the documentation's Python examples use without defining them, bound to tiny CPU objects.

`tests/test_docs_examples.py` runs every ```python block of README.md and docs/ in a fresh namespace holding
`namespace(...)`: the placeholders a reader fills in (`x`, `weight`, `model`, `path`, `micro_batches`, ...),
sized so that all examples run in seconds on two CPU cores. `device="cuda"` in an example runs on the CPU where
there is no GPU (`cuda_as_cpu`), so the examples stay what a GPU user pastes.
"""

import contextlib
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
    """Placeholders that cost an import or a file, bound only where the example mentions them."""
    names = {}
    if re.search(r"\bpath\b", code):
        names["path"] = tiny_hf_model_dir(root)
    if "AutoModelForCausalLM" in code:
        from transformers import AutoModelForCausalLM

        names["AutoModelForCausalLM"] = AutoModelForCausalLM
    return names


class cuda_as_cpu(TorchFunctionMode):
    """Tensors and modules asked for on "cuda" land on the CPU (machines without a GPU run the GPU examples)."""

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
    """A tiny Llama saved with save_pretrained (no download): what `from_pretrained(path)` loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    path = f"{root}/tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


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
