"""FedFew (Dong et al.): learning underrepresented classes from decentralised partially labelled images.

Framework-free core (no NVFlare import):

- :mod:`cxrfl.fedfew.config`: the settings of the three stages;
- :mod:`cxrfl.fedfew.ssl`: stage 1, SimSiam (projector, predictor, stop-gradient, negative cosine),
  a site's local SimSiam epochs;
- :mod:`cxrfl.fedfew.energy`: energy scores, hinge terms, margins, threshold choice;
- :mod:`cxrfl.fedfew.prototypes`: the paper's dual prototypes (minimum-count rule), cosine
  matching, majority vote;
- :mod:`cxrfl.fedfew.scorer`: a UC site's class-balanced linear scorer, its threshold chosen out
  of fold;
- :mod:`cxrfl.fedfew.detectors`: both kinds of UC detector under one interface (fit at a site,
  parse, predict with a detection score, evaluate);
- :mod:`cxrfl.fedfew.learner`: the site side of every stage over a ``SiteData``;
- :mod:`cxrfl.fedfew.roles`: the roles of a site's images (role flags) and the energies per role;
- :mod:`cxrfl.fedfew.energy_training`: stage 2's loss and a site's local epochs;
- :mod:`cxrfl.fedfew.site_evaluation`: a site's CC loss, CC AUROCs and counts, UC training prevalence;
- :mod:`cxrfl.fedfew.protocol`: the tasks as messages, the site dispatcher and the site host;
- :mod:`cxrfl.fedfew.plan`: which classes are CCs and UCs, which sites take part in which stage;
- :mod:`cxrfl.fedfew.server`: the three-stage workflow over any transport (NVFlare or in-process),
  a :class:`cxrfl.common.server.ServerLoop`;
- :mod:`cxrfl.fedfew.rounds`: the rounds of stages 1-2: FedAvg of the valid results, retries,
  early stopping on the validation loss, the per-round resume state;
- :mod:`cxrfl.fedfew.stage1`: stage 1 on the server: first weights, SimSiam rounds;
- :mod:`cxrfl.fedfew.stage2`: stage 2 on the server: first weights, phases, validation loss, margins;
- :mod:`cxrfl.fedfew.stage3`: the threshold from the sites' counts, the detectors kept;
- :mod:`cxrfl.fedfew.evaluation`: the final model on every site's test split, CCs pooled;
- :mod:`cxrfl.fedfew.stages`: the stage results on disk, read back by a resumed run;
- :mod:`cxrfl.fedfew.inprocess`: the workflow with the sites called in this process;
- :mod:`cxrfl.fedfew.model`: the final self-describing model file and inference.

The NVFlare glue is :mod:`cxrfl.fl.fedfew`; the benchmark :mod:`cxrfl.bench.fedfew`.
"""

from cxrfl.fedfew.config import FedFewConfig

__all__ = ["FedFewConfig"]
