"""Evaluation-only federation (issue 45): pooled clinical statistics from binned score counts.

What leaves a site is only, per class, a :class:`~cxrfl.clinical.counts.ScoreCounts`: how many
positives and how many negatives scored in each of a fixed set of bins (integers), and nothing
for a class with fewer than ``min_cell`` positives or negatives. No score, label or image of
its own leaves a site. From the merged counts the server computes the pooled AUROC with its
DeLong interval (:mod:`~cxrfl.clinical.pooled`), sensitivity and specificity at any bin edge,
calibration maps and expected calibration error (:mod:`~cxrfl.clinical.calibration`) and
operating points (:mod:`~cxrfl.clinical.operating`). Nothing here imports NVFlare or torch.
"""
