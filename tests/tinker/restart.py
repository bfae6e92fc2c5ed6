"""After `kill -9` and a restart of the server (tests/server_sdk.rs): the checkpoint saved by
checkpoints.py is still listed and loadable, and reproduces the saved log-probs."""

import json
import os
import sys

import numpy as np
import tinker

sys.path.insert(0, os.path.dirname(__file__))
from checkpoints import BATCH  # noqa: E402

saved = json.load(open(os.path.join(os.environ["OXRL_OUT"], "checkpoint.json")))
service = tinker.ServiceClient()
client = service.create_training_client_from_state_with_optimizer(saved["path"]).result()
out = client.forward(BATCH, "cross_entropy").result()
got = np.concatenate([np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs])
assert np.allclose(got, np.asarray(saved["logprobs"]), atol=1e-6), "restored log-probs differ"
print(f"restart: {saved['path']} loaded, log-probs equal")
print("ok")
