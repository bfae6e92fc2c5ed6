"""After `kill -9` and a restart of the server (tests/server_sdk.rs): the checkpoint saved by
checkpoints.py is still listed and loadable, and reproduces the saved log-probs; the model it was
saved from (lost: models live in memory) answers with an error saying so."""

import json
import os
import sys
import urllib.request

import numpy as np
import tinker

sys.path.insert(0, os.path.dirname(__file__))
from checkpoints import BATCH  # noqa: E402
from common import finish

saved = json.load(open(os.path.join(os.environ["OXRL_OUT"], "checkpoint.json")))
service = tinker.ServiceClient()
client = service.create_training_client_from_state_with_optimizer(saved["path"]).result()
out = client.forward(BATCH, "cross_entropy").result()
got = np.concatenate([np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs])
assert np.allclose(got, np.asarray(saved["logprobs"]), atol=1e-6), "restored log-probs differ"
print(f"restart: {saved['path']} loaded, log-probs equal")

old_model = saved["path"].removeprefix("tinker://").split("/")[0]
req = urllib.request.Request(
    os.environ["TINKER_BASE_URL"] + "/api/v1/get_info",
    data=json.dumps({"model_id": old_model}).encode(),
    headers={"Content-Type": "application/json", "X-API-Key": os.environ["TINKER_API_KEY"]},
)
try:
    urllib.request.urlopen(req)
    raise AssertionError("a model from before the restart answered")
except urllib.error.HTTPError as e:
    body = json.loads(e.read())
    assert "lost when the server restarted" in body["error"] and body["category"] == "user", body
print(f"the pre-restart model {old_model}: {body['error'][:60]}...")
finish()
