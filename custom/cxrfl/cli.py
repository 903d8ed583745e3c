"""The ``cxrfl`` command line.

Subcommands import their modules lazily so ``cxrfl --help`` stays fast. Errors meant for
the operator (:class:`cxrfl.errors.CxrflError`) print one clear line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cxrfl.errors import ConfigError, CxrflError, DataError

RENAMED = {"bench-cwt": "bench cwt", "bench-fedfew": "bench fedfew"}
"""Former commands, still accepted (not listed): old name -> the command that runs instead."""


def _cmd_synth(args: argparse.Namespace) -> int:
    from cxrfl.synth import write_profile

    configs = write_profile(
        args.profile, Path(args.out), n_per_site=args.n_per_site, image_size=args.image_size, seed=args.seed
    )
    for cfg in configs:
        print(f"wrote site config {cfg}")
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from cxrfl.data.summary import format_summary, summarise

    summary = summarise(args.site_config, check_images=not args.no_image_check)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if summary["refused"]:  # the reason a job's start-up gives for this site
        raise DataError(summary["refused"])
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from cxrfl.predict import format_predictions, predict_images

    rows = predict_images(args.model, args.images, device=args.device, precision=args.precision, raw=args.raw)
    text = format_predictions(rows, fmt="json" if args.json else "csv" if args.csv else "table")
    if text:
        print(text)
    failed = [r for r in rows if "error" in r]
    for r in failed:  # after every readable image's output: one line per unreadable one
        print(f"cxrfl: cannot read image {r['image']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    if args.clinical:
        from cxrfl.clinical.report import write_clinical_report

        if args.external or args.plots:
            raise ConfigError("--clinical writes the clinical report alone; ask for --plots or --external separately")
        for path in write_clinical_report(args.workspace, args.clinical):
            print(f"wrote {path}")
        return 0
    from cxrfl.report import format_report, load_run, write_plots

    run = load_run(args.workspace)
    external, example = None, None
    if args.external:
        from cxrfl.common.server import BEST_MODEL
        from cxrfl.data.site import load_site
        from cxrfl.nn.evaluation import evaluate_on_site
        from cxrfl.nn.models import model_from_checkpoint

        if args.external == "demo":
            from cxrfl.synth import demo_site_config

            config = demo_site_config("external")
        else:
            config = Path(args.external)
        model, classes, mcfg = model_from_checkpoint(run["app"] / BEST_MODEL)
        data = load_site(config)
        external = {
            "site": data.site,
            **evaluate_on_site(model, classes, data, image_size=mcfg.image_size, splits=None),
        }
        example = data.table["path"].iloc[0] if len(data.table) else None
    print(format_report(run, external, workspace=args.workspace, example_image=example))
    if args.plots:
        for path in write_plots(run, args.plots, external):
            print(f"wrote {path}")
    return 0


def _cmd_jobs_export(args: argparse.Namespace) -> int:
    from cxrfl.jobs import export_all

    for path in export_all(Path(args.out)):
        print(f"wrote job {path}")
    return 0


def _cmd_export_bundle(args: argparse.Namespace) -> int:
    from cxrfl.bundle import export_bundle

    out = export_bundle(args.model, args.out, name=args.name)
    print(
        f"wrote MONAI bundle {out}; run it with: python -m monai.bundle run --config_file "
        f"{out / 'configs' / 'inference.json'} --bundle_root {out} --dataset_dir IMAGES --output_dir OUT"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``cxrfl`` command."""
    p = argparse.ArgumentParser(prog="cxrfl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    _add_data(sub)
    _add_predict(sub)
    _add_report(sub)
    _add_jobs_and_export(sub)
    from cxrfl.deploy.cli import add_parser as add_deploy_parser  # stdlib + yaml only; NVFlare loads per command

    add_deploy_parser(sub)

    from cxrfl.bench.cli import add_parser as add_bench_parser  # argparse only; benchmarks load per command

    add_bench_parser(sub)
    return p


def _add_data(sub: argparse._SubParsersAction) -> None:
    """``cxrfl data synth | summary``.

    Args:
        sub: the ``cxrfl`` command's subparsers.
    """
    data = sub.add_parser("data", help="site data: synthesize demo data, summarise and validate")
    dsub = data.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("synth", help="write a synthetic demo profile (images, labels, site configs)")
    s.add_argument("--profile", default="two-hospitals")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--n-per-site", type=int, default=None, help="images per site (profile default if unset)")
    s.add_argument("--image-size", type=int, default=None, help="written image size in pixels")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_synth)
    m = dsub.add_parser(
        "summary",
        help="summarise and validate one site's data",
        description="Summarise and validate one site's data. A site a federated job would refuse at "
        "start-up (an empty train or val split) exits with status 2 and the job's reason.",
    )
    m.add_argument("site_config", help="the site config YAML")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.add_argument("--no-image-check", action="store_true", help="do not open every image")
    m.set_defaults(func=_cmd_summary)


def _add_predict(sub: argparse._SubParsersAction) -> None:
    """``cxrfl predict``.

    Args:
        sub: the ``cxrfl`` command's subparsers.
    """
    pr = sub.add_parser(
        "predict",
        help="predict every class of a model for PNG/JPEG/DICOM images",
        description="Predict every class of a model for PNG/JPEG/DICOM images. Each unreadable "
        "image gets one line on stderr (and an error entry with --json/--csv); the others are "
        "still predicted; the exit status is then 1.",
    )
    pr.add_argument("--model", required=True, help="a checkpoint saved by a cxrfl job")
    pr.add_argument("images", nargs="+")
    fmt = pr.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")
    pr.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    pr.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="auto (default): bf16 autocast on a GPU or a CPU with native bf16, as training does; fp32 otherwise",
    )
    pr.add_argument(
        "--raw",
        action="store_true",
        help="the model's raw probabilities, not the calibrated ones of a model fitted by an evaluation-only run",
    )
    pr.set_defaults(func=_cmd_predict)


def _add_report(sub: argparse._SubParsersAction) -> None:
    """``cxrfl report``.

    Args:
        sub: the ``cxrfl`` command's subparsers.
    """
    rp = sub.add_parser("report", help="where a finished run's models are and how it went")
    rp.add_argument("workspace", help="simulator workspace (-w), downloaded job result or server app folder")
    rp.add_argument(
        "--external", help="also evaluate the best model on this site config ('demo': the demo external site)"
    )
    rp.add_argument(
        "--plots", metavar="DIR", help="write the learning curves and per-class AUROC as PNG files into DIR"
    )
    rp.add_argument(
        "--clinical",
        metavar="DIR",
        help="instead, write the per-class clinical report of the run's pooled evaluation into DIR (report.md, "
        "roc.png, reliability.png); also for an evaluation-only run (job_recipes/fedeval)",
    )
    rp.set_defaults(func=_cmd_report)


def _add_jobs_and_export(sub: argparse._SubParsersAction) -> None:
    """``cxrfl jobs export`` and ``cxrfl export bundle``.

    Args:
        sub: the ``cxrfl`` command's subparsers.
    """
    jobs = sub.add_parser("jobs", help="NVFlare job folders")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True)
    je = jsub.add_parser("export", help="write every job folder defined in cxrfl.jobs")
    je.add_argument("--out", default="jobs")
    je.set_defaults(func=_cmd_jobs_export)

    export = sub.add_parser("export", help="a trained model in another format")
    esub = export.add_subparsers(dest="export_command", required=True)
    eb = esub.add_parser(
        "bundle",
        help="a MONAI bundle of a global model (python -m monai.bundle run ...)",
        description="Write a MONAI bundle of a global model: configs/metadata.json (channel_def: "
        "the classes in order), configs/inference.json, models/model.pt, docs/README.md (model card "
        "with the run's settings and evaluation).",
    )
    eb.add_argument("--model", required=True, help="a checkpoint saved by a cxrfl job (best_FL_global_model.pt ...)")
    eb.add_argument("--out", required=True, help="the bundle folder")
    eb.add_argument("--name", default=None, help="the model's name in the metadata (default: the checkpoint's)")
    eb.set_defaults(func=_cmd_export_bundle)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cxrfl`` console script.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in RENAMED:
        print(f"cxrfl: '{argv[0]}' is now 'cxrfl {RENAMED[argv[0]]}'; running that", file=sys.stderr)
        argv = [*RENAMED[argv[0]].split(), *argv[1:]]
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CxrflError as exc:
        print(f"cxrfl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
