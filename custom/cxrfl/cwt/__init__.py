"""Cyclical weight transfer (CWT) and its four optimizations, free of any FL framework.

Balachandar, Chang et al., "Accounting for data variability in multi-institutional distributed
deep learning for medical imaging", JAMIA 2020 (``papers/cyclical-weight-transfer-*.txt``).
One model visits the sites in turn; the weights that leave site k are the weights site k+1
starts from. The four optimizations, each switchable in :class:`CWTConfig`:

- proportional local training iterations (PLTI, :func:`plti_steps`): site i trains
  ``s * n_i`` steps (``n_i`` its training images) instead of the same number everywhere, so each
  image is seen equally often. ``s = local_steps * k / N``: the mean over the k sites stays
  ``local_steps`` (same total work as vanilla CWT); by default ``local_steps = N / (k * b)``, so
  ``s = 1 / b`` and one cycle is one epoch over all sites' data, as in the paper.
- cyclical learning rate (CLR, :func:`clr_rates`): ``lr_i = lr * k * n_i / N``; the mean
  over the sites is the global rate ``lr``.
- locally weighted minibatch sampling (LWMS, :func:`lwms_sample_weights`): at site i an image
  with label j is drawn with weight ``1 / n_ij`` (here normalised to ``1 / (L_i * n_ij)``), so
  every label present at the site is equally likely in each minibatch.
- cyclically weighted loss (CWL, :func:`cwl_class_weights`): the loss term of label j at site i
  is weighted ``1 / (L * p_ij)`` with ``p_ij`` its local share (the paper's ``1 / p_ij``, times
  the constant ``1 / L`` so that a balanced site gets weight 1, i.e. the plain loss).

The text of the paper we have lost its typeset equations; the formulas above are the ones its
words define (iterations "proportional to the training sample size", a rate "proportional to
the number of training samples" whose average "is equal to the global learning rate", sample
weights that make "the data from each label equally likely", loss weights inverse to "the
proportion of samples at institution i with label j").

What leaves a site so that this works (counts, never images):

- to the server, once: the number of training images (PLTI and CLR need ``n_i`` and ``N``),
  the number of validation images, and, for the multi-label task, the site's class names (the
  union head is built from them);
- every cycle: the validation loss of the current model and the number of validation labels it
  was computed on (the early-stopping criterion is the pooled validation loss);
- LWMS and CWL use the site's own label counts, which never leave the site.

Unlike surgical aggregation, the whole model (every head row) and, with
``optimizer_state="travel"``, Adam's moment estimates travel from site to site: every site sees
the model the previous site trained, including the rows of classes it does not annotate.

Tasks: ``binary`` (the paper's abnormal vs normal: one output ``Abnormal`` = any finding
positive, 0 = every finding known negative, i.e. NIH ``No Finding``; a site-side label
transform, see :func:`binary_labels`) and ``multilabel`` (a head over the sorted union of the
sites' classes; the classes a site does not annotate are masked out of its loss, so CWT also
serves sites whose label sets differ).

The paper's base recipe is the default: the learning rate decays by 0.99 every 200 iterations,
counted across visits (the server carries the iteration count from site to site), and an L2
coefficient of 1e-4 (:class:`CWTConfig`).

Modules: :mod:`cxrfl.cwt.config` (settings), :mod:`cxrfl.cwt.optimizations` (PLTI, CLR, LWMS,
CWL), :mod:`cxrfl.cwt.relay` (plan, order, learning-rate schedule, travelling optimiser state,
task names), :mod:`cxrfl.cwt.site` (one site's data and training), :mod:`cxrfl.cwt.host` (a
site's answers to the relay's tasks), :mod:`cxrfl.cwt.server` (the transport-free relay loop:
retries, resume, early stopping, checkpoints), :mod:`cxrfl.cwt.evaluation` (the best model on
the sites' test splits) and :mod:`cxrfl.cwt.inprocess` (the relay with the sites called in this
process).
"""

from cxrfl.cwt.config import CWTConfig

__all__ = ["CWTConfig"]
