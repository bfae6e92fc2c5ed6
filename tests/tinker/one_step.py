"""One SDK training step, timed: create a LoRA client, forward_backward, optim_step,
forward_backward again. Prints both losses exactly (`repr`) so that the Rust side can compare
them with a fresh server's, and the round trip in seconds.

Run by tests/server_hostile.rs with TINKER_BASE_URL, TINKER_API_KEY and OXRL_MODEL set.
"""

import os
import time

import tinker
from tinker import types

from common import finish, text_datum

MODEL = os.environ["OXRL_MODEL"]


def main() -> None:
    start = time.perf_counter()
    client = tinker.ServiceClient().create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    batch = [text_datum(b"Q: 2+2? A: four.", 10)]
    first = client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    second = client.forward_backward(batch, "cross_entropy").result()
    print(f"losses {first.metrics['loss:sum']!r} {second.metrics['loss:sum']!r}")
    print(f"round trip {time.perf_counter() - start:.3f} s")
    finish()


if __name__ == "__main__":
    main()
