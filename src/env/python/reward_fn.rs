//! A row scored by the user's Python reward function, verl's contract unchanged: one model turn,
//! then `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`.
//!
//! - `solution_str`: the decoded reply (special tokens removed), what the built-in envs grade.
//! - `data_source`: the row's `data_source`; `ground_truth`: verl's `reward_model.ground_truth`,
//!   else SkyRL's `reward_spec.ground_truth`, else the row's `answer` (null when none);
//!   `extra_info`: the row's `extra_info` (null when none).
//! - The return: a number, or a dict whose `score` is the reward; its other numeric keys are
//!   logged as per-step means ([`Outcome::metrics`]). `correct` (accuracy, pass@k) is the dict's
//!   `acc` when it gives one (non-zero is correct), else `score ≥ 1`.
//! - The call runs in the pool without blocking: the trainer starts every reply's call of a
//!   round before it waits for any, so a worker takes them as one batch.

use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value};

use super::user_code::UserCode;
use crate::env::fields::{ground_truth, prompt_messages, with_system, FieldResult};
use crate::env::protocol::{Env, Message, Outcome, PendingStep, Step};
use crate::env::EnvConfig;
use crate::locks::lock;
use crate::Result;

pub struct RewardFnEnv {
    code: Arc<UserCode>,
    prompt: Vec<Message>,
    /// `data_source`, `ground_truth`, `extra_info`.
    args: Map<String, Value>,
    source: String,
    outcome: Arc<Mutex<Option<Outcome>>>,
}

impl RewardFnEnv {
    /// Checks the row without calling Python (prompt loading).
    pub fn check_row(row: &Value) -> FieldResult<()> {
        prompt_messages(row).map(|_| ())
    }

    pub fn from_row(code: Arc<UserCode>, row: &Value, source: &str, config: &EnvConfig) -> FieldResult<RewardFnEnv> {
        let field = |k: &str| row.get(k).cloned().unwrap_or(Value::Null);
        let truth = ground_truth(row).map(|(_, v)| v.clone()).unwrap_or_else(|| field("answer"));
        let mut args = Map::new();
        args.insert("data_source".into(), field("data_source"));
        args.insert("ground_truth".into(), truth);
        args.insert("extra_info".into(), field("extra_info"));
        Ok(RewardFnEnv {
            code,
            prompt: with_system(config.system_prompt.as_deref(), prompt_messages(row)?),
            args,
            source: source.to_string(),
            outcome: Arc::new(Mutex::new(None)),
        })
    }
}

/// The outcome of a reward function's checked return (`{"score": x, "extra": {...}}`).
fn scored(value: &Value) -> Outcome {
    let score = value["score"].as_f64().unwrap_or(0.0);
    let extra: Vec<(String, f64)> = value["extra"]
        .as_object()
        .map(|m| m.iter().filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x))).collect())
        .unwrap_or_default();
    let correct = match extra.iter().find(|(k, _)| k == "acc") {
        Some((_, acc)) => *acc != 0.0,
        None => score >= 1.0,
    };
    let mut outcome = Outcome::new(score, correct);
    outcome.metrics.extend(extra);
    outcome
}

impl Env for RewardFnEnv {
    fn initial(&self) -> Vec<Message> {
        self.prompt.clone()
    }

    fn step(&mut self, model_turn: &str) -> Result<Step> {
        self.start_step(model_turn).wait()
    }

    fn start_step(&mut self, model_turn: &str) -> PendingStep {
        if let Some(done) = lock(&self.outcome).clone() {
            return PendingStep::ready(Ok(Step::Done(done)));
        }
        let mut args = self.args.clone();
        args.insert("solution_str".into(), json!(model_turn));
        let mut call = Map::new();
        call.insert("op".into(), json!("score"));
        call.insert("args".into(), Value::Object(args));
        let handle = self.code.pool.call(None, call);
        let (code, source, slot) = (self.code.clone(), self.source.clone(), self.outcome.clone());
        PendingStep::later(move || {
            let outcome = match code.answer(&code.function_label(), &source, handle.wait())? {
                Ok(value) => scored(&value),
                Err(why) => Outcome { user_error: Some(why), ..Outcome::new(0.0, false) },
            };
            *lock(&slot) = Some(outcome.clone());
            Ok(Step::Done(outcome))
        })
    }

    fn max_turns(&self) -> usize {
        1
    }
}
