"""Byte-level training data: a text file or a generated English-like corpus, cut into random windows.

The generated corpus needs no download and is the same on every machine for a given seed: sentences
from a small grammar, so a few hundred optimizer steps visibly learn spelling, words and syntax.
Every rank draws the same global batch of windows and keeps its data-parallel slice, so a
single-process run that keeps the whole global batch (`--check`) sees exactly the same tokens.
"""

import random
from pathlib import Path

import torch

SUBJECTS = ["the model", "a kernel", "every rank", "the optimizer", "our cluster", "the norm",
            "a small batch", "the gradient", "each shard", "the scheduler", "a tired engineer",
            "the compiler", "this layer", "the residual stream", "a new checkpoint"]
VERBS = ["reduces", "gathers", "normalizes", "scatters", "computes", "accumulates", "broadcasts",
         "writes", "reads", "averages", "compiles", "shards", "fuses", "checks", "saves"]
OBJECTS = ["the partial sums", "a bucket of gradients", "every token", "the hidden states",
           "the attention scores", "one more micro-batch", "the loss", "its weights",
           "the variance", "a long sequence", "the learning rate", "the activations"]
ENDINGS = ["before the step", "in fp32", "across the mesh", "once per step", "without a gather",
           "on every device", "after the backward", "as fast as it can", "in a fixed order",
           "while the others wait"]
CONNECTIVES = ["and then", "but", "so", "because", "while", "after which"]


def generate_corpus(n_bytes: int, seed: int) -> bytes:
    """Paragraphs of grammatical nonsense about distributed training, about `n_bytes` long."""
    rng = random.Random(seed)

    def clause() -> str:
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(ENDINGS))
        return " ".join(words)

    paragraphs, size = [], -2  # the size joined: a separator before every paragraph but the first
    while size < n_bytes:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            text = clause()
            if rng.random() < 0.4:
                text += f", {rng.choice(CONNECTIVES)} {clause()}"
            sentences.append(text[0].upper() + text[1:] + rng.choice(".....!?"))
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs).encode()[:n_bytes]


def load_tokens(path: str, n_bytes: int, seed: int) -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values (tokens 0..255)."""
    data = Path(path).read_bytes() if path else generate_corpus(n_bytes, seed)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class BatchSampler:
    """Per step, `grad_accum` micro-batches of (inputs, targets), this rank's rows of each.

    Windows start at random offsets drawn from a generator seeded identically on every rank; the
    global micro-batch has `rows_per_rank * n_ranks` rows and rank `rank` keeps its contiguous
    slice.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, rows_per_rank: int, grad_accum: int,
                 seed: int, rank: int = 0, n_ranks: int = 1):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, need more than seq_len + 1")
        self.tokens, self.seq_len, self.grad_accum = tokens, seq_len, grad_accum
        self.rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        self.global_rows = rows_per_rank * n_ranks
        self.generator = torch.Generator().manual_seed(seed)

    def _micro_batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.seq_len - 1, (self.global_rows,),
                               generator=self.generator)[self.rows]
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        windows = windows.to(device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def next_step(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self._micro_batch(device) for _ in range(self.grad_accum)]

    def state_dict(self) -> dict:
        """The data position: the window generator's state, the same on every rank. It maps to the
        same global batches on another layout if `global_rows` (batch_size × dp) is unchanged."""
        return {"generator": self.generator.get_state(), "global_rows": self.global_rows,
                "grad_accum": self.grad_accum, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
