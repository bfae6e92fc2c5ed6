"""Small-request latency of one tenant while another saturates `oxrl serve` (BENCHMARKS.md).

Stdlib only (no SDK): key `k2` times small requests alone, then beside key `k1`'s load —
sampling (8 concurrent requests of 64 samples x 254 tokens, resubmitted until done) or
training (forward_backward of 64 datums x 1,024 tokens = 65,536 tokens, in a loop).
Usage: python3 benches/tinker_fairness.py http://127.0.0.1:PORT [N]; prints p50 / p99 in ms.
"""

import json
import sys
import threading
import time
import urllib.request

BASE = sys.argv[1].rstrip("/") + "/api/v1/"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 30


def post(key, path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-API-Key": key})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def result(key, rid):
    while True:
        out = post(key, "retrieve_future", {"request_id": rid, "allow_metadata_only": False})
        if out.get("type") != "try_again":
            assert "error" not in out, out
            return out


def sample_body(samples, tokens, seed):
    return {"base_model": "tiny", "num_samples": samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [72, 105, 33, 32]}]},
            "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": seed, "stop": []}}


def model(key):
    session = post(key, "create_session", {"tags": []})["session_id"]
    r = post(key, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                   "lora_config": {"rank": 8}})
    result(key, r["request_id"])
    return f"{session}:train:0"


def datum(n):
    tokens = [(7 * i) % 250 + 3 for i in range(n + 1)]
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"},
                               "weights": {"data": [1.0] * n, "dtype": "float32"}}}


class Model:
    def __init__(self, key):
        self.key, self.id, self.seq = key, model(key), 0

    def fwdbwd(self, data):
        self.seq += 1
        body = {"model_id": self.id, "seq_id": self.seq,
                "forward_backward_input": {"data": data, "loss_fn": "cross_entropy", "loss_fn_config": None}}
        return result(self.key, post(self.key, "forward_backward", body)["request_id"])


def timed(f, n):
    out = []
    for i in range(n):
        t = time.perf_counter()
        f(i)
        out.append(time.perf_counter() - t)
    out.sort()
    return out[len(out) // 2] * 1e3, out[min(len(out) - 1, round(0.99 * (len(out) - 1)))] * 1e3


def under(load, measure):
    stop = threading.Event()

    def run():
        while not stop.is_set():
            load()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(1.0)
    out = measure()
    stop.set()
    t.join()
    return out


def saturate_sampling():
    ids = [post("k1", "asample", sample_body(64, 254, 100 + i))["request_id"] for i in range(8)]
    for rid in ids:
        result("k1", rid)


def main():
    small = lambda i: result("k2", post("k2", "asample", sample_body(1, 8, i))["request_id"])
    small(0)
    print("sample 1 x 8 tokens, alone: p50 %.1f ms, p99 %.1f ms" % timed(small, N))
    print("sample 1 x 8 tokens, beside 8 x 64 x 254: p50 %.1f ms, p99 %.1f ms" % under(saturate_sampling, lambda: timed(small, N)))
    b, a = Model("k2"), Model("k1")
    small_fb = lambda i: b.fwdbwd([datum(16)])
    small_fb(0)
    print("forward_backward 16 tokens, alone: p50 %.1f ms, p99 %.1f ms" % timed(small_fb, N))
    big = [datum(1024) for _ in range(64)]
    print("forward_backward 16 tokens, beside 65,536-token forward_backward: p50 %.1f ms, p99 %.1f ms"
          % under(lambda: a.fwdbwd(big), lambda: timed(small_fb, N)))


main()
