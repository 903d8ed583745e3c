"""The ``cxrfl bench`` subcommands that run in process: NVFlare's filters (``privacy``, ``hostile``, ``quantize``) and
the evaluation-only federation (``clinical``).

Each takes the settings a user gives and leaves the rest to the benchmark's settings class.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cxrfl.bench.cli import _comma_list, _stamped

RUN_KEYS = ("seeds", "rounds", "patience", "image_size", "steps", "threads", "arch")
"""The settings every in-process benchmark takes: those of :func:`_add_run_args`, and ``--arch``
(:func:`cxrfl.bench.arch.add_arch_option`)."""

DEMO_DEFAULTS = ("60", "the demo job's, 3", "the demo job's, 64")
"""The rounds, patience and image size ``--help`` shows for the benchmarks that train as the committed demo job
(quantize, clinical)."""


def _given(args: argparse.Namespace, *keys: str) -> dict:
    """The settings a user gave on the command line (the rest: the settings' defaults).

    Args:
        args: parsed arguments.
        keys: the benchmark's own settings beside :data:`RUN_KEYS`, as argparse spells them.
    """
    given = {k: getattr(args, k) for k in (*RUN_KEYS, *keys) if getattr(args, k) is not None}
    if "steps" in given:
        given["steps"] = given["steps"] or None  # --steps 0: whole epochs
    return given


def _cmd_privacy(args: argparse.Namespace) -> int:
    from cxrfl.bench.privacy import OPTIONS, PrivacyBenchSettings, run_privacy

    settings = PrivacyBenchSettings(**_given(args, "profile"), options=tuple(_comma_list(args.options) or OPTIONS))
    run_privacy(settings, Path(args.out), log=_stamped, data_dir=args.data_dir)
    return 0


def _add_run_args(
    p: argparse.ArgumentParser, name: str, rounds: str, patience: str, image_size: str, *, resumes: bool = True
) -> None:
    """The arguments every in-process benchmark takes (:data:`RUN_KEYS`; defaults in the help: the settings class
    holds them).

    Args:
        p: the subcommand's parser.
        name: the benchmark (its default output folder).
        rounds: the default most rounds, as the help shows it.
        patience: the default patience, as the help shows it.
        image_size: the default model input size, as the help shows it.
        resumes: an interrupted run goes on from the runs in ``--out``.
    """
    out = f"benchmarks/results/{name}"
    resume = "; an interrupted run resumes there" if resumes else ""
    p.add_argument("--out", default=out, help=f"output folder (default {out}{resume})")
    p.add_argument("--seeds", type=int, help="training seeds 0 ... seeds-1 (default 3)")
    p.add_argument("--rounds", type=int, help=f"max rounds after the warm-up, a guard (default {rounds})")
    p.add_argument(
        "--patience", type=int, help=f"rounds without a better validation loss before stopping (default {patience})"
    )
    p.add_argument("--image-size", type=int, help=f"model input size (default {image_size})")
    p.add_argument("--steps", type=int, help="max steps per local epoch and site (default 0: the whole split)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default 1)")
    p.add_argument("--data-dir", default=None, help="where profile data is written (default OUT/data)")


def _add_privacy(bsub: argparse._SubParsersAction) -> None:
    pr = bsub.add_parser(
        "privacy",
        help="NVFlare's privacy filters on surgical aggregation: fidelity of the sent "
        "update, SVT epsilon, mean AUROC against the unfiltered run",
    )
    _add_run_args(pr, "privacy", rounds="15", patience="3", image_size="64", resumes=False)
    pr.add_argument("--profile", help="data profile (default nih1000: the real NIH images)")
    pr.add_argument(
        "--options", default=None, help="comma-separated subset of the options (default: all; none always runs)"
    )
    pr.set_defaults(func=_cmd_privacy)


def _cmd_hostile(args: argparse.Namespace) -> int:
    from cxrfl.bench.hostile import ATTACKS, ROBUST, HostileBenchSettings, run_hostile

    attacks, robust = tuple(_comma_list(args.attacks) or ATTACKS), tuple(_comma_list(args.robust) or ROBUST)
    given = _given(args, "profile", "sites", "pool", "clip_norm")
    settings = HostileBenchSettings(**given, attacks=attacks, robust=robust)
    run_hostile(settings, Path(args.out), log=_stamped, data_dir=args.data_dir)
    return 0


def _add_hostile(bsub: argparse._SubParsersAction) -> None:
    h = bsub.add_parser(
        "hostile",
        help="one hostile site (scaled, sign-flipped, NaN update, huge count) against each "
        "robust aggregation option: mean test AUROC against the honest run",
    )
    _add_run_args(h, "hostile", rounds="40", patience="3", image_size="64")
    h.add_argument("--profile", help="pool profile (default synth-nih)")
    h.add_argument("--sites", type=int, help="sites, one hostile (default 5)")
    h.add_argument("--pool", type=int, help="images of the synthetic pool (default: the profile's)")
    h.add_argument(
        "--clip-norm",
        type=float,
        help="norm bound of clip (and of median groups of 1-2 sites); default: each round's lower median update norm",
    )
    h.add_argument("--attacks", default=None, help="comma-separated subset of none,scale,sign,nan,count (default: all)")
    h.add_argument("--robust", default=None, help="comma-separated subset of none,median,clip (default: all)")
    h.set_defaults(func=_cmd_hostile)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from cxrfl.bench.quantize import FORMATS, QuantizeBenchSettings, run_quantize

    settings = QuantizeBenchSettings(**_given(args), formats=tuple(_comma_list(args.formats) or FORMATS))
    run_quantize(settings, Path(args.out), log=_stamped, data_dir=args.data_dir)
    return 0


def _add_quantize(bsub: argparse._SubParsersAction) -> None:
    q = bsub.add_parser(
        "quantize",
        help="NVFlare's quantization filters on surgical aggregation (two-hospitals): bytes per site and round "
        "each way, time added, mean test AUROC paired against the unquantized run, issue 46's targets",
    )
    _add_run_args(q, "quantize", *DEMO_DEFAULTS)
    q.add_argument(
        "--formats",
        default=None,
        help="comma-separated subset of none,float16,blockwise8,float4,normfloat4 (default: none,float16,"
        "blockwise8,normfloat4; none always runs: the reference)",
    )
    q.set_defaults(func=_cmd_quantize)


def _cmd_clinical(args: argparse.Namespace) -> int:
    from cxrfl.bench.clinical import ClinicalBenchSettings, run_clinical

    given = _given(args, "target_sensitivity", "calibration", "min_cell", "bins", "external")
    if args.profiles:
        given["profiles"] = tuple(_comma_list(args.profiles) or ())
    run_clinical(ClinicalBenchSettings(**given), Path(args.out), log=_stamped, data_dir=args.data_dir)
    return 0


def _add_clinical(bsub: argparse._SubParsersAction) -> None:
    c = bsub.add_parser(
        "clinical",
        help="the evaluation-only federation (issue 45): federated pooled AUROC against the central AUROC of the "
        "same images, ECE before and after calibration, test sensitivity at the operating point chosen on validation",
    )
    _add_run_args(c, "clinical", *DEMO_DEFAULTS)
    c.add_argument("--profiles", default=None, help="comma-separated profiles (default two-hospitals,nih1000)")
    c.add_argument("--target-sensitivity", type=float, help="sensitivity of the operating point (default 0.9)")
    c.add_argument("--calibration", choices=("platt", "temperature"), help="calibration map (default platt)")
    c.add_argument("--min-cell", type=int, help="least positives and negatives a site sends counts for (default 10)")
    c.add_argument("--bins", type=int, help="logit bins of the first counting pass (default 4000)")
    c.add_argument(
        "--no-external",
        dest="external",
        action="store_false",
        default=None,
        help="evaluate the training sites' test splits only (default: the external test sets join as test-only sites)",
    )
    c.set_defaults(func=_cmd_clinical)


def add_inprocess_parsers(bsub: argparse._SubParsersAction) -> None:
    """Add ``bench privacy|hostile|quantize|clinical``.

    Args:
        bsub: the ``bench`` subparsers.
    """
    for add in (_add_privacy, _add_hostile, _add_quantize, _add_clinical):
        add(bsub)
