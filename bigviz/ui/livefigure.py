"""The live treemap's two widgets: a ``FigureWidget`` whose synced state is always the
current figure, and an invisible helper that fits it to its column and reports clicks.

plotly's ``FigureWidget`` (an anywidget) sends each change to the browser as a one-off
message and keeps its synced state (``_widget_data``, ``_widget_layout``) at the figure it
was built with. Two consequences, both fixed by :class:`LiveFigure`:

* **The first display could stay blank.** The widget opens its comm (the browser creates the
  model from the state in that message) before plotly has set the figure's data, which then
  follows as an update; plotly's view draws the model's data once, when it renders, and ignores
  later data updates. On a busy machine the view can render between the two messages and show
  empty axes for good (Notebook 7, three times in four). :class:`LiveFigure` opens its comm
  only once the figure is built, so the first state the browser gets holds the figure.
* **A reload drew the first figure.** A page that reconnects to a running kernel asks for
  every widget's state. :class:`LiveFigure` answers with the figure as it is now; the
  messages of ordinary updates are unchanged.
* **Updates could be lost for good.** anywidget (0.11) gives a model 2 s to load its code
  (plotly's is a 5 MB bundle) and, on a busy machine that needs longer, drops every message
  the kernel sends that model afterwards: the figure shows its first state and never changes.
  plotly's view answers each update it applies (its trace and layout deltas, with the update's
  edit id), so :class:`LiveFigure` notices an update a drawn view never answered within
  :data:`LOST_AFTER_S` and calls the ``on_lost`` callbacks: the Planner then shows a new
  figure widget, whose first state holds the current figure (``bigviz.ui.figure``).

plotly draws a widget before it is in the page, when its width is unknown, so it used a
fixed 700 px and overflowed narrower columns; it never listens for its container's size.
:class:`FigureHelper` watches the column that holds the figure (a ``ResizeObserver``) and
asks plotly to resize the figure to it (plotly's own ``responsive`` resize handler), after
the first draw and whenever the column changes size. It also listens for clicks on the
figure's tiles and sends the clicked tile's id to Python: the ``FigureWidget``'s own click
events do not reach Python for a tile that plotly zooms into (checked in JupyterLab 4.6).

Example:
    >>> import plotly.graph_objects as go
    >>> fig = LiveFigure(go.Figure(go.Treemap(ids=["a"], parents=[""], values=[1])))
    >>> with fig.batch_update():
    ...     fig.data[0].values = [2]
    >>> fig.get_state()["_widget_data"][0]["values"]  # a reconnecting page draws this
    [2]
    >>> LiveFigure(go.Figure(go.Bar(y=[3]))).comm is not None  # opened, with the figure in it
    True
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from typing import Any

import anywidget
import plotly.graph_objects as go
import traitlets

__all__ = ["LiveFigure", "FigureHelper", "LOST_AFTER_S"]

LOST_AFTER_S = 4.0
"""Seconds a drawn view may take to answer an update before the update counts as lost."""
_SENT = ["_py2js_update", "_py2js_restyle", "_py2js_relayout", "_py2js_addTraces", "_py2js_deleteTraces"]

_HELPER_ESM = """
function render({ model, el }) {
  el.style.display = "none";  // nothing to see: it watches the column and its figures
  const selector = "." + model.get("column_class");
  const wired = new WeakSet();
  let column = null, observer = null, frame = 0, tries = 0;
  const figures = () => column ? [...column.querySelectorAll(".js-plotly-plot")] : [];
  const fit = () => {
    for (const gd of figures()) {
      // plotly's resize for `responsive: true` figures: fills gd's width, skips hidden ones
      if (typeof gd._responsiveChartHandler === "function") gd._responsiveChartHandler();
      if (!wired.has(gd) && typeof gd.on === "function") {  // once per drawn figure
        wired.add(gd);
        gd.on("plotly_click", (event) => {
          const point = event && event.points && event.points[0];
          if (point && typeof point.id === "string") model.send({ event: "click", id: point.id });
        });
      }
    }
  };
  const schedule = () => { cancelAnimationFrame(frame); frame = requestAnimationFrame(fit); };
  const attach = () => {
    column = el.closest(selector);
    if (!column) {  // not in the page yet: look again on the next frames (a few seconds at most)
      if (tries++ < 600) frame = requestAnimationFrame(attach);
      return;
    }
    observer = new ResizeObserver(schedule);
    observer.observe(column);
    schedule();
  };
  const drawn = (event) => {  // plotly's event after each first draw of a figure view
    if (column && event.detail && column.contains(event.detail.element)) schedule();
  };
  document.addEventListener("plotlywidget-after-render", drawn);
  attach();
  return () => {
    cancelAnimationFrame(frame);
    if (observer) observer.disconnect();
    document.removeEventListener("plotlywidget-after-render", drawn);
  };
}
export default { render };
"""


class FigureHelper(anywidget.AnyWidget):
    """An invisible widget for the plotly figures in the box of CSS class ``column_class``
    that holds it: they follow the box's width, and a click on a tile calls the functions
    given to :meth:`on_click` with the tile's id."""

    _esm = _HELPER_ESM
    column_class = traitlets.Unicode("bigviz-figure-column").tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._click_handlers: list[Callable[[str], None]] = []
        self.on_msg(self._received)

    def on_click(self, handler: Callable[[str], None]) -> None:
        self._click_handlers.append(handler)

    def _received(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("event") == "click" and isinstance(content.get("id"), str):
            for handler in self._click_handlers:
                handler(content["id"])


class LiveFigure(go.FigureWidget):
    """A ``FigureWidget`` that opens its comm with the figure in it, and whose state, as a
    reconnecting page reads it, is the current figure."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._building = True  # ipywidgets opens the comm inside __init__: not yet (see open)
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._building = False
        self._drawn = False  # a view drew the figure (plotly's view reports its first draw)
        self._unanswered_since: float | None = None  # when the oldest update no view answered was sent
        self._lost_handlers: list[Callable[[], None]] = []
        self.observe(self._sent, names=_SENT)
        self.observe(self._answered, names=["_js2py_traceDeltas", "_js2py_layoutDelta"])
        self.open()

    def on_lost(self, handler: Callable[[], None]) -> None:
        """Call ``handler()`` when an update to a drawn figure was not answered in time."""
        self._lost_handlers.append(handler)

    @property
    def drawn(self) -> bool:
        """A view of the figure has drawn it (plotly's view reports each draw)."""
        return self._drawn

    @property
    def lost(self) -> bool:
        """True when a view drew the figure and has not answered an update sent
        :data:`LOST_AFTER_S` ago or more: the browser is not applying updates."""
        since = self._unanswered_since
        return self._drawn and since is not None and time.monotonic() - since >= LOST_AFTER_S

    def _sent(self, change: Any) -> None:
        if change["new"] is None or self._unanswered_since is not None:
            return
        self._unanswered_since = time.monotonic()
        try:
            loop = asyncio.get_running_loop()  # the kernel's: the check runs between its messages
        except RuntimeError:  # no event loop (a script, a test): nothing can answer anyway
            return
        loop.call_later(LOST_AFTER_S + 0.1, self._check)

    def _answered(self, change: Any) -> None:
        msg = change["new"]
        if not msg:
            return
        self._drawn = True
        last = self._last_trace_edit_id if "trace_edit_id" in msg else self._last_layout_edit_id
        # the id of an edit the kernel sent (>= 1) comes back only from a view that received it;
        # id 0 is a first draw from the state the model was created with, which proves nothing
        if last >= 1 and msg.get("trace_edit_id", msg.get("layout_edit_id")) == last:
            self._unanswered_since = None

    def _check(self) -> None:
        if self.lost and self.comm is not None:
            for handler in list(self._lost_handlers):
                handler()

    def renewed(self) -> LiveFigure:
        """A new widget of this figure as it is now (a new comm: the browser creates a new model
        whose first state is the current figure), with the same config and ``on_lost`` handlers."""
        fresh = LiveFigure(go.Figure(data=self.data, layout=self.layout))
        fresh._config = self._config
        for handler in self._lost_handlers:
            fresh.on_lost(handler)
        return fresh

    def open(self) -> None:
        """Open the comm, once the figure is built: the browser's model starts with its data."""
        if not getattr(self, "_building", False):
            super().open()

    def get_state(self, key: Any = None, drop_defaults: bool = False) -> dict[str, Any]:
        state = super().get_state(key, drop_defaults)
        if getattr(self, "_layout_obj", None) is None:  # asked while the widget opens, before plotly's init
            return state
        current = {"_widget_data": self._data, "_widget_layout": self._layout_obj._props}
        for name, value in current.items():
            if name in state:  # the full-state reply (a reconnect), not an update message
                to_json = self.trait_metadata(name, "to_json")
                value = copy.deepcopy(value)
                state[name] = to_json(value, self) if to_json else value
        return state
