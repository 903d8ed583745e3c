"""The network a benchmark trains: ``arch``, one setting of every training benchmark's settings (by default
``ModelConfig.arch``, DenseNet121, the product's network; ``densenet-tiny`` for tests and smoke runs, whose numbers
mean nothing), its one ``--arch`` option, and how results written before the setting existed read it.

Light on purpose: ``cxrfl --help`` builds the option without importing torch (the network code loads when used).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

BENCHES = ("compare", "cwt", "fedfew", "privacy", "hostile", "quantize", "clinical")
"""The ``cxrfl bench`` subcommands that take ``--arch`` (``speed``, ``load`` and ``pretrain`` measure DenseNet121)."""


def add_arch_option(bsub: argparse._SubParsersAction) -> None:
    """Add ``--arch`` to every subcommand of :data:`BENCHES` (None when not given: the settings' default; an
    unknown name is refused by the settings).

    Args:
        bsub: the ``bench`` subparsers, each of :data:`BENCHES` already added.
    """
    for name in BENCHES:
        bsub.choices[name].add_argument(
            "--arch",
            default=None,
            help="network: densenet121 (default, the product's) or densenet-tiny (about 17 k parameters, for tests "
            "and smoke runs: its numbers mean nothing); recorded in results.json",
        )


def with_arch(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Stored settings with their ``arch`` (settings stored before it was recorded trained DenseNet121, the
    default).

    Args:
        settings: settings as a results file holds them.
    """
    from cxrfl.nn.models import ModelConfig

    return {"arch": ModelConfig.arch, **settings}


def arch_label(settings: Mapping[str, Any]) -> str:
    """The network of stored settings as a report names it.

    Args:
        settings: settings as a results file holds them.
    """
    arch = with_arch(settings)["arch"]
    return "DenseNet121" if arch == "densenet121" else arch
