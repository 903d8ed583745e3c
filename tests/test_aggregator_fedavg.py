"""cxrfl's aggregator inside NVFlare's own FedAvg workflow, in NVFlare's simulator (issue 43 point 7).

``cxrfl.fl.aggregator.SurgicalAggregator`` is the one class behind the surgical job's ``aggregator`` component
and NVFlare's ``FedAvg(aggregator=...)``. Two sites with fixed updates (``fedavg_app/surgical_fedavg_site.py``)
run two rounds; the global model FedAvg saves is compared, as arrays, with the aggregate computed by hand, and
the class list each site received shows what that workflow gives up: every site is sent every class.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("fedavg_app") / "surgical_fedavg_site.py"


def test_surgical_aggregator_stitches_heads_inside_nvflare_fedavg(tmp_path, monkeypatch):
    from cxrfl.fl.aggregator import SurgicalAggregator
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.fuel.utils import fobs
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    out = tmp_path / "sites"
    out.mkdir()
    monkeypatch.setenv("FEDAVG_TEST_OUT", str(out))
    job = FedJob(name="surgical_in_fedavg", min_clients=2)
    job.to_server(
        FedAvg(
            num_clients=2,
            num_rounds=2,
            model={"body.w": [0.0, 0.0]},
            aggregator=SurgicalAggregator(weighting="samples"),
            save_filename="global.fobs",
        )
    )
    job.to_clients(ScriptRunner(script=str(SCRIPT), framework=FrameworkType.NUMPY))
    job.simulator_run(str(tmp_path / "ws"), n_clients=2, threads=2)

    (saved,) = list((tmp_path / "ws").rglob("global.fobs"))
    model = fobs.loadf(str(saved))
    # by hand, weights 10 (site-1, +1 a round) and 30 (site-2, +3); x is site-1's, z site-2's, y both's
    # round 1: body (10*1 + 30*3)/40 = 2.5; x 1, y 2.5, z 3.   round 2: body (10*3.5 + 30*5.5)/40 = 5; x 2, y 5, z 6
    expected = {"x": 2.0, "y": 5.0, "z": 6.0}
    classes = model.meta["classes"]
    assert sorted(classes) == ["x", "y", "z"]
    np.testing.assert_allclose(model.params["body.w"], [5.0, 5.0])
    np.testing.assert_allclose(model.params["classifier.weight"], [[expected[c]] * 2 for c in classes])
    np.testing.assert_allclose(model.params["classifier.bias"], [expected[c] for c in classes])
    assert model.meta["contributors"] == {"x": ["site-1"], "y": ["site-1", "site-2"], "z": ["site-2"]}
    # what NVFlare's workflow gives up (the aggregator's docstring): round 2 sends every site every class
    for site in ("site-1", "site-2"):
        assert json.loads((out / f"{site}-0.json").read_text()) == []
        assert sorted(json.loads((out / f"{site}-1.json").read_text())) == ["x", "y", "z"]
