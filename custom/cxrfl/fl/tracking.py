"""MLflow tracking of a cxrfl job: NVFlare's MLflow receiver, with one more run for the server's own
(aggregated) metrics.

NVFlare's :class:`nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver` opens one MLflow
run per connected site and files every analytics event under its sender; events the server fires
itself (the workflow's aggregated metrics, :meth:`cxrfl.fl.base.TaskController.record_scalars`)
have the server as sender, for which it keeps no run. :class:`MLflowReceiver` adds that run;
everything else is NVFlare's (tracking URI: None means an SQLite store ``mlflow.db`` in the job's
server workspace folder, no server needed).
"""

from __future__ import annotations

from nvflare.apis.analytix import TrackConst
from nvflare.apis.fl_constant import ProcessType
from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.tracking.mlflow.mlflow_receiver import MLflowReceiver as NVFlareMLflowReceiver


class MLflowReceiver(NVFlareMLflowReceiver):
    """NVFlare's MLflow receiver plus a run for the server's own metrics (see the module docstring).

    Args: those of NVFlare's ``MLflowReceiver`` (tracking_uri, kw_args, artifact_location, events,
    buffer_flush_time).
    """

    def initialize(self, fl_ctx: FLContext) -> None:
        super().initialize(fl_ctx)
        if fl_ctx.get_process_type() != ProcessType.SERVER_JOB:
            return
        server = fl_ctx.get_identity_name()
        self._mlflow_setup(
            self._get_artifact_location(self.artifact_location, fl_ctx),
            self.kw_args.get(TrackConst.EXPERIMENT_NAME, "FLARE FL Experiment"),
            self._get_tags(TrackConst.EXPERIMENT_TAGS, kwargs=self.kw_args),
            [server],
            fl_ctx,
        )
        self._init_buffer([server])
