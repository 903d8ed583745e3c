"""Evaluation only: a trained cxrfl model scored at every site, nothing trained, as an NVFlare 2.9 recipe.

    python job.py --model best_FL_global_model.pt                    # simulator, the demo hospitals site-1, site-2
    python job.py --model M.pt --split val --min_cell 20
    python job.py --model M.pt --split val --calibration platt --target sensitivity --target_value 0.9
    python job.py --model M.pt --env poc | --env prod --startup_kit KIT --clients hospital-a,hospital-b
    python job.py --model M.pt --export --export-dir jobs            # write the job folder: jobs/fedeval

Each site receives the feature extractor and the head rows of its own classes, and sends back, per class,
binned counts of its positives' and negatives' scores (nothing below --min_cell cases). The server writes
cxrfl/evaluation.json: per class the AUROC pooled over the sites that label it, with its interval,
sensitivity and specificity and calibration. The model is shipped inside the job's server app only.
"""

import argparse

# importing the recipes imports nvflare.recipe, which takes --export/--export-dir out of sys.argv
from cxrfl.clinical.operating import RULES
from cxrfl.fedeval.config import SPLITS, FedEvalConfig
from cxrfl.fl.job_script import add_run_arguments, run_recipe
from cxrfl.fl.recipes import FedEvalRecipe

DEFAULTS = FedEvalConfig()


def define_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", required=True, help="the checkpoint to evaluate (FL_global_model.pt, best_..., a bundle's model.pt)"
    )
    p.add_argument("--name", default="fedeval", help="job name")
    p.add_argument("--split", choices=SPLITS, default=DEFAULTS.split, help="the sites' split to score")
    p.add_argument(
        "--min_cell",
        type=int,
        default=DEFAULTS.min_cell,
        help="fewest positives (and negatives) of a class a site sends counts for",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=DEFAULTS.threshold,
        help="probability whose sensitivity and specificity are reported",
    )
    p.add_argument(
        "--calibration",
        choices=("platt", "temperature"),
        default=None,
        help="fit a calibration map per class (needs --split val); the model with it: cxrfl/calibrated_model.pt",
    )
    p.add_argument(
        "--target",
        choices=("sensitivity", "specificity", "youden"),
        default=None,
        help="choose an operating point per class (needs --split val)",
    )
    p.add_argument("--target_value", type=float, default=None, help="the sensitivity or specificity --target asks for")
    p.add_argument(
        "--threshold_rule",
        choices=RULES,
        default=DEFAULTS.threshold_rule,
        help="new_data: the expected rate on new images reaches --target_value; validation: the rate on the split does",
    )
    p.add_argument(
        "--calibration_alpha",
        type=float,
        default=DEFAULTS.calibration_alpha,
        help="keep a map only where a likelihood-ratio test at this level says it fits better than the raw scores",
    )
    p.add_argument(
        "--no_site_fits",
        action="store_true",
        help="do not send each site its copy (own classes, own maps) to write as cxrfl_state/site_models/<job>.pt",
    )
    p.add_argument("--task_timeout", type=int, default=0, help="seconds a site may take (0: no limit)")
    add_run_arguments(p, quantize=False)
    return p


def main() -> None:
    args = define_parser().parse_args()
    sites = [c for c in (args.clients or "").split(",") if c] or [f"site-{i + 1}" for i in range(args.n_clients)]
    recipe = FedEvalRecipe(
        model=args.model,
        name=args.name,
        min_clients=len(sites),
        sites=sites,
        fedeval_config={
            "split": args.split,
            "min_cell": args.min_cell,
            "threshold": args.threshold,
            "calibration": args.calibration,
            "target": args.target,
            "target_value": args.target_value,
            "threshold_rule": args.threshold_rule,
            "calibration_alpha": args.calibration_alpha,
            "site_fits": not args.no_site_fits,
        },
        task_timeout=args.task_timeout,
        num_threads=args.num_threads,
    )
    run_recipe(recipe, args)


if __name__ == "__main__":
    main()
