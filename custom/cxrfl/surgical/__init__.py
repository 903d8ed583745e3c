"""Surgical aggregation and its baselines (head modes): maths, site learner, transport-free server loop.

- :mod:`~cxrfl.surgical.config`: the server settings (:class:`SurgicalConfig`, defaults in one place).
- :mod:`~cxrfl.surgical.head_modes`: the mode constants and what each site receives.
- :mod:`~cxrfl.surgical.aggregation`, :mod:`~cxrfl.surgical.round_aggregator`: the class-wise aggregation of
  one round (the feature extractor by the shared core's FedAvg, :mod:`cxrfl.core`; each head row from the sites
  that have its class), at once or as the results arrive.
- :mod:`~cxrfl.surgical.learner`, :mod:`~cxrfl.surgical.host`: the site side (training, the tasks).
- :mod:`~cxrfl.surgical.server`: the round loop, run over NVFlare (:mod:`cxrfl.fl.surgical`) or in
  process (:mod:`~cxrfl.surgical.inprocess`: benchmarks and tests); :mod:`~cxrfl.surgical.tasks`: what
  it sends each site; :mod:`~cxrfl.surgical.evaluation`: the selected model on the test splits.
"""
