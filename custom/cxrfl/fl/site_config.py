"""Where a site finds its own data config at run time (no job carries site data)."""

from __future__ import annotations

import os
from pathlib import Path

from cxrfl.errors import ConfigError

SITE_CONFIG_ENV = "CXRFL_SITE_CONFIG"
SITE_CONFIG_DIR_ENV = "CXRFL_SITE_CONFIG_DIR"
LOCAL_CONFIG_NAME = "cxrfl_site.yaml"
"""The file a deployed kit keeps its data config in, under ``local/`` (``cxrfl deploy site-config``)."""
DEMO_SITES = ("site-1", "site-2")
"""The simulator's default site names (its embedded demo hospitals): the sites of the FedFew demo job."""


def resolve_site_config(site: str, local_dir: str | Path | None = None, *, simulator: bool = False) -> tuple[Path, str]:
    """Find a site's config file.

    Order: ``$CXRFL_SITE_CONFIG`` (a file); ``<workspace>/local/cxrfl_site.yaml`` (a deployed
    kit); ``$CXRFL_SITE_CONFIG_DIR/<site>.yaml``; ``./site_configs/<site>.yaml``; else, in NVFlare's
    simulator only, the embedded demo data for the demo names (``site-1`` -> hospital-a, ...). A
    deployed or POC site never trains on the demo data: without a config it stops.

    Args:
        site: the site name as NVFlare knows it.
        local_dir: the site's ``local/`` folder, if any.
        simulator: the site is a client of NVFlare's simulator (``FLContextKey.SIMULATE_MODE``).

    Returns:
        (path, how it was found).

    Raises:
        ConfigError: no config found (and, in the simulator, not a demo site name).
    """
    env = os.environ.get(SITE_CONFIG_ENV)
    if env:
        return Path(env), f"${SITE_CONFIG_ENV}"
    if local_dir and (Path(local_dir) / LOCAL_CONFIG_NAME).is_file():
        return Path(local_dir) / LOCAL_CONFIG_NAME, "the site's local/ folder"
    for folder, how in (
        (os.environ.get(SITE_CONFIG_DIR_ENV), f"${SITE_CONFIG_DIR_ENV}"),
        ("site_configs", "site_configs/"),
    ):
        if folder and (Path(folder) / f"{site}.yaml").is_file():
            return (Path(folder) / f"{site}.yaml").resolve(), how
    if not simulator:
        raise ConfigError(
            f"no site config for {site!r}: describe the site's data in a YAML file (site_configs/README.md) and "
            f"install it with 'cxrfl deploy site-config <kit folder> <file.yaml>' (it becomes "
            f"local/{LOCAL_CONFIG_NAME}), or set ${SITE_CONFIG_ENV}; the embedded demo data is for NVFlare's "
            "simulator only"
        )
    from cxrfl.synth import demo_site_config

    try:
        return demo_site_config(site), "the embedded demo data"
    except ConfigError as exc:
        raise ConfigError(
            f"no site config for {site!r}: set ${SITE_CONFIG_DIR_ENV} (a folder of <site>.yaml), write "
            f"site_configs/{site}.yaml, or set ${SITE_CONFIG_ENV} ({exc})"
        ) from exc
