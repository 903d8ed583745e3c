"""The ``cxrfl bench`` subcommands: ``compare``, ``cwt``, ``fedfew``, ``speed``, ``load``, ``pretrain``.

Every benchmark writes its results, a Markdown report and its plots into ``--out``; heavy modules
load per command. The library functions report progress through a ``log`` callable: here it
prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from cxrfl.errors import ConfigError

DISPATCHED = ("cwt", "fedfew")
"""``bench compare --method`` values that run another benchmark (``cxrfl bench <method>`` with its defaults)."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def _stamped(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _methods(text: str | None) -> list[str] | None:
    return [m.strip() for m in text.split(",") if m.strip()] if text else None


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.method is not None:
        if args.method not in DISPATCHED:
            raise ConfigError(f"--method must be 'cwt' or 'fedfew' (or left out for the method comparison), got {args.method!r}")
        if args.method == "fedfew" and args.profile not in (None, "fedfew"):
            raise ConfigError(f"--method fedfew runs on the fedfew profile only, got --profile {args.profile}")
        from cxrfl.cli import build_parser

        _say(f"--method {args.method}: running `cxrfl bench {args.method} --out {args.out} --seeds {args.seeds}` "
             f"(its other options: cxrfl bench {args.method} --help)")
        other = build_parser().parse_args(["bench", args.method, "--out", str(args.out), "--seeds", str(args.seeds)])
        return other.func(other)
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
        run_ablation(args.ablation, settings, Path(args.out), log=_say)
    else:
        run_compare(settings, Path(args.out), data_dir=Path(args.data_dir) if args.data_dir else None, log=_say)
    return 0


def _cmd_cwt(args: argparse.Namespace) -> int:
    from cxrfl.bench.cwt import BenchSettings, run_cwt_benchmark

    settings = BenchSettings(
        seeds=args.seeds, image_size=args.image_size, per_class=args.per_class, cycles=args.cycles,
        patience=args.patience, batch_size=args.batch_size, lr=args.lr, threads=args.threads,
        splits=tuple(int(x) for x in args.splits.split(",")),
    )
    run_cwt_benchmark(Path(args.out), args.seeds, settings=settings, log=_say, resume=not args.no_resume)
    return 0


def _cmd_fedfew(args: argparse.Namespace) -> int:
    from cxrfl.bench.fedfew import QUICK, BenchSettings, run_fedfew_benchmark

    base = QUICK if args.quick else BenchSettings()
    fedfew = dict(base.fedfew)
    for key in ("rounds", "ssl_rounds", "warmup_rounds"):
        if getattr(args, key) is not None:
            fedfew[key] = getattr(args, key)
    changes = {k: v for k, v in (("image_size", args.image_size), ("n_cc", args.n_cc), ("mlc_rounds", args.mlc_rounds),
                                 ("threads", args.threads), ("jobs", args.jobs)) if v is not None}
    if args.methods:
        changes["methods"] = tuple(_methods(args.methods))
    try:
        settings = dataclasses.replace(base, fedfew=fedfew, **changes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_fedfew_benchmark(Path(args.out), args.seeds, settings=settings, data_root=args.data_root, work=args.work,
                         log=_say, resume=not args.no_resume)
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
        log=_stamped,
    )
    return 0


def _cmd_load(args: argparse.Namespace) -> int:
    import json

    from cxrfl.bench.load import LoadSettings, run_load

    settings = LoadSettings(sites=args.sites, rounds=args.rounds, image_size=args.image_size, steps=args.steps,
                            threads=args.threads)
    result = run_load(settings, Path(args.out), Path(args.work), log=_stamped)
    _say(json.dumps(result, indent=2))
    return 0 if result["rc"] == 0 and len(result["rounds_completed"]) == settings.rounds else 1


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from cxrfl.bench.pretrain import pretrain_backbone

    out = Path(args.out)
    pretrain_backbone(out, data_dir=Path(args.data_dir) if args.data_dir else out.parent / "pretrain-data",
                      n_images=args.n_images, image_size=args.image_size, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, threads=args.threads or None, log=_say)
    return 0


def _add_compare(bsub: argparse._SubParsersAction) -> None:
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
                   help="run another benchmark instead, with its defaults: 'cwt' is `cxrfl bench cwt`, 'fedfew' is "
                        "`cxrfl bench fedfew`")
    c.set_defaults(func=_cmd_compare)


def _add_cwt(bsub: argparse._SubParsersAction) -> None:
    c = bsub.add_parser("cwt", help="cyclical weight transfer on the real NIH images: the paper's splits 1-10")
    c.add_argument("--out", default="benchmarks/results/cwt", help="output folder (default benchmarks/results/cwt)")
    c.add_argument("--seeds", type=int, default=3)
    c.add_argument("--image-size", type=int, default=32)
    c.add_argument("--per-class", type=int, default=200, help="abnormal (= normal) training images over all sites")
    c.add_argument("--cycles", type=int, default=3, help="most cycles (one cycle = one epoch over all sites)")
    c.add_argument("--patience", type=int, default=2)
    c.add_argument("--batch-size", type=int, default=32)
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest on a shared machine)")
    c.add_argument("--splits", default="1,2,3,4,5,6,7,8,9,10", help="which of the paper's splits")
    c.add_argument("--no-resume", action="store_true", help="do not reuse finished runs in OUT")
    c.set_defaults(func=_cmd_cwt)


def _add_fedfew(bsub: argparse._SubParsersAction) -> None:
    f = bsub.add_parser("fedfew", help="FedFew against the multi-label and nearest-neighbour baselines (profile fedfew); "
                                       "write results.json, report.md and plots")
    f.add_argument("--out", default="benchmarks/results/fedfew", help="output folder (default benchmarks/results/fedfew)")
    f.add_argument("--seeds", type=int, default=3)
    f.add_argument("--data-root", default=None, help="where the synthetic sites are written (reused when there)")
    f.add_argument("--work", default=None, help="where the runs' stage files and models go (default DATA_ROOT/runs)")
    f.add_argument("--image-size", type=int, default=None)
    f.add_argument("--n-cc", type=int, default=None, help="images per CC site")
    f.add_argument("--rounds", type=int, default=None, help="FedFew energy rounds")
    f.add_argument("--warmup-rounds", type=int, default=None)
    f.add_argument("--ssl-rounds", type=int, default=None)
    f.add_argument("--mlc-rounds", type=int, default=None)
    f.add_argument("--methods", default=None, help="comma-separated subset of mlc,mlc-ssl,nn-ssl,nn-mlc-ssl,fedfew-no-ebm,"
                                                   "fedfew,fedfew-balanced (fedfew always runs)")
    f.add_argument("--threads", type=int, default=None, help="torch CPU threads per seed (default 1: fastest on a shared machine)")
    f.add_argument("--jobs", type=int, default=None, help="seeds run in parallel processes (default 2)")
    f.add_argument("--quick", action="store_true", help="a few-minute smoke setting (not for reporting)")
    f.add_argument("--no-resume", action="store_true", help="start over instead of going on with the finished runs in OUT")
    f.set_defaults(func=_cmd_fedfew)


def _add_pretrain(bsub: argparse._SubParsersAction) -> None:
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


def _add_speed(bsub: argparse._SubParsersAction) -> None:
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


def _add_load(bsub: argparse._SubParsersAction) -> None:
    lo = bsub.add_parser("load", help="K sites with small data and different label sets in the simulator: peak "
                                      "server memory and round times (OUT/load_K.json)")
    lo.add_argument("--sites", type=int, default=10, help="sites (a load-K synthetic profile; default 10)")
    lo.add_argument("--rounds", type=int, default=3)
    lo.add_argument("--image-size", type=int, default=32)
    lo.add_argument("--steps", type=int, default=2, help="local steps per round and site")
    lo.add_argument("--threads", type=int, default=2, help="simulator threads (-t)")
    lo.add_argument("--work", default="/tmp/cxrfl-load", help="scratch folder (data, job, workspace; emptied first)")
    lo.add_argument("--out", default="benchmarks/results/load", help="output folder (default benchmarks/results/load)")
    lo.set_defaults(func=_cmd_load)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``bench compare|cwt|fedfew|speed|load|pretrain`` to the ``cxrfl`` command.

    Args:
        sub: the top-level subparsers.
    """
    bench = sub.add_parser("bench", help="benchmarks: the methods against the papers' baselines, and framework overhead")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (_add_compare, _add_cwt, _add_fedfew, _add_speed, _add_load, _add_pretrain):
        add(bsub)
