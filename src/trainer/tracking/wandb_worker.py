"""oxrl's W&B worker: logs a run's metrics lines to Weights & Biases for the oxrl process that
started it (src/trainer/tracking/wandb.rs), which embeds this script and runs it with
`tracking.python -c`.

Protocol, one JSON object a line:
  stdin   first {"project", "name", "dir", "config"} (wandb.init's arguments), then
          {"step": N, "metrics": {key: number}} per metrics line (wandb.log(metrics, step=N)),
          and {"finish": exit_code} at a clean end. EOF without "finish" is an abnormal end:
          wandb.finish(exit_code=1).
  stdout  one line once wandb.init returned: {"ready": true, ...}, or {"error": "..."} (with the
          traceback) when the import or the init failed.
The protocol runs on private copies of fds 0 and 1: fd 0 becomes /dev/null and fd 1 stderr, so
that nothing wandb or its service process prints (or reads) mixes with it. Everything else goes
to stderr, which oxrl forwards. WANDB_MODE, WANDB_API_KEY, ... come from the environment as
they are.
"""

import json
import os
import signal
import sys
import traceback


def main():
    # Ctrl-C is oxrl's to handle: it finishes its step and closes this worker itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.flush()
    os.dup2(2, 1)

    def reply(message):
        proto_out.write(json.dumps(message) + "\n")
        proto_out.flush()

    line = proto_in.readline()
    if not line:
        return 1
    init = json.loads(line)
    try:
        import wandb
    except BaseException as e:
        reply({
            "error": f"cannot import wandb: {type(e).__name__}: {e} (install it for this interpreter: "
                     f"{sys.executable} -m pip install wandb)\n{traceback.format_exc()}"
        })
        return 1
    try:
        run = wandb.init(project=init["project"], name=init["name"], dir=init["dir"], config=init["config"])
    except BaseException as e:
        reply({"error": f"wandb.init failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return 1
    reply({"ready": True, "id": run.id, "url": run.url, "wandb": wandb.__version__})

    exit_code = 1
    try:
        for line in proto_in:
            message = json.loads(line)
            if "finish" in message:
                exit_code = int(message["finish"])
                break
            run.log(message["metrics"], step=message["step"])
    finally:
        run.finish(exit_code=exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
