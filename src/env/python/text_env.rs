//! A multi-turn environment written in Python in SkyRL-gym's text-env shape, one instance per
//! episode living in the worker pool.
//!
//! ```text
//! class MyEnv:                       # named by the row's `env_class`
//!     def __init__(self, env_config, extras)      # extras: the row (also `(row)` or `()`)
//!     def init(self, prompt) -> (messages, info)  # optional: the prompt as given by default
//!     def step(self, action: str) -> {"observations": [messages], "reward": float,
//!                                     "done": bool, "metadata": {...}}
//!     def close(self)                              # optional
//! ```
//! The episode's reward is the sum of its steps' rewards; `correct` is the last step's
//! `metadata["acc"]` when given (non-zero is correct), else reward ≥ 1. Observations are chat
//! messages, rendered by the model's chat template as the built-in calculator's tool results
//! are. The trainer ends an episode that is not done after `env.max_turns` model turns
//! ([`Env::at_turn_limit`]: truncated, with the rewards so far). Every step call carries what
//! rebuilds the instance (class, row, prompt, earlier actions), so a worker restarted mid-episode
//! replays it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Map, Value};

use super::user_code::UserCode;
use crate::env::fields::{prompt_messages, with_system, FieldResult};
use crate::env::protocol::{messages_to_json, Env, Message, Outcome, PendingStep, Step};
use crate::env::EnvConfig;
use crate::locks::lock;
use crate::{Error, Result};

pub struct PythonTextEnv {
    code: Arc<UserCode>,
    class: String,
    source: String,
    instance: u64,
    worker: usize,
    /// The call fields that rebuild the instance: class, row, prompt.
    rebuild: Map<String, Value>,
    initial: Vec<Message>,
    max_turns: usize,
    state: Arc<Mutex<EpisodeState>>,
}

#[derive(Default)]
struct EpisodeState {
    /// The actions taken, in order (replayed by a restarted worker).
    history: Vec<String>,
    reward: f64,
    /// The last step's numeric metadata.
    metrics: BTreeMap<String, f64>,
    outcome: Option<Outcome>,
    closed: bool,
}

impl PythonTextEnv {
    /// Checks the row without calling Python (prompt loading).
    pub fn check_row(row: &Value) -> FieldResult<()> {
        prompt_messages(row).map(|_| ())
    }

    /// A new instance of `class` for one episode of `row`: created and `init`-ed in the pool.
    pub fn start(code: Arc<UserCode>, class: &str, row: &Value, source: &str, config: &EnvConfig) -> Result<Self> {
        let prompt = with_system(config.system_prompt.as_deref(), prompt_messages(row).map_err(field_error(class))?);
        let (instance, worker) = code.pool.new_instance();
        let mut rebuild = Map::new();
        rebuild.insert("class".into(), json!(class));
        rebuild.insert("row".into(), row.clone());
        rebuild.insert("prompt".into(), json!(messages_to_json(&prompt)));
        let mut env = PythonTextEnv {
            code,
            class: class.to_string(),
            source: source.to_string(),
            instance,
            worker,
            rebuild,
            initial: prompt,
            max_turns: config.max_turns.max(1),
            state: Arc::new(Mutex::new(EpisodeState::default())),
        };
        let mut call = env.call("env_init");
        call.extend(env.rebuild.clone());
        let result = env.code.pool.call(Some(worker), call).wait();
        match env.code.answer(&env.label("init"), source, result)? {
            Ok(v) => env.initial = parse_messages(&v["messages"]).ok_or_else(|| env.bad("init() messages"))?,
            // Scored 0: the episode runs on the row's prompt and ends at its first step.
            Err(why) => lock(&env.state).outcome = Some(failed(why)),
        }
        Ok(env)
    }

    fn label(&self, method: &str) -> String {
        format!("env class `{}` ({method})", self.class)
    }

    fn bad(&self, what: &str) -> Error {
        Error::UserCode(format!("{}: bad {what} for row {}", self.label("init"), self.source))
    }

    fn call(&self, op: &str) -> Map<String, Value> {
        let mut call = Map::new();
        call.insert("op".into(), json!(op));
        call.insert("instance".into(), json!(self.instance));
        call
    }

    fn close(&self, state: &mut EpisodeState) {
        if !state.closed {
            state.closed = true;
            drop(self.code.pool.call(Some(self.worker), self.call("env_close")));
        }
    }
}

fn field_error(class: &str) -> impl Fn(crate::env::fields::FieldError) -> Error + '_ {
    move |e| Error::input(format!("env `{class}`: {e}"))
}

fn failed(why: String) -> Outcome {
    Outcome { user_error: Some(why), ..Outcome::new(0.0, false) }
}

fn parse_messages(v: &Value) -> Option<Vec<Message>> {
    serde_json::from_value(v.clone()).ok()
}

/// The outcome of an episode with `reward` summed over its steps (module rules).
fn outcome(state: &EpisodeState, truncated: bool) -> Outcome {
    let correct = match state.metrics.get("acc") {
        Some(acc) => *acc != 0.0,
        None => state.reward >= 1.0,
    };
    let mut o = Outcome::new(state.reward, correct).with("turns", state.history.len());
    o.truncated = truncated;
    o.metrics = state.metrics.clone();
    o
}

impl Env for PythonTextEnv {
    fn initial(&self) -> Vec<Message> {
        self.initial.clone()
    }

    fn step(&mut self, model_turn: &str) -> Result<Step> {
        self.start_step(model_turn).wait()
    }

    fn start_step(&mut self, model_turn: &str) -> PendingStep {
        let mut st = lock(&self.state);
        if let Some(done) = st.outcome.clone() {
            self.close(&mut st);
            return PendingStep::ready(Ok(Step::Done(done)));
        }
        let mut call = self.call("env_step");
        call.extend(self.rebuild.clone());
        call.insert("history".into(), json!(st.history));
        call.insert("action".into(), json!(model_turn));
        st.history.push(model_turn.to_string());
        drop(st);
        let handle = self.code.pool.call(Some(self.worker), call);
        let (code, state, label, source) =
            (self.code.clone(), self.state.clone(), self.label("step"), self.source.clone());
        let close = self.call("env_close");
        let worker = self.worker;
        PendingStep::later(move || {
            let answer = code.answer(&label, &source, handle.wait())?;
            let mut st = lock(&state);
            let v = match answer {
                Ok(v) => v,
                Err(why) => {
                    st.outcome = Some(failed(why));
                    return Ok(Step::Done(st.outcome.clone().unwrap_or_else(|| Outcome::new(0.0, false))));
                }
            };
            st.reward += v["reward"].as_f64().unwrap_or(0.0);
            st.metrics = (v["metadata"].as_object().into_iter().flatten())
                .filter_map(|(k, x)| x.as_f64().or_else(|| x.as_bool().map(f64::from)).map(|x| (k.clone(), x)))
                .collect();
            if v["done"].as_bool().unwrap_or(false) {
                let done = outcome(&st, false);
                st.outcome = Some(done.clone());
                if !st.closed {
                    st.closed = true;
                    drop(code.pool.call(Some(worker), close));
                }
                return Ok(Step::Done(done));
            }
            let observation = parse_messages(&v["observations"])
                .ok_or_else(|| Error::UserCode(format!("{label}: bad observations for row {source}")))?;
            Ok(Step::Continue { observation })
        })
    }

    fn max_turns(&self) -> usize {
        self.max_turns
    }

    fn at_turn_limit(&mut self) -> Option<Outcome> {
        let mut st = lock(&self.state);
        let done = outcome(&st, true);
        st.outcome = Some(done.clone());
        self.close(&mut st);
        Some(done)
    }
}

impl Drop for PythonTextEnv {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        self.close(&mut st);
    }
}
