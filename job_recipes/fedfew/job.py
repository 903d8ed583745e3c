"""FedFew (rare classes held by few sites) as an NVFlare 2.9 recipe.

    python job.py                                    # simulator, sites site-1 and site-2 (the demo hospitals)
    python job.py --clients cc-1,cc-2,uc-hernia      # other sites (data: $CXRFL_SITE_CONFIG_DIR/<site>.yaml)
    python job.py --ssl_rounds 5 --rounds 20
    python job.py --detector scorer                  # each UC site's class-balanced scorer instead of the paper's rule
    python job.py --detector scorer --scorer_model prototype  # the scorer is the dual prototype's cosine margin
    python job.py --tracking tensorboard,mlflow      # MLflow too (an SQLite store in the job's server folder)
    python job.py --quantize blockwise8              # 8-bit messages both ways (BatchNorm statistics exact)
    python job.py --env poc | --env prod --startup_kit KIT --clients SITE,SITE,...
    python job.py --export --export-dir jobs         # write the job folder instead: jobs/fedfew

The defaults are those of the committed ``jobs/fedfew`` (CPU demo settings). The job names its sites
(``--clients``, default site-1 .. site-N of ``--n_clients``): the server's app, with its config, goes to
the server alone and each site gets a client app.
"""

import argparse

# importing the recipes imports nvflare.recipe, which takes --export/--export-dir out of sys.argv
from cxrfl.fedfew.config import DETECTORS, SCORER_MODELS
from cxrfl.fl.job_script import add_run_arguments, run_recipe
from cxrfl.fl.recipes import FedFewRecipe
from cxrfl.jobs import job_spec

DEMO = job_spec("fedfew")
SETTINGS = DEMO.controller_args
FEDFEW = SETTINGS["fedfew_config"]


def define_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=DEMO.name, help="job name")
    p.add_argument("--ssl_rounds", type=int, default=FEDFEW["ssl_rounds"], help="stage 1: federated SimSiam rounds")
    p.add_argument("--rounds", type=int, default=FEDFEW["rounds"], help="stage 2: energy rounds after the warm-up")
    p.add_argument("--warmup_rounds", type=int, default=FEDFEW["warmup_rounds"])
    p.add_argument("--image_size", type=int, default=SETTINGS["model_config"]["image_size"])
    p.add_argument(
        "--detector",
        choices=DETECTORS,
        default=FEDFEW["detector"],
        help="how stage 3 detects a rare class: paper (energy gate + dual prototypes) or scorer",
    )
    p.add_argument(
        "--scorer_model",
        choices=SCORER_MODELS,
        default=FEDFEW["scorer_model"],
        help="the scorer's rule (--detector scorer): logistic regression or the dual prototype's cosine margin",
    )
    add_run_arguments(p)
    return p


def main() -> None:
    args = define_parser().parse_args()
    if args.env == "prod" and not args.clients:
        raise SystemExit("--env prod needs --clients (the sites' names: each gets a client app)")
    args.clients = args.clients or ",".join(f"site-{k}" for k in range(1, args.n_clients + 1))
    recipe = FedFewRecipe(
        name=args.name,
        sites=args.clients.split(","),
        description=DEMO.description,
        min_clients=DEMO.min_clients,
        min_results=SETTINGS["min_clients"],
        fedfew_config={
            **FEDFEW,
            "ssl_rounds": args.ssl_rounds,
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "detector": args.detector,
            "scorer_model": args.scorer_model,
        },
        model_config={**SETTINGS["model_config"], "image_size": args.image_size},
        task_timeout=SETTINGS["task_timeout"],
        num_threads=args.num_threads,
        tracking=args.tracking,
        tracking_uri=args.tracking_uri,
        quantize=args.quantize,
    )
    run_recipe(recipe, args)


if __name__ == "__main__":
    main()
