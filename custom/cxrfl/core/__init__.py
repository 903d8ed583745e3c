"""The shared federated core: what every method's server does with its sites' updates, framework-free.

- :mod:`~cxrfl.core.updates`: checking one site's update whole (fields, dtypes, shapes, finite values,
  sample counts); the head is optional.
- :mod:`~cxrfl.core.running_sum`: the streaming weighted sum (each update read once, as it arrives).
- :mod:`~cxrfl.core.update_change`: how a result differs from the model it was sent (update norm,
  unchanged share; the warning line naming an outlying norm).
- :mod:`~cxrfl.core.fedavg`: head-agnostic FedAvg (weighting, median, clipped updates) and
  :class:`~cxrfl.core.streaming.StreamingFedAvg`, one round's results validated and summed as they arrive.

Used by surgical aggregation (which adds the per-class head), CWT, FedFew and the evaluation-only
federation; imports only :mod:`cxrfl.nn` (one torch thread, the head prefix) and :mod:`cxrfl.errors`.
"""
