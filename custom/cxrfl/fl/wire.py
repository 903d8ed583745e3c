"""A model update as NVFlare puts it on the wire: an FLModel in a Shareable, serialised with FOBS.

Benchmarks and tests that measure or carry messages in process use these functions so that FOBS
is set up as in NVFlare's own processes. Order matters: FOBS keeps the first decomposer it sees
for a type, so serialising a Shareable before NVFlare's decomposers are registered leaves a
generic one in place for the rest of the process, and a later FLARE API session in that process
then reads every Shareable from the server as empty (its login fails).
"""

from __future__ import annotations

from typing import Any

from nvflare.apis.shareable import Shareable
from nvflare.apis.utils.decomposers import flare_decomposers
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.decomposers import common_decomposers
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.fuel.utils import fobs


def register_decomposers() -> None:
    """Register NVFlare's FOBS decomposers (Shareable, DXO, FLModel, numpy) as its processes do."""
    flare_decomposers.register()
    common_decomposers.register()


def model_message(params: dict[str, Any], meta: dict[str, Any]) -> Shareable:
    """A full-weights FLModel as the Shareable NVFlare sends.

    Args:
        params: the weights by key.
        meta: the model's metadata.
    """
    return FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params, meta=meta))


def dumps(message: Shareable) -> bytes:
    """Serialise a message with FOBS, as NVFlare does before sending it.

    Args:
        message: the Shareable.
    """
    register_decomposers()
    return fobs.dumps(message)


def loads(data: bytes) -> Shareable:
    """Read a message serialised by :func:`dumps` (or by NVFlare).

    Args:
        data: the bytes.
    """
    register_decomposers()
    return fobs.loads(data)


def carry(params: dict[str, Any], meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``params`` and ``meta`` after a trip over the wire (serialised and read back).

    Args:
        params: the weights by key.
        meta: the model's metadata.
    """
    model = FLModelUtils.from_shareable(loads(dumps(model_message(params, meta))))
    return dict(model.params or {}), dict(model.meta or {})
