"""Surgical aggregation (or one of the papers' baselines) as an NVFlare 2.9 recipe.

    python job.py                                    # simulator, sites site-1 and site-2 (the demo hospitals)
    python job.py --head_mode union --missing ignore --name fl_partial_loss
    python job.py --tracking tensorboard,mlflow      # MLflow too (an SQLite store in the job's server folder)
    python job.py --quantize blockwise8              # 8-bit messages both ways (BatchNorm statistics exact)
    python job.py --env poc                          # a local POC federation (nvflare poc)
    python job.py --env prod --startup_kit KIT       # a provisioned deployment (KIT: the admin's startup kit)
    python job.py --export --export-dir jobs         # write the job folder instead: jobs/surgical_agg

The defaults are those of the committed ``jobs/surgical_agg`` (CPU demo: 64 px, from scratch).
"""

import argparse

# importing the recipes imports nvflare.recipe, which takes --export/--export-dir out of sys.argv
from cxrfl.fl.job_script import add_run_arguments, run_recipe
from cxrfl.fl.recipes import SurgicalAggregationRecipe
from cxrfl.jobs import job_spec
from cxrfl.surgical.head_modes import BATCHNORM_MODES, HEAD_MODES, MISSING_POLICIES

DEMO = job_spec("surgical_agg")
SETTINGS = DEMO.controller_args


def define_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=DEMO.name, help="job name")
    p.add_argument("--num_rounds", type=int, default=SETTINGS["num_rounds"])
    p.add_argument(
        "--patience", type=int, default=SETTINGS["patience"], help="rounds without improvement before stopping"
    )
    p.add_argument(
        "--time_budget",
        type=float,
        default=SETTINGS["time_budget"],
        help="seconds for the sites' data, the warm-up and the rounds; no round starts that would end after it "
        "(0: no budget)",
    )
    p.add_argument("--head_mode", choices=HEAD_MODES, default=SETTINGS["head_mode"])
    p.add_argument("--missing", choices=MISSING_POLICIES, default=SETTINGS["missing"])
    p.add_argument("--batchnorm", choices=BATCHNORM_MODES, default=SETTINGS["batchnorm"])
    p.add_argument("--image_size", type=int, default=SETTINGS["model_config"]["image_size"])
    p.add_argument("--pretrained", default=None, help="local DenseNet121 checkpoint on the server (needed by fedbn+)")
    p.add_argument(
        "--lr",
        type=float,
        default=SETTINGS["train_config"]["lr"],
        help="Adam rate of the rounds (1e-3 from scratch; the papers' 5e-5 with ImageNet weights)",
    )
    add_run_arguments(p)
    return p


def main() -> None:
    args = define_parser().parse_args()
    recipe = SurgicalAggregationRecipe(
        name=args.name,
        description=DEMO.description,
        min_clients=SETTINGS["min_clients"],
        num_rounds=args.num_rounds,
        model_config={**SETTINGS["model_config"], "image_size": args.image_size, "pretrained": args.pretrained},
        train_config={**SETTINGS["train_config"], "lr": args.lr},
        head_mode=args.head_mode,
        missing=args.missing,
        batchnorm=args.batchnorm,
        patience=args.patience,
        time_budget=args.time_budget or None,
        task_timeout=SETTINGS["task_timeout"],
        num_threads=args.num_threads,
        tracking=args.tracking,
        tracking_uri=args.tracking_uri,
        quantize=args.quantize,
    )
    run_recipe(recipe, args)


if __name__ == "__main__":
    main()
