"""cxrfl: federated chest X-ray learning across hospitals whose label sets differ.

A framework-free core (labels, data, models, losses, aggregation, metrics) with thin NVFlare
glue in :mod:`cxrfl.fl`.
"""

__version__ = "0.1.0"
