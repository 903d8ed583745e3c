"""``cxrfl bench compare``: the papers' methods on one profile with the converged protocol, the ablations
(``--ablation``), and ``--method cwt|fedfew``, which runs that benchmark with its defaults.

Argparse only at import, as :mod:`cxrfl.bench.cli`; the comparison loads when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from cxrfl.bench.cli import _comma_list, _say, add_parser
from cxrfl.errors import ConfigError

if TYPE_CHECKING:
    from cxrfl.bench.protocol import CompareSettings

DISPATCHED = ("cwt", "fedfew")
"""``bench compare --method`` values that run another benchmark (``cxrfl bench <method>`` with its defaults)."""


def _floats(text: str | None) -> tuple[float, ...] | None:
    """Comma-separated numbers as floats (None when not given).

    Args:
        text: the option's value.
    """
    return tuple(float(x) for x in text.split(",") if x.strip()) if text else None


def _compare_settings(args: argparse.Namespace) -> CompareSettings:
    """The comparison's settings: the converged protocol, ``--quick``'s smoke preset, then every option given.

    Args:
        args: the parsed ``bench compare`` arguments.
    """
    from cxrfl.bench.compare import ABLATION_SEEDS
    from cxrfl.bench.protocol import QUICK, CompareSettings

    given = {
        "seeds": args.seeds,
        "max_rounds": args.max_rounds,
        "patience": args.patience,
        "min_delta": args.min_delta,
        "image_size": args.image_size,
        "data_image_size": args.data_image_size,
        "n_per_site": args.n_per_site,
        "n_external": args.n_external,
        "split": _floats(args.split),
        "steps": args.steps,
        "warmup_epochs": args.warmup_epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_lr": args.warmup_lr,
        "methods": _comma_list(args.methods),
        "n_boot": args.n_boot,
        "n_sites": args.sites,
        "n_shared": args.shared,
        "threads": args.threads,
        "jobs": args.jobs,
        "device": args.device,
        "pretrained": args.pretrained,
        "arch": args.arch,
        "site_configs": args.site_config,
        "external_configs": args.external_config,
        "selection": args.selection,
    }
    values = {"profile": args.profile or "two-hospitals", **(QUICK if args.quick else {})}
    if args.ablation and not args.quick:
        values["seeds"] = ABLATION_SEEDS
    values.update({k: v for k, v in given.items() if v is not None})
    for key in ("steps", "threads"):  # 0: no cap / torch's default
        if values.get(key) == 0:
            values[key] = None
    return CompareSettings.from_dict(values, where="the bench compare options")


def _run_dispatched(args: argparse.Namespace) -> int:
    """Run ``cxrfl bench <--method>`` with its defaults, passing on ``--out``, ``--seeds`` and ``--arch``.

    Args:
        args: the parsed ``bench compare`` arguments, ``method`` given.

    Raises:
        ConfigError: ``--method`` is not one of :data:`DISPATCHED`, or fedfew is asked for on another profile.
    """
    if args.method not in DISPATCHED:
        raise ConfigError(
            f"--method must be 'cwt' or 'fedfew' (or left out for the method comparison), got {args.method!r}"
        )
    if args.method == "fedfew" and args.profile not in (None, "fedfew"):
        raise ConfigError(f"--method fedfew runs on the fedfew profile only, got --profile {args.profile}")
    given = [f"--{k}={v}" for k, v in (("seeds", args.seeds), ("arch", args.arch)) if v is not None]
    _say(
        f"--method {args.method}: running `cxrfl bench {args.method} --out {args.out} {' '.join(given)}` "
        f"(its other options: cxrfl bench {args.method} --help)"
    )
    parser = argparse.ArgumentParser(prog="cxrfl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    other = parser.parse_args(["bench", args.method, "--out", str(args.out), *given])
    return other.func(other)


def _cmd_compare(args: argparse.Namespace) -> int:
    """``cxrfl bench compare``: the comparison or an ablation (130 when interrupted), or ``--method``'s benchmark.

    Args:
        args: the parsed ``bench compare`` arguments.
    """
    if args.method is not None:
        return _run_dispatched(args)
    from cxrfl.bench.compare import run_ablation, run_compare

    settings = _compare_settings(args)
    data_dir = Path(args.data_dir) if args.data_dir else None
    try:
        if args.ablation:
            values = tuple(int(v) for v in _floats(args.ablation_values) or ()) or None
            run_ablation(
                args.ablation,
                settings,
                Path(args.out),
                values=values,
                log=_say,
                data_dir=data_dir,
                restart=args.restart,
                report_only=args.report_only,
            )
        else:
            run_compare(
                settings,
                Path(args.out),
                data_dir=data_dir,
                log=_say,
                restart=args.restart,
                report_only=args.report_only,
            )
    except KeyboardInterrupt:
        return 130
    return 0


def add_compare_parser(bsub: argparse._SubParsersAction) -> None:
    """Add ``bench compare`` (its options in this order: the run, the protocol, the ablations and resources, the
    data and stored runs).

    Args:
        bsub: the ``bench`` subparsers.
    """
    c = bsub.add_parser(
        "compare",
        help="run every method on a profile until converged; write results.json, report.md and plots",
        description="The papers' methods on one profile with the converged protocol (cxrfl.bench.protocol): "
        "rounds of one local epoch until the mean validation loss stops improving. Each "
        "(method, seed) is stored under OUT/runs as it finishes: run the same command again "
        "to continue an interrupted comparison.",
    )
    c.add_argument(
        "--profile",
        default=None,
        help="two-hospitals (default), two-hospitals-shared, nih1000 or synth-nih (with --site-config: the name "
        "in the results); fedfew with --method fedfew",
    )
    c.add_argument("--out", required=True, help="output folder")
    c.add_argument(
        "--quick", action="store_true", help="a smoke run of a few minutes (tiny data, step caps): not evidence"
    )
    c.add_argument("--seeds", type=int, default=None, help="training seeds (default 5; ablations 3)")
    _add_protocol_options(c)
    _add_ablation_and_resource_options(c)
    _add_data_and_resume_options(c)
    c.set_defaults(func=_cmd_compare)


def _add_protocol_options(c: argparse.ArgumentParser) -> None:
    """The converged protocol's options, the synthetic data's sizes and the methods of ``bench compare``.

    Args:
        c: the ``bench compare`` parser.
    """
    c.add_argument(
        "--max-rounds",
        "--rounds",
        dest="max_rounds",
        type=int,
        default=None,
        help="most rounds (= epochs of the one-site baselines), a guard only (default 40)",
    )
    c.add_argument("--patience", type=int, default=None, help="rounds without improvement before stopping (default 5)")
    c.add_argument(
        "--min-delta", type=float, default=None, help="smallest improvement of the validation loss (default 1e-4)"
    )
    c.add_argument("--image-size", type=int, default=None, help="model input size (default 64)")
    c.add_argument(
        "--data-image-size", type=int, default=None, help="size synthetic images are written at (default 64)"
    )
    c.add_argument(
        "--n-per-site",
        type=int,
        default=None,
        help="images per synthetic hospital (default 2200), or of the synth-nih pool (default 3000)",
    )
    c.add_argument(
        "--n-external", type=int, default=None, help="images of the synthetic external test site (default 2000)"
    )
    c.add_argument(
        "--split", default=None, help="train,val,test fractions of the synthetic hospitals (default 0.55,0.12,0.33)"
    )
    c.add_argument(
        "--steps", type=int, default=None, help="cap on steps per local epoch and site; 0: whole splits (default)"
    )
    c.add_argument("--warmup-epochs", type=int, default=None, help="head warm-up epochs (default 1)")
    c.add_argument("--batch-size", type=int, default=None, help="default 32")
    c.add_argument("--lr", type=float, default=None, help="Adam learning rate (default 1e-3, from scratch)")
    c.add_argument("--warmup-lr", type=float, default=None, help="head warm-up learning rate (default 5e-3)")
    c.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset (default: individual, pfl-fedavg, centralized, vanilla-fedavg, "
        "partial-fedavg, surgical-fedavg, surgical-fedbn, and the FedBN+ variants with --pretrained; "
        "surgical-fedavg always runs)",
    )
    c.add_argument("--n-boot", type=int, default=None, help="bootstrap resamples per seed (default 1000)")


def _add_ablation_and_resource_options(c: argparse.ArgumentParser) -> None:
    """The pool profiles' settings and ablations, the threads, jobs and device, and the model selection rule of
    ``bench compare``.

    Args:
        c: the ``bench compare`` parser.
    """
    c.add_argument("--sites", type=int, default=None, help="pool profiles: number of sites (ablation setting)")
    c.add_argument("--shared", type=int, default=None, help="pool profiles: classes all sites share (ablation setting)")
    c.add_argument(
        "--ablation",
        choices=("sites", "shared"),
        default=None,
        help="the papers' ablation on a pool profile: sites 2,4,6,10 sharing 4 classes, or shared classes "
        "0..14 over 4 sites (methods: vanilla-fedavg, partial-fedavg, surgical-fedavg; 3 seeds)",
    )
    c.add_argument("--ablation-values", default=None, help="comma-separated ablation settings (e.g. 2,3,4,5,6,8,10)")
    c.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per process (default: torch's, every core; 1 on a busy machine)",
    )
    c.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="(method, seed) runs trained side by side in worker processes (default 1; with --threads 1, "
        "one job per core)",
    )
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default auto: CUDA when available")
    c.add_argument(
        "--selection",
        choices=("annotated", "head"),
        default=None,
        help="what the validation loss that selects a model counts: each site's own classes (default) or the "
        "whole head (the rule before issue 41; vanilla FL and centralized then count other sites' classes as "
        "negatives). Stored runs of vanilla FL and centralized under the other rule are set aside and trained again",
    )


def _add_data_and_resume_options(c: argparse.ArgumentParser) -> None:
    """Own sites and weights, where the data goes, how stored runs are reused, and ``--method`` of ``bench compare``.

    Args:
        c: the ``bench compare`` parser.
    """
    c.add_argument(
        "--site-config",
        action="append",
        default=None,
        help="your own training site (its site config YAML; repeat per site) instead of a built-in profile",
    )
    c.add_argument(
        "--external-config",
        action="append",
        default=None,
        help="your own fully annotated external test set (site config YAML; repeatable)",
    )
    c.add_argument(
        "--pretrained",
        default=None,
        help="local feature-extractor checkpoint (e.g. ImageNet DenseNet121); default: from scratch",
    )
    c.add_argument("--data-dir", default=None, help="where profile data is written (default: $TMPDIR/cxrfl-bench-data)")
    c.add_argument(
        "--restart",
        action="store_true",
        help="set stored runs of other settings aside (OUT/runs-set-aside-*) instead of refusing to continue them",
    )
    c.add_argument("--report-only", action="store_true", help="train nothing: results and report from the stored runs")
    c.add_argument(
        "--method",
        default=None,
        help="run another benchmark instead, with its defaults: 'cwt' is `cxrfl bench cwt`, 'fedfew' is "
        "`cxrfl bench fedfew`",
    )
