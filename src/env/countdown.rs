//! `countdown`: reach a target number from given numbers with `+ - * /` and parentheses.
//!
//! Row: `numbers` (a non-empty list of integers) and `target` (an integer); optional `prompt`
//! (or `question`), else the prompt is written from them ([`countdown_prompt`]).
//! Reply: the expression is the content of the last `<answer>...</answer>` if the reply has
//! one, else the text after the last `Answer:` (any case) up to the end of its line. A trailing
//! `= ...` is dropped (`(3+5)*2 = 16` reads as `(3+5)*2`).
//! Rules: each given number may be used at most once (a number listed twice may be used
//! twice); unused numbers are fine; only integer literals from the list are allowed; arithmetic
//! is exact over rationals, so intermediate fractions are fine (`(7/2)*4` is 14); division by
//! zero makes the expression invalid. Unary minus is accepted.
//! Reward: 1 if the rules hold and the value equals the target; the format reward (default 0.1)
//! for an expression that parses and evaluates but breaks a rule or misses the target; 0 when
//! there is no expression, it does not parse, or it divides by zero.

use serde_json::Value;

use super::env_config::EnvConfig;
use super::expr::{parse, Rational};
use super::fields::{integer, integer_list, optional_prompt_messages, with_system, FieldResult};
use super::protocol::{Env, Message, Outcome, Step};
use crate::Result;

/// Default reward of a well-formed wrong expression.
pub const COUNTDOWN_FORMAT_REWARD: f64 = 0.1;

pub struct CountdownEnv {
    prompt: Vec<Message>,
    numbers: Vec<i64>,
    target: i64,
    format_reward: f64,
    outcome: Option<Outcome>,
}

/// The prompt written for rows without one.
pub fn countdown_prompt(numbers: &[i64], target: i64) -> String {
    let list: Vec<String> = numbers.iter().map(i64::to_string).collect();
    format!(
        "Using the numbers [{}], create an expression that equals {target}. You may use + - * / and \
         parentheses, and each number at most once. Give the expression after \"Answer:\".",
        list.join(", ")
    )
}

impl CountdownEnv {
    pub fn from_row(row: &Value, config: &EnvConfig) -> FieldResult<CountdownEnv> {
        let numbers = integer_list(row, "numbers")?;
        let target = integer(row, "target")?;
        let prompt = match optional_prompt_messages(row)? {
            Some(messages) => messages,
            None => vec![Message::user(countdown_prompt(&numbers, target))],
        };
        Ok(CountdownEnv {
            prompt: with_system(config.system_prompt.as_deref(), prompt),
            numbers,
            target,
            format_reward: config.format_reward.unwrap_or(COUNTDOWN_FORMAT_REWARD),
            outcome: None,
        })
    }
}

impl Env for CountdownEnv {
    fn initial(&self) -> Vec<Message> {
        self.prompt.clone()
    }

    fn step(&mut self, model_turn: &str) -> Result<Step> {
        let outcome = self.outcome.get_or_insert_with(|| {
            let expression = extract_expression(model_turn);
            let verdict = expression.as_deref().map(|e| check_countdown(e, &self.numbers, self.target));
            let reward = match &verdict {
                Some(Verdict::Correct) => 1.0,
                Some(Verdict::Wrong(_)) => self.format_reward,
                Some(Verdict::Invalid(_)) | None => 0.0,
            };
            let why = match &verdict {
                Some(Verdict::Correct) => "correct".to_string(),
                Some(Verdict::Wrong(why) | Verdict::Invalid(why)) => why.clone(),
                None => "no expression found".to_string(),
            };
            Outcome::new(reward, verdict == Some(Verdict::Correct))
                .with("extracted", expression)
                .with("expected", self.target)
                .with("verdict", why)
        });
        Ok(Step::Done(outcome.clone()))
    }

    fn max_turns(&self) -> usize {
        1
    }
}

/// The expression of a reply (module rules), `None` when there is none.
pub fn extract_expression(reply: &str) -> Option<String> {
    let raw = if let Some(start) = reply.rfind("<answer>") {
        let inner = &reply[start + "<answer>".len()..];
        inner.find("</answer>").map(|end| &inner[..end])?
    } else {
        let lower = reply.to_ascii_lowercase();
        let start = lower.rfind("answer:")? + "answer:".len();
        reply[start..].lines().next().unwrap_or("")
    };
    let expr = raw.split('=').next().unwrap_or("").trim();
    (!expr.is_empty()).then(|| expr.to_string())
}

/// The result of checking an expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Correct,
    /// Well-formed, but breaks a rule or misses the target (why).
    Wrong(String),
    /// Does not parse or cannot be evaluated (why).
    Invalid(String),
}

/// Checks an expression against the numbers and target (module rules).
pub fn check_countdown(expression: &str, numbers: &[i64], target: i64) -> Verdict {
    let expr = match parse(expression) {
        Ok(e) => e,
        Err(e) => return Verdict::Invalid(e.to_string()),
    };
    let value = match expr.eval() {
        Ok(v) => v,
        Err(e) => return Verdict::Invalid(e.to_string()),
    };
    let mut unused: Vec<Rational> = numbers.iter().map(|&n| Rational::integer(n.into())).collect();
    for used in expr.numbers() {
        match unused.iter().position(|&n| n == used) {
            Some(i) => {
                unused.swap_remove(i);
            }
            None => return Verdict::Wrong(format!("uses {used}, which is not an unused given number")),
        }
    }
    if value == Rational::integer(target.into()) {
        Verdict::Correct
    } else {
        Verdict::Wrong(format!("evaluates to {value}, not {target}"))
    }
}
