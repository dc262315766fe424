"""``kempner-resilience accelerate launch ...``: accelerate's own parser and ``launch_command``,
with our torchrun agent in the place of torch's ``run``.

Several CPU ranks: stock ``--cpu`` starts one process, and ``--multi_gpu`` without GPUs ranks
that each train alone; either is read here as N gloo ranks (``ACCELERATE_USE_CPU=1``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Sequence

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core.log import get_logger

__all__ = ["run", "parse", "AccelerateArgsError"]

log = get_logger("kempner_resilience.supervise.torchrun.wrapper")


class AccelerateArgsError(ValueError):
    """An ``accelerate launch`` command line this wrapper cannot run as asked."""


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``accelerate launch``'s arguments (the word ``launch`` first), parsed by accelerate."""
    if list(argv[:1]) != ["launch"]:
        raise AccelerateArgsError("give accelerate's launch command: `kempner-resilience "
                                  "accelerate launch [accelerate's options] train.py [args]`")
    import torch
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(list(argv[1:]))
    if (args.num_processes or 1) > 1 and (args.cpu or (args.multi_gpu
                                                       and not torch.cuda.is_available())):
        log.info("accelerate launch: %d ranks on CPU (gloo), started as --multi_gpu with "
                 "ACCELERATE_USE_CPU=1 (stock accelerate starts %s)", args.num_processes,
                 "one process for --cpu" if args.cpu else "ranks that each train alone")
        args.cpu, args.multi_gpu = False, True
        os.environ["ACCELERATE_USE_CPU"] = "true"     # the ranks' Accelerator reads it: MULTI_CPU
    return args


def run(argv: Sequence[str], config: ResilienceConfig | None = None,
        forward: bool | None = None) -> int:
    """Run ``accelerate launch ...`` (``argv`` starts with ``launch``) with our agent; the exit
    code for the batch script, as ``kempner-resilience torchrun`` returns it."""
    from kempner_resilience.supervise.torchrun import wrapper as torchrun

    args = parse(argv)

    def front(start: Callable[[Any], Any]) -> Any:
        from unittest import mock

        import torch.distributed.run as distrib_run
        from accelerate.commands.launch import launch_command

        # accelerate looks the function up on torch's module at the call (`distrib_run.run`).
        with mock.patch.object(distrib_run, "run", start):
            return launch_command(args)

    return torchrun.run([], config, forward, front=front)
