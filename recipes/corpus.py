"""The recipe's data: a local text file, tokenized offline, cut into random windows.

Nothing is downloaded: bytes are the tokens unless a local model directory ships its own
tokenizer. Every rank builds the same stream from the same seed, so ranks agree without
communicating.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["DEFAULT_DATA", "VAL_FRACTION", "Tokenizer", "ByteTokenizer", "tokenizer_for", "load_tokens", "batches"]

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "coriolanus.txt"
VAL_FRACTION = 0.1  # tail of the corpus kept out of training, for the final held-out loss


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """Raw UTF-8 bytes as tokens: no vocabulary file, nothing to download, vocab 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class _HFTokenizer:
    """A tokenizer saved next to a local model (read offline)."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])


def tokenizer_for(model: str) -> Tokenizer:
    """The model directory's own tokenizer when it ships one, else bytes."""
    directory = Path(model)
    if directory.is_dir() and any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return _HFTokenizer(directory)
    return ByteTokenizer()


def load_tokens(path: Path, tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: the last VAL_FRACTION of the text is held out."""
    ids = torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=torch.long)
    cut = int(len(ids) * (1 - VAL_FRACTION))
    return ids[:cut], ids[cut:]


def batches(tokens: torch.Tensor, *, batch: int, seq_len: int, seed: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless micro-batches of random windows; micro-batch i depends on (seed, i) only.

    That is what lets every rank agree without communication and lets ``--resume``
    continue the exact sequence: start at micro-batch ``start``.
    """
    if len(tokens) <= seq_len:
        raise ValueError(f"the corpus has {len(tokens)} tokens; --seq-len {seq_len} needs more")
    index = start
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        offsets = torch.randint(0, len(tokens) - seq_len, (batch,), generator=g)
        ids = torch.stack([tokens[o : o + seq_len] for o in offsets.tolist()])
        yield ids, ids.clone()
        index += 1
