"""Old class path of the surgical-aggregation site executor, kept for job configs exported before
:mod:`cxrfl.fl.surgical` (``cxrfl.fl.executor.SiteExecutor``)."""

from cxrfl.fl.site_config import LOCAL_CONFIG_NAME, resolve_site_config
from cxrfl.fl.surgical import SiteExecutor

__all__ = ["LOCAL_CONFIG_NAME", "SiteExecutor", "resolve_site_config"]
