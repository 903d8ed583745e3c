"""Evaluation-only federation (issue 45): a trained model scored at every site, nothing trained.

The server (:class:`~cxrfl.fedeval.server.FedEvalServer`) asks each site which classes it labels,
sends it the feature extractor and the head rows of those classes only, and receives per class
binned score counts (:mod:`cxrfl.clinical.counts`); from the counts pooled over exactly the sites
that label a class it computes the pooled AUROC with its interval, sensitivity and specificity and
calibration (:mod:`cxrfl.clinical`). Sites run the training jobs' site host
(:class:`cxrfl.surgical.host.SurgicalSiteHost`), so a deployed kit needs nothing new.
"""
