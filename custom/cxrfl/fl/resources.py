"""Site resources in NVFlare 2.9: what a job asks of each site, and the GPUs a site's kit offers.

A job's ``meta.json`` ``resource_spec`` is read per site by NVFlare's resolver
(``nvflare.utils.job_launcher_utils``: ``resolve_site_resource_spec``, ``get_resource_manager_spec``):
the portable ``@default`` entry (:data:`PORTABLE_KEYS`) holds for every site and a site's own entry
overrides it. ``@ALL`` is a ``deploy_map`` keyword only: a request under it reaches no site. Before
NVFlare dispatches a job it asks each site's ``resource_manager`` (its kit's ``local/resources.json``)
for the resolved request less ``num_of_cpus`` and ``memory`` (those are for the docker, k8s and slurm
launchers); a site that cannot offer it does not get the job, which waits while fewer than its
``min_clients`` sites can. The recipes write ``resource_spec`` from their ``resources`` and
``site_resources`` (:class:`cxrfl.fl.job_settings.JobSettings`).

A site declares its GPUs with ``cxrfl deploy site-gpus KIT 0,1``
(:func:`cxrfl.deploy.provision.declare_gpus`): NVFlare's ``ListResourceManager`` with one unit per GPU
index under :data:`GPU_KEY`, so a job asking for one GPU holds one index until it ends and no two jobs
share one, and :class:`GPUListConsumer`, which pins the job's process to the indices it holds. A kit
as NVFlare provisions it (``GPUResourceManager`` with ``num_of_gpus: 0``) offers no GPU.
"""

from __future__ import annotations

from nvflare.app_common.resource_consumers.list_resource_consumer import ListResourceConsumer
from nvflare.utils.job_launcher_utils import PORTABLE_RESOURCE_DEFAULT_KEY, PORTABLE_RESOURCE_KEYS

DEFAULT_KEY = PORTABLE_RESOURCE_DEFAULT_KEY
"""``@default``: the request of every site a job does not name in its ``resource_spec``."""
PORTABLE_KEYS = PORTABLE_RESOURCE_KEYS
"""``num_of_gpus``, ``num_of_cpus``, ``memory`` (``"32Gi"``): what ``@default`` may hold."""
GPU_KEY = "num_of_gpus"
"""The request key a site's GPU units are listed under (the portable one)."""


class GPUListConsumer(ListResourceConsumer):
    """NVFlare's ``ListResourceConsumer`` for GPU units listed under :data:`GPU_KEY`: sets
    ``CUDA_VISIBLE_DEVICES`` to the indices a job was allocated (NVFlare's own GPU consumer; no
    hardware check), in the site process that then starts the job's process."""

    def __init__(self) -> None:
        super().__init__()
        self.resource_consumer_map = {GPU_KEY: self.resource_consumer_map["gpu"]}
