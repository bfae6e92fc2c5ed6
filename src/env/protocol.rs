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
//! The env sees text only. Token budgets are the trainer's: it passes
//! [`EnvConfig::max_turn_tokens`](super::EnvConfig) as the sampler's `max_tokens` and hands a
//! cut-off turn to `step` like any other.

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
}

impl Outcome {
    pub fn new(reward: f64, correct: bool) -> Outcome {
        Outcome { reward, correct, truncated: false, info: serde_json::Map::new() }
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

/// A single- or multi-turn environment for one prompt. Built by [`super::make_env`] from a
/// dataset row; one instance per episode (a group of n samples builds n instances).
pub trait Env: Send {
    /// The first observation: the prompt as chat messages.
    fn initial(&self) -> Vec<Message>;

    /// Takes the text of one model turn (decoded, special tokens removed).
    fn step(&mut self, model_turn: &str) -> Step;

    /// The most model turns an episode can take (1 for single-turn envs).
    fn max_turns(&self) -> usize;

    /// Strings at which the trainer should stop sampling a turn (e.g. the end of a tool call),
    /// besides the tokenizer's end-of-turn tokens. None by default.
    fn stop_strings(&self) -> Vec<String> {
        Vec::new()
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
/// evaluation, or a trainer whose closure also records tokens and log-probs). An env that is not
/// done after `max_turns` steps breaks its contract: that is an error, not a silent cut.
pub fn run_episode<F>(env: &mut dyn Env, mut model: F) -> Result<Transcript>
where
    F: FnMut(&[Message]) -> Result<String>,
{
    let mut messages = env.initial();
    for turn in 1..=env.max_turns() {
        let reply = model(&messages)?;
        messages.push(Message::assistant(reply.clone()));
        match env.step(&reply) {
            Step::Continue { observation } => messages.extend(observation),
            Step::Done(outcome) => return Ok(Transcript { messages, turns: turn, outcome }),
        }
    }
    Err(Error::Other(format!("env not done after its max_turns ({}) steps", env.max_turns())))
}
