//! Reading the fields an environment needs from a dataset row, with errors that name the field.
//!
//! - prompt: `prompt` (a string, or a list of `{role, content}` messages as in verl-style
//!   datasets), else `question` (a string). A string becomes one `user` message.
//! - answer: `answer`, else the ground truth of verl's `reward_model.ground_truth` or SkyRL's
//!   `reward_spec.ground_truth` ([`ground_truth`]); a string or a number; a GSM8K-style
//!   `... #### 42` keeps what follows the last `####` (see [`super::answer::reference_answer`]).
//! - integers: JSON integers (a float such as `3.0` or a string `"3"` is a type error).

use std::fmt;

use serde_json::Value;

use super::answer::reference_answer;
use super::protocol::Message;

/// A row field that is missing or of the wrong type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "field `{}`: {}", self.field, self.message)
    }
}

pub type FieldResult<T> = std::result::Result<T, FieldError>;

pub fn field_error(field: &str, message: impl Into<String>) -> FieldError {
    FieldError { field: field.to_string(), message: message.into() }
}

fn get<'a>(row: &'a Value, field: &str) -> Option<&'a Value> {
    row.get(field).filter(|v| !v.is_null())
}

/// A short JSON rendering of a value's type, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The prompt as messages (module rules).
pub fn prompt_messages(row: &Value) -> FieldResult<Vec<Message>> {
    if let Some(prompt) = get(row, "prompt") {
        return match prompt {
            Value::String(s) => Ok(vec![Message::user(s.clone())]),
            Value::Array(items) if !items.is_empty() => items
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    serde_json::from_value::<Message>(m.clone()).map_err(|_| {
                        field_error("prompt", format!("message {i} must be an object with string `role` and `content`"))
                    })
                })
                .collect(),
            Value::Array(_) => Err(field_error("prompt", "is an empty list")),
            other => Err(field_error("prompt", format!("must be a string or a list of messages, got {}", kind(other)))),
        };
    }
    match get(row, "question") {
        Some(Value::String(s)) => Ok(vec![Message::user(s.clone())]),
        Some(other) => Err(field_error("question", format!("must be a string, got {}", kind(other)))),
        None => Err(field_error("prompt", "missing (give `prompt` or `question`)")),
    }
}

/// The optional prompt (for envs that can write their own, such as `countdown`).
pub fn optional_prompt_messages(row: &Value) -> FieldResult<Option<Vec<Message>>> {
    if get(row, "prompt").is_none() && get(row, "question").is_none() {
        return Ok(None);
    }
    prompt_messages(row).map(Some)
}

/// The reference answer (module rules).
pub fn answer(row: &Value) -> FieldResult<String> {
    let (field, value) = match get(row, "answer") {
        Some(v) => ("answer", Some(v)),
        None => match ground_truth(row) {
            Some((field, v)) => (field, Some(v)),
            None => ("answer", None),
        },
    };
    let text = match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => return Err(field_error(field, format!("must be a string or a number, got {}", kind(other)))),
        None => return Err(field_error("answer", "missing (give `answer` or `reward_model.ground_truth`)")),
    };
    let reference = reference_answer(&text);
    if reference.is_empty() {
        return Err(field_error(field, "is empty"));
    }
    Ok(reference)
}

/// The ground truth of the ecosystem's RL datasets, with the field it came from: verl's
/// `reward_model.ground_truth`, else SkyRL's `reward_spec.ground_truth`.
pub fn ground_truth(row: &Value) -> Option<(&'static str, &Value)> {
    [("reward_model", "reward_model.ground_truth"), ("reward_spec", "reward_spec.ground_truth")]
        .into_iter()
        .find_map(|(outer, field)| get(row, outer).and_then(|o| get(o, "ground_truth")).map(|v| (field, v)))
}

/// A required JSON integer.
pub fn integer(row: &Value, field: &str) -> FieldResult<i64> {
    match get(row, field) {
        Some(v) => as_integer(v).ok_or_else(|| field_error(field, format!("must be an integer, got {v}"))),
        None => Err(field_error(field, "missing")),
    }
}

/// A required non-empty list of JSON integers.
pub fn integer_list(row: &Value, field: &str) -> FieldResult<Vec<i64>> {
    match get(row, field) {
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                as_integer(v).ok_or_else(|| field_error(field, format!("item {i} must be an integer, got {v}")))
            })
            .collect(),
        Some(Value::Array(_)) => Err(field_error(field, "is an empty list")),
        Some(other) => Err(field_error(field, format!("must be a list of integers, got {}", kind(other)))),
        None => Err(field_error(field, "missing")),
    }
}

fn as_integer(v: &Value) -> Option<i64> {
    v.as_i64()
}

/// Puts the configured system prompt, if any, before messages that do not start with one.
pub fn with_system(system: Option<&str>, mut messages: Vec<Message>) -> Vec<Message> {
    if let Some(system) = system {
        if messages.first().is_none_or(|m| m.role != "system") {
            messages.insert(0, Message::system(system));
        }
    }
    messages
}
