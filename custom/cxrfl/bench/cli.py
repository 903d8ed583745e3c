"""The ``cxrfl bench`` subcommands (``compare``, ``pretrain``, ``speed``); heavy modules load per command."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from cxrfl.errors import ConfigError


def _methods(text: str | None) -> list[str] | None:
    return [m.strip() for m in text.split(",") if m.strip()] if text else None


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.method == "cwt":
        if importlib.util.find_spec("cxrfl.bench.cwt") is None:
            raise ConfigError("--method cwt needs cxrfl.bench.cwt (the cyclical weight transfer benchmark), "
                              "which this installation does not have")
        from cxrfl.bench.cwt import run_cwt_benchmark

        run_cwt_benchmark(out=Path(args.out), seeds=args.seeds)
        return 0
    if args.method == "fedfew":
        if args.profile not in (None, "fedfew"):
            raise ConfigError(f"--method fedfew runs on the fedfew profile only, got --profile {args.profile}")
        from cxrfl.bench.fedfew import run_fedfew_benchmark

        run_fedfew_benchmark(out=Path(args.out), seeds=args.seeds)
        return 0
    if args.method is not None:
        raise ConfigError(f"--method must be 'cwt' or 'fedfew' (or left out for the method comparison), got {args.method!r}")
    from cxrfl.bench.compare import CompareSettings, run_ablation, run_compare

    settings = CompareSettings(
        profile=args.profile or "two-hospitals",
        seeds=args.seeds,
        rounds=args.rounds,
        image_size=args.image_size,
        data_image_size=args.data_image_size,
        n_per_site=args.n_per_site,
        n_external=args.n_external,
        steps=args.steps if args.steps > 0 else None,
        warmup_epochs=args.warmup_epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_lr=args.warmup_lr,
        patience=args.patience,
        methods=_methods(args.methods),
        n_boot=args.n_boot,
        n_sites=args.sites,
        n_shared=args.shared,
        threads=args.threads or None,
        pretrained=args.pretrained,
        site_configs=args.site_config,
        external_configs=args.external_config,
    )
    if args.ablation:
        run_ablation(args.ablation, settings, Path(args.out))
    else:
        run_compare(settings, Path(args.out), data_dir=Path(args.data_dir) if args.data_dir else None)
    return 0


def _cmd_speed(args: argparse.Namespace) -> int:
    from cxrfl.bench.speed import SpeedSettings, run_speed

    run_speed(
        SpeedSettings(
            image_size=args.image_size,
            batch_size=args.batch_size,
            steps=args.steps,
            rounds=args.rounds,
            threads=args.threads,
            site_counts=tuple(int(x) for x in args.sites.split(",")),
            repeats=args.repeats,
            skip_simulator=args.skip_simulator,
            parts=tuple(x.strip() for x in args.only.split(",") if x.strip()) if args.only else SpeedSettings.parts,
        ),
        Path(args.out),
    )
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from cxrfl.bench.pretrain import pretrain_backbone

    out = Path(args.out)
    pretrain_backbone(out, data_dir=Path(args.data_dir) if args.data_dir else out.parent / "pretrain-data",
                      n_images=args.n_images, image_size=args.image_size, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, threads=args.threads or None)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``bench compare`` and ``bench speed`` to the ``cxrfl`` command.

    Args:
        sub: the top-level subparsers.
    """
    bench = sub.add_parser("bench", help="benchmarks: the papers' method comparison and framework overhead")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    c = bsub.add_parser("compare", help="run every method on a profile; write results.json, report.md and plots")
    c.add_argument("--profile", default=None,
                   help="two-hospitals (default), two-hospitals-shared, nih1000 or synth-nih (with --site-config: the name "
                        "in the results); fedfew with --method fedfew")
    c.add_argument("--out", required=True, help="output folder")
    c.add_argument("--seeds", type=int, default=3, help="training seeds (default 3)")
    c.add_argument("--rounds", type=int, default=8, help="federated rounds = local epochs of the baselines (default 8)")
    c.add_argument("--image-size", type=int, default=32, help="model input size (default 32)")
    c.add_argument("--data-image-size", type=int, default=64, help="size synthetic images are written at (default 64)")
    c.add_argument("--n-per-site", type=int, default=None, help="images per synthetic training site (default 500)")
    c.add_argument("--n-external", type=int, default=None, help="images of the synthetic external test site (default 400)")
    c.add_argument("--steps", type=int, default=10, help="max steps per local epoch and site; 0: whole split (default 10)")
    c.add_argument("--warmup-epochs", type=int, default=1)
    c.add_argument("--batch-size", type=int, default=16)
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--warmup-lr", type=float, default=5e-3)
    c.add_argument("--patience", type=int, default=5)
    c.add_argument("--methods", default=None, help="comma-separated subset (default: all; surgical-fedavg is always run)")
    c.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples per seed")
    c.add_argument("--sites", type=int, default=None, help="pool profiles: number of sites (ablation setting)")
    c.add_argument("--shared", type=int, default=None, help="pool profiles: classes all sites share (ablation setting)")
    c.add_argument("--ablation", choices=("sites", "shared"), default=None,
                   help="run the papers' ablation series on a pool profile: sites 2..10, or shared classes 0..14 over 4 sites")
    c.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0: torch's default)")
    c.add_argument("--site-config", action="append", default=None,
                   help="your own training site (its site config YAML; repeat per site) instead of a built-in profile")
    c.add_argument("--external-config", action="append", default=None,
                   help="your own fully annotated external test set (site config YAML; repeatable)")
    c.add_argument("--pretrained", default=None, help="local feature-extractor checkpoint (e.g. ImageNet DenseNet121); default: from scratch")
    c.add_argument("--data-dir", default=None, help="where profile data is written (default OUT/data)")
    c.add_argument("--method", default=None,
                   help="'cwt': run the cyclical weight transfer benchmark instead; 'fedfew': the FedFew benchmark "
                        "(rare classes at few sites, profile fedfew; writes OUT/fedfew.json)")
    c.set_defaults(func=_cmd_compare)

    pt = bsub.add_parser("pretrain", help="train a stand-in for ImageNet weights on a disjoint synthetic cohort")
    pt.add_argument("--out", required=True, help="checkpoint file to write")
    pt.add_argument("--data-dir", default=None, help="where the cohort is written (default: beside --out)")
    pt.add_argument("--n-images", type=int, default=2000)
    pt.add_argument("--image-size", type=int, default=32)
    pt.add_argument("--steps", type=int, default=600)
    pt.add_argument("--batch-size", type=int, default=16)
    pt.add_argument("--lr", type=float, default=1e-3)
    pt.add_argument("--threads", type=int, default=1)
    pt.set_defaults(func=_cmd_pretrain)

    s = bsub.add_parser("speed", help="framework overhead: simulator vs plain loop, aggregation time/memory, payload bytes")
    s.add_argument("--out", required=True, help="output folder (speed.json, speed.md)")
    s.add_argument("--image-size", type=int, default=64)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--steps", type=int, default=10, help="training steps per round")
    s.add_argument("--rounds", type=int, default=3, help="rounds of the one-site simulator run")
    s.add_argument("--threads", type=int, default=2, help="torch CPU threads in both loops")
    s.add_argument("--sites", default="2,4,10,20", help="site counts of the aggregation benchmark")
    s.add_argument("--repeats", type=int, default=5, help="timing repeats of each aggregation")
    s.add_argument("--skip-simulator", action="store_true", help="leave out the simulator-vs-plain measurement")
    s.add_argument("--only", default=None, metavar="PARTS",
                   help="comma-separated parts to run: simulator, aggregation, payload (default: all); the others are "
                        "carried over from OUT/speed.json when it has them")
    s.set_defaults(func=_cmd_speed)
