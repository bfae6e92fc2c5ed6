//! The environment protocol: chat messages in, model turns (text) out, a reward at the end.
//!
//! An episode: the trainer renders [`Env::initial`] with the chat template and samples a model
//! turn; [`Env::step`] takes the turn's text and answers either [`Step::Continue`] with the next
//! observation (messages the trainer appends after the assistant turn, e.g. a tool result) or
//! [`Step::Done`] with the [`Outcome`]. Single-turn envs are done after their first step.
//!
//! Rules every env keeps:
//! - It is done at the latest on its [`Env::max_turns`]-th step. A multi-turn env that reaches
//!   the limit without a final answer ends with `truncated = true` and the reward of an episode
//!   without an answer (0 for the built-ins): there is no partial credit for unfinished work.
//! - A malformed or empty turn is a low reward (0 for the built-ins), never an error or panic.
//! - A step after `Done` repeats the same outcome (a caller bug, answered harmlessly).
//!
//! Envs whose code runs elsewhere (the user's Python, [`super::python`]) fail with an error
//! rather than a low reward when that code fails, answer [`Env::start_step`] without waiting
//! (the trainer starts every episode's step of a round before waiting for any, so they run as
//! one batch), and cannot be trusted to end: the trainer ends them at their turn limit
//! ([`Env::at_turn_limit`]).
//!
//! The env sees text only. Token budgets are the trainer's: it passes
//! [`EnvConfig::max_turn_tokens`](super::EnvConfig) as the sampler's `max_tokens` and hands a
//! cut-off turn to `step` like any other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Error, Result};

/// One chat message, as chat templates take them (`{"role": ..., "content": ...}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into() }
    }
    pub fn system(content: impl Into<String>) -> Message {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new("assistant", content)
    }

    /// The JSON object that `ChatTemplate::render` and `rollout::chat` take.
    pub fn to_json(&self) -> Value {
        serde_json::json!({"role": self.role, "content": self.content})
    }
}

/// Messages as the JSON values that `ChatTemplate::render` and `rollout::chat` take.
pub fn messages_to_json(messages: &[Message]) -> Vec<Value> {
    messages.iter().map(Message::to_json).collect()
}

/// How an episode ended.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outcome {
    /// The episode's reward (the trainer's score for advantages).
    pub reward: f64,
    /// Whether the final answer was right, apart from any format reward (eval accuracy).
    pub correct: bool,
    /// Ended by the turn limit rather than by an answer.
    pub truncated: bool,
    /// Details for logs: e.g. `extracted` (the answer read from the reply) and `expected`.
    pub info: serde_json::Map<String, Value>,
    /// Numbers the trainer logs as per-step means (a reward function's extra keys).
    pub metrics: BTreeMap<String, f64>,
    /// The user's code failed and `reward.on_error = "zero"` scored the episode 0: why.
    pub user_error: Option<String>,
}

impl Outcome {
    pub fn new(reward: f64, correct: bool) -> Outcome {
        Outcome {
            reward,
            correct,
            truncated: false,
            info: serde_json::Map::new(),
            metrics: BTreeMap::new(),
            user_error: None,
        }
    }

    /// Adds a detail for logs.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Outcome {
        self.info.insert(key.to_string(), value.into());
        self
    }
}

/// What the env answers to a model turn.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The episode goes on: append these messages (after the assistant turn) and sample again.
    Continue {
        observation: Vec<Message>,
    },
    Done(Outcome),
}

/// A step that may still be running elsewhere: [`PendingStep::wait`] for its answer.
pub enum PendingStep {
    Ready(Result<Step>),
    Later(Box<dyn FnOnce() -> Result<Step> + Send>),
}

impl PendingStep {
    pub fn ready(step: Result<Step>) -> PendingStep {
        PendingStep::Ready(step)
    }

    /// A step answered by `wait` (e.g. waiting on a call in flight).
    pub fn later(wait: impl FnOnce() -> Result<Step> + Send + 'static) -> PendingStep {
        PendingStep::Later(Box::new(wait))
    }

    pub fn is_ready(&self) -> bool {
        matches!(self, PendingStep::Ready(_))
    }

    pub fn wait(self) -> Result<Step> {
        match self {
            PendingStep::Ready(step) => step,
            PendingStep::Later(wait) => wait(),
        }
    }
}

/// A single- or multi-turn environment for one prompt. Built from a dataset row by
/// [`super::make_env`] (the built-ins) or an [`super::EnvFactory`]; one instance per episode (a
/// group of n samples builds n instances).
pub trait Env: Send {
    /// The first observation: the prompt as chat messages.
    fn initial(&self) -> Vec<Message>;

    /// Takes the text of one model turn (decoded, special tokens removed). An error is the
    /// env's own failure (the user's code raised), never the model's: a bad turn is a low reward.
    fn step(&mut self, model_turn: &str) -> Result<Step>;

    /// Starts [`Env::step`] and answers later; by default it steps at once.
    fn start_step(&mut self, model_turn: &str) -> PendingStep {
        PendingStep::ready(self.step(model_turn))
    }

    /// The most model turns an episode can take (1 for single-turn envs).
    fn max_turns(&self) -> usize;

    /// Strings at which the trainer should stop sampling a turn (e.g. the end of a tool call),
    /// besides the tokenizer's end-of-turn tokens. None by default.
    fn stop_strings(&self) -> Vec<String> {
        Vec::new()
    }

    /// The outcome of an episode the trainer ends at [`Env::max_turns`] because the env did not.
    /// `None` (the default, every built-in) means the env promised to end itself: not ending is
    /// a broken contract and an error naming the env.
    fn at_turn_limit(&mut self) -> Option<Outcome> {
        None
    }
}

/// A whole episode as text: the conversation (initial messages, then each assistant turn and
/// each observation) and the outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Transcript {
    pub messages: Vec<Message>,
    /// Number of model turns taken.
    pub turns: usize,
    pub outcome: Outcome,
}

/// Runs an episode with `model` producing each turn from the conversation so far (for tests,
/// evaluation, or a trainer whose closure also records tokens and log-probs). An env still
/// going after `max_turns` steps ends there if it leaves that to its caller
/// ([`Env::at_turn_limit`]); otherwise it broke its contract: an error, not a silent cut.
pub fn run_episode<F>(env: &mut dyn Env, mut model: F) -> Result<Transcript>
where
    F: FnMut(&[Message]) -> Result<String>,
{
    let mut messages = env.initial();
    for turn in 1..=env.max_turns() {
        let reply = model(&messages)?;
        messages.push(Message::assistant(reply.clone()));
        match env.start_step(&reply).wait()? {
            Step::Continue { observation } => messages.extend(observation),
            Step::Done(outcome) => return Ok(Transcript { messages, turns: turn, outcome }),
        }
    }
    match env.at_turn_limit() {
        Some(outcome) => Ok(Transcript { messages, turns: env.max_turns(), outcome }),
        None => Err(Error::Other(format!("env not done after its max_turns ({}) steps", env.max_turns()))),
    }
}
