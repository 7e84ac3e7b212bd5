"""Weights of one pipeline layer: read from a safetensors checkpoint, materialised or freshly initialised.

``Checkpoint`` reads only the requested tensors from a local ``*.safetensors``
checkpoint (single or sharded; base-model-only checkpoints without the prefix
work too).  ``parameters_on_meta`` builds a model skeleton without parameter
memory; ``materialise``, ``load_part`` and ``initialise`` give one part of it real
storage and its checkpoint or freshly initialised values.  Everything here is
internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

__all__ = [
    "Checkpoint",
    "initialise",
    "load_part",
    "materialise",
    "parameters_on_meta",
    "stored_name_converter",
]

# ---------------------------------------------------------------------- weights


class Checkpoint:
    """Reads selected tensors from a local safetensors checkpoint (single file or sharded).

    ``rename`` maps a stored name to the model's (transformers 5 renames some on load,
    e.g. GPT-NeoX's ``embed_out`` to ``lm_head``); default: names are the model's.
    """

    def __init__(self, directory: Path, *, strip_prefix: str, rename: Callable[[str], str] | None = None) -> None:
        self.directory = directory
        self._strip = strip_prefix + "."
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {key: directory / name for key, name in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:  # reads the header only
                self._files = {key: single for key in handle.keys()}  # noqa: SIM118 (not iterable)
        else:
            raise ValueError(
                f"{directory} has no model.safetensors[.index.json]; only safetensors can be read per layer"
            )
        renamed = {(rename(key) if rename else key): key for key in self._files}
        self._by_model_name = {name: stored for name, stored in renamed.items() if name != stored}

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Tensors for those ``keys`` present in the checkpoint, each read from disk once."""
        by_file: dict[Path, dict[str, str]] = {}
        for key in keys:
            stored = self._stored_name(key)
            if stored is not None:
                by_file.setdefault(self._files[stored], {})[stored] = key
        found: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for stored, key in names.items():
                    found[key] = handle.get_tensor(stored)
        return found

    def _stored_name(self, key: str) -> str | None:
        if key in self._by_model_name:
            return self._by_model_name[key]
        if key in self._files:
            return key
        # Base-model checkpoints (e.g. saved from LlamaModel) lack the prefix.
        if key.startswith(self._strip) and key[len(self._strip) :] in self._files:
            return key[len(self._strip) :]
        return None


def stored_name_converter(lm: PreTrainedModel) -> Callable[[str], str] | None:
    """How transformers renames this model's stored weights on load, or None (4.5x: it does not)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return None
    renamings = [t for t in get_model_conversion_mapping(lm) if isinstance(t, WeightRenaming)]
    if not renamings:
        return None
    # Converters (e.g. merging experts) would need whole tensors of other layers: not applied,
    # so such checkpoints fail in load_part naming the weights they lack.
    return lambda key: rename_source_key(key, renamings, [])[0]


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Construct modules with parameters on ``meta`` but buffers real.

    Buffers (e.g. rotary ``inv_freq``, not stored in checkpoints) are thereby
    computed by the model's own constructor, while no parameter memory is used.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialise(module: nn.Module, *, dtype: torch.dtype | None) -> nn.Module:
    """Give every meta parameter real (uninitialised) CPU storage; shared parameters stay shared."""
    fresh: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in fresh:
                target = dtype if dtype is not None and param.is_floating_point() else param.dtype
                data = torch.empty(param.shape, dtype=target)
                fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            sub._parameters[name] = fresh[id(param)]
    return module


def initialise(part: nn.Module, donor: PreTrainedModel) -> None:
    """Apply the model's own weight init to a freshly materialised part (children before parents, as HF)."""
    with torch.no_grad():
        for sub in reversed(list(part.modules())):
            donor._init_weights(sub)


def load_part(part: nn.Module, prefix: str, checkpoint: Checkpoint) -> None:
    state = part.state_dict(keep_vars=True)
    keys = {f"{prefix}.{name}": tensor for name, tensor in state.items()}
    found = checkpoint.read(keys)
    params = {id(p) for p in part.parameters()}
    missing = sorted(key for key, tensor in keys.items() if key not in found and id(tensor) in params)
    if missing:
        raise ValueError(f"{checkpoint.directory} lacks {len(missing)} weights, e.g. {missing[:3]}")
    with torch.no_grad():
        for key, tensor in found.items():
            if keys[key].shape != tensor.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model {tuple(keys[key].shape)}")
            keys[key].copy_(tensor)
