"""Benchmark of `oxrl serve` driven by the official tinker SDK (not a test).

Usage: start `oxrl serve --model DIR --port N --data-dir D` (a release build for figures worth
recording), then
    TINKER_BASE_URL=http://127.0.0.1:N TINKER_API_KEY=tml-bench OXRL_MODEL=<name> \
        .venv-tinker/bin/python benches/tinker_server.py
Prints: the round trip of a minimal forward_backward (1 datum of 2 tokens: submit + retrieve_future),
and, with OXRL_DATA_DIR set to the server's data dir, how much of it the server spent on the
request (future created -> result stored: queueing and compute, from server.sqlite) and the rest
(HTTP, polling, the SDK): the round-trip overhead; of optim_step, SDK-driven SFT steps/s (4 x 32 tokens), and sampling throughput (tokens/s) with 1, 4
and 16 LoRA sampling clients sampling at once (each 4 requests x 2 samples x 32 tokens).
"""

import os
import sqlite3
import statistics
import threading
import time

import tinker
from tinker import types

MODEL = os.environ["OXRL_MODEL"]


def timed(f, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    service = tinker.ServiceClient()
    c = service.create_lora_training_client(base_model=MODEL, rank=1).result()
    tiny = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})]
    timed(lambda: c.forward_backward(tiny, "cross_entropy").result(), 5)
    fb = timed(lambda: c.forward_backward(tiny, "cross_entropy").result(), 100)
    op = timed(lambda: c.optim_step(types.AdamParams(learning_rate=0.0)).result(), 100)
    print(f"minimal forward_backward round trip: {fb * 1e3:.2f} ms (median of 100); optim_step {op * 1e3:.2f} ms")
    if os.environ.get("OXRL_DATA_DIR"):
        db = sqlite3.connect(os.path.join(os.environ["OXRL_DATA_DIR"], "server.sqlite"))
        spans = [f - c for (c, f) in db.execute(
            "SELECT created, finished FROM futures WHERE kind = 'forward_backward' ORDER BY created")][-100:]
        server = statistics.median(spans)
        print(f"  of which in the server (queue + compute): {server * 1e3:.2f} ms; "
              f"overhead (HTTP, polling, SDK): {(fb - server) * 1e3:.2f} ms")

    batch = [types.Datum(model_input=types.ModelInput.from_ints(list(range(i, i + 32))),
                         loss_fn_inputs={"target_tokens": list(range(i + 1, i + 33)), "weights": [1.0] * 32})
             for i in range(4)]
    def sft_step():
        f = c.forward_backward(batch, "cross_entropy")
        o = c.optim_step(types.AdamParams(learning_rate=1e-3))
        f.result()
        o.result()
    timed(sft_step, 3)
    n = 30
    t = time.perf_counter()
    for _ in range(n):
        sft_step()
    print(f"SDK-driven SFT (4 x 32 tokens): {n / (time.perf_counter() - t):.1f} steps/s")

    params = types.SamplingParams(max_tokens=32, temperature=1.0, stop=[])
    for clients in (1, 4, 16):
        samplers = []
        for k in range(clients):
            tc = service.create_lora_training_client(base_model=MODEL, rank=4).result()
            samplers.append(tc.save_weights_and_get_sampling_client().result())
        tokens = [0] * clients
        def run(k):
            futs = [samplers[k].sample(types.ModelInput.from_ints([10 + k, 20, 30]), 2, params) for _ in range(4)]
            tokens[k] = sum(len(s.tokens) for f in futs for s in f.result().sequences)
        t = time.perf_counter()
        threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dt = time.perf_counter() - t
        print(f"sampling, {clients:2d} LoRA clients at once: {sum(tokens) / dt:8.0f} tokens/s ({sum(tokens)} tokens in {dt:.2f} s)")


if __name__ == "__main__":
    main()
