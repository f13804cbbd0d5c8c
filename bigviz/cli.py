"""The ``bigviz`` command: ``bigviz demo`` and ``bigviz plan``.

Example:
    $ bigviz demo --out bigviz-demo
    $ bigviz plan path/to/checkpoint --max-memory cpu=8GiB,0=16GiB --out device_map.json
    $ bigviz plan llama-70b --dtype float16 --max-memory 0=24GiB,cpu=64GiB --html report.html
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "parse_max_memory_arg"]


def parse_max_memory_arg(text: str) -> dict[str, str]:
    """``"cpu=8GiB,0=16GiB"`` -> ``{"cpu": "8GiB", "0": "16GiB"}`` (validated by the planner).

    Example:
        >>> parse_max_memory_arg("cpu=8GiB, 0=16GiB")
        {'cpu': '8GiB', '0': '16GiB'}
    """
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = part.partition("=")
        if not sep or not device.strip() or not size.strip():
            raise argparse.ArgumentTypeError(f"cannot read {part!r} in --max-memory: write DEVICE=SIZE, "
                                             f"e.g. cpu=8GiB,0=16GiB")
        out[device.strip()] = size.strip()
    return out


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigviz", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plan, save, load with offload and run a model (about a minute)")
    demo.add_argument("--out", default="bigviz-demo", help="folder for device_map.json, report.html, ...")
    demo.add_argument("--quick", action="store_true", help="shorter training and generation")
    plan = sub.add_parser("plan", help="plan a device map for a checkpoint or a reference model preset")
    plan.add_argument("model", help="checkpoint file or folder, or a preset name such as llama-70b")
    plan.add_argument("--max-memory", type=parse_max_memory_arg, default=None,
                      help="budgets, e.g. cpu=8GiB,0=16GiB (default: this machine's free memory)")
    plan.add_argument("--strategy", default="auto", choices=["auto", "balanced", "balanced_low_0", "sequential"])
    plan.add_argument("--no-split", action="append", default=None, metavar="PATTERN",
                      help="class name or module-name glob kept whole (repeatable), e.g. 'transformer.h.*'")
    plan.add_argument("--dtype", default=None, help="plan for this dtype, e.g. float16")
    plan.add_argument("--out", default="device_map.json", help="where to write the device map JSON")
    plan.add_argument("--html", default=None, help="also write a standalone HTML report here")
    return parser


def _plan(args: argparse.Namespace) -> int:
    import bigviz
    from bigviz.models import PRESETS, build

    target: object = args.model
    if args.model in PRESETS:
        with bigviz.init_empty_weights():
            target = build(args.model)
    elif not Path(args.model).exists():
        print(f"bigviz plan: {args.model!r} is neither a checkpoint path nor a preset "
              f"({', '.join(sorted(PRESETS))})", file=sys.stderr)
        return 2
    plan = bigviz.plan(target, args.max_memory, strategy=args.strategy,
                       no_split_module_classes=args.no_split, dtype=args.dtype)
    print(plan.summary())
    bigviz.save_device_map(plan.device_map, args.out)
    print(f"wrote {args.out} ({len(plan.device_map)} entries)")
    if args.html:
        bigviz.save_html(plan, args.html)
        print(f"wrote {args.html}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bigviz`` console script."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from bigviz.demo import main as demo

            return demo(args.out, quick=args.quick)
        return _plan(args)
    except (ValueError, OSError) as err:  # bad input, or a folder bigviz will not touch
        print(f"bigviz {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
