"""oxrl's Python worker: runs a user's reward function and environments for the RL trainer.

Started by oxrl (src/env/python/pool.rs) with the user's interpreter, so their venv and
packages are what the user code sees. It speaks JSON lines:

    stdin, first line   {"reward": {"path": ..., "name": ...} | null, "env_modules": [...]}
    stdout, answer      {"ready": {"env_classes": [...], "reward_async": bool}}
                        | {"fatal": "message and traceback"}   (then it exits)
    stdin, then         {"calls": [{"id": N, "op": "score" | "env_step" | "env_close", ...}, ...]}
    stdout, per call    {"id": N, "ok": ...} | {"id": N, "error": traceback}
                        | {"id": N, "bad_return": "what was wrong"}

A batch's calls run one after another, in order (an `async def` reward function: all of the
batch's calls at once on one event loop), each answered as it ends: oxrl times a call from the
previous answer (or the batch's arrival), so each call is timed on its own. Environment instances live here between calls; an `env_step` call carries what
rebuilds its instance (class, row, prompt and the earlier actions), so a restarted worker
replays an episode it never saw. The user's own prints go to stderr: stdout is the protocol's.
"""

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import os
import signal
import sys
import traceback


def _protocol_stream():
    """The real stdout for the protocol; fd 1 and sys.stdout then point at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


OUT = None


def send(obj):
    OUT.write(json.dumps(obj) + "\n")  # line-buffered: each answer leaves at once


def load_file(path, name):
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SetupError(f"cannot import `{path}`")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_module(entry):
    """A module by file path (`envs.py`, `dir/envs.py`) or by import name (`my_pkg.envs`)."""
    if entry.endswith(".py") or os.sep in entry:
        if not os.path.isfile(entry):
            raise SetupError(f"env.python_modules: no file `{entry}`")
        stem = os.path.splitext(os.path.basename(entry))[0]
        return load_file(entry, stem)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(entry)


def env_classes_of(module):
    """The classes a module defines (not imports) that have a `step` method, by class name."""
    found = {}
    for value in vars(module).values():
        if inspect.isclass(value) and value.__module__ == module.__name__ and callable(getattr(value, "step", None)):
            found[value.__name__] = value
    return found


class Bad(Exception):
    """A user function returned something of the wrong shape."""


class SetupError(Exception):
    """A file, function or module the config names is not there (no traceback needed)."""


def number(value, what):
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        value = value.item()  # numpy / torch scalars
    if isinstance(value, (int, float)):
        x = float(value)
        if math.isnan(x) or math.isinf(x):
            raise Bad(f"{what} is {x}")
        return x
    raise Bad(f"{what} must be a number, got {type(value).__name__} ({value!r:.80})")


def score_result(value):
    """A reward function's return: a number, or a dict whose `score` is the reward."""
    if isinstance(value, dict):
        if "score" not in value:
            raise Bad(f"returned a dict without `score` (keys: {', '.join(map(str, value)) or 'none'})")
        extra = {}
        for key, x in value.items():
            if key == "score":
                continue
            try:
                extra[str(key)] = number(x, f"`{key}`")
            except Bad:
                pass  # only numeric keys are logged
        return {"score": number(value["score"], "`score`"), "extra": extra}
    return {"score": number(value, "the return value"), "extra": {}}


def messages(value, what):
    if not isinstance(value, list):
        raise Bad(f"{what} must be a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise Bad(f"{what}: message {i} must be a dict with string `role` and `content`")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def plain(metadata):
    """The JSON-safe scalars of a metadata dict (the rest is dropped)."""
    out = {}
    if isinstance(metadata, dict):
        for key, x in metadata.items():
            if isinstance(x, (str, bool)) or x is None:
                out[str(key)] = x
            else:
                try:
                    out[str(key)] = number(x, "")
                except Bad:
                    pass
    return out


class Worker:
    def __init__(self, setup):
        self.reward = None
        self.reward_async = False
        reward = setup.get("reward")
        if reward:
            path, name = reward["path"], reward["name"]
            if not os.path.isfile(path):
                raise SetupError(f"reward.custom_function: no file `{path}`")
            module = load_file(path, "oxrl_user_reward")
            fn = getattr(module, name, None)
            if fn is None:
                raise SetupError(f"reward.custom_function: `{path}` has no function `{name}`")
            if not callable(fn):
                raise SetupError(f"reward.custom_function: `{name}` in `{path}` is not callable")
            self.reward = fn
            self.reward_async = inspect.iscoroutinefunction(fn)
        self.classes = {}
        for entry in setup.get("env_modules") or []:
            found = env_classes_of(load_module(entry))
            if not found:
                raise SetupError(f"env.python_modules: `{entry}` defines no environment class (a class with a `step` method)")
            self.classes.update(found)
        self.instances = {}

    # --- calls -------------------------------------------------------------------------------

    def score(self, call):
        return self.reward(**call["args"])

    def make_instance(self, call):
        cls = self.classes[call["class"]]
        try:
            params = list(inspect.signature(cls).parameters.values())
        except (TypeError, ValueError):
            params = []
        if len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params):
            env = cls({}, call["row"])  # SkyRL's (env_config, extras)
        elif len(params) == 1:
            env = cls(call["row"])
        else:
            env = cls()
        prompt = call["prompt"]
        first = env.init(prompt) if callable(getattr(env, "init", None)) else (prompt, {})
        if isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[1], dict):
            first = first[0]
        return env, messages(first, "init() messages")

    def instance(self, call):
        """The call's instance, rebuilt and replayed if this worker never saw it."""
        key = call["instance"]
        if key not in self.instances:
            env, first = self.make_instance(call)
            for action in call.get("history", []):
                env.step(action)
            self.instances[key] = (env, first)
        return self.instances[key]

    def env_init(self, call):
        key = call["instance"]
        self.instances.pop(key, None)
        env, first = self.make_instance(call)
        self.instances[key] = (env, first)
        return {"messages": first}

    def env_step(self, call):
        env, _ = self.instance(call)
        out = env.step(call["action"])
        if not isinstance(out, dict):
            raise Bad(f"step() must return a dict (observations, reward, done, metadata), got {type(out).__name__}")
        if "done" not in out:
            raise Bad("step() returned a dict without `done`")
        observations = messages(out.get("observations") or [], "step() observations")
        reward = number(out.get("reward", 0.0) if out.get("reward") is not None else 0.0, "step() `reward`")
        return {
            "observations": observations,
            "reward": reward,
            "done": bool(out["done"]),
            "metadata": plain(out.get("metadata")),
        }

    def env_close(self, call):
        entry = self.instances.pop(call["instance"], None)
        if entry is not None and callable(getattr(entry[0], "close", None)):
            entry[0].close()
        return None

    # --- the loop ----------------------------------------------------------------------------

    def answer(self, call, run):
        try:
            value = run()
            if call["op"] == "score":
                value = score_result(value)
            send({"id": call["id"], "ok": value})
        except Bad as e:
            send({"id": call["id"], "bad_return": str(e)})
        except Exception:
            send({"id": call["id"], "error": traceback.format_exc()})

    def batch(self, calls):
        if self.reward_async and all(c["op"] == "score" for c in calls):
            asyncio.run(self.score_all(calls))
            return
        ops = {"score": self.score, "env_init": self.env_init, "env_step": self.env_step, "env_close": self.env_close}
        for call in calls:
            run = ops[call["op"]]
            if call["op"] == "score" and self.reward_async:
                self.answer(call, lambda: asyncio.run(self.reward(**call["args"])))
            else:
                self.answer(call, lambda: run(call))

    async def score_all(self, calls):
        async def one(call):
            try:
                value = score_result(await self.reward(**call["args"]))
                send({"id": call["id"], "ok": value})
            except Bad as e:
                send({"id": call["id"], "bad_return": str(e)})
            except Exception:
                send({"id": call["id"], "error": traceback.format_exc()})

        await asyncio.gather(*(one(c) for c in calls))


def main():
    global OUT
    # Ctrl-C is the trainer's to handle: it stops this worker itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    OUT = _protocol_stream()
    try:
        worker = Worker(json.loads(sys.stdin.readline()))
    except BaseException as e:
        detail = str(e) if isinstance(e, SetupError) else traceback.format_exc()
        send({"fatal": detail})
        sys.exit(1)
    send({"ready": {"env_classes": sorted(worker.classes), "reward_async": worker.reward_async}})
    for line in sys.stdin:
        if line.strip():
            worker.batch(json.loads(line)["calls"])


if __name__ == "__main__":
    main()
