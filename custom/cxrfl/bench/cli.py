"""The ``cxrfl bench`` subcommands: ``compare``, ``cwt``, ``fedfew``, ``speed``, ``load``, ``pretrain`` (and, from
``cli_inprocess``, ``privacy``, ``hostile``, ``quantize``, ``clinical``; ``--arch``, from ``arch``).

Every benchmark writes its results, a Markdown report and its plots into ``--out``; heavy modules
load per command. The library functions report progress through a ``log`` callable: here it
prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cxrfl.errors import ConfigError

if TYPE_CHECKING:
    from cxrfl.bench.protocol import CompareSettings

DISPATCHED = ("cwt", "fedfew")
"""``bench compare --method`` values that run another benchmark (``cxrfl bench <method>`` with its defaults)."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def _stamped(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _methods(text: str | None) -> list[str] | None:
    return [m.strip() for m in text.split(",") if m.strip()] if text else None


def _floats(text: str | None) -> tuple[float, ...] | None:
    return tuple(float(x) for x in text.split(",") if x.strip()) if text else None


def _compare_settings(args: argparse.Namespace) -> CompareSettings:
    """The comparison's settings: the converged protocol, ``--quick``'s smoke preset, then every option given."""
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
        "methods": _methods(args.methods),
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


def _cmd_compare(args: argparse.Namespace) -> int:
    if args.method is not None:
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


def _cmd_cwt(args: argparse.Namespace) -> int:
    from cxrfl.bench.cwt import BenchSettings, run_cwt_benchmark

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
    try:
        settings = BenchSettings(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_cwt_benchmark(
        Path(args.out), settings.seeds, settings=settings, data_root=args.data_root, log=_say, resume=not args.no_resume
    )
    return 0


def _cmd_fedfew(args: argparse.Namespace) -> int:
    from cxrfl.bench.fedfew import QUICK, BenchSettings, run_fedfew_benchmark

    base = QUICK if args.quick else BenchSettings()
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
        changes["methods"] = tuple(_methods(args.methods))
    try:
        settings = dataclasses.replace(base, fedfew=fedfew, **changes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_fedfew_benchmark(
        Path(args.out),
        args.seeds,
        settings=settings,
        data_root=args.data_root,
        work=args.work,
        log=_say,
        resume=not args.no_resume,
    )
    return 0


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


def _add_compare(bsub: argparse._SubParsersAction) -> None:
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
    c.set_defaults(func=_cmd_compare)


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
    f.add_argument("--seeds", type=int, default=3)
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
        help="comma-separated subset of mlc,mlc-ssl,mlc-surgical,mlc-pooled,nn-ssl,nn-mlc-ssl,fedfew-no-ebm,"
        "fedfew,fedfew-balanced,fedfew-lambda1,fedfew-neg-in,fedfew-scorer (fedfew always runs; "
        "added to a finished benchmark, only the new ones run)",
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
    from cxrfl.bench.cli_inprocess import add_inprocess_parsers  # it imports this module's helpers

    bench = sub.add_parser(
        "bench", help="benchmarks: the methods against the papers' baselines, and framework overhead"
    )
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (_add_compare, _add_cwt, _add_fedfew, _add_speed, _add_load, _add_pretrain, add_inprocess_parsers):
        add(bsub)
    add_arch_option(bsub)
