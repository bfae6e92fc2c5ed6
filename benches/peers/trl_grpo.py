"""oxrl's RL with a Python reward function against TRL's GRPOTrainer: the same model, prompts,
reward function and GRPO settings, per-step wall time and reward of both.

Benchmark-only: run by benches/peers/trl_grpo.sh from its own virtual environment (.venv-trl/);
nothing in the Rust build or tests imports this.

    trl_grpo.py bench --oxrl BIN --model DIR --work DIR --out DIR [settings]
        writes the prompts (WORK/train.parquet), runs `oxrl rl` (one process) and then TRL
        (`trl_grpo.py trl`, one process), each under the same settings, and writes under OUT:
        settings.json, oxrl.jsonl and trl.jsonl (one line per step), oxrl_rl.toml (the config),
        oxrl_metrics.jsonl (oxrl's own metrics.jsonl), trl_log_history.json, runs.jsonl (one
        line per run: wall, CPU time), table.md (printed too).
    trl_grpo.py data --out FILE [--rows N --seed S]
    trl_grpo.py trl  ... (one TRL run; called by `bench`)
    trl_grpo.py table OUT

The task is the demo's (src/cli/demo.rs): one-digit sums "What is a + b?", verl's row schema
(data_source, prompt as chat messages, ability, reward_model.ground_truth, extra_info). The reward
is tests/fixtures/python/arithmetic_reward.py's compute_score, the built-in `arithmetic` env's
reward: oxrl calls it as `[reward] custom_function`; TRL through `reward_funcs=[fn]`, fn calling
the same compute_score per completion.

Step wall time: oxrl, the time between consecutive lines of its metrics.jsonl as they appear
(polled every 20 ms), beside the step's own sum of parts (time_generate_s + time_reference_s +
time_train_s + time_sync_s); TRL, the time between consecutive `on_step_end` callbacks. Both
include whatever the loop does between steps (metrics, logging). Step CPU time: oxrl, its
process's user + system time (all threads, not its Python workers) read from /proc when each line
appears; TRL, time.process_time() between the same callbacks. Step 1 is reported but the medians
skip it (first-call costs).

What TRL spends a step on is measured by wrapping its methods on the trainer instance:
`_generate` (tokenize the prompts, transformers' generate, decode), `_calculate_rewards` (the
reward function), `_generate_and_score_completions` (the two, plus advantages and metrics),
`training_step` (the above, then forward + backward); the rest of the step (gradient clipping,
AdamW, scheduler, logging) is wall - training_step.
"""

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
REWARD_FILE = os.path.join(ROOT, "tests", "fixtures", "python", "arithmetic_reward.py")


# ---------------------------------------------------------------------------------------------
# Settings shared by both runs


def add_settings(p):
    s = p.add_argument_group("GRPO settings (the same for both)")
    s.add_argument("--steps", type=int, default=200, help="optimizer steps (= RL steps)")
    s.add_argument("--group", type=int, default=16, help="samples per prompt")
    s.add_argument("--prompts", type=int, default=16, help="prompts per step")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--warmup", type=int, default=5, help="linear warmup steps, lr*(s+1)/w")
    s.add_argument("--max-tokens", type=int, default=4, help="most reply tokens")
    s.add_argument("--temperature", type=float, default=1.2)
    s.add_argument("--ent-coef", type=float, default=0.01, help="entropy bonus")
    s.add_argument("--kl-coef", type=float, default=0.0, help="KL coefficient (TRL's beta)")
    s.add_argument("--clip-eps", type=float, default=0.2)
    s.add_argument("--grad-clip", type=float, default=1.0)
    s.add_argument("--beta1", type=float, default=0.9)
    s.add_argument("--beta2", type=float, default=0.95)
    s.add_argument("--adam-eps", type=float, default=1e-12)
    s.add_argument("--threads", type=int, default=1, help="tensor-math threads")
    s.add_argument("--reward-workers", type=int, default=1, help="oxrl's Python reward workers")
    s.add_argument("--seed", type=int, default=0)


SETTING_KEYS = ["steps", "group", "prompts", "lr", "warmup", "max_tokens", "temperature", "ent_coef", "kl_coef",
                "clip_eps", "grad_clip", "beta1", "beta2", "adam_eps", "threads", "reward_workers", "seed"]


def settings(a):
    return {k: getattr(a, k) for k in SETTING_KEYS}


def settings_args(s):
    out = []
    for k in SETTING_KEYS:
        out += ["--" + k.replace("_", "-"), str(s[k])]
    return out


def lr_factor(step, warmup):
    """oxrl's schedule (src/worker/schedule.rs), constant after warmup: the 0-based step's lr / peak."""
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


# ---------------------------------------------------------------------------------------------
# Prompts


def arithmetic_rows(n, seed):
    """The demo's task: one-digit sums (operands 0-9), in verl's row schema."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i},
        })
    return rows


def write_data(path, rows, seed):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(arithmetic_rows(rows, seed)), path)


# ---------------------------------------------------------------------------------------------
# oxrl


def oxrl_config(s, model, data, run_dir, python):
    kv = lambda v: json.dumps(v)  # TOML basic strings and numbers are JSON's
    return f"""# Written by benches/peers/trl_grpo.py: the settings of settings.json.
mode = "sync"

[model]
path = {kv(os.path.abspath(model))}

[data]
train_file = {kv(os.path.abspath(data))}
shuffle_seed = {s['seed']}

[env]
max_turn_tokens = {s['max_tokens']}

[reward]
custom_function = {{ path = {kv(REWARD_FILE)}, name = "compute_score" }}
workers = {s['reward_workers']}
python = {kv(python)}

[rollout]
n_samples = {s['group']}
temperature = {s['temperature']}

[algorithm]
advantage = "grpo"
norm_by_std = true
loss = "regular"
loss_config = {{ eps_clip_low = {s['clip_eps']}, eps_clip_high = {s['clip_eps']}, ent_coef = {s['ent_coef']} }}
reduction = "token_mean"
dynamic_sampling = "none"
zero_variance_filter = false

[algorithm.kl]
coef = {s['kl_coef']}

[optimizer]
lr = {s['lr']}
betas = [{s['beta1']}, {s['beta2']}]
eps = {s['adam_eps']}
weight_decay = 0.0
grad_clip_norm = {s['grad_clip']}

[schedule]
kind = "constant"
warmup_steps = {s['warmup']}

[train]
prompts_per_step = {s['prompts']}
mini_batches = 1
update_epochs = 1
max_steps = {s['steps']}
eval_every = 0
checkpoint_every = 0
seed = {s['seed']}

[launch]
engines = 1
engine_threads = {s['threads']}
trainer_threads = {s['threads']}

[output]
run_dir = {kv(os.path.abspath(run_dir))}
"""


def run_oxrl(binary, s, model, data, work, python, out):
    run_dir = os.path.join(work, "oxrl_run")
    if os.path.exists(run_dir):
        import shutil

        shutil.rmtree(run_dir)
    config = os.path.join(work, "oxrl_rl.toml")
    with open(config, "w") as f:
        f.write(oxrl_config(s, model, data, run_dir, python))
    cmd = [binary, "--threads", str(s["threads"]), "rl", "--config", config]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    log = open(os.path.join(work, "oxrl_rl.log"), "w")
    before = resource_children()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    seen, arrivals, buf = 0, [], b""
    stat = f"/proc/{proc.pid}/stat"
    while True:
        done = proc.poll() is not None
        if os.path.exists(metrics):
            with open(metrics, "rb") as f:
                f.seek(seen)
                chunk = f.read()
            seen += len(chunk)
            buf += chunk
            now = time.perf_counter() - t0
            cpu = None
            if b"\n" in buf:
                cpu = proc_cpu_s(stat)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    arrivals.append((now, cpu, json.loads(line)))
        if done:
            break
        time.sleep(0.02)
    # The child's CPU time (with its Python reward workers, which it waits for).
    after = resource_children()
    rusage = {k: after[k] - before[k] for k in ("cpu_user_s", "cpu_sys_s")}
    wall = time.perf_counter() - t0
    log.close()
    if proc.returncode != 0:
        with open(os.path.join(work, "oxrl_rl.log")) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"oxrl rl failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    import shutil

    shutil.copy(metrics, os.path.join(out, "oxrl_metrics.jsonl"))
    shutil.copy(config, os.path.join(out, "oxrl_rl.toml"))
    with open(os.path.join(out, "oxrl.jsonl"), "w") as f:
        prev, prev_cpu = None, None
        for t, cpu, m in arrivals:
            parts = {k: m.get(k, 0.0) or 0.0 for k in ("time_generate_s", "time_reference_s", "time_train_s", "time_sync_s")}
            rec = {
                "framework": "oxrl",
                "step": m["step"],
                "wall_s": None if prev is None else t - prev,
                "cpu_s": None if prev_cpu is None or cpu is None else cpu - prev_cpu,
                "parts_sum_s": sum(parts.values()),
                **parts,
                "reward_mean": m.get("reward_mean"),
                "correct_mean": m.get("correct_mean"),
                "response_length_mean": m.get("response_length_mean"),
                "entropy_mean": m.get("entropy_mean"),
                "episodes_generated": m.get("episodes_generated"),
                "episodes_trained": m.get("episodes_trained"),
                "loss": m.get("loss"),
                "grad_norm": m.get("grad_norm"),
                "lr": m.get("lr"),
                "reward_errors": m.get("reward_errors"),
            }
            if prev is None:
                rec["since_start_s"] = t
            prev, prev_cpu = t, cpu
            f.write(json.dumps(rec) + "\n")
    return {"framework": "oxrl", "command": " ".join(cmd), "wall_s": wall, **rusage, "steps": len(arrivals)}


def proc_cpu_s(stat):
    """User + system CPU seconds of a live process, all its threads (not its children)."""
    try:
        with open(stat) as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def resource_children():
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu_user_s": r.ru_utime, "cpu_sys_s": r.ru_stime, "max_rss_kb": r.ru_maxrss}


# ---------------------------------------------------------------------------------------------
# TRL (one process)


def load_reward():
    import importlib.util

    spec = importlib.util.spec_from_file_location("arithmetic_reward", REWARD_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.compute_score


def run_trl(a):
    s = settings(a)
    os.environ.setdefault("OMP_NUM_THREADS", str(s["threads"]))
    import torch

    torch.set_num_threads(s["threads"])
    torch.set_num_interop_threads(s["threads"])
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    compute_score = load_reward()

    def compute_score_reward(prompts, completions, data_source, reward_model, extra_info, **kwargs):
        """TRL's reward callable: the verl compute_score on each completion's text."""
        out = []
        for i, c in enumerate(completions):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(float(compute_score(data_source=data_source[i], solution_str=text,
                                           ground_truth=reward_model[i]["ground_truth"], extra_info=extra_info[i])))
        return out

    dataset = datasets.load_dataset("parquet", data_files=a.data, split="train")
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["adam_eps"],
                                  weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, s["warmup"]))

    config = GRPOConfig(
        output_dir=os.path.join(a.work, "trl_run"),
        max_steps=s["steps"],
        per_device_train_batch_size=s["prompts"] * s["group"],  # one optimizer step = one generation batch
        gradient_accumulation_steps=1,
        num_generations=s["group"],
        num_iterations=1,
        learning_rate=s["lr"],
        max_grad_norm=s["grad_clip"],
        max_completion_length=s["max_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        beta=s["kl_coef"],
        epsilon=s["clip_eps"],
        loss_type="dapo",  # token mean over the batch: oxrl's token_mean
        scale_rewards="group",  # GRPO, divided by the group's std: oxrl's norm_by_std
        entropy_coef=s["ent_coef"],
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=s["seed"],
        data_seed=s["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    timers = {}

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] = timers.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)

    records, logs_by_step = [], {}

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.prev = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.prev is None:
                self.prev, self.prev_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            now, cpu = time.perf_counter(), time.process_time()
            rec = {"framework": "trl", "step": state.global_step, "wall_s": now - self.prev,
                   "cpu_s": cpu - self.prev_cpu,
                   **{k: v for k, v in sorted(timers.items())}}
            rec["other_s"] = rec["wall_s"] - timers.get("training_step_s", 0.0)
            rec["train_fwd_bwd_s"] = timers.get("training_step_s", 0.0) - timers.get("generate_and_score_s", 0.0)
            records.append(rec)
            timers.clear()
            self.prev, self.prev_cpu = now, cpu

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                logs_by_step.setdefault(state.global_step, {}).update(logs)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[compute_score_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
        optimizers=(optimizer, scheduler),
    )
    timed(trainer, "_generate", "generate_s")
    timed(trainer, "_calculate_rewards", "reward_s")
    timed(trainer, "_generate_and_score_completions", "generate_and_score_s")
    timed(trainer, "training_step", "training_step_s")
    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    logs = logs_by_step
    with open(os.path.join(a.out, "trl.jsonl"), "w") as f:
        for rec in records:
            l = logs.get(rec["step"], {})
            rec.update({
                "reward_mean": l.get("reward"),
                "reward_std": l.get("reward_std"),
                "response_length_mean": l.get("completions/mean_length"),
                "entropy_mean": l.get("entropy"),
                "loss": l.get("loss"),
                "grad_norm": l.get("grad_norm"),
                "lr": l.get("learning_rate"),
                "trl_step_time": l.get("step_time"),
            })
            f.write(json.dumps(rec) + "\n")
    with open(os.path.join(a.out, "trl_log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f, indent=1)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "trl": trl.__version__, "datasets": datasets.__version__}
    import accelerate

    versions["accelerate"] = accelerate.__version__
    with open(os.path.join(a.out, "trl_versions.json"), "w") as f:
        json.dump({**versions, "train_wall_s": train_wall, "torch_threads": torch.get_num_threads()}, f)


def spawn_trl(a, s):
    cmd = [sys.executable, os.path.abspath(__file__), "trl", "--model", a.model, "--data", a.data_file, "--work", a.work,
           "--out", a.out, *settings_args(s)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(s["threads"]), MKL_NUM_THREADS=str(s["threads"]),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    log = open(os.path.join(a.work, "trl.log"), "w")
    t0 = time.perf_counter()
    before = resource_children()
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource_children()
    log.close()
    if rc != 0:
        with open(os.path.join(a.work, "trl.log")) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"TRL failed (exit {rc}):\n{tail}")
    usage = {k: after[k] - before[k] for k in ("cpu_user_s", "cpu_sys_s")}
    with open(os.path.join(a.out, "trl.jsonl")) as f:
        steps = sum(1 for _ in f)
    return {"framework": "trl", "command": " ".join(cmd), "wall_s": wall, **usage, "steps": steps}


# ---------------------------------------------------------------------------------------------
# The table


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def fmt_ms(x):
    return "–" if x != x else f"{x * 1e3:,.0f} ms"


def table(out, last_n=5, edge=3, blocks=10):
    ox = read_jsonl(os.path.join(out, "oxrl.jsonl"))
    tr = read_jsonl(os.path.join(out, "trl.jsonl"))
    runs = {r["framework"]: r for r in read_jsonl(os.path.join(out, "runs.jsonl"))}
    with open(os.path.join(out, "settings.json")) as f:
        meta = json.load(f)
    rest = lambda rows: [r for r in rows if r["step"] > 1]
    lines = []
    p = lines.append
    n = min(len(ox), len(tr))
    p(f"{meta['date']}, {meta['machine']}; {n} steps of {meta['settings']['prompts']} prompts x "
      f"{meta['settings']['group']} samples; medians over steps 2-{n}.")
    p("")
    p("| | oxrl | TRL GRPOTrainer | TRL / oxrl |")
    p("|---|---|---|---|")
    ow, tw = med([r["wall_s"] for r in rest(ox)]), med([r["wall_s"] for r in rest(tr)])
    p(f"| step wall time (median) | {fmt_ms(ow)} | {fmt_ms(tw)} | {tw / ow:.1f}x |")
    ob, tb = min(r["wall_s"] for r in rest(ox)), min(r["wall_s"] for r in rest(tr))
    p(f"| step wall time (best) | {fmt_ms(ob)} | {fmt_ms(tb)} | {tb / ob:.1f}x |")
    oc, tc = med([r.get("cpu_s") for r in rest(ox)]), med([r.get("cpu_s") for r in rest(tr)])
    p(f"| step CPU time, all threads (median) | {fmt_ms(oc)} | {fmt_ms(tc)} | {tc / oc:.1f}x |")
    p(f"| samples/s (median step) | {meta['settings']['prompts'] * meta['settings']['group'] / ow:,.0f} | "
      f"{meta['settings']['prompts'] * meta['settings']['group'] / tw:,.0f} | |")
    p(f"| whole run: wall (start-up, model load, {n} steps, exit) | {runs['oxrl']['wall_s']:.1f} s | "
      f"{runs['trl']['wall_s']:.1f} s | {runs['trl']['wall_s'] / runs['oxrl']['wall_s']:.1f}x |")
    ocpu = runs["oxrl"]["cpu_user_s"] + runs["oxrl"]["cpu_sys_s"]
    tcpu = runs["trl"]["cpu_user_s"] + runs["trl"]["cpu_sys_s"]
    p(f"| whole run: CPU time (user + sys) | {ocpu:.1f} s | {tcpu:.1f} s | {tcpu / ocpu:.1f}x |")
    rewards = lambda rows: ", ".join("%.3f" % r["reward_mean"] for r in rows)
    p(f"| reward, steps 1-{edge} | {rewards(ox[:edge])} | {rewards(tr[:edge])} | |")
    p(f"| reward, steps {n - edge + 1}-{n} | {rewards(ox[n - edge:n])} | {rewards(tr[n - edge:n])} | |")
    first = lambda rows: mean([r["reward_mean"] for r in rows[:last_n]])
    p(f"| reward, mean of the first {last_n} steps | {first(ox):.3f} | {first(tr):.3f} | |")
    last = lambda rows: mean([r["reward_mean"] for r in rows[n - last_n:n]])
    p(f"| reward, mean of the last {last_n} steps | {last(ox):.3f} | {last(tr):.3f} | |")
    p("")
    p("Where the step goes (medians over steps 2-N; parts need not add up to the median step):")
    p("")
    p("| oxrl | median | TRL | median |")
    p("|---|---|---|---|")
    opart = [("generate + reward (`time_generate_s`)", "time_generate_s"),
             ("anchor forward (`time_reference_s`)", "time_reference_s"),
             ("forward + backward + AdamW (`time_train_s`)", "time_train_s"),
             ("weight push to the engine (`time_sync_s`)", "time_sync_s"),
             ("sum of the parts", "parts_sum_s")]
    tpart = [("transformers generate (`_generate`)", "generate_s"),
             ("reward function (`_calculate_rewards`)", "reward_s"),
             ("generate + reward + advantages (`_generate_and_score_completions`)", "generate_and_score_s"),
             ("forward + backward (`training_step` - the above)", "train_fwd_bwd_s"),
             ("clip + AdamW + scheduler + logging (rest of the step)", "other_s")]
    for (on, ok), (tn, tk) in zip(opart, tpart):
        p(f"| {on} | {fmt_ms(med([r.get(ok) for r in rest(ox)]))} | {tn} | {fmt_ms(med([r.get(tk) for r in rest(tr)]))} |")
    p("")
    size = max(1, n // blocks)
    p(f"Reward and step wall time by blocks of {size} steps (means of the reward, medians of the wall time; "
      "every step in oxrl.jsonl and trl.jsonl):")
    p("")
    p("| steps | oxrl reward | TRL reward | oxrl wall | TRL wall |")
    p("|---|---|---|---|---|")
    for b in range(0, n, size):
        o, t = ox[b:b + size], tr[b:b + size]
        p(f"| {b + 1}-{b + len(o)} | {mean([r['reward_mean'] for r in o]):.3f} | "
          f"{mean([r['reward_mean'] for r in t]):.3f} | {fmt_ms(med([r['wall_s'] for r in o]))} | "
          f"{fmt_ms(med([r['wall_s'] for r in t]))} |")
    text = "\n".join(lines)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)


# ---------------------------------------------------------------------------------------------


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return f"{os.cpu_count()} cores ({cpu}), load average at start {load}"


def git_describe():
    """The commit of the working tree oxrl was built from (`-dirty`: with uncommitted edits)."""
    r = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or None


def bench(a):
    s = settings(a)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    a.data_file = os.path.join(a.work, "train.parquet")
    write_data(a.data_file, a.rows, a.seed)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "settings": s, "model": a.model,
            "data": a.data_file, "rows": a.rows, "reward": REWARD_FILE, "nice": os.nice(0), "oxrl_tree": git_describe()}
    with open(os.path.join(a.out, "settings.json"), "w") as f:
        json.dump(meta, f, indent=1)
    runs = [run_oxrl(a.oxrl, s, a.model, a.data_file, a.work, sys.executable, a.out)]
    print(f"oxrl: {runs[0]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    runs.append(spawn_trl(a, s))
    print(f"TRL: {runs[1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    with open(os.path.join(a.out, "runs.jsonl"), "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
    table(a.out, last_n=a.last_n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--oxrl", required=True)
    b.add_argument("--model", required=True, help="the HF model directory both start from")
    b.add_argument("--work", required=True, help="scratch: prompts, configs, runs, logs")
    b.add_argument("--out", required=True, help="the JSON lines and table.md")
    b.add_argument("--rows", type=int, default=2000)
    b.add_argument("--last-n", type=int, default=20)
    add_settings(b)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--rows", type=int, default=2000)
    d.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("trl")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--work", required=True)
    t.add_argument("--out", required=True)
    add_settings(t)
    tb = sub.add_parser("table")
    tb.add_argument("out")
    tb.add_argument("--last-n", type=int, default=20)
    a = ap.parse_args()
    if a.cmd == "bench":
        bench(a)
    elif a.cmd == "data":
        write_data(a.out, a.rows, a.seed)
    elif a.cmd == "trl":
        run_trl(a)
    else:
        table(a.out, last_n=a.last_n)


if __name__ == "__main__":
    main()
