"""A stand-in for the papers' ImageNet-pretrained DenseNet121: a feature extractor trained on a
disjoint synthetic cohort.

The papers start every model from ImageNet weights, warm the heads up on the frozen feature
extractor and fine-tune at a small learning rate; FedBN+ freezes BatchNorm at the pretrained
statistics. ImageNet weights cannot be downloaded here and DenseNet121 from scratch learns
little in a CPU budget, so ``cxrfl bench pretrain`` trains one on ``pretrain-pool`` (its own
patients, the ``community`` acquisition style that no benchmark site or test set uses, all 20
findings) and writes a cxrfl checkpoint that ``cxrfl bench compare --pretrained FILE`` (and any
job, through ``model_config.pretrained``) loads into the feature extractor. Its features have
seen the findings, so it is closer to a CheXpert-pretrained than to an ImageNet-pretrained
network: results with it are optimistic for every method alike.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from cxrfl.data.dataset import make_loader
from cxrfl.data.site import load_site
from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint
from cxrfl.nn.training import adam, evaluate, train_epochs


def pretrain_backbone(
    out: Path,
    *,
    data_dir: Path,
    n_images: int = 2000,
    image_size: int = 32,
    data_image_size: int = 64,
    steps: int = 600,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 1234,
    threads: int | None = 1,
    log=print,
) -> dict:
    """Train DenseNet121 on ``pretrain-pool`` and save it as a cxrfl checkpoint.

    Args:
        out: checkpoint file.
        data_dir: where the cohort is written.
        n_images: cohort size.
        image_size: model input size.
        data_image_size: size the images are written at.
        steps: optimiser steps.
        batch_size: minibatch size.
        lr: Adam learning rate.
        seed: data and weight seed (not one of the comparison's).
        threads: torch CPU threads.
        log: progress callback.

    Returns:
        a summary (validation AUROC, time).
    """
    import cxrfl.synth.bench_profiles  # noqa: F401  (registers pretrain-pool)
    from cxrfl.synth import write_profile

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    (cfg,) = write_profile("pretrain-pool", Path(data_dir), n_per_site=n_images, image_size=data_image_size, seed=seed)
    data = load_site(cfg, check_images=False)
    mc = ModelConfig(image_size=image_size)
    torch.manual_seed(seed)
    model = build_model(mc, len(data.classes))
    opt = adam(model, lr)
    train = make_loader(
        data.split_table("train"), data.classes, image_size=image_size, train=True, batch_size=batch_size, seed=seed
    )
    val = make_loader(
        data.split_table("val"), data.classes, image_size=image_size, train=False, batch_size=64, cache=True
    )
    done, chunk = 0, 50
    res = None
    while done < steps:
        n = min(chunk, steps - done)
        stats = train_epochs(model, train, opt, torch.device("cpu"), max_steps=n, desc=f"pretrain {done}/{steps}")
        done += stats.steps
        res = evaluate(model, val, data.classes, torch.device("cpu"))
        log(
            f"pretrain step {done}/{steps}: train loss {stats.loss:.3f}, val loss {res.loss:.3f}, "
            f"val mean AUROC {res.mean_auroc:.3f} ({time.perf_counter() - start:.0f}s)"
        )
    summary = {
        "steps": done,
        "val_loss": res.loss if res else None,
        "val_mean_auroc": res.mean_auroc if res else None,
        "val_auroc": res.aurocs if res else None,
        "images": len(data.table),
        "seconds": time.perf_counter() - start,
        "seed": seed,
        "image_size": image_size,
        "cohort": "pretrain-pool (community style, 20 findings)",
    }
    save_checkpoint(out, model, classes=list(data.classes), model_config=mc, extra={"pretrain": summary})
    log(f"wrote {out}")
    return summary
