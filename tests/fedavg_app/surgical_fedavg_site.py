"""A site of NVFlare's own FedAvg workflow aggregated by cxrfl's ``SurgicalAggregator``
(``tests/test_aggregator_fedavg.py``): NVFlare's Client API loop with a fixed update instead of training, so
that the server's aggregate can be computed by hand.

``site-1`` labels x and y, holds 10 images and moves every value it sends by +1 a round; ``site-2`` labels
y and z, holds 30 images, +3. A class's row starts from the global row of that class when the received model
has one, else from zeros. Each round the site writes the class list that came with the global model to
``$FEDAVG_TEST_OUT/<site>-<round>.json``: what NVFlare's workflow discloses to every site.
"""

import json
import os
from pathlib import Path

import numpy as np
import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

SITES = {"site-1": (["x", "y"], 1.0, 10), "site-2": (["y", "z"], 3.0, 30)}


def rows(params: dict, received: list[str], classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """This site's head rows, taken from the global head where it has the class."""
    weight = np.zeros((len(classes), 2), np.float32)
    bias = np.zeros(len(classes), np.float32)
    for i, name in enumerate(classes):
        if name in received:
            j = received.index(name)
            weight[i] = np.asarray(params["classifier.weight"])[j]
            bias[i] = np.asarray(params["classifier.bias"])[j]
    return weight, bias


def main() -> None:
    flare.init()
    site = flare.get_site_name()
    classes, step, n = SITES[site]
    out = Path(os.environ["FEDAVG_TEST_OUT"])
    while flare.is_running():
        model = flare.receive()
        received = list((model.meta or {}).get("classes") or [])
        (out / f"{site}-{model.current_round}.json").write_text(json.dumps(received))
        weight, bias = rows(model.params, received, classes)
        params = {
            "body.w": np.asarray(model.params["body.w"], np.float32) + step,
            "classifier.weight": weight + step,
            "classifier.bias": bias + step,
        }
        flare.send(FLModel(params=params, meta={"classes": classes, "num_samples": n}))


if __name__ == "__main__":
    main()
