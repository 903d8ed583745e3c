"""The ``cxrfl bench`` subcommands: ``cwt``, ``fedfew``, ``speed``, ``load``, ``pretrain`` (and ``compare``, from
``cli_compare``; from ``cli_inprocess``, ``privacy``, ``hostile``, ``quantize``, ``clinical``; ``--arch``, from
``arch``).

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


def _say(msg: str) -> None:
    print(msg, flush=True)


def _stamped(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _comma_list(text: str | None) -> list[str] | None:
    """An option's comma-separated items, stripped, empty ones left out (None: not given)."""
    return [m.strip() for m in text.split(",") if m.strip()] if text else None


def _cmd_cwt(args: argparse.Namespace) -> int:
    from cxrfl.bench.cwt import CWTBenchSettings, run_cwt_benchmark

    given = {
        "seeds": args.seeds,
        "image_size": args.image_size,
        "arch": args.arch,
        "per_class": args.per_class,
        "cycles": args.cycles,
        "patience": args.patience,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "threads": args.threads,
        "jobs": args.jobs,
        "synthetic_images": args.synthetic_images,
        "splits": tuple(int(x) for x in args.splits.split(",")) if args.splits else None,
        "synthetic_splits": tuple(int(x) for x in args.synthetic_splits.split(",")) if args.synthetic_splits else None,
    }
    settings = CWTBenchSettings(**{k: v for k, v in given.items() if v is not None})
    run_cwt_benchmark(
        Path(args.out), settings.seeds, settings=settings, data_root=args.data_root, log=_say, resume=not args.no_resume
    )
    return 0


def _cmd_fedfew(args: argparse.Namespace) -> int:
    from cxrfl.bench.fedfew import QUICK, FedFewBenchSettings, run_fedfew_benchmark

    base = QUICK if args.quick else FedFewBenchSettings()
    fedfew = dict(base.fedfew)
    for key in ("rounds", "ssl_rounds", "warmup_rounds", "patience"):
        if getattr(args, key) is not None:
            fedfew[key] = getattr(args, key)
    changes = {
        k: v
        for k, v in (
            ("image_size", args.image_size),
            ("arch", args.arch),
            ("n_cc", args.n_cc),
            ("mlc_rounds", args.mlc_rounds),
            ("probe_every", args.probe_every),
            ("threads", args.threads),
            ("jobs", args.jobs),
            ("device", args.device),
        )
        if v is not None
    }
    if args.image_size is not None:  # the images are written at least as large as they are trained
        changes["data_image_size"] = max(args.image_size, base.data_image_size)
    if args.methods:
        changes["methods"] = tuple(_comma_list(args.methods))
    settings = dataclasses.replace(base, fedfew=fedfew, **changes)
    run_fedfew_benchmark(
        Path(args.out),
        args.seeds,
        settings=settings,
        data_root=args.data_root,
        work=args.work,
        log=_say,
        resume=not args.no_resume,
        only=_seed_list(args.only_seeds),
        report_only=args.report_only,
    )
    return 0


def _seed_list(text: str | None) -> list[int] | None:
    """``--only-seeds``: comma-separated seeds (None: not given).

    Args:
        text: the option's value.

    Raises:
        ConfigError: an item is not a whole number.
    """
    if text is None:
        return None
    try:
        return [int(s) for s in _comma_list(text) or []]
    except ValueError:
        raise ConfigError(f"--only-seeds takes comma-separated whole numbers, e.g. 2,3; got {text!r}") from None


def _cmd_speed(args: argparse.Namespace) -> int:
    import json
    import sys

    from cxrfl.bench.loading import LoadingSettings
    from cxrfl.bench.speed import SpeedSettings, json_summary, run_speed

    def to_stderr(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    res = run_speed(
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
            busy=args.busy,
            training_batch_size=args.training_batch_size,
            epochs=args.epochs,
            seeds=args.seeds,
            device=args.device,
            loading=LoadingSettings(
                image_size=args.loading_size,
                batch_size=args.loading_batch_size,
                n_images=args.loading_images,
                threads=args.threads,
                device=args.loading_device,
                workers=tuple(int(x) for x in args.loading_workers.split(",")) if args.loading_workers else (),
            ),
        ),
        Path(args.out),
        log=to_stderr if args.json else _stamped,
    )
    if args.json:
        print(json.dumps(json_summary(res, res["parts_measured"])), flush=True)
    return 0


def _cmd_load(args: argparse.Namespace) -> int:
    import json

    from cxrfl.bench.load import LoadSettings, run_load

    if args.harness:
        from cxrfl.bench.server_memory import run_harness, write_harness

        _say(f"wrote {write_harness(run_harness(args.sites, args.rounds, log=_stamped), args.out)}")
        return 0

    settings = LoadSettings(
        sites=args.sites, rounds=args.rounds, image_size=args.image_size, steps=args.steps, threads=args.threads
    )
    result = run_load(settings, Path(args.out), Path(args.work), log=_stamped)
    _say(json.dumps(result, indent=2))
    return 0 if result["rc"] == 0 and len(result["rounds_completed"]) == settings.rounds else 1


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from cxrfl.bench.pretrain import pretrain_backbone

    out = Path(args.out)
    pretrain_backbone(
        out,
        data_dir=Path(args.data_dir) if args.data_dir else out.parent / "pretrain-data",
        n_images=args.n_images,
        image_size=args.image_size,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        threads=args.threads or None,
        log=_say,
    )
    return 0


def _add_cwt(bsub: argparse._SubParsersAction) -> None:
    c = bsub.add_parser(
        "cwt", help="cyclical weight transfer, the paper's splits 1-10: real NIH images and a synthetic cohort"
    )
    c.add_argument("--out", default="benchmarks/results/cwt", help="output folder (default benchmarks/results/cwt)")
    c.add_argument("--seeds", type=int, default=None, help="training seeds (default 5)")
    c.add_argument("--image-size", type=int, default=None, help="model input side (default 64)")
    c.add_argument(
        "--per-class",
        type=int,
        default=None,
        help="abnormal (= normal) real training images over all sites (default: every usable image)",
    )
    c.add_argument("--cycles", type=int, default=None, help="most cycles, one epoch over all sites each (default 80)")
    c.add_argument("--patience", type=int, default=None, help="cycles without a lower validation loss (default 10)")
    c.add_argument("--batch-size", type=int, default=None)
    c.add_argument("--lr", type=float, default=None)
    c.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default 1)")
    c.add_argument("--jobs", type=int, default=None, help="seeds run in parallel processes (default 2)")
    c.add_argument("--splits", default=None, help="which of the paper's splits (default 1,...,10)")
    c.add_argument(
        "--synthetic-images",
        type=int,
        default=None,
        help="images of the synthetic cohort (default 3000; 0: real images only)",
    )
    c.add_argument("--synthetic-splits", default=None, help="the synthetic table's splits (default: --splits)")
    c.add_argument("--data-root", default=None, help="where the synthetic cohort is written (reused when there)")
    c.add_argument("--no-resume", action="store_true", help="do not reuse finished runs in OUT")
    c.set_defaults(func=_cmd_cwt)


def _add_fedfew(bsub: argparse._SubParsersAction) -> None:
    f = bsub.add_parser(
        "fedfew",
        help="FedFew against the multi-label and nearest-neighbour baselines (profile fedfew); "
        "write results.json, report.md and plots",
    )
    f.add_argument(
        "--out", default="benchmarks/results/fedfew", help="output folder (default benchmarks/results/fedfew)"
    )
    f.add_argument("--seeds", type=int, default=3, help="seeds 0 ... SEEDS-1 (default 3)")
    f.add_argument(
        "--only-seeds",
        default=None,
        help="comma-separated seeds of those to run now (default all); the report keeps every finished seed",
    )
    f.add_argument("--data-root", default=None, help="where the synthetic sites are written (reused when there)")
    f.add_argument("--work", default=None, help="where the runs' stage files and models go (default DATA_ROOT/runs)")
    f.add_argument("--image-size", type=int, default=None)
    f.add_argument("--n-cc", type=int, default=None, help="images per CC site")
    f.add_argument("--rounds", type=int, default=None, help="FedFew energy rounds")
    f.add_argument("--warmup-rounds", type=int, default=None)
    f.add_argument("--ssl-rounds", type=int, default=None)
    f.add_argument("--patience", type=int, default=None, help="stage 2: rounds without a lower CC validation loss")
    f.add_argument("--probe-every", type=int, default=None, help="stage-1 rounds between two linear probes")
    f.add_argument("--mlc-rounds", type=int, default=None)
    f.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of mlc,mlc-ssl,mlc-surgical,mlc-surgical-ssl,mlc-pooled,nn-ssl,nn-mlc-ssl,"
        "fedfew-no-ebm,"
        "fedfew,fedfew-balanced,fedfew-lambda1,fedfew-neg-in,fedfew-scorer,fedfew-prototype,fedfew-no-ebm-prototype "
        "(only these run; "
        "a finished (method, seed) in OUT is not run again, so methods can be added to a finished benchmark)",
    )
    f.add_argument(
        "--device",
        default=None,
        help="cpu (default) or cuda: where the networks train (cuda: one GPU shared by the parallel seeds)",
    )
    f.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads per seed (default 1: fastest on a shared machine)"
    )
    f.add_argument("--jobs", type=int, default=None, help="seeds run in parallel processes (default 2)")
    f.add_argument("--quick", action="store_true", help="a few-minute smoke setting (not for reporting)")
    f.add_argument(
        "--no-resume", action="store_true", help="start over instead of going on with the finished runs in OUT"
    )
    f.add_argument("--report-only", action="store_true", help="train nothing: results and report from the stored runs")
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
    s = bsub.add_parser(
        "speed",
        help="framework overhead: simulator vs plain loop, default precision vs float32, "
        "aggregation time/memory, payload bytes",
    )
    s.add_argument("--out", required=True, help="output folder (speed.json, speed.md)")
    s.add_argument("--image-size", type=int, default=64)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--steps", type=int, default=10, help="training steps per round")
    s.add_argument("--rounds", type=int, default=3, help="rounds of the one-site simulator run")
    s.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch CPU threads of the training loops (0: torch's default; aggregation always runs at torch's default)",
    )
    s.add_argument("--sites", default="2,4,10,20", help="site counts of the aggregation benchmark")
    s.add_argument("--repeats", type=int, default=5, help="timing repeats of each aggregation")
    s.add_argument("--skip-simulator", action="store_true", help="leave out the simulator-vs-plain measurement")
    s.add_argument(
        "--only",
        default=None,
        metavar="PARTS",
        help="comma-separated parts to run: simulator, training, aggregation, payload, accuracy, loading "
        "(default: all but accuracy, which trains for about an hour, and loading); the others are carried "
        "over from OUT/speed.json",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with the headline numbers of the parts measured in this run (progress "
        "goes to stderr)",
    )
    s.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="start N busy-loop processes for the aggregation timings (and stop them after)",
    )
    s.add_argument("--training-batch-size", type=int, default=32, help="batch of the training and accuracy parts")
    s.add_argument("--epochs", type=int, default=8, help="training epochs of the accuracy part")
    s.add_argument("--seeds", type=int, default=3, help="seeds of the accuracy part")
    s.add_argument("--device", default="cpu", help="cpu or cuda: where the training and accuracy parts run")
    s.add_argument(
        "--loading-images", type=int, default=128, help="synthetic full-size images per format of the loading part"
    )
    s.add_argument(
        "--loading-workers",
        default=None,
        metavar="N,N",
        help="loader worker counts of the loading part (default: 0, 1, 2, 4 ... up to the cores, and auto's)",
    )
    s.add_argument("--loading-size", type=int, default=224, help="model input of the loading part")
    s.add_argument("--loading-batch-size", type=int, default=64, help="batch of the loading part (loader and model)")
    s.add_argument("--loading-device", default="auto", help="device of the loading part: auto, cpu, cuda[:N]")
    s.set_defaults(func=_cmd_speed)


def _add_load(bsub: argparse._SubParsersAction) -> None:
    lo = bsub.add_parser(
        "load",
        help="K sites with small data and different label sets in the simulator: peak "
        "server memory and round times (OUT/load_K.json)",
    )
    lo.add_argument("--sites", type=int, default=10, help="sites (a load-K synthetic profile; default 10)")
    lo.add_argument("--rounds", type=int, default=3)
    lo.add_argument("--image-size", type=int, default=32)
    lo.add_argument("--steps", type=int, default=2, help="local steps per round and site")
    lo.add_argument("--threads", type=int, default=2, help="simulator threads (-t)")
    lo.add_argument("--work", default="/tmp/cxrfl-load", help="scratch folder (data, job, workspace; emptied first)")
    lo.add_argument("--out", default="benchmarks/results/load", help="output folder (default benchmarks/results/load)")
    lo.add_argument(
        "--harness",
        action="store_true",
        help="no simulator: the server loop alone over K stub sites sending full DenseNet121 updates through "
        "FOBS, peak RSS streaming vs collecting first (OUT/server_memory_K.json; a minute or two)",
    )
    lo.set_defaults(func=_cmd_load)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``bench compare|cwt|fedfew|speed|load|pretrain|privacy|hostile|quantize|clinical`` to the ``cxrfl`` command.

    Args:
        sub: the top-level subparsers.
    """
    from cxrfl.bench.arch import add_arch_option
    from cxrfl.bench.cli_compare import add_compare_parser  # they import this module's helpers
    from cxrfl.bench.cli_inprocess import add_inprocess_parsers

    bench = sub.add_parser(
        "bench", help="benchmarks: the methods against the papers' baselines, and framework overhead"
    )
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (add_compare_parser, _add_cwt, _add_fedfew, _add_speed, _add_load, _add_pretrain, add_inprocess_parsers):
        add(bsub)
    add_arch_option(bsub)
