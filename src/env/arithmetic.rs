//! `arithmetic`: synthetic integer arithmetic ("What is 23 + 58?"), small enough for a tiny
//! model to learn after a short SFT.
//!
//! Row: `prompt` (or `question`) and `answer`, an integer (JSON number or decimal string).
//! Reply: the answer read is the LAST integer in the reply (ASCII digits, with a `-` sign when
//! the `-` directly precedes the digits and does not follow a digit, letter or `)`: in
//! `58-23=35` the answer is 35; in `= -35` it is -35). Thousands separators are not read:
//! the expected format is the bare number.
//! Reward: 1 if that integer equals the answer; else the format reward (default 0) if the
//! whole reply, trimmed, is one integer (the format is right, the value wrong); else 0.
//!
//! Generator ([`generate_arithmetic`]): operands of exactly `digits` digits (0-9 when
//! `digits` is 1), an op drawn uniformly from `ops`; for `-` the larger operand comes first so
//! no answer is negative. Train and eval sets come from separate seeded streams, and eval
//! problems are distinct from each other and from every train problem (held out).

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::env_config::EnvConfig;
use super::fields::{answer, field_error, prompt_messages, with_system, FieldResult};
use super::prompts::PromptRow;
use super::protocol::{Env, Message, Outcome, Step};
use crate::{Error, Result};

pub struct ArithmeticEnv {
    prompt: Vec<Message>,
    answer: i128,
    format_reward: f64,
    outcome: Option<Outcome>,
}

impl ArithmeticEnv {
    pub fn from_row(row: &Value, config: &EnvConfig) -> FieldResult<ArithmeticEnv> {
        let prompt = with_system(config.system_prompt.as_deref(), prompt_messages(row)?);
        let text = answer(row)?;
        let answer =
            text.parse::<i128>().map_err(|_| field_error("answer", format!("must be an integer, got `{text}`")))?;
        Ok(ArithmeticEnv { prompt, answer, format_reward: config.format_reward.unwrap_or(0.0), outcome: None })
    }
}

impl Env for ArithmeticEnv {
    fn initial(&self) -> Vec<Message> {
        self.prompt.clone()
    }

    fn step(&mut self, model_turn: &str) -> Result<Step> {
        let outcome = self.outcome.get_or_insert_with(|| {
            let found = last_integer(model_turn);
            let correct = found == Some(self.answer);
            let well_formed = model_turn.trim().parse::<i128>().is_ok();
            let reward = if correct {
                1.0
            } else if well_formed {
                self.format_reward
            } else {
                0.0
            };
            Outcome::new(reward, correct)
                .with("extracted", found.map(|n| n.to_string()))
                .with("expected", self.answer.to_string())
        });
        Ok(Step::Done(outcome.clone()))
    }

    fn max_turns(&self) -> usize {
        1
    }
}

/// The last integer in `text` (module rules), `None` if there is none or it overflows.
pub fn last_integer(text: &str) -> Option<i128> {
    let chars: Vec<char> = text.chars().collect();
    let mut end = chars.len();
    while end > 0 && !chars[end - 1].is_ascii_digit() {
        end -= 1;
    }
    if end == 0 {
        return None;
    }
    let mut start = end;
    while start > 0 && chars[start - 1].is_ascii_digit() {
        start -= 1;
    }
    let digits: String = chars[start..end].iter().collect();
    let value = digits.parse::<i128>().ok()?;
    let signed = start > 0
        && chars[start - 1] == '-'
        && !(start > 1 && (chars[start - 2].is_alphanumeric() || chars[start - 2] == ')'));
    Some(if signed { -value } else { value })
}

/// What the generator draws.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ArithmeticSpec {
    /// Digits of each operand, 1 to 9. Default 2.
    pub digits: u32,
    /// The operators to draw from, a non-empty string over `+-*`. Default `+-*`.
    pub ops: String,
}

impl Default for ArithmeticSpec {
    fn default() -> Self {
        ArithmeticSpec { digits: 2, ops: "+-*".into() }
    }
}

/// One problem: `a op b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    pub a: i64,
    pub op: char,
    pub b: i64,
}

impl Problem {
    pub fn answer(&self) -> i64 {
        match self.op {
            '+' => self.a + self.b,
            '-' => self.a - self.b,
            _ => self.a * self.b,
        }
    }

    pub fn prompt(&self) -> String {
        format!("What is {} {} {}?", self.a, self.op, self.b)
    }

    /// The row the `arithmetic` env reads (the operands are kept for analysis).
    pub fn to_row(&self, id: &str) -> Value {
        json!({
            "id": id, "env": "arithmetic", "prompt": self.prompt(), "answer": self.answer(),
            "a": self.a, "op": self.op.to_string(), "b": self.b,
        })
    }
}

impl ArithmeticSpec {
    fn check(&self) -> Result<Vec<char>> {
        if !(1..=9).contains(&self.digits) {
            return Err(Error::input(format!("arithmetic: digits must be 1 to 9, got {}", self.digits)));
        }
        let ops: Vec<char> = self.ops.chars().collect();
        if ops.is_empty() || ops.iter().any(|c| !"+-*".contains(*c)) {
            return Err(Error::input(format!(
                "arithmetic: ops must be a non-empty string over `+-*`, got `{}`",
                self.ops
            )));
        }
        Ok(ops)
    }

    fn operand_range(&self) -> (i64, i64) {
        let hi = 10i64.pow(self.digits) - 1;
        let lo = if self.digits == 1 { 0 } else { 10i64.pow(self.digits - 1) };
        (lo, hi)
    }

    /// Number of distinct problems (for `-`, pairs are ordered larger first).
    fn space(&self, ops: &[char]) -> u128 {
        let (lo, hi) = self.operand_range();
        let n = (hi - lo + 1) as u128;
        let distinct: HashSet<&char> = ops.iter().collect();
        distinct.iter().map(|op| if **op == '-' { n * (n + 1) / 2 } else { n * n }).sum()
    }

    fn draw(&self, rng: &mut StdRng, ops: &[char]) -> Problem {
        let (lo, hi) = self.operand_range();
        let (mut a, mut b) = (rng.random_range(lo..=hi), rng.random_range(lo..=hi));
        let op = ops[rng.random_range(0..ops.len())];
        if op == '-' && a < b {
            (a, b) = (b, a);
        }
        Problem { a, op, b }
    }
}

/// Seed offset of the eval stream, so that train and eval never share a random sequence.
const EVAL_STREAM: u64 = 0x9E37_79B9_7F4A_7C15;

/// `n_eval` held-out eval prompts (uids `eval-0`, ...: distinct problems) and `n_train` train
/// prompts (`train-0`, ...: drawn with repetition from the problems not held out),
/// deterministic in `seed` (module rules). The eval set is chosen first, so the train set can
/// be of any size; a space too small to hold out `n_eval` problems and still train is an error.
pub fn generate_arithmetic(
    spec: &ArithmeticSpec,
    n_train: usize,
    n_eval: usize,
    seed: u64,
) -> Result<(Vec<PromptRow>, Vec<PromptRow>)> {
    let ops = spec.check()?;
    let space = spec.space(&ops);
    if n_eval as u128 >= space && n_train > 0 {
        return Err(Error::input(format!(
            "arithmetic: {n_eval} held-out eval problems asked, but there are only {space} distinct problems \
             (some must remain for training)"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed ^ EVAL_STREAM);
    let mut held: HashSet<Problem> = HashSet::new();
    let mut eval = Vec::with_capacity(n_eval);
    // Rejection sampling; when most of the space is taken, fall back to a scan so that the
    // loop always ends.
    let mut misses = 0usize;
    while eval.len() < n_eval && misses < 1000 + 20 * n_eval {
        let p = spec.draw(&mut rng, &ops);
        if held.insert(p) {
            eval.push(p);
        } else {
            misses += 1;
        }
    }
    if eval.len() < n_eval {
        let (lo, hi) = spec.operand_range();
        'scan: for &op in &ops {
            for a in lo..=hi {
                for b in lo..=hi {
                    let p = Problem { a, op, b };
                    if (op != '-' || a >= b) && held.insert(p) {
                        eval.push(p);
                        if eval.len() == n_eval {
                            break 'scan;
                        }
                    }
                }
            }
        }
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut train = Vec::with_capacity(n_train);
    while train.len() < n_train {
        let p = spec.draw(&mut rng, &ops);
        if !held.contains(&p) {
            train.push(p);
        }
    }
    Ok((to_rows(&train, "train", seed), to_rows(&eval, "eval", seed)))
}

/// `n_train` train and `n_eval` eval prompts drawn independently from the same distribution
/// (with repetition): the eval set measures the task, and may repeat train problems. For small
/// problem spaces (one-digit sums: 100 problems), where held-out problems would measure
/// generalisation to unseen table entries rather than mastery of the task.
pub fn sample_arithmetic(
    spec: &ArithmeticSpec,
    n_train: usize,
    n_eval: usize,
    seed: u64,
) -> Result<(Vec<PromptRow>, Vec<PromptRow>)> {
    let ops = spec.check()?;
    let draw = |n: usize, stream: u64| {
        let mut rng = StdRng::seed_from_u64(stream);
        (0..n).map(|_| spec.draw(&mut rng, &ops)).collect::<Vec<_>>()
    };
    Ok((to_rows(&draw(n_train, seed), "train", seed), to_rows(&draw(n_eval, seed ^ EVAL_STREAM), "eval", seed)))
}

fn to_rows(problems: &[Problem], split: &str, seed: u64) -> Vec<PromptRow> {
    problems
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let uid = format!("{split}-{i}");
            PromptRow {
                row: p.to_row(&uid),
                source: format!("generated arithmetic {split} #{i} (seed {seed})"),
                uid,
                env: "arithmetic".into(),
            }
        })
        .collect()
}
