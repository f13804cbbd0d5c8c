"""bigviz.engine: run a device map — hooks, offload units, prefetch, dispatch.

Modules, bottom up:

- :mod:`~bigviz.engine.hooks`: accelerate's four-method hook protocol (``ModelHook``,
  ``add_hook_to_module``, ``remove_hook_from_module``) and ``remove_hooks``.
- :mod:`~bigviz.engine.devices`: torch devices for map values, "does this machine have
  it", moving nested arguments.
- :mod:`~bigviz.engine.weights`: tensor slots and tie groups; stores (pinned dicts,
  ``LazyWeights`` over safetensors); the offload folder.
- :mod:`~bigviz.engine.binding`: a dispatch plan's units bound to the model's tensor slots
  and stores (``BoundUnit``), and its resident tensors.
- :mod:`~bigviz.engine.fetchers`: how a unit's weights are read, one class per way (zero-copy
  CPU, side-stream CUDA through pinned staging, an ``O_DIRECT`` ring, the page cache).
- :mod:`~bigviz.engine.scheduler`: when: the next units in recorded order, as far ahead as
  the stream plan says.
- :mod:`~bigviz.engine.resident`: the resident copy ("cpu" weights of a model larger than
  RAM read once into process memory, when the stream plan says ``"copy"``) and
  ``bigviz.residency(model)``, what a dispatch did.
- :mod:`~bigviz.engine.offload_hooks`: the hooks a dispatch attaches.
- :mod:`~bigviz.engine.dispatch`: ``dispatch_model`` (executes a dispatch plan, its stream
  plan included: the engine decides nothing).
- :mod:`~bigviz.engine.big_modeling`: ``load_checkpoint_and_dispatch``, ``cpu_offload``,
  ``cpu_offload_with_hook``, ``disk_offload``.

The public names are exported from ``bigviz`` itself (``bigviz.dispatch_model`` ...).
"""
