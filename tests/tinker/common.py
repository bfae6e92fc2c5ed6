"""What the SDK test scripts share: datums built from text, RL datums, float comparison.

Imported by the scripts next to it (Python puts a script's own folder on `sys.path`).
"""

import numpy as np
from tinker import types


def text_datum(text: bytes, prompt_len: int = 0) -> types.Datum:
    """Next-byte prediction over `text` (the tiny model's tokens are bytes), the first
    `prompt_len` targets weighted 0 and the rest 1."""
    tokens = list(text)
    inputs, targets = tokens[:-1], tokens[1:]
    weights = [0.0] * prompt_len + [1.0] * (len(targets) - prompt_len)
    return types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def rl_datum(d: types.Datum, q: np.ndarray, adv: np.ndarray) -> types.Datum:
    """`d`'s input and targets with sampling log-probs `q` and advantages `adv` (float32)."""
    return types.Datum(
        model_input=d.model_input,
        loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": types.TensorData.from_numpy(q.astype(np.float32)),
            "advantages": types.TensorData.from_numpy(adv.astype(np.float32)),
        },
    )


def close(a: float, b: float, tol: float = 1e-4) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def finish() -> None:
    """Prints the success marker the Rust side checks and exits at once: every check has passed,
    and the interpreter's teardown (the SDK's background threads and event loop) once exited
    non-zero after a passing run under a loaded CI machine."""
    import os
    import sys

    print("ok")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
