"""Messages carried in process the way NVFlare carries them (``cxrfl.fl.wire``)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from cxrfl.fl.wire import carry

SERVER_REPLY = """
import sys
from nvflare.apis.shareable import Shareable
from nvflare.apis.utils.decomposers import flare_decomposers
from nvflare.fuel.utils import fobs
flare_decomposers.register()  # as NVFlare's server process has it
reply = Shareable()
reply["cert"] = b"-----BEGIN CERTIFICATE-----"
reply["nonce"] = "n-1"
sys.stdout.buffer.write(fobs.dumps(reply))
"""

ADMIN_AFTER_A_BENCHMARK = """
import sys
import numpy as np
from cxrfl.fl.wire import carry
from nvflare.apis.utils.decomposers import flare_decomposers
from nvflare.fuel.utils import fobs
carry({"w": np.ones((4, 4), np.float32)}, {"site": "a"})  # a benchmark or test carried a message first
flare_decomposers.register()  # what a FLARE API session does when it connects
reply = fobs.loads(sys.stdin.buffer.read())
print(sorted(k for k in reply if not k.startswith("__")))
"""


def test_carrying_a_message_leaves_fobs_able_to_read_the_servers_replies(repo_root):
    # a FLARE API session in a process that carried a message first read every reply from the server as
    # an empty Shareable (FOBS kept a generic decomposer for Shareable), so its login failed
    reply = subprocess.run([sys.executable, "-c", SERVER_REPLY], capture_output=True, check=True).stdout
    env_path = str(repo_root / "custom")
    read = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {env_path!r})\n" + ADMIN_AFTER_A_BENCHMARK],
        input=reply,
        capture_output=True,
        check=True,
    )
    assert read.stdout.decode().strip() == "['cert', 'nonce']"


def test_carry_gives_back_the_weights_and_metadata():
    params = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "a.num_batches_tracked": np.array(7)}
    got, meta = carry(params, {"classes": ["Edema"], "num_samples": 3})
    assert meta["classes"] == ["Edema"] and meta["num_samples"] == 3
    assert list(got) == list(params)
    assert all(np.array_equal(got[k], v) and got[k].dtype == v.dtype for k, v in params.items())
