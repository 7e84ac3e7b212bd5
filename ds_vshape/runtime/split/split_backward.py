"""Split backward: B computes input gradients now, W computes the weight gradients later.

This module owns the store; ``graph_linear`` (``nn.Linear`` split on autograd's graph),
``split_mode`` (routing), ``split_ops`` (the split autograd functions), ``split_graph`` (custom
autograd Functions) and ``module_hooks`` take it as a parameter.

While a unit's forward runs (``forward_of``), a plain ``nn.Linear`` runs its GEMM on the weight
detached and a hook on its output hands its work over in B (``graph_linear``); every other
operation that consumes a trainable parameter of the stage goes through an autograd function
of ``split_ops`` (routing: ``split_mode``), and every custom autograd Function node that takes
one is taken over by ``split_graph``. In the unit's B (``deferring``) they compute only input gradients and park,
per unit, what the parameter gradients need: the GEMMs' input and output gradient, for other
operations (embeddings, custom parameters) the small re-run graph of that one operation and
its output gradient, for a custom Function its saved tensors and output gradients. The
unit's W (``run``) turns the parked work into ``.grad``. Nothing else of the stage's graph
outlives B.

Routing costs host time on every call it sees, so it sees as few as it can: the engine routes
only units whose backward is split (``split_units``), and after a stage's first routed forward
only the calls inside modules owning deferred parameters are routed, unless that forward
found such a parameter consumed elsewhere (a tied head, say): then the stage stays routed
whole (``forward_of``'s scope).

Some weight gradients are B's by design: cheap ones (``cheap_in_b``, on by default: parameters
with at most one dimension, norm scales and biases) and those of the parameters whose module
path matches one of ``enable_split_backward``'s ``in_b`` patterns (``pipeline.weight_grads_in_b``:
W then keeps less, B takes their time). They park nothing and never warn; a tensor computed
from such parameters only is computed in B too (``grad_in_b``).

W adds a GEMM's weight gradient into ``.grad`` itself where autograd would do nothing else (no
hook on the parameter but the store's own: ``MatmulWork.add_to_grads``), the same bits without an
autograd call per few parameters. Any other gradient, and every parameter with a hook (DeepSpeed's
post-accumulate hooks, the bf16 optimizer's immediate update, a user's tensor hook), accumulates
through autograd's engine on the parameter, so they see it as if autograd had produced it. (A hook
put on the parameter's AccumulateGrad node itself is invisible from Python: not run for what W adds itself.)
A deferred parameter whose gradient still lands during B (used in place, say, or by a custom
Function whose backward computes it anyway) is exact but not deferred: a warning names its
module (and the Function), once.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

from .enable import enable_split_backward  # the store's entry point, here for its callers
from .graph_linear import DERIVED as _DERIVED
from .graph_linear import GRAPH, GRAPH_BIAS, PLAIN, ROUTED, GemmCapture, Plan, any_autocast
from .split_mode import DeferMode, param_like
from .split_ops import GenericWork, MatmulWork, ParkedWork, accumulate

# GEMM weight gradients accumulated per autograd call in W: one call per GEMM cost more than its
# Python and engine start-up is worth; a few at once hold only a few gradients' memory more.
_BATCH = 8

__all__ = ["SplitBackwardWarning", "WeightGradStore", "enable_split_backward"]


class SplitBackwardWarning(UserWarning):
    """A parameter's gradient was computed in B instead of W (exact, but not delayed)."""


class WeightGradStore:
    """Parked weight-gradient work, keyed by unit (stage, micro-batch, chunk).

    ``cheap_in_b``: parameters with at most one dimension (norm scales, biases) get their
    gradients in B by design; off, they wait for W like every other parameter (unless adopted
    with ``in_b``).
    """

    def __init__(self, *, cheap_in_b: bool = True) -> None:
        self.cheap_in_b = cheap_in_b
        self._current: Hashable | None = None  # unit whose forward (or backward) is running
        self._deferring: set[Hashable] = set()
        self._suspended = 0
        self.graph_key: Hashable | None = None  # see _refresh
        self._parked: dict[Hashable, list[ParkedWork]] = defaultdict(list)
        self._refs: dict[int, int] = {}  # storage -> parked references (q, k, v share one input)
        self._param_ids: set[int] = set()
        self._in_b: set[int] = set()  # adopted parameters whose gradients B computes (cheap, or named by in_b)
        self._param_ptrs: set[int] = set()  # parameter storages: never counted as parked
        self._owner: dict[int, str] = {}  # parameter id -> its module, for warnings
        self._own_hooks: dict[int, int] = {}  # parameter id -> the key of the store's own hook in its hook dict
        self._warned: set[str] = set()
        self.parked_bytes = 0
        self._token = object()  # marks the tensors computed from this store's parameters
        self._modules_suffice: set[Hashable] = set()  # scopes whose forwards route only their modules
        self._whole: set[Hashable] = set()  # units whose last forward was routed whole
        self._module_depth = 0  # modules owning deferred parameters now running their forward
        self._outside = False  # this forward consumed a deferred parameter outside such modules
        self._inputs_only = 0  # torch.autograd.grad calls running (graph_linear's captures add nothing then)
        # What B's GEMM captures handed over, parked when B ends (or before anything else parks, to keep the order)
        self._captured: list[tuple[GemmCapture, torch.Tensor, torch.Tensor]] = []

    # ---- contexts the engine opens --------------------------------------------------------------
    @contextmanager
    def forward_of(self, key: Hashable, *, scope: Hashable = None) -> Iterator[None]:
        """Route the parameter-consuming operations run inside through split backward, for ``key``.

        ``scope`` (default: ``key``) names the code the forward runs, a model stage say. Its first
        forward routes every operation; if every parameter it deferred was consumed inside a module
        owning one, later forwards of the scope route only those modules' operations (the rest
        of a transformer block, attention and elementwise work, then runs without the per-call
        cost). A deferred gradient found in B (``_accumulated_in_b``) routes everything again.
        """
        scope = key if scope is None else scope
        whole = scope not in self._modules_suffice
        (self._whole.add if whole else self._whole.discard)(key)
        self._outside = False
        with self._unit(key), (DeferMode(self) if whole else nullcontext()):
            yield
        if whole and not self._outside:
            self._modules_suffice.add(scope)

    def routed_whole(self) -> bool:
        """The running unit's forward routed every operation (not only its modules')."""
        return self._current in self._whole

    # ---- what the routing tells the store ---------------------------------------------------------
    def enter_module(self, delta: int) -> None:
        """A module owning deferred parameters starts (+1) or ends (-1) its forward."""
        self._module_depth += delta

    @property
    def in_module(self) -> bool:
        return self._module_depth > 0

    def used_outside(self) -> None:
        """A deferred parameter was consumed outside the modules owning one: route this scope whole."""
        self._outside = True

    @contextmanager
    def backward_of(self, key: Hashable, *, defer: bool) -> Iterator[None]:
        """``key``'s backward: B when ``defer``, else fused. A checkpointed forward re-run inside is routed too."""
        if defer:
            self._deferring.add(key)
        start = len(self._captured)  # what an enclosing backward captured before this one stays
        try:
            with self._unit(key), DeferMode(self):
                yield
            self._park_captured()
        finally:
            self._deferring.discard(key)
            del self._captured[start:]  # B raised: none of its captures are parked

    def deferring(self, key: Hashable) -> Any:
        """``key``'s B: parameter gradients are parked for ``run(key)``."""
        return self.backward_of(key, defer=True)

    @contextmanager
    def _unit(self, key: Hashable) -> Iterator[None]:
        previous, self._current = self._current, key
        self._refresh()
        try:
            yield
        finally:
            self._current = previous
            self._refresh()

    def _refresh(self) -> None:
        """``graph_key``: the running unit where its linear layers may split on the graph (it is not
        suspended, its forward not routed whole), else None: ``SplitLinear`` asks one attribute."""
        key = self._current
        self.graph_key = None if key is None or self._suspended or key in self._whole else key

    def suspended(self) -> AbstractContextManager[None]:
        """Operations run inside are not routed (split_ops re-running one operation)."""
        return self._raised("_suspended")

    @contextmanager
    def _raised(self, counter: str) -> Iterator[None]:
        """``counter`` (a depth: nested calls add up) one higher while the block runs."""
        setattr(self, counter, getattr(self, counter) + 1)
        self._refresh()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) - 1)
            self._refresh()

    # ---- what the routing asks -------------------------------------------------------------------
    @property
    def current(self) -> Hashable | None:
        return self._current

    @property
    def is_suspended(self) -> bool:
        return self._suspended > 0

    def is_deferring(self, key: Hashable) -> bool:
        return key in self._deferring

    @property
    def in_b_ids(self) -> set[int]:
        """The ids of the adopted parameters whose gradients B computes."""
        return self._in_b

    def linear_plan(self, x: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> Plan:
        """What a ``SplitLinear`` call runs as (``graph_linear.Plan``). ROUTED: a whole-routed forward, an
        input computed from parameters or without a gradient, a weight ZeRO-3 partitions, autocast (a
        detached weight would miss autocast's cast cache: a copy of it saved per call). ``SplitLinear.forward``
        checks the common call itself (every condition of GRAPH, the same as here, on ``graph_key``) and
        asks this for the rest; ``tests/unit/test_w_direct.py`` holds the two to the same answers."""
        key, in_b = self._current, self._in_b
        if key is None or self._suspended or not torch.is_grad_enabled():
            return PLAIN
        if not weight.requires_grad or id(weight) in in_b:
            return PLAIN if bias is None or not bias.requires_grad or id(bias) in in_b else ROUTED
        if key in self._whole or type(x) is not torch.Tensor or not x.requires_grad or x.dim() < 2 or hasattr(weight, "ds_id"):
            return ROUTED
        if id(x) in self._param_ids or hasattr(x, _DERIVED) or any_autocast():
            return ROUTED
        if isinstance(x.grad_fn, BackwardCFunction) and param_like(self, x):  # a custom Function fed by parameters
            return ROUTED
        return GRAPH if bias is None or not bias.requires_grad or id(bias) in in_b else GRAPH_BIAS

    def is_param_like(self, t: torch.Tensor) -> bool:
        return t.requires_grad and (id(t) in self._param_ids or self._mark(t) is not None)

    def grad_in_b(self, t: torch.Tensor) -> bool:
        """A parameter-like tensor whose gradient B computes by design: a parameter adopted as such
        (cheap, or ``in_b``), or a tensor computed from such parameters only."""
        return id(t) in self._in_b if id(t) in self._param_ids else bool(self._mark(t))

    def mark_param_like(self, out: Any, *, in_b: bool) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                setattr(t, _DERIVED, (self._token, in_b))

    def _mark(self, t: torch.Tensor) -> bool | None:
        """Whether B computes the gradient of ``t``, computed from this store's parameters (None: not such a tensor)."""
        mark = getattr(t, _DERIVED, None)
        return mark[1] if mark is not None and mark[0] is self._token else None

    def trainable_param(self, node: Node) -> torch.Tensor | None:
        """The deferred-or-cheap parameter behind an accumulate node, else None."""
        if not isinstance(node, torch._C._functions.AccumulateGrad):
            return None
        param = node.variable
        return param if id(param) in self._param_ids and param.requires_grad else None

    # ---- parked work -------------------------------------------------------------------------------
    def park(self, key: Hashable, work: ParkedWork) -> None:
        if self._captured:
            self._park_captured()
        self._park(key, work)

    def _park(self, key: Hashable, work: ParkedWork) -> None:
        self._parked[key].append(work)
        for t in work.held:
            self._hold(t, +1)

    def _hold(self, t: torch.Tensor, delta: int) -> None:
        """Count each parked storage once, however many operations park it."""
        storage = t.untyped_storage()
        if storage.data_ptr() in self._param_ptrs:
            return
        # Keyed by the storage itself, not its address: activation offload moves a parked storage
        # to host after B and back before W, at another address.
        ptr = storage._cdata
        before = self._refs.get(ptr, 0)
        after = before + delta
        if before == 0:
            self.parked_bytes += storage.nbytes()
        if after == 0:
            self.parked_bytes -= storage.nbytes()
            self._refs.pop(ptr, None)
        else:
            self._refs[ptr] = after

    def capture(self, capture: GemmCapture, x: torch.Tensor, grad: torch.Tensor) -> None:
        """B reached a GEMM split on the graph (``graph_linear``): its work is parked when B ends (or
        before the next work B parks, which keeps the order), a fused backward runs it now. (Parked in
        one loop rather than here: Python run from inside autograd's engine, once per GEMM, costs
        several times what the same lines cost in a loop of their own.)"""
        if capture.key in self._deferring:
            self._captured.append((capture, x, grad))
        else:
            capture.work(x, grad).run()

    def _park_captured(self) -> None:
        """Park what B's GEMM captures handed over, in the order B reached them."""
        captured, self._captured = self._captured, []
        works = [(capture.key, capture.work(x, grad)) for capture, x, grad in captured]  # each checks its input first
        for key, work in works:
            self._park(key, work)

    def inputs_only(self) -> AbstractContextManager[None]:
        """A ``torch.autograd.grad`` call runs inside (the routing sees it): it leaves ``.grad`` alone."""
        return self._raised("_inputs_only")

    @property
    def asks_inputs_only(self) -> bool:
        """A ``torch.autograd.grad`` call the routing saw is running: ``graph_linear``'s captures take nothing."""
        return self._inputs_only > 0

    def run(self, key: Hashable) -> None:
        """The W pass of ``key``: every parked weight-gradient computation, accumulated into ``.grad``."""
        batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        works = self._parked.pop(key, [])
        direct = _each_once(works)
        for work in works:
            if not isinstance(work, MatmulWork):
                _accumulate(batch)  # in order: this work may consume what the batch accumulates
                work.run()
            elif not (direct and work.add_to_grads(own_hooks=self._own_hooks)):
                batch.extend(work.gradients())
                if len(batch) >= _BATCH:
                    _accumulate(batch)
            for t in work.held:
                self._hold(t, -1)
        _accumulate(batch)

    def parked_of(self, key: Hashable) -> list[ParkedWork]:
        """``key``'s parked work, in the order B parked it."""
        return list(self._parked.get(key, ()))

    def run_now(self, key: Hashable, works: Sequence[ParkedWork]) -> None:
        """Run ``works`` (parked by ``key``) now, in their parked order; the rest waits for ``key``'s W."""
        chosen = {id(w) for w in works}
        now = [w for w in self._parked.get(key, ()) if id(w) in chosen]
        self._parked[key] = [w for w in self._parked[key] if id(w) not in chosen]
        for work in now:
            work.run()
            for t in work.held:
                self._hold(t, -1)

    def compute_in_b(self, params: Sequence[torch.Tensor], *, in_b: bool = True) -> None:
        """From the next forward on, B computes these adopted parameters' gradients (``fit``'s choice);
        ``in_b=False`` gives them back to W."""
        ids = {id(p) for p in params if id(p) in self._param_ids}
        self._in_b = self._in_b | ids if in_b else self._in_b - ids

    @property
    def param_storages(self) -> set[int]:
        """The adopted parameters' storage addresses: never counted as parked."""
        return self._param_ptrs

    def owner_of(self, param: torch.Tensor) -> str:
        """The module an adopted parameter belongs to, as warnings name it."""
        return self._owner.get(id(param), "?")

    def held(self, key: Hashable) -> list[torch.Tensor]:
        """The tensors ``key``'s parked work keeps until its W (activation offload moves them out and back)."""
        return [t for work in self._parked.get(key, ()) for t in work.held]

    def pending(self) -> list[Hashable]:
        return list(self._parked)

    def clear(self) -> None:
        """Drop all parked work: after a skipped fp16 step nothing may carry into the next."""
        self._parked.clear()
        self._captured.clear()
        self._refs.clear()
        self.parked_bytes = 0

    # ---- setup --------------------------------------------------------------------------------------
    def adopt(self, param: nn.Parameter, owner: str, *, in_b: bool = False) -> None:
        """Route ``param``'s gradient through W, or B when ``in_b`` or cheap; ``owner`` names its module in
        warnings. A parameter adopted already (shared by two modules) keeps its first adoption."""
        if id(param) in self._param_ids:
            return
        self._param_ids.add(id(param))
        self._param_ptrs.add(param.untyped_storage().data_ptr())
        self._owner[id(param)] = owner
        if in_b or (self.cheap_in_b and param.dim() <= 1):
            self._in_b.add(id(param))
        if param.requires_grad and not self.grad_in_b(param):  # a frozen one parks nothing and cannot take the hook
            # Autograd calls it with None where B returned None for the parameter: only a real one counts,
            # and not for a parameter that ``compute_in_b`` has moved to B since.
            pid = id(param)
            handle = param.register_hook(lambda grad: None if grad is None or pid in self._in_b else self._accumulated_in_b(owner))
            self._own_hooks[pid] = handle.id

    def _accumulated_in_b(self, owner: str) -> None:  # returns None: the gradient is left as it is
        if self._deferring and not self.is_suspended:
            self._modules_suffice.clear()  # a use the routing missed: route whole forwards from now on
        if self._deferring and not self.is_suspended and owner not in self._warned:
            self._warned.add(owner)
            warnings.warn(f"ds_vshape split backward: the weight gradient of {owner} was computed in B, not deferred "
                          "to W (exact, but the zero-bubble gain is lost for it): a parameter used in place, or "
                          "outside the stage's forward", SplitBackwardWarning, stacklevel=2)

    def kept_whole(self, name: str, params: list[torch.Tensor]) -> None:
        """A custom Function computed deferred gradients in B anyway: say so once, naming it."""
        owners = sorted({self._owner.get(id(p), "?") for p in params})
        fresh = name not in self._warned
        self._warned.update([name, *owners])  # the per-module warning would only repeat it
        if fresh:
            warnings.warn(f"ds_vshape split backward: {name} (in {', '.join(owners) or 'the stage'}) computes its "
                          "parameters' gradients in B although B does not ask for them (ctx.needs_input_grad), so it runs "
                          "whole in B, once: exact, but its weight-gradient work is not deferred to W. A backward that "
                          "computes each gradient only where ctx.needs_input_grad asks for it is split.",
                          SplitBackwardWarning, stacklevel=2)


def _each_once(works: list[ParkedWork]) -> bool:
    """Each parameter gets its gradient from one work only, and every work names its parameters themselves:
    W may add the GEMMs' gradients one by one. (Where one parameter gets several, a fused backward sums
    them before adding them into ``.grad``, as the engine's batch does; one by one, the last bits differ.)"""
    seen: set[int] = set()
    for work in works:
        if isinstance(work, MatmulWork):
            targets: Sequence[torch.Tensor | None] = (work.weight, work.bias)
        elif isinstance(work, GenericWork):
            targets = work.targets
        else:  # a custom Function's: which parameters it reaches is its own business
            return False
        for t in targets:
            if t is None:
                continue
            if not t.is_leaf or id(t) in seen:
                return False
            seen.add(id(t))
    return True


def _accumulate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if batch:
        accumulate([t for t, _ in batch], [g for _, g in batch])
        batch.clear()
