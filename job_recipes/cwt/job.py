"""Cyclical weight transfer (PLTI, CLR, LWMS, CWL) as an NVFlare 2.9 recipe.

    python job.py                                    # simulator, sites site-1 and site-2 (the demo hospitals)
    python job.py --clr --lwms --cwl                 # switch on the other optimizations
    python job.py --tracking tensorboard,mlflow      # MLflow too (an SQLite store in the job's server folder)
    python job.py --quantize blockwise8              # 8-bit messages both ways (BatchNorm statistics exact)
    python job.py --env poc | --env prod --startup_kit KIT
    python job.py --export --export-dir jobs         # write the job folder instead: jobs/cwt

The defaults are those of the committed ``jobs/cwt`` (CPU demo: the binary task, PLTI on).
"""

import argparse

# importing the recipes imports nvflare.recipe, which takes --export/--export-dir out of sys.argv
from cxrfl.fl.job_script import add_run_arguments, run_recipe
from cxrfl.fl.recipes import CWTRecipe
from cxrfl.jobs import job_spec

DEMO = job_spec("cwt")
SETTINGS = DEMO.controller_args
CWT = SETTINGS["cwt_config"]


def define_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=DEMO.name, help="job name")
    p.add_argument("--task", choices=("binary", "multilabel"), default=CWT["task"])
    p.add_argument("--num_cycles", type=int, default=CWT["num_cycles"])
    for flag in ("plti", "clr", "lwms", "cwl"):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=CWT[flag])
    p.add_argument("--image_size", type=int, default=SETTINGS["model_config"]["image_size"])
    add_run_arguments(p)
    return p


def main() -> None:
    args = define_parser().parse_args()
    recipe = CWTRecipe(
        name=args.name,
        description=DEMO.description,
        min_clients=DEMO.min_clients,
        cwt_config={
            **CWT,
            "task": args.task,
            "num_cycles": args.num_cycles,
            "plti": args.plti,
            "clr": args.clr,
            "lwms": args.lwms,
            "cwl": args.cwl,
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
