//! `oxrl bench train|decode|gemm|all-reduce|memory|save-model`: workloads on the
//! benchmark model (or any HF model directory), one JSON line per measurement on stdout:
//! `{"bench": "train", ..., "median_ms": …, "tokens_per_s": …}`.
//!
//! `memory` trains a model directory on `--ranks` data-parallel ranks of this process (and of
//! each process under `mpirun`), `--batch` × `--seq` tokens per rank in one micro-batch, and
//! prints the process's resident set once loaded and its peak over the steps (`VmHWM`) beside
//! what [`crate::bench::memory`] predicts per rank for parameters, gradients, optimizer state and
//! activations, and the median step time. Run each setting in a process of its own: the peak
//! is the process's since it started.
//!
//! `all-reduce` sums a gradient of every parameter over the data-parallel ranks through the
//! collective the trainers use: `--ranks` threads of this process, and under `mpirun -np W`
//! the same in each of W processes (process 0 prints).
//!
//! `gemm` times candle's f32 matmul (the gemm crate) on square matrices: the machine's GEMM speed
//! in the same session and thread count, which decoding's FLOP rates are set against: `gflops`
//! (the projections' FLOPs of the generated tokens per second of the whole run), `computed_gflops`
//! (the same with the prompts' prefill counted: what the run computed) and `later_steps_gflops`
//! (the steps after the first, every row decoding).
//!
//! `save-model` writes the benchmark model as an HF directory with the workloads' tokens, so that
//! other frameworks (benches/peers/) measure the same weights on the same tokens. Threads: the
//! global `--threads` (default 1 here, as for generation).

use std::path::PathBuf;

use anyhow::Context;
use candle_core::DType;
use serde_json::json;

use crate::bench::timing::{measure_ms, median};
use crate::bench::{model as bench_model, workloads};
use crate::model::{weights, Transformer};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Training step: forward + backward + AdamW of one worker on BATCH × SEQ tokens.
    Train(TrainArgs),
    /// Greedy decoding through the sampling engine at each concurrency of --batch.
    Decode(DecodeArgs),
    /// The machine's f32 GEMM speed: candle's matmul (the gemm crate) on square matrices, the
    /// reference decoding's FLOP/s are compared with.
    Gemm(GemmArgs),
    /// The gradient sum over data-parallel ranks (threads here, processes under mpirun).
    AllReduce(AllReduceArgs),
    /// A weight push to an engine: in this process, to `oxrl engine` at --engine, or over MPI to
    /// the engine processes of the job (`mpirun -np 1 oxrl bench weight-push … : -np 1 oxrl engine …`).
    WeightPush(WeightPushArgs),
    /// Peak memory of training steps (per process) against the per-rank prediction.
    Memory(MemoryArgs),
    /// Reward calls per second through the Python worker pool, against the same function called
    /// in a plain Python loop.
    Reward(RewardArgs),
    /// Write the benchmark model (HF layout) and its workloads' tokens (bench_workloads.json).
    SaveModel {
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(clap::Args)]
struct MemoryArgs {
    /// An HF model directory (e.g. made by `oxrl init-model`) or a Hub repo id.
    #[arg(long)]
    model: PathBuf,
    /// The Hub revision (branch, tag or commit) of a --model given by repo id; default main.
    #[arg(long, default_value = "")]
    revision: String,
    /// Parameter dtype: f32 or bf16 (bf16 keeps f32 master weights).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// How the ranks share the model's state: none (every rank holds all of it), optimizer or
    /// gradients (each rank keeps the optimizer state of its slice of the parameters), or full
    /// (the parameters too, gathered layer by layer).
    #[arg(long, default_value = "none")]
    sharding: String,
    /// Data-parallel ranks in this process (threads).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Keep only each layer's input in the forward and recompute the layer in the backward.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Sequences per micro-batch; 0: the rank's whole batch in one.
    #[arg(long, default_value_t = 0)]
    micro_batch_size: usize,
    /// When the ranks' gradients are summed: step (once, at the optimizer step) or micro_batch
    /// (after every micro-batch; under full a rank then keeps only its slice of the gradients).
    #[arg(long, default_value = "step")]
    gradient_sum: String,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Timed steps (the median is reported), after one untimed step.
    #[arg(long, default_value_t = 2)]
    reps: usize,
}

#[derive(clap::Args)]
struct RewardArgs {
    /// The reward file (a verl-style `compute_score`).
    #[arg(long)]
    path: PathBuf,
    #[arg(long, default_value = "compute_score")]
    name: String,
    #[arg(long, default_value = "python3")]
    python: String,
    /// Worker processes of the pool.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Calls per repetition, submitted at once (as a step's episodes are).
    #[arg(long, default_value_t = 2048)]
    calls: usize,
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

#[derive(clap::Args)]
struct Common {
    /// An HF model directory or Hub repo id; default: the built-in benchmark model (qwen3 d256, 6.0 M parameters).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The Hub revision (branch, tag or commit) of a --model given by repo id; default main.
    #[arg(long, default_value = "")]
    revision: String,
    /// Compute dtype: f32 or bf16 (training in bf16 keeps f32 master weights unless --pure-bf16).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Untimed runs first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
}

#[derive(clap::Args)]
struct TrainArgs {
    #[command(flatten)]
    common: Common,
    /// Sequences per step.
    #[arg(long, default_value_t = workloads::TRAIN_BATCH)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = workloads::TRAIN_SEQ)]
    seq: usize,
    /// bf16 without f32 master weights (parameters updated in bf16), for comparison.
    #[arg(long)]
    pure_bf16: bool,
}

#[derive(clap::Args)]
struct DecodeArgs {
    #[command(flatten)]
    common: Common,
    /// Concurrent requests, one measurement each (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = workloads::CONCURRENCY)]
    batch: Vec<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = workloads::PROMPT_LEN)]
    prompt: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = workloads::NEW_TOKENS)]
    new_tokens: usize,
    /// Sampling temperature: 0 = greedy (the peers' workload); RL samples at 1.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Keep the k most likely tokens when sampling (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus mass when sampling, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
}

#[derive(clap::Args)]
struct GemmArgs {
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Square sizes N (N × N times N × N), one measurement each (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1024, 2048])]
    size: Vec<usize>,
}

#[derive(clap::Args)]
struct AllReduceArgs {
    #[command(flatten)]
    common: Common,
    /// Data-parallel ranks in this process (threads).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
}

#[derive(clap::Args)]
struct WeightPushArgs {
    #[command(flatten)]
    common: Common,
    /// An `oxrl engine` URL (started on the same model, with the same --lora-rank); default: an
    /// engine in this process.
    #[arg(long)]
    engine: Option<String>,
    /// Push LoRA adapters of this rank (all linear layers) instead of every weight.
    #[arg(long, default_value_t = 0)]
    lora_rank: usize,
}

impl Common {
    fn dtype(&self) -> anyhow::Result<DType> {
        match weights::parse_dtype(&self.dtype) {
            Ok(d @ (DType::F32 | DType::BF16)) => Ok(d),
            _ => anyhow::bail!("--dtype `{}`: expected f32 or bf16", self.dtype),
        }
    }

    fn load(&self) -> anyhow::Result<(Transformer, String)> {
        let (dtype, device) = (self.dtype()?, weights::parse_device(&self.device)?);
        anyhow::ensure!(self.reps > 0, "--reps must be at least 1");
        Ok(match &self.model {
            Some(m) => {
                let dir = crate::model::hub::resolve_model_dir(m, &self.revision)?;
                (Transformer::load(&dir, dtype, &device)?, m.display().to_string())
            }
            None => (bench_model::build(bench_model::SEED, dtype, &device)?, "bench-qwen3-d256".into()),
        })
    }

    /// The fields every record has (on a GPU also whether oxrl's CUDA kernels ran, see
    /// `ops::cuda_kernels`, whether candle's backward ran as upstream has it, and whether flash
    /// attention was switched off).
    fn record(&self, bench: &str, model: &str) -> serde_json::Value {
        let mut r = json!({
            "bench": bench,
            "framework": "oxrl",
            "model": model,
            "dtype": self.dtype,
            "device": self.device,
            "threads": rayon::current_num_threads(),
            "reps": self.reps,
        });
        if self.device.starts_with("cuda") {
            r["cuda_kernels"] = json!(crate::model::ops::cuda_kernels());
            if weights::upstream_backward() {
                r["candle_zero_first"] = json!(true);
            }
            if !crate::model::ops::flash_attention::switched_on() {
                r["flash_attention"] = json!(false);
            }
        }
        r
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.what {
        What::Train(t) => train(t),
        What::Decode(d) => decode(d),
        What::Gemm(g) => gemm(g),
        What::AllReduce(a) => all_reduce(a),
        What::WeightPush(a) => weight_push(a),
        What::Reward(a) => reward(a),
        What::Memory(a) => memory(a),
        What::SaveModel { out } => {
            bench_model::write(&out).with_context(|| format!("writing the benchmark model to {}", out.display()))?;
            eprintln!("wrote the benchmark model and {} to {}", bench_model::WORKLOADS_FILE, out.display());
            Ok(())
        }
    }
}

fn train(a: TrainArgs) -> anyhow::Result<()> {
    let c = &a.common;
    let (model, name) = c.load()?;
    anyhow::ensure!(!a.pure_bf16 || c.dtype()? == DType::BF16, "--pure-bf16 needs --dtype bf16");
    let mixed = c.dtype()? != DType::F32 && !a.pure_bf16;
    let device = model.device.clone();
    let mut bench = workloads::TrainBench::new(model, a.batch, a.seq, !a.pure_bf16)?;
    crate::memory::reset_device_peak(&device);
    let mut losses = Vec::new();
    let ms = measure_ms(c.warmup, c.reps, || {
        losses.push(bench.step()?);
        Ok(())
    })?;
    let med = median(ms.clone());
    let mut r = c.record("train", &name);
    r["master_weights"] = json!(mixed);
    r["batch"] = json!(a.batch);
    r["seq_len"] = json!(a.seq);
    r["median_ms"] = json!(med);
    r["min_ms"] = json!(ms.iter().cloned().fold(f64::INFINITY, f64::min));
    r["tokens_per_s"] = json!(bench.tokens_per_step() as f64 / (med / 1e3));
    r["first_loss"] = json!(losses.first());
    r["last_loss"] = json!(losses.last());
    if let Some(bytes) = crate::memory::device_peak_bytes(&device) {
        // GiB, as the PyTorch peer reports its `max_memory_allocated`.
        r["peak_gib"] = json!(bytes as f64 / (1u64 << 30) as f64);
    }
    println!("{r}");
    // The GPU check times each process to its exit: say how long the last step's queued work
    // and the teardown's first part took.
    let waiting = std::time::Instant::now();
    device.synchronize()?;
    eprintln!("bench train: the device finished its queued work in {:.2} s", waiting.elapsed().as_secs_f64());
    let dropping = std::time::Instant::now();
    drop(bench);
    eprintln!("bench train: the worker dropped in {:.2} s", dropping.elapsed().as_secs_f64());
    Ok(())
}

fn memory(a: MemoryArgs) -> anyhow::Result<()> {
    use crate::bench::memory::predict;
    use crate::dispatch::{Dispatch, MeshShape, WorkerSpec};
    use crate::memory::{peak_rss_gb, resident_rss_gb, GB};
    use crate::trainer::model_ids::POLICY;
    use crate::worker::WorkerConfig;
    anyhow::ensure!(
        a.ranks > 0 && a.batch > 0 && a.seq > 0 && a.reps > 0,
        "--ranks, --batch, --seq and --reps must be positive"
    );
    let sharding = crate::worker::Sharding::from_name(&a.sharding).map_err(|e| anyhow::anyhow!("--sharding: {e}"))?;
    sharding.check_served("cpu")?;
    let gradient_sum =
        crate::worker::GradientSum::from_name(&a.gradient_sum).map_err(|e| anyhow::anyhow!("--gradient-sum: {e}"))?;
    let micro_batch = match a.micro_batch_size {
        0 => a.batch,
        m => m.min(a.batch),
    };
    let micro_batches = a.batch.div_ceil(micro_batch);
    let dtype = match weights::parse_dtype(&a.dtype) {
        Ok(d @ (DType::F32 | DType::BF16)) => d,
        _ => anyhow::bail!("--dtype `{}`: expected f32 or bf16", a.dtype),
    };
    let dir = crate::model::hub::resolve_model_dir(&a.model, &a.revision)?;
    let config = crate::model::ModelConfig::from_dir(&dir)?;
    let world = crate::world::world()?;
    let spec = WorkerSpec {
        dtype,
        mesh: MeshShape::dp(a.ranks * world.size()),
        threads: (crate::launch::cores() / a.ranks).max(1),
        worker: WorkerConfig {
            activation_checkpointing: a.activation_checkpointing,
            sharding,
            gradient_sum,
            micro_batch_size: (a.micro_batch_size > 0).then_some(a.micro_batch_size),
            ..Default::default()
        },
        ..WorkerSpec::new(&dir)
    };
    let dispatch = Dispatch::new(false);
    dispatch.create_model(POLICY, &spec)?;
    let loaded_gb = resident_rss_gb();
    let ranks = a.ranks * world.size();
    let datums = workloads::train_batch(a.batch * ranks, a.seq, config.vocab_size);
    let loss = crate::algo::Loss::parse("cross_entropy", &json!({}))?;
    let params = workloads::adam_params();
    let mut losses = vec![];
    let ms = measure_ms(1, a.reps, || {
        let (out, _) = dispatch.forward_backward_step(POLICY, &datums, &loss, false, &params)?;
        losses.push(out.metrics.value("loss:sum").unwrap_or(f64::NAN));
        Ok(())
    })?;
    let peak = peak_rss_gb();
    // The optimizer state each of this process's ranks holds, by the tensors' own sizes.
    let optimizer_gb: Vec<f64> =
        dispatch.model(POLICY)?.inspect(|w| w.optimizer_bytes())?.into_iter().map(|b| b as f64 / GB).collect();
    // And the parameters it holds between steps (under `full`, its own slice).
    let param_gb: Vec<f64> =
        dispatch.model(POLICY)?.inspect(|w| w.param_bytes())?.into_iter().map(|b| b as f64 / GB).collect();
    // Every process's figures: the processes of a run are alike, but each is measured.
    let mine = serde_json::to_vec(&json!({
        "rss_loaded_gb": loaded_gb, "peak_rss_gb": peak, "optimizer_gb_per_rank": optimizer_gb,
        "param_gb_per_rank": param_gb,
    }))?;
    let all: Vec<serde_json::Value> =
        world.all_gather(&mine)?.iter().map(|b| serde_json::from_slice(b)).collect::<Result<_, _>>()?;
    if crate::world::is_writer() {
        let p = predict(&config, dtype.size_in_bytes(), true, micro_batch, a.seq, a.activation_checkpointing).sharded(
            sharding,
            ranks,
            micro_batches,
            gradient_sum,
        );
        let gb = |b: f64| b / GB;
        let med = median(ms.clone());
        let r = json!({
            "bench": "memory", "framework": "oxrl", "model": a.model.display().to_string(), "dtype": a.dtype,
            "sharding": a.sharding, "activation_checkpointing": a.activation_checkpointing,
            "micro_batches_per_rank": micro_batches, "gradient_sum": a.gradient_sum,
            "processes": world.size(), "ranks_per_process": a.ranks, "batch_per_rank": a.batch, "seq_len": a.seq,
            "threads_per_rank": spec.threads, "reps": a.reps,
            "median_ms": med, "min_ms": ms.iter().cloned().fold(f64::INFINITY, f64::min),
            "tokens_per_s": (a.batch * ranks * a.seq) as f64 / (med / 1e3),
            "last_loss": losses.last(),
            "measured_per_process": all,
            "predicted_per_rank_gb": {
                "params": gb(p.params), "grads": gb(p.grads), "optimizer": gb(p.optimizer),
                "activations": gb(p.activations), "total": gb(p.total()),
            },
            "predicted_per_process_gb": gb(p.total()) * a.ranks as f64,
        });
        println!("{r}");
    }
    Ok(())
}

fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    let c = &a.common;
    let (model, name) = c.load()?;
    let sampling = crate::rollout::SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        ..Default::default()
    };
    sampling.validate()?;
    let flops = workloads::flops_per_token(&model.config);
    let prefill_flops = workloads::prefill_flops_per_token(&model.config);
    for &n in &a.batch {
        let mut runs = vec![];
        let ms = measure_ms(c.warmup, c.reps, || {
            runs.push(workloads::decode(&model, n, a.prompt, a.new_tokens, &sampling)?);
            Ok(())
        })?;
        let timed = &runs[runs.len() - ms.len()..];
        let generated = timed[0].tokens;
        let med = median(ms.clone());
        let later = median(timed.iter().map(|r| r.later_steps_ms).collect());
        let mut r = c.record("decode", &name);
        r["batch"] = json!(n);
        r["prompt_len"] = json!(a.prompt);
        r["new_tokens"] = json!(a.new_tokens);
        r["temperature"] = json!(a.temperature);
        r["top_k"] = json!(a.top_k);
        r["top_p"] = json!(a.top_p);
        r["median_ms"] = json!(med);
        r["min_ms"] = json!(ms.iter().cloned().fold(f64::INFINITY, f64::min));
        r["tokens_per_s"] = json!(generated as f64 / (med / 1e3));
        r["first_step_ms"] = json!(median(timed.iter().map(|r| r.first_step_ms).collect()));
        r["later_steps_ms"] = json!(later);
        // The projections' FLOPs of the generated tokens per second of the whole run (prefill
        // time included).
        r["gflops"] = json!(generated as f64 * flops / (med / 1e3) / 1e9);
        // Every projection FLOP the run computed, the prompts' prefill (all tokens but the last,
        // which the first decode step feeds) included: the machine's utilisation.
        let prefilled = (n * a.prompt.saturating_sub(1)) as f64 * prefill_flops;
        r["computed_gflops"] = json!((generated as f64 * flops + prefilled) / (med / 1e3) / 1e9);
        // The generated tokens' FLOPs of the steps after the first (every row decoding one
        // token) per second of those steps.
        r["later_steps_gflops"] = json!(generated.saturating_sub(n) as f64 * flops / (later / 1e3) / 1e9);
        println!("{r}");
    }
    Ok(())
}

fn gemm(a: GemmArgs) -> anyhow::Result<()> {
    use candle_core::{Device, Tensor};
    anyhow::ensure!(a.reps > 0, "--reps must be at least 1");
    for &n in &a.size {
        anyhow::ensure!(n > 0, "--size must be at least 1");
        let x = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
        let w = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
        let ms = measure_ms(1, a.reps, || {
            crate::model::ops::matmul::matmul(&x, &w)?;
            Ok(())
        })?;
        let med = median(ms);
        let r = json!({
            "bench": "gemm", "framework": "oxrl", "dtype": "f32", "device": "cpu",
            "threads": rayon::current_num_threads(), "reps": a.reps, "size": n, "median_ms": med,
            "gflops": 2.0 * (n as f64).powi(3) / (med / 1e3) / 1e9,
        });
        println!("{r}");
    }
    Ok(())
}

fn all_reduce(a: AllReduceArgs) -> anyhow::Result<()> {
    use crate::dispatch::collective::{Collective, InProcess};
    let c = &a.common;
    anyhow::ensure!(a.ranks > 0, "--ranks must be at least 1");
    let (model, name) = c.load()?;
    let grads: Vec<candle_core::Tensor> = model.named_params().into_iter().map(|(_, t)| t).collect();
    let elements: usize = grads.iter().map(|t| t.elem_count()).sum();
    let bytes: usize = grads.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
    let world = crate::world::world()?;
    let collective = InProcess::across(a.ranks, world);
    let ms = measure_ms(c.warmup, c.reps, || {
        world.all_gather(&[])?; // the processes start each repetition together
        std::thread::scope(|s| {
            let (collective, grads) = (&collective, &grads);
            let ranks: Vec<_> =
                (0..a.ranks).map(|r| s.spawn(move || collective.all_reduce_sum(r, grads.clone()).map(drop))).collect();
            ranks.into_iter().try_for_each(|h| h.join().expect("a rank panicked"))
        })?;
        Ok(())
    })?;
    if crate::world::is_writer() {
        let mut r = c.record("all_reduce", &name);
        r["processes"] = json!(world.size());
        r["ranks"] = json!(collective.world_size());
        r["elements"] = json!(elements);
        r["bytes_per_rank"] = json!(bytes);
        println!("{}", with_bandwidth(r, &ms, bytes));
    }
    Ok(())
}

fn weight_push(a: WeightPushArgs) -> anyhow::Result<()> {
    use crate::model::{lora, SamplerWeights};
    use crate::rollout::{Engine, EngineConfig, RemoteEngine, SamplingEngine};
    let c = &a.common;
    let (mut model, name) = c.load()?;
    let config =
        (a.lora_rank > 0).then(|| lora::LoraConfig::new(a.lora_rank, 2.0 * a.lora_rank as f64, &["all-linear"]));
    if let Some(config) = &config {
        lora::attach_new(&mut model, config, 0)?;
    }
    let link = crate::world::engine_link();
    type Push = Box<dyn Fn(&SamplerWeights) -> crate::Result<()>>;
    let (push, target): (Push, &str) = match (&a.engine, link) {
        (Some(_), Some(_)) => anyhow::bail!("--engine and engine processes in the MPI job: use one or the other"),
        (Some(url), None) => {
            let engine = RemoteEngine::connect(url, std::env::var("OXRL_ENGINE_API_KEY").ok())?.0;
            (Box::new(move |w| engine.update_weights(w).wait()), url)
        }
        (None, Some(link)) => {
            let urls = crate::world::job_engines();
            (Box::new(move |w| crate::rollout::weight_broadcast::send_weights(link, urls, w)), "mpi")
        }
        (None, None) => {
            let (base, _) = c.load()?;
            let engine = Engine::start(base, EngineConfig::default())?;
            (Box::new(move |w| engine.update_weights(w).wait()), "in-process")
        }
    };
    let mut version = 0;
    let mut bytes = 0;
    let ms = measure_ms(c.warmup, c.reps, || {
        version += 1;
        let weights = SamplerWeights::snapshot(&model, config.as_ref(), version)?;
        bytes = weights.num_bytes();
        push(&weights)?;
        Ok(())
    })?;
    let mut r = c.record("weight_push", &name);
    r["engine"] = json!(target);
    r["lora_rank"] = json!(a.lora_rank);
    r["bytes"] = json!(bytes);
    println!("{}", with_bandwidth(r, &ms, bytes));
    Ok(())
}

/// `r` with the median and minimum of `ms` and the bandwidth of `bytes` at the median.
/// The same function through the pool and in a Python loop (one process, no pipes): calls/s.
fn reward(a: RewardArgs) -> anyhow::Result<()> {
    use crate::env::python::{CallResult, PoolSpec, PythonPool};
    let path = a.path.display().to_string();
    let pool = PythonPool::start(PoolSpec {
        python: a.python.clone(),
        workers: a.workers,
        timeout: std::time::Duration::from_secs(60),
        start_timeout: std::time::Duration::from_secs(120),
        reward: Some((path.clone(), a.name.clone())),
        env_modules: vec![],
    })?;
    let call = |i: usize| {
        let args = json!({"data_source": "bench", "solution_str": format!("{}", i % 100),
                          "ground_truth": "42", "extra_info": {"index": i}});
        let mut c = serde_json::Map::new();
        c.insert("op".into(), json!("score"));
        c.insert("args".into(), args);
        c
    };
    let round = || -> anyhow::Result<()> {
        let handles: Vec<_> = (0..a.calls).map(|i| pool.call(None, call(i))).collect();
        for h in handles {
            match h.wait()? {
                CallResult::Ok(_) => {}
                other => anyhow::bail!("reward call failed: {other:?}"),
            }
        }
        Ok(())
    };
    round()?; // warm-up
    let mut ms = vec![];
    for _ in 0..a.reps {
        let t = std::time::Instant::now();
        round()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let pool_ms = median(ms);
    // The baseline: the same calls in a loop of the same interpreter.
    let script = format!(
        "import importlib.util, sys, time\n\
         spec = importlib.util.spec_from_file_location('r', {path:?})\n\
         m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n\
         f = getattr(m, {name:?})\n\
         args = [dict(data_source='bench', solution_str=str(i % 100), ground_truth='42', extra_info={{'index': i}}) for i in range({calls})]\n\
         best = []\n\
         for _ in range({reps} + 1):\n\
         \x20   t = time.perf_counter()\n\
         \x20   for kw in args: f(**kw)\n\
         \x20   best.append((time.perf_counter() - t) * 1e3)\n\
         best = sorted(best[1:])\n\
         print(best[len(best) // 2])\n",
        name = a.name,
        calls = a.calls,
        reps = a.reps,
    );
    let out = std::process::Command::new(&a.python).args(["-c", &script]).output()?;
    anyhow::ensure!(out.status.success(), "the Python loop failed: {}", String::from_utf8_lossy(&out.stderr));
    let loop_ms: f64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    let per_s = |ms: f64| a.calls as f64 / (ms / 1e3);
    println!(
        "{}",
        json!({
            "bench": "reward", "workers": a.workers, "calls": a.calls,
            "pool_ms": pool_ms, "pool_calls_per_s": per_s(pool_ms),
            "python_loop_ms": loop_ms, "python_loop_calls_per_s": per_s(loop_ms),
            "pool_over_loop": per_s(pool_ms) / per_s(loop_ms),
        })
    );
    Ok(())
}

fn with_bandwidth(mut r: serde_json::Value, ms: &[f64], bytes: usize) -> serde_json::Value {
    let med = median(ms.to_vec());
    r["median_ms"] = json!(med);
    r["min_ms"] = json!(ms.iter().cloned().fold(f64::INFINITY, f64::min));
    r["gb_per_s"] = json!(bytes as f64 / (med / 1e3) / 1e9);
    r
}
