"""A four-method hook protocol around ``nn.Module.forward``, as accelerate defines it.

A hook sees a module's call before (``pre_forward``: may rewrite the arguments) and after
(``post_forward``: may rewrite the output); ``init_hook`` runs when it is attached and
``detach_hook`` when it is removed. The protocol, the argument names and the attributes
written on the module (``_hf_hook``, ``_old_forward``) are accelerate's, so hooks written
for accelerate attach here unchanged, and the reverse.

Everything the dispatch engine does at run time (moving inputs, streaming offloaded
weights in, prefetching) is one of these hooks; removing them restores the module.

Example:
    >>> import torch
    >>> class Double(ModelHook):
    ...     def post_forward(self, module, output):
    ...         return output * 2
    >>> layer = torch.nn.Identity()
    >>> _ = add_hook_to_module(layer, Double())
    >>> layer(torch.ones(1)).item()
    2.0
    >>> _ = remove_hook_from_module(layer)
    >>> layer(torch.ones(1)).item()
    1.0
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hooks",
]

# methods a dispatch guards on the model (instance attributes marked ``bigviz_guard``);
# the guards go with the hooks
GUARDED_METHODS: tuple[str, ...] = ("to", "cuda", "cpu", "half", "float", "bfloat16", "double")


class ModelHook:
    """Callbacks run around a module's ``forward``; unlike torch's hooks they get kwargs.

    Subclasses override any of the four methods. Set the class attribute ``no_grad`` to run
    the wrapped forward under ``torch.no_grad()``. A hook may also define
    ``on_forward_error(module)``: called when ``pre_forward`` or ``forward`` raises, to put the
    module back in order before the error travels on.

    Example:
        >>> hook = ModelHook()
        >>> hook.pre_forward(None, 1, key=2)
        ((1,), {'key': 2})
    """

    no_grad: bool = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is attached; returns the (possibly changed) module."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Called before ``forward``; returns the ``(args, kwargs)`` forward will get."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after ``forward``; returns what the caller gets."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; undoes what ``init_hook`` did."""
        return module


class SequentialHook(ModelHook):
    """Several hooks on one module, run in the order given (pre and post alike).

    Example:
        >>> chain = SequentialHook(ModelHook(), ModelHook())
        >>> len(chain.hooks)
        2
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    @property
    def no_grad(self) -> bool:  # type: ignore[override]
        return any(hook.no_grad for hook in self.hooks)

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def on_forward_error(self, module: nn.Module) -> None:
        for hook in self.hooks:
            on_error = getattr(hook, "on_forward_error", None)
            if on_error is not None:
                on_error(module)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        # undone in reverse: a later hook may rely on what an earlier one set up (files open)
        for hook in reversed(self.hooks):
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook: ModelHook = module._hf_hook
    try:
        args, kwargs = hook.pre_forward(module, *args, **kwargs)
        if hook.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)
        else:
            output = module._old_forward(*args, **kwargs)
    except BaseException:
        # let the hook put the module back (e.g. weights to meta) before the error travels on
        on_error = getattr(hook, "on_forward_error", None)
        if on_error is not None:
            on_error(module)
        raise
    return hook.post_forward(module, output)


def _set_forward(module: nn.Module, forward: Any) -> None:
    # A GraphModule's forward is generated on its class; an instance attribute would freeze
    # the graph's later recompiles, so fx modules are patched on the class as accelerate does.
    if "GraphModuleImpl" in str(type(module)):
        module.__class__.forward = forward
    else:
        module.forward = forward


def _restore_forward(module: nn.Module, old_forward: Any) -> None:
    is_class_method = getattr(old_forward, "__self__", None) is module and getattr(
        old_forward, "__func__", None
    ) is getattr(type(module).forward, "__func__", type(module).forward)
    if is_class_method and "GraphModuleImpl" not in str(type(module)):
        module.__dict__.pop("forward", None)  # the class's forward shows through again
    else:
        _set_forward(module, old_forward)  # someone else's patched forward: put it back


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``, wrapping its ``forward`` (the original is kept).

    An existing hook is replaced, unless ``append`` is true: then both run, the old one
    first, chained in a :class:`SequentialHook`. Chaining neither detaches nor re-initialises
    the existing hook (only ``hook.init_hook`` runs): a dispatch's root hook keeps the files it
    owns open when another hook joins it on the same module.

    Args:
        module: The module to hook (changed in place).
        hook: The hook to attach; its ``init_hook`` runs now.
        append: Chain with an existing hook instead of replacing it.

    Returns:
        The module (what ``hook.init_hook`` returned).

    Example:
        >>> import torch
        >>> layer = add_hook_to_module(torch.nn.Linear(2, 2), ModelHook())
        >>> hasattr(layer, "_old_forward")
        True
    """
    old_hook = getattr(module, "_hf_hook", None)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = module._old_forward  # replacing a hook: keep the true original
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    if append and old_hook is not None:
        hook = SequentialHook(*_chain(old_hook), hook)  # the old hook stays as it is: attached
    module._hf_hook = hook
    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), old_forward)
    _set_forward(module, forward)
    return module


def _chain(hook: ModelHook) -> tuple[ModelHook, ...]:
    """The hooks of a chain, flattened (appending twice gives one chain, not a nest)."""
    return tuple(hook.hooks) if type(hook) is SequentialHook else (hook,)


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (calling its ``detach_hook``) and restore ``forward``.

    Args:
        module: The hooked module (changed in place).
        recurse: Also remove the hooks of every submodule.

    Returns:
        The module.

    Example:
        >>> import torch
        >>> layer = add_hook_to_module(torch.nn.Linear(2, 2), ModelHook())
        >>> hasattr(remove_hook_from_module(layer), "_hf_hook")
        False
    """
    if hasattr(module, "_hf_hook"):
        hook = module._hf_hook
        del module._hf_hook
        hook.detach_hook(module)
    if hasattr(module, "_old_forward"):
        _restore_forward(module, module._old_forward)
        del module._old_forward
    for name in GUARDED_METHODS:
        if getattr(module.__dict__.get(name), "bigviz_guard", False):
            del module.__dict__[name]  # a dispatch's guard; a user's own patch stays
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hooks(model: nn.Module) -> nn.Module:
    """Undo a dispatch (or any hooks) on ``model`` and every submodule.

    Each module's ``forward`` is the original again, the guards on ``.to()``/``.cuda()``
    are gone, and files opened by the dispatch are closed. Weights end up where they were
    *before* the dispatch: offloaded weights that were in memory then are copied back to
    the CPU; weights that were loaded straight from a checkpoint to "disk" (on ``meta``
    in the model) stay on ``meta``; modules the dispatch placed on a GPU stay there.

    Submodules are detached before their parents, so a dispatch's root hook closes its
    files only after every offloaded module has been restored from them.

    Args:
        model: A model hooked by :func:`~bigviz.engine.dispatch.dispatch_model`,
            :func:`~bigviz.engine.big_modeling.cpu_offload` or :func:`add_hook_to_module`.

    Returns:
        The model, with no hooks left.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> _ = add_hook_to_module(model[0], ModelHook())
        >>> hasattr(remove_hooks(model)[0], "_hf_hook")
        False
    """
    # model.modules() lists a parent before its descendants: reversed, children come first
    for module in reversed(list(model.modules())):
        remove_hook_from_module(module)
    return model
