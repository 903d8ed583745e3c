"""The Markdown report and the target sentences of ``cxrfl bench speed`` (``speed.md``)."""

from __future__ import annotations

from typing import Any

from cxrfl.bench.loading import format_loading, loading_verdicts
from cxrfl.bench.protocol import load_text
from cxrfl.bench.report_text import markdown_table


def _settings_of(res: dict[str, Any], part: str) -> dict[str, Any]:
    return (res.get("carried_over", {}).get(part) or {}).get("settings") or res["settings"]


def _header(res: dict[str, Any]) -> list[str]:
    m = res["machine"]
    cores = m.get("cores", m.get("cpus"))  # "cpus" in results written before 2026-11-25
    lines = [
        f"Machine: {cores} CPU cores, CPU only, {res['settings']['threads']} torch thread(s) for training; load "
        f"average at start {load_text(m)}.",
        "",
    ]
    for part, source in res.get("carried_over", {}).items():
        lines += [
            f"The {part} part is carried over from an earlier run: `{source.get('command')}` (load average at its "
            f"start {load_text(source.get('machine') or {})}).",
            "",
        ]
    return lines


def _simulator(res: dict[str, Any]) -> list[str]:
    sim = res.get("simulator")
    if not sim:
        return []
    s = _settings_of(res, "simulator")

    def row(label: str, rates: list[float], mean: float) -> list[str]:
        return [label, ", ".join(f"{x:.1f}" for x in rates), f"{mean:.1f}"]

    return [
        "### Local training inside the simulator vs a plain PyTorch loop",
        "",
        f"DenseNet121, {s['image_size']}x{s['image_size']} px, batch {s['batch_size']}, {s['steps']} steps per round, "
        f"{s['rounds']} rounds, one synthetic site; `{sim['command']}`.",
        "",
        markdown_table(
            ["loop", "images/s per round", "mean"],
            [
                row("plain, before", sim["plain_before"]["images_per_second"], sim["plain_before"]["mean"]),
                row("simulator (site metrics)", sim["simulator_images_per_second"], sim["simulator_mean"]),
                row("plain, after", sim["plain_after"]["images_per_second"], sim["plain_after"]["mean"]),
            ],
        ),
        "",
        f"Ratio simulator / plain: **{sim['ratio']:.2f}x** (simulator run took {sim['simulator_wall_seconds']:.0f} s "
        "wall time, mostly start-up).",
        "",
    ]


def _training(res: dict[str, Any]) -> list[str]:
    tr = res.get("training")
    if not tr:
        return []
    default = (
        f"{tr['precision']}{' autocast' if tr['precision'] != 'fp32' else ''}, "
        f"{'channels-last' if tr['channels_last'] else 'NCHW'}"
    )
    return [
        "### Training precision and memory format (default vs float32 NCHW)",
        "",
        f"DenseNet121 training steps (forward, backward, Adam), {tr['image_size']} px, batch {tr['batch_size']}, "
        f"{tr['steps']} steps per repeat, {tr['threads']} torch thread(s), the same in-memory batches; "
        "the settings take "
        f"turns ({tr['repeats']} repeats each). Default on this machine: {default}.",
        "",
        markdown_table(
            ["setting", "images/s per repeat", "mean"],
            [
                [
                    "float32, NCHW",
                    ", ".join(f"{x:.1f}" for x in tr["images_per_second"]["fp32"]),
                    f"{tr['fp32_img_s']:.1f}",
                ],
                [
                    f"default ({default})",
                    ", ".join(f"{x:.1f}" for x in tr["images_per_second"]["default"]),
                    f"{tr['default_img_s']:.1f}",
                ],
            ],
        ),
        "",
        f"Ratio default / float32: **{tr['ratio']:.2f}x**.",
        "",
    ]


def _accuracy(res: dict[str, Any]) -> list[str]:
    acc = res.get("accuracy")
    if not acc:
        return []

    def cells(vals: list[float | None]) -> str:
        return ", ".join("n/a" if v is None else f"{v:.3f}" for v in vals)

    return [
        "### Accuracy of the default against float32",
        "",
        f"DenseNet121 from scratch on the {acc['site']} split of two-hospitals ({acc['train_images']} training, "
        f"{acc['test_images']} test images) at {acc['image_size']} px, {acc['epochs']} epochs, Adam "
        f"{acc['lr']:g}, batch "
        f"{acc['batch_size']}, {acc['seeds']} seeds; mean test AUROC, each setting evaluated on its own "
        "inference path.",
        "",
        markdown_table(
            ["setting", "per seed", "mean"],
            [
                ["float32, NCHW", cells(acc["auroc"]["fp32"]), f"{acc['fp32_mean_auroc']:.3f}"],
                [
                    f"default ({acc['precision']}, {'channels-last' if acc['channels_last'] else 'NCHW'})",
                    cells(acc["auroc"]["default"]),
                    f"{acc['default_mean_auroc']:.3f}",
                ],
            ],
        ),
        "",
    ]


def _extra(row: dict[str, Any], method: str) -> str:
    v = row[method]["extra_model_sizes"]
    return "-" if v is None else f"{row[method]['memory']['extra'] / 1e6:.0f} MB ({v:.2f} models)"


def _timed(row: dict[str, Any], method: str) -> list[str]:
    if method not in row:
        return ["-", "-"]
    r, q = row[method]["ratio_to_nvflare_fedavg"], row[method].get("ratio_of_minima")
    return [f"{row[method]['median_seconds']:.3f}", f"{r:.2f}" + (f" ({q:.2f})" if q is not None else "")]


def _aggregation(res: dict[str, Any]) -> list[str]:
    agg = res.get("aggregation")
    if not agg:
        return []
    repeats = _settings_of(res, "aggregation")["repeats"]
    busy = f"{agg.get('busy', 0)} busy-loop process(es) running" if agg.get("busy") else "no load of its own"
    lines = [
        "### Aggregation of K full DenseNet121 updates",
        "",
        f"One update = {agg['model_bytes'] / 1e6:.1f} MB (float32 feature extractor, BatchNorm buffers "
        "and a 20-class head; "
        "FedAvg sites send all 20 rows, surgical sites the 7 shared classes plus a random third of the "
        "others). Median of "
        f"{repeats} repeats, the methods taking turns within each repeat (in brackets: the ratio of the fastest "
        f"repeats); torch at {agg.get('threads', 1)} thread(s) in the process, {busy}; peak extra memory in a fresh "
        "process. The job's path is the server's `RoundAggregator` (validation + aggregation).",
        "",
    ]
    rows = []
    for k, row in agg["sites"].items():
        rows.append(
            [
                k,
                f"{row['nvflare_fedavg']['median_seconds']:.3f}",
                *_timed(row, "round_aggregator"),
                *_timed(row, "surgical"),
                *_timed(row, "surgical_nvflare"),
                _extra(row, "nvflare_fedavg"),
                _extra(row, "surgical"),
                _extra(row, "surgical_nvflare"),
            ]
        )
    header = [
        "K",
        "NVFlare FedAvg (s)",
        "job's path (s)",
        "ratio",
        "surgical_aggregate (s)",
        "ratio",
        "SurgicalAggregator (s)",
        "ratio",
        "peak extra: NVFlare",
        "surgical_aggregate",
        "SurgicalAggregator",
    ]
    return lines + [markdown_table(header, rows), ""]


def _payload(res: dict[str, Any]) -> list[str]:
    pay = res.get("payload")
    if not pay:
        return []
    lines = [
        "### Bytes per site per round",
        "",
        f"Full model: {pay['full_model_bytes'] / 1e6:.2f} MB raw "
        f"({pay['full_model_wire_bytes'] / 1e6:.2f} MB as FOBS task "
        f"data); feature extractor {pay['feature_extractor_bytes'] / 1e6:.2f} MB; one head row {pay['head_row_bytes']} "
        "bytes. Down = up for every mode (a site sends back what it received, trained).",
        "",
    ]
    rows = [
        [
            site,
            mode,
            str(r["head_rows"]),
            f"{r['raw_bytes'] / 1e6:.3f}",
            f"{r['wire_bytes'] / 1e6:.3f}",
            f"{r['fraction_of_full_model']:.4f}",
        ]
        for site, modes in pay["sites"].items()
        for mode, r in modes.items()
    ]
    header = ["site", "head mode", "head rows", "raw MB", "FOBS MB", "of the full model"]
    return lines + [markdown_table(header, rows), ""]


def format_speed(res: dict[str, Any]) -> str:
    """Markdown of the speed results (tables and one sentence per target)."""
    lines = ["## Framework overhead (`cxrfl bench speed`)", "", *_header(res)]
    for section in (_simulator, _training, _accuracy, _aggregation, _payload, format_loading):
        lines += section(res)
    lines += ["### Targets", ""] + [f"- {t}" for t in speed_verdicts(res)] + [""]
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "**MET**" if ok else "**NOT MET**"


def _training_verdicts(res: dict[str, Any]) -> list[str]:
    out = []
    tr = res.get("training")
    if tr and tr.get("ratio") is not None:
        out.append(
            f"Default training at least 1.7x float32 NCHW images/s (same run, same data): {_met(tr['ratio'] >= 1.7)} "
            f"({tr['ratio']:.2f}x: {tr['default_img_s']:.1f} vs {tr['fp32_img_s']:.1f} images/s, {tr['precision']}, "
            f"channels_last={tr['channels_last']})."
        )
    acc = res.get("accuracy")
    if acc and acc.get("difference") is not None:
        n = len([d for d in acc["auroc"]["default"] if d is not None])
        half = None
        if acc.get("difference_sd") is not None and n > 1:
            from scipy.stats import t

            half = float(t.ppf(0.975, n - 1)) * acc["difference_sd"] / n**0.5
        ok = half is not None and abs(acc["difference"]) <= half
        out.append(
            f"Accuracy of the default within noise of float32 (the paired 95 % interval of the AUROC difference "
            f"contains 0): {_met(ok)} (default - float32 = {acc['difference']:+.3f}"
            + (f" +- {half:.3f}" if half is not None else "")
            + f" over {n} seeds)."
        )
    return out


def _aggregation_verdicts(row: dict[str, Any], busy: int) -> list[str]:
    out = []
    when = f" with {busy} busy-loop process(es)" if busy else ""
    if "round_aggregator" in row:
        r = row["round_aggregator"]["ratio_to_nvflare_fedavg"]
        out.append(
            f"The job's aggregation path (validation + aggregation) of 10 updates within 1.5x NVFlare's FedAvg{when}: "
            f"{_met(r <= 1.5)} ({row['round_aggregator']['median_seconds']:.3f} s = {r:.2f}x)."
        )
    r = row["surgical"]["ratio_to_nvflare_fedavg"]
    rn = row["surgical_nvflare"]["ratio_to_nvflare_fedavg"]
    out.append(
        f"Surgical aggregation (`surgical_aggregate`) of 10 updates within 1.5x NVFlare's "
        f"InTimeAccumulateWeightedAggregator FedAvg: {_met(r <= 1.5)} "
        f"({row['surgical']['median_seconds']:.3f} s vs {row['nvflare_fedavg']['median_seconds']:.3f} s = {r:.2f}x)."
    )
    fastest = row["surgical_nvflare"].get("ratio_of_minima")
    out.append(
        f"The same through the NVFlare component (`SurgicalAggregator`: every update validated, then "
        f"aggregated) within 1.5x: {_met(rn <= 1.5)} ({row['surgical_nvflare']['median_seconds']:.3f} s = {rn:.2f}x"
        + (f"; fastest repeats {fastest:.2f}x" if fastest is not None else "")
        + ")."
    )
    ex = row["surgical"]["extra_model_sizes"]
    if ex is not None:
        out.append(
            f"Peak extra memory of aggregating 10 updates under 3 model sizes: {_met(ex < 3)} "
            f"({ex:.2f} model sizes for surgical_aggregate; SurgicalAggregator "
            f"{row['surgical_nvflare']['extra_model_sizes']:.2f}; NVFlare FedAvg "
            f"{row['nvflare_fedavg']['extra_model_sizes']:.2f})."
        )
    return out


def speed_verdicts(res: dict[str, Any]) -> list[str]:
    """One sentence per framework-overhead target."""
    out = []
    sim = res.get("simulator")
    if sim and sim.get("ratio") is not None:
        out.append(
            f"Training inside the simulator at least 0.9x the plain loop's images/s: {_met(sim['ratio'] >= 0.9)} "
            f"({sim['ratio']:.2f}x: {sim['simulator_mean']:.1f} vs {sim['plain_mean']:.1f} images/s)."
        )
    out += _training_verdicts(res)
    out += loading_verdicts(res)
    agg = res.get("aggregation") or {}
    row = agg.get("sites", {}).get("10")
    if row:
        out += _aggregation_verdicts(row, agg.get("busy", 0))
    pay = res.get("payload")
    if pay:
        ok = all(rows["surgical"]["equals_feature_extractor_plus_own_rows"] for rows in pay["sites"].values())
        detail = "; ".join(
            f"{site}: {rows['surgical']['raw_bytes'] / 1e6:.3f} MB = feature extractor + "
            f"{rows['surgical']['head_rows']} rows ({rows['surgical']['fraction_of_full_model']:.4f} of the "
            "full model)"
            for site, rows in pay["sites"].items()
        )
        out.append(
            f"Per-round payload to a site = the feature extractor plus its own head rows only: {_met(ok)} ({detail})."
        )
    return out
