"""What every ``job.py`` shares: its arguments (tracking, quantization, where to run), NVFlare's
execution environment from them, and running (or exporting) the recipe.
"""

from __future__ import annotations

from typing import Any

from nvflare.recipe.spec import Recipe

from cxrfl.fl.job_settings import QUANTIZE_TYPES, TRACKERS


def add_run_arguments(parser: Any, quantize: bool = True) -> None:
    """The arguments every ``job.py`` shares: tracking, quantization, and where to run (NVFlare's environments).

    Args:
        parser: an ``argparse.ArgumentParser``.
        quantize: offer ``--quantize`` (training jobs).
    """
    parser.add_argument(
        "--tracking",
        default=("tensorboard",),
        type=lambda text: tuple(t for t in text.split(",") if t),
        help="comma-separated trackers of " + ", ".join(TRACKERS) + " ('' for none)",
    )
    parser.add_argument(
        "--tracking_uri",
        default=None,
        help="MLflow tracking server (default: an SQLite file mlflow.db in the job's server folder)",
    )
    parser.add_argument("--num_threads", type=int, default=1, help="CPU threads per site (0: all it is given)")
    if quantize:
        parser.add_argument(
            "--quantize",
            choices=QUANTIZE_TYPES,
            default=None,
            help="quantize what the server sends and the sites return (default: off; BatchNorm statistics stay exact)",
        )
    env = parser.add_argument_group("where to run")
    env.add_argument(
        "--env",
        choices=("sim", "poc", "prod"),
        default="sim",
        help="simulator (default), a local POC federation, or a provisioned deployment",
    )
    env.add_argument(
        "--n_clients",
        type=int,
        default=2,
        help="sites to simulate (site-1, site-2, ...: the embedded demo hospitals) or to start in POC",
    )
    env.add_argument(
        "--clients",
        default=None,
        help="comma-separated site names instead (data: $CXRFL_SITE_CONFIG_DIR/<site>.yaml or site_configs/)",
    )
    env.add_argument("--threads", type=int, default=None, help="simulator threads (default: one per site)")
    env.add_argument("--workspace", default="/tmp/nvflare/simulation", help="simulator workspace root")
    env.add_argument("--startup_kit", default=None, help="prod: the admin's startup kit folder")
    env.add_argument("--username", default="admin@nvidia.com", help="poc/prod: the submitting admin")


def env_from_args(args: Any) -> Any:
    """The NVFlare execution environment :func:`add_run_arguments` describes.

    Args:
        args: the parsed arguments.
    """
    from nvflare.recipe import PocEnv, ProdEnv, SimEnv

    clients = [c for c in (args.clients or "").split(",") if c] or None
    if args.env == "sim":
        return SimEnv(
            num_clients=0 if clients else args.n_clients,
            clients=clients,
            num_threads=args.threads,
            workspace_root=args.workspace,
        )
    if args.env == "poc":
        return PocEnv(num_clients=len(clients) if clients else args.n_clients, clients=clients, username=args.username)
    if not args.startup_kit:
        raise SystemExit("--env prod needs --startup_kit (the admin's startup kit folder)")
    return ProdEnv(startup_kit_location=args.startup_kit, username=args.username)


def run_recipe(recipe: Recipe, args: Any) -> None:
    """Run (or, with NVFlare's ``--export --export-dir DIR``, export) a recipe and say where the results are.

    Args:
        recipe: the recipe.
        args: arguments of :func:`add_run_arguments`.
    """
    run = recipe.execute(env_from_args(args))
    print(f"job {run.get_job_id()}: status {run.get_status()}; results in {run.get_result()}")
