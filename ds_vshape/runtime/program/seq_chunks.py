"""Sequence chunks in the engine: a micro-batch's sequence cut into k pieces (Seq1F1B).

The schedule already orders per (stage, micro-batch, seq_chunk) units; this module gives
the engine what a unit needs that a whole micro-batch does not:

* inputs: stage 0 reads positions ``[b_j, b_{j+1})`` of the micro-batch it loaded; the last
  stage reads the chunk's slice of targets shifted once for the whole sequence, and the
  micro-batch's count of real targets, so the chunk losses add up to the model's mean loss;
* attention: every forward runs inside ``ds_vshape.hf.seq_chunk`` with one
  ``ChunkKVState`` per (stage, micro-batch); a stage that loads nothing (a middle stage)
  places chunk j right after chunk j-1, its length being that of what it received;
* backward: chunk j adds the K/V gradients that later chunks left for it as extra autograd
  roots, then releases what it kept.

Chunk boundaries: ``"equal"`` lengths (the sequence length a multiple of k), or with
``"compute"`` equal causal cost per chunk (``schedules.seq_partition``, from the model's hidden
size, heads and FFN width: ``partition_dims``), later chunks shorter. A middle stage, which
loads nothing, sizes the K/V buffers from chunk 0's length: the longest sequence whose
partition starts with a chunk that long.

Only ``ds_vshape.hf`` layers know how to run a chunk; ``check_module`` refuses the rest at
initialize, on every rank, and so the ``ds_vshape.hf`` models that cannot run in chunks
exactly. Evaluation runs a forward-only schedule without chunks, so nothing here applies.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from ...schedules.seq_partition import chunk_boundaries

__all__ = ["SeqChunks", "check_module", "partition_dims", "PARTITIONS"]


def _hf() -> ModuleType:
    """``ds_vshape.hf``, imported where chunks are asked for: it imports ``transformers``' modeling code
    (and with it ``torch._dynamo``), seconds of every rank's start that a job without chunks never needs."""
    return importlib.import_module("ds_vshape.hf")


Key = tuple[int, int]  # (stage, micro-batch)
PARTITIONS = ("equal", "compute")


def partition_dims(model: Any) -> dict[str, int]:
    """The model sizes the compute-wise partition needs (hidden, heads, head_dim, ffn), from the
    Hugging Face config behind its ``ds_vshape.hf`` layers; ``ValueError`` when they are not there."""
    config = None
    for spec in model._layer_specs:
        plan = (getattr(spec, "module_args", None) or (None,))[0]
        config = getattr(getattr(plan, "lm", None), "config", None)
        if config is not None:
            break
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int):
        raise ValueError(
            "pipeline.seq_partition 'compute' needs the model's hidden size and number of attention heads (its config's "
            f"hidden_size and num_attention_heads; found {hidden!r} and {heads!r}) to cost each chunk; set "
            "pipeline.seq_partition to 'equal'")
    dims = {"hidden": hidden, "heads": heads}
    for key, attr in (("head_dim", "head_dim"), ("ffn", "intermediate_size"), ("ffn", "n_inner")):
        value = getattr(config, attr, None)
        if isinstance(value, int) and key not in dims:
            dims[key] = value
    return dims


def check_module(model: Any, k: int, schedule_name: str) -> None:
    """Refuse at initialize what cannot run ``k`` sequence chunks exactly; raises ``ValueError``."""
    where = f"schedule {schedule_name!r} with pipeline.seq_chunks={k}"
    hf = _hf()
    hf_layers = (hf.HFEmbedding, hf.HFDecoderBlock, hf.HFFinalNorm, hf.HFLMHead)
    for index, spec in enumerate(model._layer_specs):
        layer_type = getattr(spec, "typename", type(spec))
        if not (isinstance(layer_type, type) and issubclass(layer_type, hf_layers)):
            name = getattr(layer_type, "__name__", repr(layer_type))
            raise ValueError(
                f"{where}: layer {index} ({name}) is not a ds_vshape.hf layer; only models built with "
                "ds_vshape.hf.pipeline_layers can run in sequence chunks (attention must see the earlier chunks' "
                "keys/values); set pipeline.seq_chunks=1 or build the layers with pipeline_layers")
    if model.loss_fn is not hf.causal_lm_loss:
        raise ValueError(
            f"{where}: the module's loss_fn is {getattr(model.loss_fn, '__name__', model.loss_fn)!r}, not "
            "ds_vshape.hf.causal_lm_loss; each chunk's loss is its share of that loss, so pass the loss_fn "
            "returned by pipeline_layers, or set pipeline.seq_chunks=1")
    refusal = hf.seq_chunk_refusal(model._layer_specs)
    if refusal is not None:  # here, on every rank, not in the first forward of the ranks holding blocks
        raise ValueError(f"{where}: {refusal}; set pipeline.seq_chunks=1 to train this model without sequence chunks")
    if model.activation_checkpoint_interval > 0:
        raise ValueError(
            f"{where}: activation_checkpoint_interval={model.activation_checkpoint_interval} is not supported: a "
            "recomputation would run outside its chunk and lose the earlier chunks' keys/values; set "
            "activation_checkpoint_interval=0 or pipeline.seq_chunks=1")


class SeqChunks:
    """Per-step chunk state of one rank; ``k == 1`` makes every method a no-op."""

    def __init__(self, rank: int, *, partition: str = "equal", dims: dict[str, int] | None = None) -> None:
        """``partition``: ``"equal"`` or ``"compute"`` (then ``dims`` from ``partition_dims``)."""
        if partition not in PARTITIONS or (partition == "compute" and not dims):
            raise ValueError(f"seq partition must be one of {PARTITIONS} ('compute' with the model's dims), got {partition!r}")
        self._rank, self.partition, self._dims = rank, partition, dict(dims or {})
        self._cuts: dict[tuple[int, int], tuple[int, ...]] = {}  # (seq_len, k) -> boundaries
        self._totals: dict[tuple[int, int], int] = {}  # (chunk 0's length, k) -> sequence length to size K/V for
        self.k = 1
        self._states: dict[Key, Any] = {}  # ds_vshape.hf.ChunkKVState
        self._ends: dict[Key, int] = {}  # where the stage's last chunk of the micro-batch ended
        self._targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start_step(self, k: int) -> None:
        """A new step of a schedule with ``k`` chunks; forgets what an interrupted step left."""
        self.k = k
        self._states.clear()
        self._ends.clear()
        self._targets.clear()

    def pending(self) -> list[Key]:
        return list(self._states)

    # ---- inputs -----------------------------------------------------------------------------
    @property
    def unequal(self) -> bool:
        """Chunks of one micro-batch differ in length: every transfer carries its shapes."""
        return self.partition == "compute"

    def _bounds(self, seq_len: int, what: str) -> tuple[int, ...]:
        if self.unequal:
            key = (seq_len, self.k)
            if key not in self._cuts:
                self._cuts[key] = chunk_boundaries(seq_len, self.k, mode="compute", **self._dims)
            return self._cuts[key]
        bounds = chunk_boundaries(seq_len, self.k)
        if seq_len % self.k:
            # One shape header per link and step: every chunk must have the same shape.
            raise ValueError(f"pipeline rank {self._rank}: {what} has sequence length {seq_len}, which "
                             f"pipeline.seq_chunks={self.k} does not divide; unequal chunks are not supported by the "
                             "engine yet: pad or cut the sequences to a multiple of seq_chunks")
        return bounds

    def first_input(self, data: dict[int, Any], micro_batch: int, seq_chunk: int) -> Any:
        """Stage 0's input of the unit: the loaded micro-batch, sliced to the chunk's positions."""
        if self.k == 1 or seq_chunk == self.k - 1:
            raw = data.pop(micro_batch)
        else:
            raw = data[micro_batch]
        if self.k == 1:
            return raw
        tensors = raw if isinstance(raw, (tuple, list)) else (raw,)
        bounds = self._bounds(tensors[0].shape[1], f"micro-batch {micro_batch}'s input")
        start, end = bounds[seq_chunk], bounds[seq_chunk + 1]
        sliced = tuple(t[:, start:end] if torch.is_tensor(t) and t.dim() >= 2 else t for t in tensors)
        return sliced if isinstance(raw, (tuple, list)) else sliced[0]

    def last_labels(self, labels: dict[int, Any], micro_batch: int, seq_chunk: int) -> Any:
        """The last stage's labels of the unit: whole labels, or ``(targets slice, count)`` in chunks."""
        if self.k == 1:
            return labels.pop(micro_batch, None)
        if seq_chunk == 0:
            self._targets[micro_batch] = _hf().loss.shifted_targets(labels.pop(micro_batch))
        targets, count = self._targets[micro_batch]
        bounds = self._bounds(targets.shape[-1], f"micro-batch {micro_batch}'s labels")
        if seq_chunk == self.k - 1:
            del self._targets[micro_batch]
        return targets[..., bounds[seq_chunk]:bounds[seq_chunk + 1]], count

    def loss(self, loss_fn: Any, outputs: Any, labels: Any) -> torch.Tensor:
        """The unit's loss: the module's own, or in chunks the chunk's share of ``causal_lm_loss``."""
        if self.k == 1:
            return loss_fn(outputs, labels)
        targets, count = labels
        return _hf().loss.causal_lm_chunk_loss(outputs, targets, count)

    # ---- forward and backward -------------------------------------------------------------------
    def forward(self, stage: int, micro_batch: int, seq_chunk: int, inputs: Any) -> AbstractContextManager[None]:
        """The context of the unit's stage forward: ``seq_chunk`` over the positions of ``inputs``."""
        if self.k == 1:
            return nullcontext()
        key = (stage, micro_batch)
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        start = 0 if seq_chunk == 0 else self._ends[key]
        end = start + first.shape[1]
        self._ends[key] = end
        hf = _hf()
        state = self._states.setdefault(key, hf.ChunkKVState())
        if seq_chunk == 0 and state.num_chunks:
            state = self._states[key] = hf.ChunkKVState()
        # Chunk 0 tells the whole length, so K/V buffers are made once.
        return hf.seq_chunk(state, start=start, end=end, total=self._total(end - start) if seq_chunk == 0 else None)

    def _total(self, first: int) -> int:
        """The sequence length whose chunk 0 is ``first`` tokens long (the longest such, under "compute")."""
        if not self.unequal:
            return first * self.k
        key = (first, self.k)
        if key not in self._totals:
            # Compute-wise chunk 0 is the longest, so the sequence is at most k times as long.
            fits = (n for n in range(first * self.k, max(first, self.k) - 1, -1)
                    if chunk_boundaries(n, self.k, mode="compute", **self._dims)[1] == first)
            self._totals[key] = next(fits, first * self.k)
        return self._totals[key]

    def kept_tensors(self) -> list[torch.Tensor]:
        """The K/V buffers (and padding masks) every pending (stage, micro-batch) keeps, for the memory meter."""
        return [t for state in self._states.values() for t in state.kept_tensors()]

    def backward_roots(self, stage: int, micro_batch: int, seq_chunk: int) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Chunk ``seq_chunk``'s own K/V with the gradients later chunks left for them: extra roots."""
        if self.k == 1:
            return [], []
        return self._states[(stage, micro_batch)].backward_roots(seq_chunk)

    def release(self, stage: int, micro_batch: int, seq_chunk: int) -> None:
        """After the unit's backward: drop what it kept (the whole state after chunk 0)."""
        if self.k == 1:
            return
        key = (stage, micro_batch)
        self._states[key].release(seq_chunk)
        if seq_chunk == 0:
            del self._states[key]
            self._ends.pop(key, None)
