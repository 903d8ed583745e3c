"""The whole learning curve of one FedFew-benchmark MLC baseline, without early stopping (issue 42's diagnostic).

Trains ``mlc`` (``fedavg``) or ``mlc-surgical`` (``surgical``) on one seed's data for ``--rounds`` rounds, from
scratch or (``--ssl-state``) from a stage-1 file's SimSiam encoder as ``mlc-ssl`` starts, at every site or
(``--sites cc``) at the CC sites only, as FedFew's stage-2 warm-up trains; it writes, per round: the pooled
validation loss the benchmark stops on, the CC sites' and the UC sites' parts of it, the CheXNet-weighted validation
loss, the CC sites' mean validation AUROC, and the test CC AUROC and each UC's test AUROC. It showed why a
patience of 5 rounds ended the baselines at round 1-2 (``cxrfl.bench.fedfew.methods.mlc_min_rounds``;
``docs/fedfew.md``), and why the baselines started from stage 1's encoder learn the CCs slowly
(``benchmarks/results/fedfew42/diagnostics/README.md``).

Usage: ``python benchmarks/fedfew_mlc_curve.py --seed 0 --mode surgical --out curve.json`` (the seed's data is
written under ``--data-root`` as ``cxrfl bench fedfew`` writes it, or reused).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cxrfl.bench.fedfew import FedFewBenchSettings
from cxrfl.bench.fedfew.data import prepare_data
from cxrfl.bench.fedfew.methods import (
    MLC_CLASSES,
    _chexnet_weights,
    _mlc_round,
    _mlc_tables,
    eval_mlc,
    weighted_bce,
)
from cxrfl.common.io import to_numpy
from cxrfl.data.dataset import make_loader
from cxrfl.fedfew.ssl import load_encoder
from cxrfl.nn.models import build_model
from cxrfl.nn.training import evaluate
from cxrfl.synth.fedfew_profile import FEDFEW_CCS


def site_validation(model: Any, tables: dict, weights: dict, settings: FedFewBenchSettings) -> dict[str, dict]:
    """Per site: known labels, unweighted and CheXNet-weighted masked BCE, mean CC AUROC on its validation split."""
    out = {}
    for s, t in tables.items():
        loader = make_loader(t, MLC_CLASSES, image_size=settings.image_size, train=False, batch_size=128)
        ev = evaluate(model, loader, MLC_CLASSES, torch.device(settings.device))
        cc = [ev.aurocs[c] for c in FEDFEW_CCS if ev.aurocs.get(c) is not None]
        out[s] = {
            "n": float(ev.mask.sum()),
            "loss": float(ev.loss),
            "wloss": weighted_bce(ev, weights[s]),
            "cc_auroc": float(np.mean(cc)) if cc else None,
        }
    return out


def pooled(sites: dict[str, dict], key: str, names: list[str]) -> float:
    """``key`` pooled over ``names`` by their known labels."""
    return sum(sites[s][key] * sites[s]["n"] for s in names) / sum(sites[s]["n"] for s in names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("fedavg", "surgical"), default="surgical")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--data-root", default="/work/cache/fedfew-bench")
    p.add_argument("--ssl-state", default=None, help="a stage-1 file whose encoder starts the network")
    p.add_argument("--sites", choices=("all", "cc"), default="all", help="the sites that train (cc: the CC sites)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    settings = dataclasses.replace(FedFewBenchSettings(), threads=1)
    data = prepare_data(settings, Path(args.data_root) / f"seed{args.seed}", args.seed)
    torch.manual_seed(args.seed + 2)  # as train_mlc seeds its network
    model = build_model(settings.model_config(), len(MLC_CLASSES))
    if args.ssl_state:
        load_encoder(model, torch.load(args.ssl_state, map_location="cpu", weights_only=True)["ssl_state"])
    state = to_numpy(model.state_dict())
    tables, val = _mlc_tables(data, "train", settings.mlc_batch_size), _mlc_tables(data, "val")
    weights = {s: _chexnet_weights(tables[s], MLC_CLASSES) for s in val}
    if args.sites == "cc":
        tables = {s: t for s, t in tables.items() if s.startswith("cc")}
    rows = []
    for rnd in range(1, args.rounds + 1):
        start = time.perf_counter()
        state = _mlc_round(model, state, tables, settings, args.seed * 1000 + rnd, args.mode)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        sites = site_validation(model, val, weights, settings)
        test = eval_mlc(model, data, settings)
        cc = [s for s in sites if s.startswith("cc")]
        row = {
            "round": rnd,
            "val_loss": pooled(sites, "loss", list(sites)),
            "val_loss_cc": pooled(sites, "loss", cc),
            "val_loss_uc": pooled(sites, "loss", [s for s in sites if s not in cc]),
            "val_wloss": pooled(sites, "wloss", list(sites)),
            "val_cc_auroc": float(np.mean([sites[s]["cc_auroc"] for s in cc])),
            "test_cc_auroc": test["mean_cc_auroc"],
            "test_uc_auroc": {u: m.get("auroc") for u, m in test["uc"].items()},
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        run = {"seed": args.seed, "mode": args.mode, "ssl_state": args.ssl_state, "sites": args.sites}
        Path(args.out).write_text(json.dumps({**run, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
