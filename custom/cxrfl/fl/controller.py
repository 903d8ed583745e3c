"""Old class path of the surgical-aggregation workflow, kept for job configs exported before
:mod:`cxrfl.fl.surgical` (``cxrfl.fl.controller.SurgicalAggregation``)."""

from cxrfl.fl.surgical import SurgicalAggregation

__all__ = ["SurgicalAggregation"]
