//! Weight updates that land mid-sample: in `keep` mode, in `abort` mode (the engine
//! client's continuation) and with no pause at all, a sample's per-token versions change once,
//! where the update landed, and every token's log-prob equals the trainer's log-prob at that
//! token's version over the same prefix — full fine-tuning and LoRA; a refused update mid-sample
//! is an error that leaves the sample untouched.

use crate::common;

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use common::{fixture_dir, loss};
use oxrl::dispatch::{Dispatch, WorkerSpec};
use oxrl::model::lora::LoraConfig;
use oxrl::model::{NamedTensors, SamplerWeights, Transformer};
use oxrl::rollout::client::continuation;
use oxrl::rollout::{
    Engine, EngineClient, EngineConfig, EngineCore, Generation, PauseMode, RemoteEngine, Request, RequestOutput,
    SamplingParams, StopReason, WeightUpdate,
};
use oxrl::worker::{AdamParams, Datum, WorkerConfig};
use serde_json::json;

const ARCH: &str = "qwen3";

/// How the update reaches the running samples.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Landing {
    Pause(PauseMode),
    /// Between two steps, nothing paused.
    Direct,
}

fn spec(arch: &str, lora: Option<LoraConfig>) -> WorkerSpec {
    WorkerSpec {
        dtype: DType::F32,
        worker: WorkerConfig { lora, seed: 7, ..Default::default() },
        ..WorkerSpec::new(fixture_dir(arch))
    }
}

fn lora_cfg() -> LoraConfig {
    LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "up_proj", "lm_head"])
}

/// The trainer: "policy" moves to version 1 with [`Trainer::step`]; "frozen" is the same model
/// kept at version 0, so both versions can be scored after the samples are done.
struct Trainer {
    d: Dispatch,
    arch: &'static str,
}

impl Trainer {
    fn new(lora: Option<LoraConfig>) -> Self {
        Self::of(ARCH, lora)
    }

    fn of(arch: &'static str, lora: Option<LoraConfig>) -> Self {
        let d = Dispatch::new(false);
        d.create_model("policy", &spec(arch, lora.clone())).unwrap();
        d.create_model("frozen", &spec(arch, lora)).unwrap();
        Trainer { d, arch }
    }

    fn weights(&self) -> SamplerWeights {
        self.d.sampler_weights("policy").unwrap()
    }

    /// One optimizer step of cross-entropy on "policy"; its weights, version 1.
    fn step(&self) -> SamplerWeights {
        let seqs: [&[u32]; 2] = [&[11, 40, 7, 93, 150, 2, 64, 31, 9], &[5, 17, 40, 2, 99, 120, 6]];
        let batch: Vec<Datum> = seqs
            .iter()
            .map(|s| Datum::supervised(s[..s.len() - 1].to_vec(), s[1..].to_vec(), vec![0.2; s.len() - 1]))
            .collect();
        let ce = loss("cross_entropy", &json!({}));
        self.d.forward_backward("policy", &batch, Some(&ce), false).unwrap();
        self.d.optim_step("policy", &AdamParams { learning_rate: 3e-2, ..Default::default() }).unwrap();
        let w = self.weights();
        assert_eq!(w.version(), 1);
        w
    }

    /// log p(seq[i+1] | seq[..=i]) for every i, by the model at `version`.
    fn logprobs(&self, version: u64, seq: &[u32]) -> Vec<f32> {
        let id = if version == 0 { "frozen" } else { "policy" };
        let n = seq.len() - 1;
        let datum = Datum::supervised(seq[..n].to_vec(), seq[1..].to_vec(), vec![1.0; n]);
        self.d.forward(id, &[datum], None, true).unwrap().loss_fn_outputs.remove(0).logprobs
    }
}

fn base() -> Transformer {
    base_of(ARCH)
}

fn base_of(arch: &str) -> Transformer {
    Transformer::load(&fixture_dir(arch), DType::F32, &Device::Cpu).unwrap()
}

fn params(max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams { max_tokens, temperature: 1.0, seed: Some(seed), ignore_eos: true, ..Default::default() }
}

/// Checks one finished sample of `prompt`: it ran to its end, its versions are 0 then 1 with
/// the change at `at` (any mid-sequence point if None), and every token's log-prob is the
/// trainer's at that token's version. Returns where the versions changed and the largest gap
/// between the two versions' log-probs after it (how much the update mattered).
fn check(t: &Trainer, prompt: &[u32], g: &Generation, at: Option<usize>, what: &str) -> (usize, f32) {
    assert_eq!(g.stop_reason, StopReason::Length, "{what}");
    assert_eq!((g.logprobs.len(), g.versions.len()), (g.tokens.len(), g.tokens.len()), "{what}");
    let change = g.versions.iter().position(|&v| v == 1).unwrap_or_else(|| panic!("{what}: no token of version 1"));
    assert!(change > 0, "{what}: the update landed before the first token: {:?}", g.versions);
    let want: Vec<u64> = (0..g.tokens.len()).map(|i| u64::from(i >= change)).collect();
    assert_eq!(g.versions, want, "{what}: versions must be 0 then 1, changing once");
    if let Some(at) = at {
        assert_eq!(change, at, "{what}: the versions changed where the update did not land");
    }
    let seq: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
    let from = prompt.len() - 1;
    let (v0, v1) = (t.logprobs(0, &seq), t.logprobs(1, &seq));
    let mut gap = 0f32;
    for (k, (&lp, &v)) in g.logprobs.iter().zip(&g.versions).enumerate() {
        let want = if v == 0 { v0[from + k] } else { v1[from + k] };
        assert!(
            lp.to_bits() == want.to_bits(),
            "{what}: token {k} (version {v}): sampler log-prob {lp} vs trainer {want} (other version: {})",
            if v == 0 { v1[from + k] } else { v0[from + k] }
        );
        if v == 1 {
            gap = gap.max((v1[from + k] - v0[from + k]).abs());
        }
    }
    (change, gap)
}

/// A core with version 0 of the trainer's weights.
fn core_at_v0(t: &Trainer) -> EngineCore {
    let mut e = EngineCore::new(base_of(t.arch), EngineConfig::default()).unwrap();
    e.update_weights(t.weights().update(), 0).unwrap();
    e
}

/// Three requests of different prompt lengths (so the rebuilt cache is left-padded): two
/// samples at temperature 1, one sample with prompt log-probs, two greedy samples. Runs
/// `before` steps, lands version 1 as `landing` says, runs to the end. Deterministic: the
/// update lands after exactly `before` tokens.
fn core_run(lora: Option<LoraConfig>, landing: Landing) {
    core_run_on(ARCH, lora, landing)
}

/// [`core_run`] on a fixture family (Qwen3.5: its rebuilt DeltaNet states as well).
fn core_run_on(arch: &'static str, lora: Option<LoraConfig>, landing: Landing) {
    let what = format!("{arch} lora={} {landing:?}", lora.is_some());
    let t = Trainer::of(arch, lora);
    let mut e = core_at_v0(&t);
    let reqs = [
        Request { num_samples: 2, ..Request::new(vec![3, 14, 15, 92, 65, 35, 8], params(24, 5)) },
        Request { prompt_logprobs: true, ..Request::new(vec![27, 18, 28], params(30, 9)) },
        // Greedy: its two samples have one prefix, which the rebuild prefills once.
        Request {
            num_samples: 2,
            ..Request::new(vec![50, 51, 52, 53], SamplingParams { temperature: 0.0, ..params(20, 0) })
        },
    ];
    let ids: Vec<u64> = reqs.iter().map(|r| e.add_request(r.clone()).unwrap()).collect();
    let before = 9;
    for _ in 0..before {
        assert!(e.step().unwrap().is_empty());
    }
    let mut outs: Vec<RequestOutput> = vec![];
    match landing {
        Landing::Pause(PauseMode::Keep) => {
            assert!(e.pause(PauseMode::Keep).is_empty());
            let frozen = e.stats();
            e.update_weights(t.step().update(), 1).unwrap();
            let after = e.stats();
            assert_eq!((after.version, after.running_rows), (1, frozen.running_rows), "{what}");
            assert!(after.cached_positions <= frozen.cached_positions, "{what}: the rebuilt cache grew");
            e.resume();
            let done = e.run_until_idle().unwrap();
            assert_eq!(done.iter().map(|(id, _)| *id).collect::<Vec<_>>(), ids, "{what}");
            outs.extend(done.into_iter().map(|(_, o)| o));
        }
        Landing::Direct => {
            e.update_weights(t.step().update(), 1).unwrap();
            outs.extend(e.run_until_idle().unwrap().into_iter().map(|(_, o)| o));
        }
        Landing::Pause(PauseMode::Abort) => {
            let mut aborted = e.pause(PauseMode::Abort);
            aborted.sort_by_key(|(id, _)| *id);
            assert_eq!(aborted.iter().map(|(id, _)| *id).collect::<Vec<_>>(), ids, "{what}");
            e.update_weights(t.step().update(), 1).unwrap();
            e.resume();
            // The engine client's continuation of each sample, by hand.
            for ((_, mut out), req) in aborted.into_iter().zip(&reqs) {
                for (j, g) in out.samples.iter_mut().enumerate() {
                    assert_eq!((g.tokens.len(), g.stop_reason), (before, StopReason::Abort), "{what}");
                    e.add_request(continuation(req, j, g)).unwrap();
                    let rest = e.run_until_idle().unwrap().pop().unwrap().1.samples.remove(0);
                    g.append(rest);
                }
                outs.push(out);
            }
        }
    }
    let mut gap = 0f32;
    for (req, out) in reqs.iter().zip(&outs) {
        assert_eq!(out.samples.len(), req.num_samples, "{what}");
        for (j, g) in out.samples.iter().enumerate() {
            assert_eq!(g.tokens.len(), req.params.max_tokens, "{what}");
            gap = gap.max(check(&t, &req.prompt, g, Some(before), &format!("{what} sample {j}")).1);
        }
    }
    // The prompt log-probs are those of the weights that admitted the request (version 0).
    let plp = outs[1].prompt_logprobs.as_ref().expect("prompt log-probs asked for");
    let want = &t.logprobs(0, &reqs[1].prompt);
    assert_eq!(plp.len(), want.len());
    for (a, b) in plp.iter().zip(want) {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}: prompt log-prob {a} vs trainer at version 0 {b}");
    }
    // The update changed the log-probs: the checks above can tell the versions apart.
    assert!(gap > 1e-3, "{what}: the update barely changed the log-probs ({gap})");
}

#[test]
fn keep_mode_update_mid_sample_gives_the_trainers_logprobs_per_version() {
    core_run(None, Landing::Pause(PauseMode::Keep));
    core_run(Some(lora_cfg()), Landing::Pause(PauseMode::Keep));
}

#[test]
fn abort_mode_update_mid_sample_gives_the_trainers_logprobs_per_version() {
    core_run(None, Landing::Pause(PauseMode::Abort));
    core_run(Some(lora_cfg()), Landing::Pause(PauseMode::Abort));
}

#[test]
fn update_between_steps_without_a_pause_gives_the_trainers_logprobs_per_version() {
    core_run(None, Landing::Direct);
}

/// Qwen3.5's DeltaNet layers carry a state per row instead of keys and values: a `keep`
/// update recomputes it, an `abort` continuation prefills it again; LoRA on the DeltaNet's
/// projections and the attention's.
#[test]
fn qwen3_5_updates_mid_sample_give_the_trainers_logprobs_per_version() {
    let lora = LoraConfig::new(4, 8.0, &["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "up_proj", "lm_head"]);
    for landing in [Landing::Pause(PauseMode::Keep), Landing::Pause(PauseMode::Abort), Landing::Direct] {
        core_run_on("qwen3_5", None, landing);
        core_run_on("qwen3_5", Some(lora.clone()), landing);
    }
}

/// Waits until `f` holds (or `deadline` passes); returns whether it held.
fn wait_for(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    false
}

/// Through the engine client and a real engine thread: submit, wait until it is decoding,
/// pause(mode) → trainer step → update_weights → resume.
#[test]
fn client_pause_update_resume_in_both_modes_gives_the_trainers_logprobs_per_version() {
    pause_update_resume(|| EngineClient::new(vec![Engine::start(base(), EngineConfig::default()).unwrap()]).unwrap());
}

/// The same across a process boundary: the engine is `oxrl engine`, the weights travel as
/// safetensors, pause and resume are HTTP calls.
#[test]
fn pause_update_resume_on_a_remote_engine_gives_the_trainers_logprobs_per_version() {
    let process = crate::remote_engine::EngineProcess::start(&fixture_dir(ARCH), &[]);
    pause_update_resume(|| {
        EngineClient::over(vec![Box::new(RemoteEngine::connect(&process.url, None).unwrap().0)]).unwrap()
    });
}

fn pause_update_resume(engine: impl Fn() -> EngineClient) {
    for mode in [PauseMode::Keep, PauseMode::Abort] {
        let t = Trainer::new(None);
        let client = engine();
        client.update_weights(&t.weights()).wait().unwrap();
        let prompt = vec![9u32, 8, 7, 6, 5];
        // Eight rows make each step slower, so the pause surely lands mid-sample.
        let n = 8;
        let req = Request { num_samples: n, ..Request::new(prompt.clone(), params(240, 3)) };
        let calls_before = client.health()[0].completed_requests;
        let handle = client.submit(req);
        let running = || client.health()[0].stats.as_ref().is_some_and(|s| s.running_rows > 0);
        assert!(wait_for(Duration::from_secs(30), running), "{mode:?}: the request never started");
        client.pause(mode).wait().unwrap();
        let weights = t.step();
        client.update_weights(&weights).wait().unwrap();
        client.resume().wait().unwrap();
        let out = handle.wait().unwrap();
        let calls = client.health()[0].completed_requests - calls_before;
        match mode {
            PauseMode::Keep => assert_eq!(calls, 1, "keep mode must not abort"),
            PauseMode::Abort => {
                assert_eq!(calls, 1 + n as u64, "abort mode: one call, then one continuation per sample")
            }
        }
        let mut changes = vec![];
        for (j, g) in out.samples.iter().enumerate() {
            assert_eq!(g.tokens.len(), 240);
            let (at, gap) = check(&t, &prompt, g, None, &format!("{mode:?} sample {j}"));
            assert!(at < 240, "{mode:?}: the update landed after the end");
            assert!(gap > 1e-3, "{mode:?}: the update barely changed the log-probs ({gap})");
            changes.push(at);
        }
        // The samples decode in one batch: the update found them all at the same token.
        assert!(changes.iter().all(|&c| c == changes[0]), "{mode:?}: {changes:?}");
    }
}

/// A refused update mid-sample is an error that changes nothing: same version, same cache, and
/// the samples finish exactly as if it had never been tried.
#[test]
fn a_refused_update_mid_sample_is_an_error_and_changes_nothing() {
    let t = Trainer::new(None);
    let req = Request { num_samples: 2, ..Request::new(vec![4, 5, 6, 7], params(20, 1)) };
    let mut whole = core_at_v0(&t);
    whole.add_request(req.clone()).unwrap();
    let whole = whole.run_until_idle().unwrap().pop().unwrap().1;

    let mut e = core_at_v0(&t);
    e.add_request(req).unwrap();
    for _ in 0..6 {
        e.step().unwrap();
    }
    let before = e.stats();
    let WeightUpdate::Full(good) = t.step().update().clone() else { panic!("a full update") };
    let mut named: Vec<_> = good.names().map(|n| (n.to_string(), good.get(n).unwrap().clone())).collect();
    named.pop();
    let missing = WeightUpdate::Full(NamedTensors::from_vec("weight update", named).unwrap());
    let msg = e.update_weights(&missing, 1).unwrap_err().to_string();
    assert!(msg.contains("missing"), "{msg}");
    assert_eq!(e.stats(), before, "a refused update changed the engine");
    let got = e.run_until_idle().unwrap().pop().unwrap().1;
    for (a, b) in got.samples.iter().zip(&whole.samples) {
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.logprobs, b.logprobs);
        assert_eq!(a.versions, vec![0; 20]);
    }
}
