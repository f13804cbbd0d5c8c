"""What the Planner's controls set, and the re-plan it triggers: no widgets here.

The model is sized once, by the same function that prepares ``bigviz.plan``'s inputs
(:func:`~bigviz.planning.inputs.planner_inputs`: the default "cpu" budget, the no-split
classes, the unit rule's knobs); a tree per dtype is cached, so a slider move is one call of
:func:`~bigviz.planning.inputs.place` (the pure, linear-time planner and the direct-read rule),
and a model planned here is placed as ``bigviz.plan`` places it.

Example:
    >>> import torch.nn as nn
    >>> state = PlannerState.from_model(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), {"cpu": "1MB"})
    >>> state.add_gpu(40_000)
    0
    >>> state.assign("3", 0)
    >>> state.replan().device_of("3")
    0
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from bigviz.core.offload_units import UnitRule
from bigviz.core.headroom import Headroom, headroom
from bigviz.core.plan import STRATEGIES, DevicePlan, PlanOptions
from bigviz.core.planner import PlanError
from bigviz.core.dtypes import canonical_dtype, itemsize
from bigviz.core.quant import QUANT_METHODS, QuantConfig, default_targets, quantized_tree
from bigviz.core.tree import SizeTree
from bigviz.core.errors import DeviceMapError, UsageError
from bigviz.core.devices import Device, device_label, normalize_device
from bigviz.core.sizes import UNLIMITED, parse_max_memory, parse_size
from bigviz.core.workload import RunBytes, RunSpec, Workload, longest_fit
from bigviz.core.counts import check_count

if TYPE_CHECKING:
    from bigviz.planning.positions import PositionLimit

__all__ = ["PlannerState"]


@dataclass
class PlannerState:
    """Budgets, reserves, strategy, dtype, no-split classes and overrides of one model.

    Attributes:
        base_tree: the model's size tree as built (its own dtypes).
        budgets: bytes per device; ``"disk"`` is unlimited unless present.
        reserve: bytes per device kept free for activations and KV cache.
        strategy: a planner strategy (``"auto"``, ``"balanced"``, ...).
        dtype: floating tensors are sized as this dtype (``None``: as built).
        no_split: module classes or name globs placed whole.
        overrides: ``{module: device}`` placements kept through every re-plan.
        workload: the run planned beside the weights (batch size, context length, cache dtype).
        run_specs: makes the model's :class:`RunSpec` for a device type (``"cuda"``, ``"cpu"``);
            ``None`` when the model's layout is unknown (a bare size tree).
        position_limit: the longest context the model's positions allow, if it says.
        positions: that limit, with the key that says it and whether it is a hard end.
        rule: the unit rule's knobs the model gives (direct reads, shared modules); its blocks
            are ``no_split``.
        inventory: the model's inventory (for the direct-read rule), if it has one.
        quant_tree: the size tree with the weights a quantization packs in their packed bytes
            (:func:`~bigviz.planning.inputs.quantized_for_plan`, as ``bigviz.plan`` sizes them).
        unquantized: modules kept in high precision when the dtype is ``int8`` / ``int4``.
        dtype_tree: the size tree at a float dtype as ``bigviz.plan`` sizes it (buffers the
            model computes at the dtype the load gives them: :func:`~bigviz.planning.models.computed_dtypes`).
    """

    base_tree: SizeTree
    budgets: dict[Device, int]
    reserve: dict[Device, int] = field(default_factory=dict)
    strategy: str = "auto"
    dtype: str | None = None
    no_split: tuple[str, ...] = ()
    overrides: dict[str, Device] = field(default_factory=dict)
    workload: Workload = field(default_factory=Workload)
    run_specs: Callable[[str], RunSpec] | None = field(default=None, repr=False)
    position_limit: int | None = None
    positions: PositionLimit | None = None
    rule: UnitRule = field(default_factory=UnitRule, repr=False)
    inventory: Any = field(default=None, repr=False)
    quant_tree: Callable[[QuantConfig], SizeTree] | None = field(default=None, repr=False)
    unquantized: tuple[str, ...] = ()
    dtype_tree: Callable[[str], SizeTree] | None = field(default=None, repr=False)
    _trees: dict[str | None, SizeTree] = field(default_factory=dict, repr=False)
    _specs: dict[str, RunSpec] = field(default_factory=dict, repr=False)

    @classmethod
    def from_model(
        cls,
        model: Any,
        max_memory: Mapping[object, object] | None = None,
        *,
        strategy: str = "auto",
        no_split_module_classes: Collection[str] | None = None,
        dtype: object = None,
    ) -> PlannerState:
        """Size ``model`` (an ``nn.Module``, a ``SizeTree`` or a checkpoint path) once.

        ``max_memory=None`` means this machine's free memory (``get_max_memory()``).
        """
        from bigviz.planning import as_tree, model_run_spec, resolve_model
        from bigviz.planning.inputs import no_split_names, planner_inputs, quantized_for_plan
        from bigviz.planning.positions import position_rule

        if strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        model = resolve_model(model)
        inputs = planner_inputs(
            model, max_memory, strategy=strategy, no_split_module_classes=no_split_module_classes, dtype=dtype
        )
        tree = inputs.tree if dtype is None else as_tree(inputs.model)
        state = cls(
            tree,
            inputs.budgets,
            strategy=strategy,
            no_split=tuple(no_split_names(inputs.model, inputs.tree, no_split_module_classes)),
            rule=inputs.options.rule,
            inventory=inputs.inventory,
        )
        if not isinstance(model, SizeTree):  # a module, or a checkpoint whose config.json tells its layout
            state.run_specs = lambda device_type: model_run_spec(model, tree, device_type=device_type)
            state.positions = position_rule(model)
            state.position_limit = state.positions.tokens if state.positions else None
        state.quant_tree = lambda config: quantized_for_plan(model, tree, config)  # bigviz.plan's rule
        if not isinstance(model, SizeTree):
            state.dtype_tree = lambda float_dtype: as_tree(inputs.model, float_dtype)  # bigviz.plan's rule too
        state.set_dtype(None if dtype is None else str(dtype))
        return state

    # ---- the plan ------------------------------------------------------------------
    @property
    def tree(self) -> SizeTree:
        """The size tree at the chosen dtype (cached per dtype); ``int8`` / ``int4``: the linear
        layers' weights as the quantizer packs them (:mod:`bigviz.core.quant`), but those of
        the modules in ``unquantized``."""
        if self.dtype not in self._trees:
            config = self.quantization
            if config is None and self.dtype is not None and self.dtype_tree is not None:
                self._trees[self.dtype] = self.dtype_tree(self.dtype)
            elif config is None:
                self._trees[self.dtype] = self.base_tree.with_dtype(self.dtype)
            elif self.quant_tree is not None:
                self._trees[self.dtype] = self.quant_tree(config)
            else:
                targets = default_targets(self.base_tree, config)
                self._trees[self.dtype] = quantized_tree(self.base_tree, config, targets)
        return self._trees[self.dtype]

    @property
    def quantization(self) -> QuantConfig | None:
        """The quantization the dtype choice means (``int8``, ``int4``), else None."""
        if self.dtype not in QUANT_METHODS:
            return None
        return QuantConfig(self.dtype, modules_to_not_convert=self.unquantized)  # type: ignore[arg-type]

    def keep_unquantized(self, modules: Collection[str]) -> None:
        """Keep ``modules`` in high precision when the dtype is ``int8`` / ``int4`` (a per-module
        override: e.g. a sensitive first block kept in bf16)."""
        unknown = [m for m in modules if m not in self.base_tree.nodes]
        if unknown:
            raise UsageError(f"keep_unquantized: {unknown} name no module of this model")
        self.unquantized = tuple(dict.fromkeys(modules))
        for method in QUANT_METHODS:
            self._trees.pop(method, None)

    def options(self, workload: Workload | None = None) -> PlanOptions:
        workload = workload or self.workload
        run = self.run_bytes(workload)
        room = self.headroom(workload)
        return PlanOptions(
            strategy=self.strategy,
            reserve=room.reserve,
            run_slack=room.run_slack,
            overrides=dict(self.overrides),
            kv_cache=run.kv_cache,
            activations=run.activations,
            held=run.held,
            workload=workload if workload.active else None,
            rule=replace(self.rule, blocks=frozenset(self.no_split)),
        )

    def headroom(self, workload: Workload | None = None) -> Headroom:
        """What each device keeps free: the reserves set here, and for a run the default of
        each device kind for the others (see :mod:`bigviz.core.headroom`)."""
        active = (workload or self.workload).active
        return headroom(self.budgets, dict(self.reserve) or None, defaults=active)

    def replan(self, workload: Workload | None = None) -> DevicePlan:
        """Plan with the current settings (``bigviz.plan``'s planner, headroom and direct-read
        rule). Raises ``PlanError`` when nothing fits."""
        from bigviz.planning.inputs import PlannerInputs, place, quant_note

        notes = self.headroom(workload).notes
        note = quant_note(None, self.tree, self.quantization)
        inputs = PlannerInputs(
            None, self.tree, self.budgets, self.options(workload), self.inventory, notes=notes, quant_note=note
        )
        return place(inputs)

    # ---- the run -------------------------------------------------------------------
    def run_spec(self) -> RunSpec:
        """The model's run spec for the planned hardware, at the chosen dtype (cached)."""
        if self.run_specs is None:
            raise UsageError(
                "this planner was made from a size tree: it cannot plan a run (context length); "
                "make it from the model, a config.json, or a checkpoint with its config.json"
            )
        device_type = "cuda" if any(isinstance(d, int) or d == "mps" for d in self.budgets) else "cpu"
        if device_type not in self._specs:
            self._specs[device_type] = self.run_specs(device_type)
        spec = self._specs[device_type]
        # weights quantised to 8 bits or less still compute (and cache) in the model's own dtype
        return replace(spec, dtype=self.dtype) if self.dtype is not None and itemsize(self.dtype) >= 2 else spec

    def run_bytes(self, workload: Workload) -> RunBytes:
        """The run's bytes per module for ``workload``, as ``bigviz.plan`` charges them."""
        if not workload.active:
            return RunBytes()
        return RunBytes.of(self.run_spec(), workload)

    def set_workload(
        self, *, batch_size: int | None = None, context_length: int | None = None, kv_dtype: str | None | bool = False
    ) -> None:
        """Change the run planned beside the weights (``kv_dtype=None``: the compute dtype).

        Raises:
            PlanError: a count that is not a whole number (``2.5`` is not taken as 2), or too small.
        """
        new = Workload(
            self.workload.batch_size if batch_size is None else check_count("batch_size", batch_size),
            self.workload.context_length
            if context_length is None
            else check_count("context_length", context_length, minimum=0),
            self.workload.kv_dtype if kv_dtype is False else kv_dtype,
        )  # type: ignore[arg-type]
        if new.active:
            self.run_spec()  # refuse a run the planner cannot describe, before it is set
            from bigviz.planning.positions import check_context

            check_context(self.positions, new.context_length)  # past a table of positions: refused
        self.workload = new

    def fits(self, workload: Workload, *, allow_offload: bool = False) -> DevicePlan | None:
        """The plan of ``workload`` if its run fits (``DevicePlan.fits``: nothing offloaded
        unless allowed), else None."""
        try:
            plan = self.replan(workload)
        except PlanError:
            return None
        return plan if plan.fits(allow_offload=allow_offload) else None

    def longest_context(self, *, allow_offload: bool = False) -> int:
        """The longest context whose run fits with these settings (0: not even the weights),
        by bisection on the planner, up to the model's position limit (else 2**24)."""

        def ok(tokens: int) -> bool:
            return self.fits(replace(self.workload, context_length=tokens), allow_offload=allow_offload) is not None

        return longest_fit(ok, self.position_limit or 2**24)

    @property
    def max_memory(self) -> dict[Device, int]:
        """The budgets in bytes, as ``max_memory`` (an unlimited disk left out)."""
        return {d: b for d, b in self.budgets.items() if not (d == "disk" and b >= UNLIMITED)}

    # ---- settings ------------------------------------------------------------------
    def set_dtype(self, dtype: str | None) -> None:
        self.dtype = None if dtype is None else canonical_dtype(dtype)

    def set_budget(self, device: object, size: int | str) -> None:
        device = normalize_device(device)
        if device not in self.budgets:
            raise UsageError(f"{device_label(device)} has no budget: add it first (add_gpu or max_memory)")
        self.budgets[device] = parse_size(size)

    def set_reserve(self, device: object, size: int | str) -> None:
        device = normalize_device(device)
        self.reserve[device] = parse_size(size)

    def gpus(self) -> list[int]:
        return [d for d in self.budgets if isinstance(d, int)]

    def add_gpu(self, size: int | str | None = None) -> int:
        """Add the next GPU index, with ``size`` bytes (default: the last GPU's budget)."""
        gpus = self.gpus()
        index = gpus[-1] + 1 if gpus else 0
        budget = parse_size(size) if size is not None else (self.budgets[gpus[-1]] if gpus else 16 * 2**30)
        self.budgets = parse_max_memory({**self.budgets, index: budget})
        return index

    def remove_device(self, device: object) -> list[str]:
        """Drop a device; returns the overrides that named it (dropped too)."""
        device = normalize_device(device)
        if device not in self.budgets:
            raise UsageError(f"{device_label(device)} is not in the budgets")
        del self.budgets[device]
        self.reserve.pop(device, None)
        dropped = [m for m, d in self.overrides.items() if d == device]
        for name in dropped:
            del self.overrides[name]
        return dropped

    def set_budgets(self, max_memory: Mapping[object, object]) -> list[str]:
        """Replace every budget (a hardware preset); overrides to devices no longer there
        are dropped and returned. A finite disk budget is kept."""
        new = parse_max_memory(max_memory)
        if "disk" in self.budgets and "disk" not in new:
            new["disk"] = self.budgets["disk"]
        dropped = [m for m, d in self.overrides.items() if d not in new and d != "disk"]
        for name in dropped:
            del self.overrides[name]
        self.budgets = parse_max_memory(new)
        self.reserve = {d: r for d, r in self.reserve.items() if d in self.budgets}
        return dropped

    # ---- overrides -----------------------------------------------------------------
    def assign(self, module: str, device: object) -> None:
        """Keep ``module`` (or a tensor) on ``device`` in every plan from now on.

        Raises:
            ValueError: naming the module (with the closest real name) or the device.
        """
        problems = []
        tree = self.base_tree
        if not isinstance(module, str):
            problems.append(
                f"module {module!r} is not a name: give the module's name as a string, e.g. "
                f"{next((n for n in tree.nodes if n), '')!r}"
            )
        elif module not in tree.nodes and module not in tree.tensors:
            close = difflib.get_close_matches(module, list(tree.nodes) + list(tree.tensors), n=1)
            problems.append(
                f"{module!r} names no module or tensor of the model"
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        try:
            target = normalize_device(device)
        except ValueError as err:
            problems.append(str(err))
        else:
            if target not in self.budgets and target != "disk":
                problems.append(
                    f"{device_label(target)} has no budget: add it first "
                    f"(have: {', '.join(device_label(d) for d in self.budgets)})"
                )
        DeviceMapError.check(problems, "cannot assign")
        self.overrides[module] = target

    def unassign(self, module: str) -> None:
        """Let the planner place ``module`` again."""
        if not isinstance(module, str) or module not in self.overrides:
            have = ", ".join(self.overrides) or "none"
            raise UsageError(f"{module!r} has no override (overrides: {have})")
        del self.overrides[module]
