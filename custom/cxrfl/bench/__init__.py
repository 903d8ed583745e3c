"""Benchmarks: the papers' method comparison (``cxrfl bench compare``) and framework overhead
(``cxrfl bench speed``).

The comparison runs every method in-process with the framework-free code that the NVFlare
executors and controller run (:class:`cxrfl.surgical.learner.SiteLearner` and
:mod:`cxrfl.surgical.head_modes`); starting the simulator for every method and seed would cost more than
the training here. The speed benchmark measures what that shortcut leaves out.
"""
