//! `math`: single-turn problems with a checkable final answer (GSM8K, MATH-style).
//!
//! Row: `prompt` (or `question`) and `answer` (GSM8K's `... #### 42` allowed: the part after
//! the last `####` is the reference).
//! Reply: the final answer is extracted by [`extract_final_answer`] (last `\boxed{}`, else after
//! the last `####`, else after the last `Answer:`) and compared by [`answers_match`] (exact
//! numeric equivalence, else whitespace-normalised string equality).
//! Reward: 1 if it matches; else the format reward (default 0) if an answer was extracted;
//! 0 when the reply gives no final answer.

use serde_json::Value;

use super::answer::{answers_match, extract_final_answer};
use super::env_config::EnvConfig;
use super::fields::{answer, prompt_messages, with_system, FieldResult};
use super::protocol::{Env, Message, Outcome, Step};
use crate::Result;

pub struct MathEnv {
    prompt: Vec<Message>,
    answer: String,
    format_reward: f64,
    outcome: Option<Outcome>,
}

impl MathEnv {
    pub fn from_row(row: &Value, config: &EnvConfig) -> FieldResult<MathEnv> {
        Ok(MathEnv {
            prompt: with_system(config.system_prompt.as_deref(), prompt_messages(row)?),
            answer: answer(row)?,
            format_reward: config.format_reward.unwrap_or(0.0),
            outcome: None,
        })
    }
}

/// The outcome of a reply against a reference answer (shared with `calculator`).
pub fn grade_final_answer(reply: &str, reference: &str, format_reward: f64) -> Outcome {
    let extracted = extract_final_answer(reply);
    let correct = extracted.as_deref().is_some_and(|a| answers_match(a, reference));
    let reward = match (&extracted, correct) {
        (_, true) => 1.0,
        (Some(_), false) => format_reward,
        (None, false) => 0.0,
    };
    Outcome::new(reward, correct).with("extracted", extracted).with("expected", reference)
}

impl Env for MathEnv {
    fn initial(&self) -> Vec<Message> {
        self.prompt.clone()
    }

    fn step(&mut self, model_turn: &str) -> Result<Step> {
        let outcome =
            self.outcome.get_or_insert_with(|| grade_final_answer(model_turn, &self.answer, self.format_reward));
        Ok(Step::Done(outcome.clone()))
    }

    fn max_turns(&self) -> usize {
        1
    }
}
