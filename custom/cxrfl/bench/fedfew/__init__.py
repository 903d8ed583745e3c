"""FedFew against the paper's baselines on the synthetic ``fedfew`` profile, in-process (``cxrfl bench fedfew``).

Per seed (the seed draws the synthetic cohorts, the unlabelled share of the CC sites, the
weights and the augmentation):

* data (:mod:`~cxrfl.bench.fedfew.data`): ``cxrfl.synth`` profile ``fedfew``: 3 CC sites, 3 UC
  sites (Edema, Pneumonia, Hernia; ~20 positives and ~200 negatives each), 3 test sites large
  enough for 200 positives + 200 negatives per UC;
* ``fedfew``: the three stages (:func:`cxrfl.fedfew.inprocess.run_fedfew`: the job's own workflow
  and site code; stage 2 until the CC validation loss stops improving), stage 1's encoder probed
  along the way, then the final model file read back as ``cxrfl predict`` does; ``fedfew-no-ebm``
  (optional): the same with lambda = 0 (``fedfew-no-ebm-prototype``: its stage-2 model with the prototype
  scorers); ``fedfew-balanced``: stage 3 again with the balanced
  threshold rule; ``fedfew-scorer``: stage 3 again with the UC sites' scorers
  (:mod:`cxrfl.fedfew.scorer`) in place of the energy gate and prototypes, and
  ``fedfew-prototype`` the same with the prototype scorer (:mod:`~cxrfl.bench.fedfew.seed`);
* ``mlc`` / ``mlc-ssl``: the plain federated multi-label baseline (until its validation loss stops
  improving); ``mlc-surgical`` / ``mlc-surgical-ssl``: the same on masked BCE with each head row
  stitched from the sites that label its class; ``mlc-pooled``: the upper bound on pooled images;
  ``nn-ssl`` / ``nn-mlc-ssl``: the paper's local nearest-neighbour classifier
  (:mod:`~cxrfl.bench.fedfew.methods`). Every trained method records its validation loss and CC
  validation AUROC per round, so the report shows what its selection gave up.

Output (:mod:`~cxrfl.bench.fedfew.run`): ``OUT/results.json`` (settings, machine, every (method,
seed) run with its ``mean_cc_auroc``, ``mean_uc_f1``, per-UC detection metrics
(:func:`cxrfl.nn.detection.detection_metrics`: AUROC with its interval, balanced accuracy, MCC,
F1 beside flagging everything, also at 9 % prevalence) and FedFew's stage
diagnostics, the summary over seeds and the target verdicts with paired statistics),
``OUT/report.md`` (:mod:`~cxrfl.bench.fedfew.report`) and the plots
(:mod:`~cxrfl.bench.fedfew.plots`). Each (method, seed) is kept as it finishes, so an interrupted
run goes on where it stopped.
"""

from cxrfl.bench.fedfew.report import code_text, format_markdown
from cxrfl.bench.fedfew.run import run_fedfew_benchmark
from cxrfl.bench.fedfew.settings import LABELS, METHODS, QUICK, FedFewBenchSettings

__all__ = ["LABELS", "METHODS", "QUICK", "FedFewBenchSettings", "code_text", "format_markdown", "run_fedfew_benchmark"]
