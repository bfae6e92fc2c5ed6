//! `calculator`: a multi-turn tool environment; the model may call a calculator before it
//! answers a math question.
//!
//! Row: as `math` (`prompt` or `question`, and `answer`).
//! A model turn is read in this order:
//! 1. If it gives a final answer (`\boxed{}`, `####` or `Answer:`, see [`super::answer`]), the
//!    episode ends and is graded like `math` (1 if right, else the format reward, default 0).
//! 2. Else, each `<calc>EXPR</calc>` in it (at most [`MAX_CALLS_PER_TURN`]) is evaluated with
//!    the countdown expression parser (exact rationals; a result prints as `7` or `7/2`; an
//!    error as `error: ...`), and the env replies with one message of role
//!    [`EnvConfig::tool_role`] holding `<result>VALUE</result>` per call, one per line. A
//!    `<calc>` left open at the end of the turn counts as a call up to the end of the text, so
//!    the trainer may stop sampling at `</calc>` ([`Env::stop_strings`]) whether or not the
//!    sampler keeps the stop string.
//! 3. A turn with neither ends the episode with reward 0 (no answer).
//!
//! The turn limit is `max_turns` of the config (at least 1): a tool call on the last allowed
//! turn ends the episode with `truncated = true` and reward 0 (no answer, no partial credit).
//! Unless the config sets a system prompt (or the row's prompt starts with its own system
//! message), [`CALCULATOR_SYSTEM_PROMPT`] explains the tool.

use serde_json::Value;

use super::answer::extract_final_answer;
use super::env_config::EnvConfig;
use super::expr::evaluate;
use super::fields::{answer, prompt_messages, with_system, FieldResult};
use super::math::grade_final_answer;
use super::protocol::{Env, Message, Outcome, Step};
use crate::Result;

/// Tool calls evaluated per turn; more are ignored (a reply that spams calls gains nothing).
pub const MAX_CALLS_PER_TURN: usize = 8;

/// The default system prompt: how to call the tool and how to answer.
pub const CALCULATOR_SYSTEM_PROMPT: &str = "You can use a calculator. To compute an expression with + - * / and \
parentheses, write <calc>EXPRESSION</calc> and stop; the result comes back as <result>VALUE</result>. When you \
know the answer, write \"Answer: \" followed by the number.";

pub struct CalculatorEnv {
    prompt: Vec<Message>,
    answer: String,
    format_reward: f64,
    max_turns: usize,
    tool_role: String,
    turns: usize,
    outcome: Option<Outcome>,
}

impl CalculatorEnv {
    pub fn from_row(row: &Value, config: &EnvConfig) -> FieldResult<CalculatorEnv> {
        let system = config.system_prompt.as_deref().unwrap_or(CALCULATOR_SYSTEM_PROMPT);
        Ok(CalculatorEnv {
            prompt: with_system(Some(system), prompt_messages(row)?),
            answer: answer(row)?,
            format_reward: config.format_reward.unwrap_or(0.0),
            max_turns: config.max_turns.max(1),
            tool_role: config.tool_role.clone(),
            turns: 0,
            outcome: None,
        })
    }

    /// Model turns taken so far.
    pub fn turns(&self) -> usize {
        self.turns
    }
}

/// The expressions of the `<calc>` calls in a turn (module rules).
pub fn calc_calls(turn: &str) -> Vec<String> {
    let mut calls = Vec::new();
    let mut rest = turn;
    while let Some(start) = rest.find("<calc>") {
        let after = &rest[start + "<calc>".len()..];
        match after.find("</calc>") {
            Some(end) => {
                calls.push(after[..end].trim().to_string());
                rest = &after[end + "</calc>".len()..];
            }
            None => {
                calls.push(after.trim().to_string());
                break;
            }
        }
    }
    calls
}

/// The tool's reply to one expression.
pub fn calc_result(expression: &str) -> String {
    match evaluate(expression) {
        Ok(value) => format!("<result>{value}</result>"),
        Err(e) => format!("<result>error: {e}</result>"),
    }
}

impl CalculatorEnv {
    fn finish(&mut self, outcome: Outcome) -> Step {
        self.outcome = Some(outcome.clone());
        Step::Done(outcome)
    }
}

impl Env for CalculatorEnv {
    fn initial(&self) -> Vec<Message> {
        self.prompt.clone()
    }

    fn step(&mut self, model_turn: &str) -> Result<Step> {
        if let Some(outcome) = &self.outcome {
            return Ok(Step::Done(outcome.clone()));
        }
        self.turns += 1;
        if extract_final_answer(model_turn).is_some() {
            let outcome = grade_final_answer(model_turn, &self.answer, self.format_reward).with("turns", self.turns);
            return Ok(self.finish(outcome));
        }
        let calls = calc_calls(model_turn);
        if calls.is_empty() {
            let outcome = Outcome::new(0.0, false)
                .with("expected", self.answer.as_str())
                .with("turns", self.turns)
                .with("verdict", "no tool call and no final answer");
            return Ok(self.finish(outcome));
        }
        if self.turns >= self.max_turns {
            let mut outcome = Outcome::new(0.0, false)
                .with("expected", self.answer.as_str())
                .with("turns", self.turns)
                .with("verdict", "turn limit reached without a final answer");
            outcome.truncated = true;
            return Ok(self.finish(outcome));
        }
        let results: Vec<String> = calls.iter().take(MAX_CALLS_PER_TURN).map(|c| calc_result(c)).collect();
        Ok(Step::Continue { observation: vec![Message::new(self.tool_role.clone(), results.join("\n"))] })
    }

    fn max_turns(&self) -> usize {
        self.max_turns
    }

    fn stop_strings(&self) -> Vec<String> {
        vec!["</calc>".to_string()]
    }
}
