"""The ``bigviz`` command: ``bigviz demo`` and ``bigviz plan``.

Example:
    $ bigviz demo --out bigviz-demo
    $ bigviz plan path/to/checkpoint --max-memory cpu=8GiB,0=16GiB --out device_map.json
    $ bigviz plan llama-70b --dtype float16 --max-memory 0=24GiB,cpu=64GiB --html report.html
    $ bigviz plan llama-3.1-70b --batch 4 --context 8192 --max-memory 0=80GiB,1=80GiB
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from bigviz.core.errors import BigvizError
from bigviz.checkpoint.outputs import check_outputs, input_files, write_output

__all__ = ["main", "parse_max_memory_arg", "parse_reserve_arg"]


def parse_reserve_arg(text: str) -> dict[str, str] | str:
    """``--reserve``: ``"0=2GiB,cpu=1GiB"`` per device (as ``--max-memory``), or one size for
    every device (``"0"``: the bare arithmetic, no headroom).

    Example:
        >>> parse_reserve_arg("0=2GiB"), parse_reserve_arg("0")
        ({'0': '2GiB'}, '0')
    """
    if "=" not in text:
        if not text.strip():
            raise argparse.ArgumentTypeError("--reserve is empty: write a size (e.g. 1GiB) or DEVICE=SIZE,...")
        return text.strip()
    try:
        return parse_max_memory_arg(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--max-memory", "--reserve")) from None


def parse_max_memory_arg(text: str) -> dict[str, str]:
    """``"cpu=8GiB,0=16GiB"`` -> ``{"cpu": "8GiB", "0": "16GiB"}`` (validated by the planner).

    A device named twice (``0=80GB,0=1GB``, or ``0`` and ``cuda:0``) is refused: one would win
    silently.

    Example:
        >>> parse_max_memory_arg("cpu=8GiB, 0=16GiB")
        {'cpu': '8GiB', '0': '16GiB'}
    """
    from bigviz.core.devices import normalize_device

    out: dict[str, str] = {}
    named: dict[object, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = part.partition("=")
        device, size = device.strip(), size.strip()
        if not sep or not device or not size:
            raise argparse.ArgumentTypeError(
                f"cannot read {part!r} in --max-memory: write DEVICE=SIZE, e.g. cpu=8GiB,0=16GiB"
            )
        try:
            key: object = normalize_device(device)
        except ValueError:
            key = device  # the planner names the unknown device
        if key in named:
            raise argparse.ArgumentTypeError(
                f"--max-memory names one device twice ({named[key]}={out[named[key]]} and {device}={size}): "
                "give each device one budget"
            )
        named[key] = device
        out[device] = size
    if not out:
        raise argparse.ArgumentTypeError(f"--max-memory {text!r} names no device: write DEVICE=SIZE, e.g. cpu=8GiB")
    return out


DESCRIPTION = "Plan, see and run PyTorch models bigger than one device's memory."
EPILOG = """examples:
  bigviz demo                                    the whole story on this machine (about 10 s on an idle
                                                 2-core machine; longer while it is busy)
  bigviz plan llama-70b --dtype float16 --max-memory 0=24GiB,cpu=64GiB --html report.html
  bigviz plan path/to/checkpoint --max-memory cpu=8GiB,0=16GiB --out device_map.json
  bigviz plan llama-3.1-70b --batch 4 --context 8192 --max-memory 0=80GiB,1=80GiB

Notebooks that explain each step: notebooks/01_quickstart.ipynb to 09_pipeline.ipynb in the bigviz
repository (pip install -e ".[notebooks]")."""
DEMO_HELP = (
    "plan, save, load with disk offload and run a small trained GPT (about 10 s on an idle 2-core machine, "
    "longer while it is busy: it times real token generation)"
)
DEMO_DESCRIPTION = (
    "Plans gpt2-xl and Llama 2 70B (bigviz's llama-70b preset) on the meta device, then saves bigviz's tiny trained GPT as a "
    "sharded checkpoint, plans it from the checkpoint's headers under a budget that puts part of it "
    "on disk, loads it, generates text, and compares predicted with measured memory and time per "
    "token. Writes device_map.json and report.html into --out, which must be new, empty or an "
    "earlier demo's folder: the demo never deletes or overwrites files it did not write."
)
PLAN_DESCRIPTION = (
    "Plans a device map (module -> GPU, cpu or disk) with a reason per placement, prints the "
    "summary and writes the map as JSON, which bigviz and transformers' from_pretrained(device_map=...) "
    "read. With --context it also plans the run: the KV cache and prefill activations per device. "
    "Outputs are checked before planning: an existing file is replaced only with --overwrite, and "
    "the model's own files never."
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bigviz", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,plan}")
    demo = sub.add_parser("demo", help=DEMO_HELP, description=DEMO_DESCRIPTION)
    demo.add_argument(
        "--out", default="bigviz-demo", help="folder for device_map.json, report.html, ... (default: bigviz-demo)"
    )
    demo.add_argument("--quick", action="store_true", help="generate fewer tokens (for tests)")
    plan = sub.add_parser(
        "plan", help="plan a device map for a checkpoint, a config or a model preset", description=PLAN_DESCRIPTION
    )
    plan.add_argument(
        "model",
        help="checkpoint file or folder, a config.json (or a folder holding only one), "
        "a shipped config such as llama-3.1-70b, or a preset such as llama-70b",
    )
    plan.add_argument(
        "--max-memory",
        type=parse_max_memory_arg,
        default=None,
        help="budgets, e.g. cpu=8GiB,0=16GiB (default: this machine's free memory)",
    )
    plan.add_argument(
        "--reserve",
        type=parse_reserve_arg,
        default=None,
        metavar="SIZES",
        help="memory each device keeps free, e.g. 0=2GiB,cpu=1GiB, or one size for every device; 0 plans the "
        "bare arithmetic (default: each device kind's headroom when --context plans a run, none otherwise)",
    )
    plan.add_argument(
        "--strategy",
        default="auto",
        choices=["auto", "balanced", "balanced_low_0", "sequential"],
        help="how to spread over GPUs (default: auto, the same as balanced)",
    )
    plan.add_argument(
        "--no-split",
        action="append",
        default=None,
        metavar="PATTERN",
        help="class name or module-name glob kept whole (repeatable), e.g. 'transformer.h.*'",
    )
    plan.add_argument("--dtype", default=None, help="plan for this dtype, e.g. float16")
    plan.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        default=None,
        help="size the linear layers' weights as quantized: int8 (torchao, per-row scales) or int4 "
        "(bitsandbytes 4-bit), what load_checkpoint_and_dispatch(..., quantization=) loads",
    )
    plan.add_argument(
        "--out", default="device_map.json", help="where to write the device map JSON (a new file unless --overwrite)"
    )
    plan.add_argument("--html", default=None, help="also write a standalone HTML report here")
    plan.add_argument(
        "--overwrite", action="store_true", help="replace --out and --html if they exist (never the model's own files)"
    )
    plan.add_argument("--batch", type=_positive, default=1, help="sequences run together (with --context)")
    plan.add_argument(
        "--context",
        type=_positive,
        default=None,
        metavar="TOKENS",
        help="plan the run too: KV cache and prefill activations for this many tokens",
    )
    plan.add_argument("--kv-dtype", default=None, help="dtype of the KV cache (default: the compute dtype)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _plan(args: argparse.Namespace) -> int:
    import bigviz
    from bigviz.core.sizes import format_count
    from bigviz.models import PRESETS, build
    from bigviz.modeling.configs import config_path, shipped_configs

    outputs = {"--out": args.out, "--html": args.html}
    _check_outputs(outputs, args.model, overwrite=args.overwrite)
    target: object = args.model
    if args.model in PRESETS:
        with bigviz.init_empty_weights():
            target = build(args.model)
    elif args.model in shipped_configs():
        target = bigviz.resolve_model(config_path(args.model))
    elif not Path(args.model).exists():
        print(
            f"bigviz plan: {args.model!r} is neither a checkpoint path nor a preset ({', '.join(sorted(PRESETS))}), "
            f"nor a config.json or a shipped config ({', '.join(shipped_configs())})",
            file=sys.stderr,
        )
        return 2
    else:
        target = bigviz.resolve_model(args.model)
    common = dict(
        strategy=args.strategy,
        no_split_module_classes=args.no_split,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        quantization=args.quantize,
        reserve=args.reserve,
    )
    with warnings.catch_warnings():  # a context past a trained length: the summary's note says it
        warnings.filterwarnings("ignore", message="planning past the model's")
        plan = bigviz.plan(target, args.max_memory, batch_size=args.batch, context_length=args.context, **common)
    print(plan.summary())
    if args.quantize:
        print(f"weights: {bigviz.QuantConfig(args.quantize).describe()}; embeddings, norms and the head as they are")
    if args.context:
        print(_run_lines(plan))
        longest = bigviz.max_context(target, plan.max_memory, args.batch, **common)
        offloaded = bigviz.max_context(target, plan.max_memory, args.batch, allow_offload=True, **common)
        print(
            f"longest context that fits (batch {args.batch}): {longest:,} tokens without offloading, "
            f"{offloaded:,} with offloading"
        )
    write_output(args.out, lambda tmp: bigviz.save_device_map(plan.device_map, tmp), overwrite=args.overwrite)
    print(f"wrote {args.out} ({format_count(len(plan.device_map), 'entry', 'entries')})")
    if args.html:
        write_output(args.html, lambda tmp: bigviz.save_html(plan, tmp), overwrite=args.overwrite)
        print(f"wrote {args.html}")
    return 0


def _check_outputs(outputs: dict[str, str | None], model: str, *, overwrite: bool) -> None:
    """Refuse, before planning, outputs that exist (without --overwrite), are links, folders or
    the model's own files, or sit in a folder that does not exist (:mod:`bigviz.checkpoint.outputs`)."""
    from bigviz.modeling.configs import config_path, shipped_configs

    source = config_path(model) if model in shipped_configs() else Path(model)
    check_outputs(outputs, overwrite=overwrite, inputs=input_files(source), headline="nothing was planned or written")


def _run_lines(plan: object) -> str:
    from bigviz.core.devices import device_label
    from bigviz.core.sizes import format_size

    rows = [
        f"  {device_label(u.device):>7}: KV cache {format_size(u.kv_cache):>10}, activations "
        f"{format_size(u.activations):>10}"
        for u in plan.usage
        if u.kv_cache or u.activations
    ]  # type: ignore[attr-defined]
    return "run per device:\n" + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bigviz`` console script."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from bigviz.demo import main as demo

            return demo(args.out, quick=args.quick)
        return _plan(args)
    except (ValueError, OSError, BigvizError) as err:  # bad input, or a file or folder bigviz will not touch
        print(f"bigviz {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
