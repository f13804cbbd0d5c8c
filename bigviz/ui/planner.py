"""The interactive planner: leave ``Planner(model)`` last in a notebook cell.

A treemap of the model coloured by device, one budget slider per device, hardware presets,
strategy and dtype, reserves, hand-made overrides, export to JSON and HTML, a cost per
forward pass, and a button that loads and dispatches a checkpoint with the plan. Every
control re-plans (one linear-time ``make_plan`` on a cached size tree) and updates the
figure in place with one ``batch_update``. A stage mode colours the same treemap by pipeline
stage instead (``planner.show_stages(4)``; see ``bigviz.plan_pipeline``).

Example:
    >>> import torch.nn as nn
    >>> planner = Planner(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), {0: 40_000, "cpu": "1MB"})
    >>> planner.device_map
    {'': 'cpu'}
    >>> planner.budget_sliders[0].value = 60_000 / 2**30  # what a slider move does
    >>> planner.device_map
    {'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
    >>> planner.assign("3", 0)
    >>> planner.device_map, planner.overrides
    ({'0': 'cpu', '1': 'cpu', '2': 'cpu', '3': 0}, {'3': 0})
"""

from __future__ import annotations

import contextlib
import html
import os
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import replace
from typing import Any

from bigviz.core.cost import ForwardEstimate
from bigviz.core.devices import Device
from bigviz.core.dispatch_plan import DispatchPlan
from bigviz.core.dtypes import canonical_dtype
from bigviz.core.hardware import preset_budgets
from bigviz.core.pipeline import PipelinePlan
from bigviz.core.plan import DevicePlan
from bigviz.core.planner import PlanError
from bigviz.core.serialize import save_device_map
from bigviz.core.stages import make_pipeline_plan, pipeline_units
from bigviz.core.workload import Workload
from bigviz.core.counts import check_count
from bigviz.ui import controls as ctl
from bigviz.ui.figure import FigureView
from bigviz.ui.planner_controller import PlannerController
from bigviz.ui.planner_view import PlannerView
from bigviz.ui.presets import DTYPE_CHOICES
from bigviz.ui.report import report_fragment, save_html
from bigviz.ui.run import run_plan
from bigviz.ui.stages import StageControls
from bigviz.ui.state import PlannerState
from bigviz.ui.svg import figure_svg
from bigviz.ui.treemap import treemap
from bigviz.core.errors import UsageError

__all__ = ["Planner"]


class Planner:
    """An ipywidgets app to plan where a model's modules go, see it, fix it, export it, run it.

    A facade over three parts: the model (:class:`~bigviz.ui.state.PlannerState`: the
    settings, planned the way ``bigviz.plan`` plans), the view
    (:class:`~bigviz.ui.planner_view.PlannerView`: the plan drawn into the widgets, and the
    treemap, ``planner.view``) and the controller
    (:class:`~bigviz.ui.planner_controller.PlannerController`: widget events in).

    Args:
        model_or_checkpoint: an ``nn.Module`` (on meta is fine), a ``SizeTree`` or a
            checkpoint path (planned from its headers).
        max_memory: budgets, e.g. ``{0: "24GiB", "cpu": "64GiB"}``; default: this machine's
            free memory. GPUs you do not have can be planned for.
        strategy: ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"``.
        no_split_module_classes: classes kept whole; default: the model's ``_no_split_modules``.
        dtype: size floating weights as this dtype (``"float16"``, ``torch.bfloat16``, ...).
        depth: module levels drawn in the treemap (default: up to 4).
        live: ``False`` draws the treemap as a static figure re-drawn on each change, for
            frontends where plotly's ``FigureWidget`` stays blank (some Colab setups).
        batch_size, context_length, kv_dtype: the run planned beside the weights (see
            ``bigviz.plan``); the "Run" controls change them.
        reserve: bytes kept free per device (``{device: size}``, or one size for all); the
            reserve boxes show and change them. ``None``: once a run is planned, each device
            keeps its kind's default headroom (CUDA context and fragmentation on a GPU, the
            allocator's slack on the CPU; said in the plan's notes); ``0``: the bare arithmetic.
    """

    def __init__(
        self,
        model_or_checkpoint: Any,
        max_memory: Mapping[object, object] | None = None,
        *,
        strategy: str = "auto",
        no_split_module_classes: Collection[str] | None = None,
        dtype: object = None,
        depth: int | None = None,
        live: bool = True,
        batch_size: int = 1,
        context_length: int | None = None,
        kv_dtype: object = None,
        reserve: Mapping[object, object] | int | str | None = None,
    ) -> None:
        self.model = model_or_checkpoint if hasattr(model_or_checkpoint, "named_modules") else None
        self.state = PlannerState.from_model(
            model_or_checkpoint,
            max_memory,
            strategy=strategy,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
        )
        if reserve is not None:  # None: each device kind's default headroom once a run is planned
            given = reserve if isinstance(reserve, Mapping) else dict.fromkeys(self.state.budgets, reserve)
            for device, size in given.items():
                self.state.set_reserve(device, size)  # type: ignore[arg-type]
        self.state.set_workload(
            batch_size=batch_size,
            context_length=context_length or 0,
            kv_dtype=None if kv_dtype is None else canonical_dtype(kv_dtype),
        )
        self._longest: tuple[Any, dict[str, Any]] | None = None
        self._plan: DevicePlan = self.state.replan()
        self._error = ""
        self.quiet = False  # widget values set from code: their callbacks do not re-plan
        self.last_update_s = 0.0
        self.last_run: Any = None
        self._stages: PipelinePlan | None = None  # set in stage mode
        blocks = sum(role == "block" for _, role in pipeline_units(self.state.tree, self.state.no_split))
        self.stage_controls = StageControls(max_stages=blocks)
        self.controls = self._make_controls(strategy, depth)
        self.view = FigureView(self._plan, depth=self.depth, live=live)
        self.controller = PlannerController(self)
        self._rows = ctl.DeviceRows(self.controls.devices, self.controller.on_budget, self.controller.on_reserve)
        self.budget_sliders: dict[Device, Any] = self._rows.sliders  # the same dicts, kept in sync
        self.reserve_inputs: dict[Device, Any] = self._rows.reserves
        self.sync_device_rows()
        self.widget = ctl.assemble(self.controls, self.view.box, self.stage_controls.widget)
        self.panels = PlannerView(self.controls, self.stage_controls, self.state, self.widget.children[-1])
        self.panels.tabs.observe(
            lambda _: self.panels.show_dispatch(self._plan, error=bool(self._error)), names="selected_index"
        )
        self.controller.wire()
        if self.state.workload.active:
            self.find_longest_context()
        self._show(self._plan)
        if not self.view.live:
            self.controls.log.append_stdout(
                f"treemap shown static (FigureWidget unavailable: "
                f"{self.view.fallback_reason}); install anywidget for live updates\n"
            )

    def _make_controls(self, strategy: str, depth: int | None) -> Any:
        from bigviz.ui.treemap import layout_of

        layout = layout_of(self.state.tree)
        self.depth = depth if depth is not None else min(4, layout.max_depth)
        dtype_label = (
            next(k for k, v in DTYPE_CHOICES.items() if v == self.state.dtype)
            if self.state.dtype in DTYPE_CHOICES.values()
            else "as built"
        )
        w = self.state.workload
        return ctl.make_controls(
            strategy=strategy,
            dtype_label=dtype_label,
            no_split=", ".join(self.state.no_split),
            modules=[n for n in self.state.base_tree.nodes if n],
            depth=self.depth,
            max_depth=layout.max_depth,
            batch=w.batch_size,
            context=w.context_length,
            kv_label=next((k for k, v in ctl.KV_DTYPES.items() if v == w.kv_dtype), "as compute"),
            max_context=self.state.position_limit,
        )

    # ---- what it exports -----------------------------------------------------------
    @property
    def plan(self) -> DevicePlan:
        """The plan for the current settings (raises ``PlanError`` if they cannot be met)."""
        if self._error:
            raise PlanError(self._error)
        return self._plan

    @property
    def device_map(self) -> dict[str, Device]:
        """The cleaned device map, ready for ``load_checkpoint_and_dispatch`` or transformers."""
        return self.plan.device_map

    @property
    def pipeline_plan(self) -> PipelinePlan | None:
        """The pipeline stages shown in stage mode (``None`` in device mode)."""
        if self._error:
            raise PlanError(self._error)
        return self._stages

    def show_stages(self, stages: int | None = None, *, balance: str | None = None) -> None:
        """Colour the treemap by pipeline stage: ``stages`` stages (default: the control's),
        cut between no-split blocks as ``bigviz.plan_pipeline`` cuts them."""
        if stages is not None:
            check_count("stages", stages)
        with self.quietly():
            if stages is not None:
                self.stage_controls.count.value = stages
            if balance is not None:
                self.stage_controls.balance.value = balance
            self.stage_controls.mode.value = "stages"
        self.refresh()

    def show_devices(self) -> None:
        """Colour the treemap by device again."""
        with self.quietly():
            self.stage_controls.mode.value = "devices"
        self.refresh()

    @property
    def max_memory(self) -> dict[Device, int]:
        """The budgets in bytes (an unlimited disk left out)."""
        return self.state.max_memory

    @property
    def overrides(self) -> dict[str, Device]:
        return dict(self.state.overrides)

    @property
    def dispatch_plan(self) -> DispatchPlan:
        """What a dispatch of the current plan will do: its offload units (the module each
        hook sits on, where its weights are stored, what it fetches), in fetch order, the
        tensors that stay resident, and how each unit lives at run time; the Dispatch tab
        shows it (see ``bigviz.dispatch_plan``)."""
        return self.plan.dispatch_plan()

    @property
    def table(self) -> Any:
        """Every placement as a pandas DataFrame (module, class, device, bytes, reason, ...)."""
        return self.plan.to_frame()

    def cost(
        self, *, link: str | None = None, disk: str | None = None, plan: DevicePlan | None = None
    ) -> ForwardEstimate:
        """The predicted time per forward pass of the plan (``DevicePlan.cost``: reads from
        disk and copies to the GPU overlapped as its dispatch will stream them), at the disk
        bandwidth measured by :meth:`measure_disk`, else the bandwidths chosen in the UI."""
        plan = plan or self.plan
        probe = getattr(self, "disk_probe", None)
        bandwidth = probe.bandwidth if probe is not None else (disk or self.controls.disk.value)
        return plan.cost(disk_bandwidth=bandwidth, link_bandwidth=link or self.controls.link.value)

    def _cost_source(self) -> str:
        return "measured" if getattr(self, "disk_probe", None) is not None else "preset"

    def measure_disk(self, path: str | os.PathLike[str], **probe_options: Any) -> Any:
        """Measure the read bandwidth of the disk holding ``path`` (a checkpoint; cached per
        disk, see :func:`bigviz.checkpoint.probe.measure_read_bandwidth`): the predicted time
        per forward then uses it instead of the disk preset."""
        from bigviz.checkpoint.probe import measure_read_bandwidth

        self.disk_probe = measure_read_bandwidth(path, **probe_options)
        self.refresh()
        return self.disk_probe

    @property
    def workload(self) -> Workload:
        """The run planned beside the weights (batch size, context length, cache dtype)."""
        return self.state.workload

    def set_workload(
        self, *, batch_size: int | None = None, context_length: int | None = None, kv_dtype: object = False
    ) -> None:
        """Plan a run beside the weights: each layer's KV cache on the device it runs on and
        the prefill's activations on every device that runs a layer (``context_length=0``:
        weights only; ``kv_dtype=None``: the compute dtype). The controls follow, the plan
        and the longest context are found again."""
        dtype = kv_dtype if kv_dtype is False or kv_dtype is None else canonical_dtype(kv_dtype)
        self.state.set_workload(batch_size=batch_size, context_length=context_length, kv_dtype=dtype)
        w = self.state.workload
        with self.quietly():
            self.controls.batch.value, self.controls.context.value = w.batch_size, w.context_length
            self.controls.kv_dtype.value = next((k for k, v in ctl.KV_DTYPES.items() if v == w.kv_dtype), "as compute")
        self.find_longest_context()
        self.refresh()

    def longest_context(self, *, allow_offload: bool = False) -> int:
        """The longest context (tokens) whose run fits these settings: on the GPUs alone, or
        with modules streamed in from cpu and disk (``allow_offload=True``)."""
        return self.state.longest_context(allow_offload=allow_offload)

    def time_per_token(self, plan: DevicePlan | None = None) -> float:
        """Seconds each generated token spends streaming offloaded weights (:meth:`cost` of
        the plan, compute not counted, at the bandwidths chosen in the UI)."""
        return self.cost(plan=plan).seconds

    def find_longest_context(self) -> dict[str, Any]:
        """Find the longest context with and without offloading (what the "Longest context"
        button does) and the time per token of the offloaded one; shown under the run controls."""
        alone = self.state.longest_context()
        offload = self.state.longest_context(allow_offload=True)
        plan = self.state.fits(replace(self.state.workload, context_length=offload), allow_offload=True)
        result = {
            "batch_size": self.state.workload.batch_size,
            "no_offload": alone,
            "with_offload": offload,
            "seconds_per_token": self.time_per_token(plan) if plan is not None and offload else None,
        }
        self._longest = (self._settings(), result)
        self.controls.fit.value = self._fit_html()
        return result

    def save_json(self, path: str | os.PathLike[str]) -> str:
        """Write the device map as JSON (atomically), readable by ``bigviz.load_device_map``
        and by transformers' ``from_pretrained(device_map=json.load(...))``."""
        save_device_map(self.device_map, path)
        return str(path)

    def save_html(self, path: str | os.PathLike[str], *, title: str = "bigviz device plan") -> str:
        """Write a standalone report (treemap with plotly.js inlined, table, budgets)."""
        self.plan  # noqa: B018 - refuse to write a report of settings that do not plan
        return save_html(self, path, title=title, depth=self.depth)

    # ---- what it changes -----------------------------------------------------------
    def assign(self, module: str, device: object) -> None:
        """Keep ``module`` on ``device`` through every re-plan; marked with a pencil and a
        black border in the treemap."""
        self.state.assign(module, device)
        self.refresh()

    def unassign(self, module: str) -> None:
        """Let the planner place ``module`` again."""
        self.state.unassign(module)
        self.refresh()

    def set_budget(self, device: object, size: int | str) -> None:
        """Set one device's budget (bytes or ``"10GiB"``); its slider follows."""
        self.state.set_budget(device, size)
        self.sync_device_rows()
        self.refresh()

    def add_gpu(self, size: int | str | None = None) -> int:
        """Add a GPU (default budget: the last GPU's) and re-plan; returns its index."""
        index = self.state.add_gpu(size)
        self._devices_changed([], ctl.CUSTOM)
        return index

    def remove_gpu(self) -> None:
        """Remove the last GPU (and the overrides that named it) and re-plan."""
        gpus = self.state.gpus()
        if not gpus:
            raise UsageError("there is no GPU to remove")
        self._devices_changed(self.state.remove_device(gpus[-1]), ctl.CUSTOM)

    def apply_preset(self, name: str) -> None:
        """Plan for a hardware preset (see ``bigviz.core.hardware.HARDWARE_PRESETS``)."""
        budgets = preset_budgets(name)
        label = next((k for k in self.controls.preset.options if k.startswith(name)), ctl.CUSTOM)
        self._devices_changed(self.state.set_budgets(budgets), label)

    def load_and_dispatch(self, checkpoint: str | os.PathLike[str], **kwargs: Any) -> Any:
        """Load ``checkpoint`` with this plan (``bigviz.load_checkpoint_and_dispatch``), then
        show the memory measured per device next to the plan's prediction.

        Keyword arguments go to the engine (``offload_folder``, ``strict``, ...); ``model=``
        gives the model when the planner was made from a checkpoint or a tree.
        """
        model = kwargs.pop("model", None) or self.model
        if model is None:
            raise UsageError(
                "this planner was made from a checkpoint or a size tree: pass the model "
                "to run, e.g. planner.load_and_dispatch(path, model=model)"
            )
        bar = self.controls.progress

        def progress(step: int, message: str) -> None:
            bar.value, bar.description = step, f"{step}/3"
            self.controls.run_result.value = html.escape(message)

        if self.state.quantization is not None:
            kwargs.setdefault("quantization", self.state.quantization)
        model, self.last_run = run_plan(
            self.plan, model, checkpoint, dtype=self.state.dtype, progress=progress, **kwargs
        )
        self.controls.run_result.value = self.last_run.html()
        return model

    def close(self) -> None:
        """Close the planner's widgets (in a long notebook session, frees their comms)."""
        for widget in [*self.budget_sliders.values(), *self.reserve_inputs.values(), *self._rows.rows.values()]:
            widget.close()
        self.controls.close()
        self.stage_controls.close()
        self.view.close()
        self.widget.close()

    def refresh(self) -> None:
        """Re-plan with the current settings and update every view."""
        start = time.perf_counter()
        try:
            plan = self.state.replan()
            stages = self._plan_stages()
        except PlanError as err:  # a PipelineError too
            self._error = str(err)
            self.panels.show_error(self._error, self._fit_html())
            return
        self._error = ""
        self._plan, self._stages = plan, stages
        self.view.update(stages or plan, self.panels.layout())
        self._show(plan)
        self.last_update_s = time.perf_counter() - start
        self.panels.show_timing(self.last_update_s)

    def show_cost(self) -> None:
        """Draw the cost sentence again (the bandwidths changed)."""
        self.controls.cost.value = self.panels.cost_html(self.cost(), self._cost_source())

    def _plan_stages(self) -> PipelinePlan | None:
        """The pipeline plan in stage mode (same tree, dtype and no-split classes), else None."""
        c = self.stage_controls
        if c.mode.value != "stages":
            return None
        return make_pipeline_plan(
            self.state.tree,
            c.count.value,
            no_split=self.state.no_split,
            balance=c.balance.value,
            dtype=self.state.dtype,
        )

    # ---- display -------------------------------------------------------------------
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict[str, Any]:
        """The live widget where a frontend runs widgets; for every other reader (GitHub,
        nbviewer, nbconvert, an untrusted or offline notebook) the treemap as SVG
        (``image/svg+xml``) and the report with that SVG and the table (``text/html``),
        neither with any script; the plan summary as text."""
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        fig = treemap(self._plan, depth=self.depth)
        bundle["image/svg+xml"] = figure_svg(fig)
        bundle["text/html"] = report_fragment(
            self._plan, max_rows=200, cost=self._cost_or_none(), depth=self.depth, figure=fig
        )
        bundle["text/plain"] = self._plan.summary()
        return bundle

    def __repr__(self) -> str:
        return f"Planner({self._plan.summary()})"

    def _cost_or_none(self) -> ForwardEstimate | None:
        return None if self._error else self.cost()

    def _show(self, plan: DevicePlan) -> None:
        self.panels.show(
            plan, self._stages, self.panels.cost_html(self.cost(plan=plan), self._cost_source()), self._fit_html()
        )
        with self.quietly():  # a device with no reserve of its own shows the headroom the plan keeps there
            for u in plan.usage:
                if u.device in self.reserve_inputs and u.device not in self.state.reserve:
                    self.reserve_inputs[u.device].value = u.reserve / ctl.GiB

    def _settings(self) -> tuple[Any, ...]:
        """What the longest context depends on (to tell when a result is out of date)."""
        s = self.state
        return (
            tuple(s.budgets.items()),
            tuple(s.reserve.items()),
            s.strategy,
            s.dtype,
            s.unquantized,
            s.no_split,
            tuple(s.overrides.items()),
            s.workload.batch_size,
            s.workload.kv_dtype,
        )

    def _fit_html(self) -> str:
        """The run's verdict: this plan's time per token, and the longest context that fits."""
        plan = None if self._error else self._plan
        per_token = self.time_per_token(plan) if plan is not None and self.state.workload.active else None
        longest, stale = None, False
        if self._longest is not None:
            settings, longest = self._longest
            stale = settings != self._settings()
        return self.panels.fit_html(plan, per_token, longest, stale)

    def keep_unquantized(self, *modules: str) -> None:
        """With the dtype ``int8`` / ``int4``: keep ``modules`` in high precision (their weights
        are not quantized; e.g. ``planner.keep_unquantized("model.layers.0")``), and re-plan."""
        self.state.keep_unquantized(modules)
        self.refresh()

    # ---- wiring --------------------------------------------------------------------
    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        """Set widget values from code without their callbacks re-planning."""
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def sync_device_rows(self) -> None:
        """The budget and reserve rows follow the state's devices (a slider per device)."""
        model_bytes = max(t.total("") for t in [self.state.base_tree, self.state.tree])
        self._rows.sync(self.state.max_memory, self.state.reserve, model_bytes, self.quietly)
        targets = list(self.state.budgets) + ([] if "disk" in self.state.budgets else ["disk"])
        with self.quietly():
            self.controls.target.options = ctl.device_options(targets)

    def _devices_changed(self, dropped: list[str], preset_label: str) -> None:
        with self.quietly():
            self.controls.preset.value = preset_label
        self.sync_device_rows()
        self.refresh()
        if dropped:
            self.controls.log.append_stdout(f"overrides dropped with their device: {', '.join(dropped)}\n")
