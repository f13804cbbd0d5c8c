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
import functools
import html
import json
import os
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from typing import Any

from bigviz.core.pipeline import PipelinePlan
from bigviz.core.dispatch_plan import DispatchPlan
from bigviz.core.plan import DevicePlan
from bigviz.core.serialize import save_device_map
from bigviz.core.stages import make_pipeline_plan, pipeline_units
from bigviz.core.planner import PlanError, check_no_split
from bigviz.core.dtypes import canonical_dtype
from bigviz.core.devices import Device
from bigviz.core.sizes import format_size
from bigviz.core.workload import Workload
from bigviz.ui import controls as ctl
from bigviz.ui.figure import FigureView
from bigviz.ui.palette import chip, legend_html
from bigviz.core.cost import plan_cost, preset_budgets
from bigviz.ui.presets import DTYPE_CHOICES, cost_html
from bigviz.ui.report import dispatch_html, report_fragment, save_html, table_html, usage_html
from bigviz.ui.run import describe_error, run_plan
from bigviz.ui.stages import StageControls, stage_legend_html
from bigviz.ui.state import PlannerState
from bigviz.ui.svg import figure_svg
from bigviz.ui.treemap import TreemapLayout, layout_of, treemap

__all__ = ["Planner"]

DISPATCH_TAB = 1  # index of the Dispatch tab (ui/controls.assemble)
TABLE_ROWS = 300  # rows drawn in the widget; planner.table has them all


def _guarded(method: Callable[..., None]) -> Callable[..., None]:
    """A widget callback whose errors land, visible, in the planner's log (not lost)."""

    @functools.wraps(method)
    def callback(self: Planner, *args: Any) -> None:
        if self._quiet:
            return
        try:
            method(self, *args)
        except Exception as err:  # shown to the person at the controls, who can fix it
            self.controls.status.value = describe_error(err)
            self.controls.log.append_stderr(traceback.format_exc())

    return callback


class Planner:
    """An ipywidgets app to plan where a model's modules go, see it, fix it, export it, run it.

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
    ) -> None:
        self.model = model_or_checkpoint if hasattr(model_or_checkpoint, "named_modules") else None
        self.state = PlannerState.from_model(
            model_or_checkpoint,
            max_memory,
            strategy=strategy,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
        )
        self.state.set_workload(
            batch_size=batch_size,
            context_length=context_length or 0,
            kv_dtype=None if kv_dtype is None else canonical_dtype(kv_dtype),
        )
        self._longest: tuple[Any, dict[str, Any]] | None = None
        self._plan: DevicePlan = self.state.replan()
        self._error = ""
        self._quiet = False
        self._layouts: dict[tuple[str | None, tuple[str, ...]], TreemapLayout] = {}
        self.last_update_s = 0.0
        self.last_run: Any = None
        layout = self._layout()
        self.depth = depth if depth is not None else min(4, layout.max_depth)
        self.view = FigureView(self._plan, depth=self.depth, live=live)
        self._stages: PipelinePlan | None = None  # set in stage mode
        blocks = sum(role == "block" for _, role in pipeline_units(self.state.tree, self.state.no_split))
        self.stage_controls = StageControls(max_stages=blocks)
        dtype_label = (
            next(k for k, v in DTYPE_CHOICES.items() if v == self.state.dtype)
            if self.state.dtype in DTYPE_CHOICES.values()
            else "as built"
        )
        w = self.state.workload
        kv_label = next((k for k, v in ctl.KV_DTYPES.items() if v == w.kv_dtype), "as compute")
        self.controls = ctl.make_controls(
            strategy=strategy,
            dtype_label=dtype_label,
            no_split=", ".join(self.state.no_split),
            modules=[n for n in self.state.base_tree.nodes if n],
            depth=self.depth,
            max_depth=layout.max_depth,
            batch=w.batch_size,
            context=w.context_length,
            kv_label=kv_label,
            max_context=self.state.position_limit,
        )
        self._rows = ctl.DeviceRows(self.controls.devices, self._on_budget, self._on_reserve)
        self.budget_sliders: dict[Device, Any] = self._rows.sliders  # the same dicts, kept in sync
        self.reserve_inputs: dict[Device, Any] = self._rows.reserves
        self._sync_device_rows()
        self.widget = ctl.assemble(self.controls, self.view.box, self.stage_controls.widget)
        self._tabs = self.widget.children[-1]
        self._dispatch_shown: DevicePlan | None = None  # the plan the Dispatch tab shows
        self._tabs.observe(lambda _: self._show_dispatch(), names="selected_index")
        self._wire()
        if w.active:
            self.find_longest_context()
        self._show(self._plan)
        if not self.view.live:
            self.controls.log.append_stdout(
                f"treemap shown static (FigureWidget unavailable: "
                f"{self.view.fallback_reason}); install anywidget for live updates\n"
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
        with self._quietly():
            if stages is not None:
                self.stage_controls.count.value = stages
            if balance is not None:
                self.stage_controls.balance.value = balance
            self.stage_controls.mode.value = "stages"
        self.refresh()

    def show_devices(self) -> None:
        """Colour the treemap by device again."""
        with self._quietly():
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
        hook sits on, where its weights are stored, what it fetches), in fetch order, and the
        tensors that stay resident; the Dispatch tab shows it (see ``bigviz.dispatch_plan``)."""
        return self.plan.dispatch_plan()

    @property
    def table(self) -> Any:
        """Every placement as a pandas DataFrame (module, class, device, bytes, reason, ...)."""
        return self.plan.to_frame()

    def cost(self, *, link: str | None = None, disk: str | None = None) -> dict[str, Any]:
        """Bytes streamed per forward pass and their predicted time (see ``plan_cost``);
        the bandwidths default to the ones chosen in the UI."""
        plan = self.plan
        cost = plan_cost(
            plan.offloaded_bytes(),
            main_device=plan.main_device,
            link=link or self.controls.link.value,
            disk=disk or self.controls.disk.value,
        )
        return _with_forward_estimate(cost, plan, getattr(self, "disk_probe", None))  # issue 12

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
        with self._quietly():
            self.controls.batch.value, self.controls.context.value = w.batch_size, w.context_length
            self.controls.kv_dtype.value = next((k for k, v in ctl.KV_DTYPES.items() if v == w.kv_dtype), "as compute")
        self.find_longest_context()
        self.refresh()

    def longest_context(self, *, allow_offload: bool = False) -> int:
        """The longest context (tokens) whose run fits these settings: on the GPUs alone, or
        with modules streamed in from cpu and disk (``allow_offload=True``)."""
        return self.state.longest_context(allow_offload=allow_offload)

    def time_per_token(self, plan: DevicePlan | None = None) -> float:
        """Seconds each generated token spends at least streaming offloaded weights (the cost
        model of :meth:`cost`, at the bandwidths chosen in the UI)."""
        plan = plan or self.plan
        return plan_cost(
            plan.offloaded_bytes(),
            main_device=plan.main_device,
            link=self.controls.link.value,
            disk=self.controls.disk.value,
        )["seconds_per_forward"]

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
        self._sync_device_rows()
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
            raise ValueError("there is no GPU to remove")
        self._devices_changed(self.state.remove_device(gpus[-1]), ctl.CUSTOM)

    def apply_preset(self, name: str) -> None:
        """Plan for a hardware preset (see ``bigviz.ui.presets.HARDWARE_PRESETS``)."""
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
            raise ValueError(
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
            self.controls.status.value = (
                f"<div style='color:#D55E00;white-space:pre-wrap'><b>Does not plan:</b> {html.escape(str(err))}</div>"
            )
            self.controls.fit.value = self._fit_html()
            return
        self._error = ""
        self._plan, self._stages = plan, stages
        self.view.update(stages or plan, self._layout())
        self._show(plan)
        self.last_update_s = time.perf_counter() - start
        self.controls.status.value = (
            f"<span style='color:#555;font-size:12px'>re-planned in {self.last_update_s * 1000:.0f} ms</span>"
        )

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

    def _cost_or_none(self) -> dict[str, Any] | None:
        return None if self._error else self.cost()

    def _show(self, plan: DevicePlan) -> None:
        c = self.controls
        root = plan.tree.nodes[""] if plan.tree is not None else None
        dtype = self.state.dtype or "as built"
        c.title.value = (
            f"<b style='font-size:15px'>bigviz planner</b>: {html.escape(root.class_name if root else '')}"
            f", {format_size(root.total_bytes if root else 0)} ({dtype})"
        )
        captions = {u.device: f"{format_size(u.used)}" for u in plan.usage}
        c.legend.value = (
            legend_html([u.device for u in plan.usage], captions=captions)
            if self._stages is None
            else stage_legend_html(self._stages)
        )
        self.stage_controls.show(self._stages)
        c.usage.value = usage_html(plan) + "".join(
            f"<div style='font-size:11px;color:#555'>{html.escape(n)}</div>" for n in plan.notes
        )
        c.cost.value = cost_html(self.cost())
        c.fit.value = self._fit_html()
        c.table.value = table_html(plan, max_rows=TABLE_ROWS)
        self._show_dispatch()
        c.overrides.value = self._overrides_html()

    def _show_dispatch(self) -> None:
        """Fill the Dispatch tab when it is open (a slider move re-plans in milliseconds; the
        dispatch plan of a thousand modules is made only when someone looks at it)."""
        if self._tabs.selected_index != DISPATCH_TAB or self._error or self._dispatch_shown is self._plan:
            return
        self.controls.dispatch.value = dispatch_html(self._plan)
        self._dispatch_shown = self._plan

    def _settings(self) -> tuple[Any, ...]:
        """What the longest context depends on (to tell when a result is out of date)."""
        s = self.state
        return (
            tuple(s.budgets.items()),
            tuple(s.reserve.items()),
            s.strategy,
            s.dtype,
            s.no_split,
            tuple(s.overrides.items()),
            s.workload.batch_size,
            s.workload.kv_dtype,
        )

    def _fit_html(self) -> str:
        """The run's verdict: this plan's time per token, and the longest context that fits."""
        w = self.state.workload
        lines = []
        if w.active and not self._error:
            seconds = self.time_per_token(self._plan)
            lines.append(
                f"This plan ({w.batch_size} x {w.context_length:,} tokens): "
                + (
                    f"at least <b>{seconds * 1000:,.0f} ms per token</b> streaming offloaded weights"
                    if seconds
                    else "nothing offloaded, no weights stream per token"
                )
            )
        if self._longest is not None:
            settings, found = self._longest
            stale = " <i>(settings changed: press Longest context)</i>" if settings != self._settings() else ""
            per_token = found["seconds_per_token"]
            cost = f", at least {per_token * 1000:,.1f} ms per token" if per_token else ""
            lines.append(
                f"Longest context (batch {found['batch_size']}): <b>{found['no_offload']:,} tokens</b> "
                f"without offloading, {found['with_offload']:,} with offloading{cost}{stale}"
            )
        elif self.state.run_specs is not None:
            lines.append("<i>Set a context length, or press Longest context.</i>")
        return "<div class='bigviz-fit' style='font-size:12px'>" + "<br>".join(lines) + "</div>"

    def _overrides_html(self) -> str:
        if not self.state.overrides:
            return "<i>No overrides: pick a module and a device, then Assign.</i>"
        items = "".join(f"<li><code>{html.escape(m)}</code> on {chip(d)}</li>" for m, d in self.state.overrides.items())
        return f"<ul>{items}</ul>"

    def keep_unquantized(self, *modules: str) -> None:
        """With the dtype ``int8`` / ``int4``: keep ``modules`` in high precision (their weights
        are not quantized; e.g. ``planner.keep_unquantized("model.layers.0")``), and re-plan."""
        self.state.keep_unquantized(modules)
        self.refresh()

    def _layout(self) -> TreemapLayout:
        key = (self.state.dtype, self.state.unquantized)
        if key not in self._layouts:
            self._layouts[key] = layout_of(self.state.tree)
        return self._layouts[key]

    # ---- wiring --------------------------------------------------------------------
    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """Set widget values from code without their callbacks re-planning."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def _sync_device_rows(self) -> None:
        model_bytes = max(t.total("") for t in [self.state.base_tree, self.state.tree])
        self._rows.sync(self.state.max_memory, self.state.reserve, model_bytes, self._quietly)
        targets = list(self.state.budgets) + ([] if "disk" in self.state.budgets else ["disk"])
        with self._quietly():
            self.controls.target.options = ctl.device_options(targets)

    def _devices_changed(self, dropped: list[str], preset_label: str) -> None:
        with self._quietly():
            self.controls.preset.value = preset_label
        self._sync_device_rows()
        self.refresh()
        if dropped:
            self.controls.log.append_stdout(f"overrides dropped with their device: {', '.join(dropped)}\n")

    def _wire(self) -> None:
        c = self.controls
        c.preset.observe(self._on_preset, names="value")
        c.add_gpu.on_click(self._on_add_gpu)
        c.remove_gpu.on_click(self._on_remove_gpu)
        c.strategy.observe(self._on_strategy, names="value")
        c.dtype.observe(self._on_dtype, names="value")
        c.no_split.observe(self._on_no_split, names="value")
        c.link.observe(self._on_bandwidth, names="value")
        c.disk.observe(self._on_bandwidth, names="value")
        c.depth.observe(self._on_depth, names="value")
        c.assign.on_click(self._on_assign)
        c.unassign.on_click(self._on_unassign)
        c.save_json.on_click(self._on_save_json)
        c.save_html.on_click(self._on_save_html)
        c.run.on_click(self._on_run)
        for control in (self.stage_controls.mode, self.stage_controls.count, self.stage_controls.balance):
            control.observe(self._on_stages, names="value")
        c.batch.observe(self._on_workload, names="value")
        c.context.observe(self._on_workload, names="value")
        c.kv_dtype.observe(self._on_workload, names="value")
        c.find_context.on_click(self._on_find_context)
        self.view.on_pick(self._on_pick)

    @_guarded
    def _on_budget(self, device: Device, change: Mapping[str, Any]) -> None:
        self.state.set_budget(device, round(change["new"] * ctl.GiB))
        self.refresh()

    @_guarded
    def _on_reserve(self, device: Device, change: Mapping[str, Any]) -> None:
        self.state.set_reserve(device, round(change["new"] * ctl.GiB))
        self.refresh()

    @_guarded
    def _on_preset(self, change: Mapping[str, Any]) -> None:
        if change["new"] != ctl.CUSTOM:
            self.apply_preset(change["new"])

    @_guarded
    def _on_add_gpu(self, _button: Any) -> None:
        self.add_gpu()

    @_guarded
    def _on_remove_gpu(self, _button: Any) -> None:
        self.remove_gpu()

    @_guarded
    def _on_strategy(self, change: Mapping[str, Any]) -> None:
        self.state.strategy = change["new"]
        self.refresh()

    @_guarded
    def _on_dtype(self, change: Mapping[str, Any]) -> None:
        self.state.set_dtype(DTYPE_CHOICES[change["new"]])
        self._sync_device_rows()  # a bigger dtype may need longer sliders
        self.refresh()

    @_guarded
    def _on_no_split(self, change: Mapping[str, Any]) -> None:
        names = tuple(s.strip() for s in change["new"].split(",") if s.strip())
        check_no_split(self.state.base_tree, names)  # a typo is shown, not silently ignored
        self.state.no_split = names
        self.refresh()

    @_guarded
    def _on_bandwidth(self, _change: Mapping[str, Any]) -> None:
        self.controls.cost.value = cost_html(self.cost())

    @_guarded
    def _on_depth(self, change: Mapping[str, Any]) -> None:
        self.depth = change["new"]
        self.view.set_depth(self.depth)

    @_guarded
    def _on_stages(self, _change: Mapping[str, Any]) -> None:
        self.refresh()

    def _on_pick(self, module: str) -> None:
        """A treemap tile was clicked: its module goes into the search box, ready to assign."""
        self.controls.module.value = module

    @_guarded
    def _on_assign(self, _button: Any) -> None:
        self.assign(self.controls.module.value, self.controls.target.value)

    @_guarded
    def _on_unassign(self, _button: Any) -> None:
        self.unassign(self.controls.module.value)

    @_guarded
    def _on_save_json(self, _button: Any) -> None:
        path = self.save_json(self.controls.json_path.value)
        text = json.dumps(self.device_map, indent=1)
        self.controls.json_view.value = (
            f"<div>Wrote <code>{html.escape(os.path.abspath(path))}</code>:</div>"
            f"<pre style='max-height:300px;overflow:auto'>{html.escape(text)}</pre>"
        )

    @_guarded
    def _on_save_html(self, _button: Any) -> None:
        path = self.save_html(self.controls.html_path.value)
        self.controls.json_view.value = f"<div>Wrote <code>{html.escape(os.path.abspath(path))}</code></div>"

    @_guarded
    def _on_workload(self, _change: Mapping[str, Any]) -> None:
        c = self.controls
        self.set_workload(
            batch_size=c.batch.value, context_length=c.context.value, kv_dtype=ctl.KV_DTYPES[c.kv_dtype.value]
        )

    @_guarded
    def _on_find_context(self, _button: Any) -> None:
        self.find_longest_context()

    @_guarded
    def _on_run(self, _button: Any) -> None:
        kwargs = {"offload_folder": self.controls.offload_folder.value} if self.controls.offload_folder.value else {}
        self.load_and_dispatch(self.controls.checkpoint.value, **kwargs)


def _with_forward_estimate(cost: dict[str, Any], plan: DevicePlan, probe: Any) -> dict[str, Any]:
    """``cost`` plus the pipeline prediction of a forward (reads overlapped with compute, the
    resident part read once), at the measured disk bandwidth when there is one."""
    from bigviz.core.streaming import forward_estimate

    bandwidth = probe.bandwidth if probe is not None else cost["disk_bandwidth"]
    link = cost["link_bandwidth"] if plan.main_device != "cpu" else None
    estimate = forward_estimate(plan, disk_bandwidth=bandwidth, link_bandwidth=link)
    source = f"measured {bandwidth / 1e9:.2f} GB/s" if probe is not None else f"preset {bandwidth / 1e9:.2f} GB/s"
    return {
        **cost,
        "forward_seconds": estimate.seconds,
        "forward_first_seconds": estimate.first_seconds,
        "forward": f"Predicted (disk {source}, compute not counted): {estimate.explain()}",
    }
