//! The SFT dataset: rows → conversations → tokenized examples with loss weights.
//!
//! Rows ([`rows`](crate::rows)) are one of:
//! - chat: `messages`, a list of `{role, content}` with roles `system`, `user`, `assistant`,
//!   `tool` (other keys such as `tool_calls`, `name`, `tool_call_id` are kept for the template;
//!   null-valued keys are dropped, since Parquet structs give every message every key and a
//!   template's `is defined` would see them), and optionally `tools` (JSON tool schemas). Either
//!   may be a JSON string holding the list, as many Parquet datasets store them.
//! - instruction: `instruction`, optional `input`, `output` (and optional `system`), turned into
//!   `[system,] user, assistant` with the user message `instruction` or, when `input` is not
//!   empty, `instruction + "\n\n" + input` (the Alpaca convention).
//!
//! Each conversation is tokenized with the model's chat template and its trained tokens marked
//! ([`chat_mask`](super::chat_mask)), cut to `max_length` tokens, and shifted into an example:
//! `input_tokens = tokens[..n-1]`, `target_tokens = tokens[1..]`, `weights[t] = 1` when token
//! `t + 1` is trained, else 0. A row whose trained tokens all fall past `max_length` is dropped
//! and counted. Weights are 0/1 here; the SFT loop scales them to a token mean per batch
//! ([`token_mean_datums`]).
//!
//! The eval set is `eval_file`, or else `eval_fraction` of the well-formed training rows, chosen
//! by a permutation seeded with `shuffle_seed` (so the split is reproducible): oxrl's one eval
//! split, [`split_eval`] (in [`crate::trainer::eval_split`]).
//!
//! A malformed row (bad JSON, missing or mistyped fields, a role the template rejects) is an
//! error naming its file and line (row for Parquet), or with `on_bad_row = "skip"` a warning and
//! a count. A template that is not prefix-stable stops the run whatever `on_bad_row` says: it
//! would reject every row.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::model::tokenizer::Tokenizer;
use crate::rows::{read_rows, OnBadRow, RawRow, RowLocation};
use crate::trainer::sft::chat_mask::{tokenize_conversation, MaskError, MaskedTokens};
use crate::trainer::sft::config::{DataSection, TrainOn};

/// The eval split of oxrl, defined in [`crate::trainer::eval_split`]; re-exported where SFT used to own it.
pub use crate::trainer::eval_split::split_eval;

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
/// Skipped rows beyond this many are counted but not printed one by one.
const MAX_WARNINGS: usize = 10;

/// A conversation ready for the chat template.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
}

/// One training sequence in the worker's layout (`Datum`): three vectors of the same length.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SftExample {
    pub input_tokens: Vec<u32>,
    pub target_tokens: Vec<u32>,
    /// 1.0 where the target token is trained, else 0.0.
    pub weights: Vec<f32>,
}

impl SftExample {
    /// Shifts a masked token sequence cut to `max_length` tokens; `None` if no trained target is
    /// left (or fewer than two tokens).
    pub fn from_masked(masked: &MaskedTokens, max_length: usize) -> Option<SftExample> {
        let n = masked.tokens.len().min(max_length);
        if n < 2 {
            return None;
        }
        let weights: Vec<f32> = masked.trained[1..n].iter().map(|&t| if t { 1.0 } else { 0.0 }).collect();
        if !weights.iter().any(|&w| w > 0.0) {
            return None;
        }
        Some(SftExample {
            input_tokens: masked.tokens[..n - 1].to_vec(),
            target_tokens: masked.tokens[1..n].to_vec(),
            weights,
        })
    }

    /// Number of trained target tokens.
    pub fn num_trained(&self) -> usize {
        self.weights.iter().filter(|&&w| w > 0.0).count()
    }

    /// The worker's datum (`target_tokens` and `weights` as loss inputs).
    pub fn to_datum(&self) -> crate::worker::batch::Datum {
        crate::worker::batch::Datum::supervised(
            self.input_tokens.clone(),
            self.target_tokens.clone(),
            self.weights.clone(),
        )
    }
}

/// What happened to the rows of one split.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DataStats {
    /// Rows read (blank JSONL lines excluded).
    pub rows: usize,
    /// Malformed rows skipped (`on_bad_row = "skip"`).
    pub bad_rows: usize,
    /// Well-formed rows longer than `max_length` that were cut and kept.
    pub truncated: usize,
    /// Rows cut by `max_length` that lost every trained token, so were dropped.
    pub dropped_by_truncation: usize,
    /// Examples kept.
    pub examples: usize,
    /// Trained target tokens over the kept examples.
    pub trained_tokens: usize,
    /// All input tokens over the kept examples.
    pub tokens: usize,
}

impl std::fmt::Display for DataStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} examples, {} trained of {} tokens ({} rows: {} malformed and skipped, {} truncated, {} dropped as truncation left nothing to train)",
            self.examples, self.trained_tokens, self.tokens, self.rows, self.bad_rows, self.truncated, self.dropped_by_truncation
        )
    }
}

/// The train and eval examples of a run, and how the rows fared.
#[derive(Clone, Debug, Default)]
pub struct SftDataset {
    pub train: Vec<SftExample>,
    pub eval: Vec<SftExample>,
    pub train_stats: DataStats,
    pub eval_stats: DataStats,
}

/// Reads `[data]`'s files and tokenizes them with `tokenizer`'s chat template.
pub fn load_sft_dataset(cfg: &DataSection, tokenizer: &Tokenizer) -> Result<SftDataset> {
    let mut train_stats = DataStats::default();
    let train_rows = read_rows(&cfg.train_file)?;
    let train_convs = parse_rows(train_rows, cfg.on_bad_row, &mut train_stats)?;

    let mut eval_stats = DataStats::default();
    let (train_convs, eval_convs) = if !cfg.eval_file.as_os_str().is_empty() {
        let eval_rows = read_rows(&cfg.eval_file)?;
        (train_convs, parse_rows(eval_rows, cfg.on_bad_row, &mut eval_stats)?)
    } else {
        let (train, eval) = split_eval(train_convs, cfg.eval_fraction, cfg.shuffle_seed);
        eval_stats.rows = eval.len();
        train_stats.rows -= eval.len();
        (train, eval)
    };

    let train = tokenize_all(&train_convs, tokenizer, cfg, &mut train_stats)?;
    let eval = tokenize_all(&eval_convs, tokenizer, cfg, &mut eval_stats)?;
    if train.is_empty() {
        return Err(Error::file(
            &cfg.train_file,
            format!(
                "no training example left: {} rows, {} malformed, {} dropped by max_length = {}",
                train_stats.rows, train_stats.bad_rows, train_stats.dropped_by_truncation, cfg.max_length
            ),
        ));
    }
    Ok(SftDataset { train, eval, train_stats, eval_stats })
}

/// Parses rows into conversations, applying `on_bad_row` to the malformed ones. Each kept
/// conversation carries its location for later (tokenization) errors.
pub fn parse_rows(
    rows: Vec<RawRow>,
    on_bad_row: OnBadRow,
    stats: &mut DataStats,
) -> Result<Vec<(RowLocation, Conversation)>> {
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        stats.rows += 1;
        let parsed = row.value.and_then(|v| parse_row(&v));
        match parsed {
            Ok(conv) => out.push((row.location, conv)),
            Err(message) => bad_row(&row.location, &message, on_bad_row, stats)?,
        }
    }
    Ok(out)
}

/// Tokenizes conversations into examples; template errors stop, row errors follow `on_bad_row`.
/// Rendering and tokenizing run in parallel (rayon); the outcomes are then taken in row order,
/// so warnings, errors and the example order do not depend on the thread count.
pub fn tokenize_all(
    convs: &[(RowLocation, Conversation)],
    tokenizer: &Tokenizer,
    cfg: &DataSection,
    stats: &mut DataStats,
) -> Result<Vec<SftExample>> {
    use rayon::prelude::*;
    let masked: Vec<_> = convs
        .par_iter()
        .map(|(_, conv)| tokenize_conversation(tokenizer, &conv.messages, conv.tools.as_ref(), cfg.train_on))
        .collect();
    let mut out = Vec::with_capacity(convs.len());
    for ((location, _), masked) in convs.iter().zip(masked) {
        let masked = match masked {
            Ok(m) => m,
            Err(MaskError::Template(e)) => return Err(Error::input(format!("{location}: {e}"))),
            Err(MaskError::Row(e)) => {
                bad_row(location, &e.to_string(), cfg.on_bad_row, stats)?;
                continue;
            }
        };
        let cut = masked.tokens.len() > cfg.max_length;
        match SftExample::from_masked(&masked, cfg.max_length) {
            Some(ex) => {
                stats.truncated += usize::from(cut);
                stats.examples += 1;
                stats.trained_tokens += ex.num_trained();
                stats.tokens += ex.input_tokens.len();
                out.push(ex);
            }
            None => stats.dropped_by_truncation += 1,
        }
    }
    Ok(out)
}

/// The batch as worker datums with weights scaled to a token mean: each trained token weighs
/// `1 / (trained tokens in the whole batch)`, so the worker's plain sum is the mean NLL over the
/// batch's trained tokens however the batch is later split into micro-batches or ranks.
pub fn token_mean_datums(batch: &[SftExample]) -> Vec<crate::worker::batch::Datum> {
    let total: usize = batch.iter().map(SftExample::num_trained).sum();
    let scale = if total == 0 { 0.0 } else { 1.0 / total as f32 };
    batch
        .iter()
        .map(|ex| {
            let weights = ex.weights.iter().map(|w| w * scale).collect();
            crate::worker::batch::Datum::supervised(ex.input_tokens.clone(), ex.target_tokens.clone(), weights)
        })
        .collect()
}

/// One row's conversation, or what is wrong with it.
pub fn parse_row(row: &Value) -> std::result::Result<Conversation, String> {
    let obj = row.as_object().ok_or("expected a JSON object")?;
    if let Some(messages) = obj.get("messages") {
        let messages = parse_messages(messages)?;
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(decode_json_string(s, "tools")?),
            Some(v) => Some(v.clone()),
        };
        if let Some(t) = &tools {
            if !t.is_array() {
                return Err("`tools` must be a list of tool schemas".into());
            }
        }
        return Ok(Conversation { messages, tools });
    }
    if obj.contains_key("instruction") || obj.contains_key("output") {
        return parse_instruction(obj);
    }
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    Err(format!(
        "expected a chat row (`messages`) or an instruction row (`instruction`, `input`, `output`); found keys: {}",
        if keys.is_empty() { "none".to_string() } else { keys.join(", ") }
    ))
}

fn parse_messages(value: &Value) -> std::result::Result<Vec<Value>, String> {
    let decoded;
    let value = match value {
        Value::String(s) => {
            decoded = decode_json_string(s, "messages")?;
            &decoded
        }
        v => v,
    };
    let list = value.as_array().ok_or("`messages` must be a list of {role, content} objects")?;
    if list.is_empty() {
        return Err("`messages` is empty".into());
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let m = m.as_object().ok_or_else(|| format!("messages[{i}]: expected an object"))?;
        // Parquet structs carry every field on every message; absent is what templates expect.
        let m: Map<String, Value> =
            m.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        let role = match m.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(_) => return Err(format!("messages[{i}].role: expected a string")),
            None => return Err(format!("messages[{i}]: missing `role`")),
        };
        if !ROLES.contains(&role) {
            return Err(format!("messages[{i}].role: `{role}` is not one of {}", ROLES.join(", ")));
        }
        match m.get("content") {
            Some(Value::String(_)) => {}
            // An assistant turn that only calls tools may have no content.
            None if role == "assistant" && m.contains_key("tool_calls") => {}
            None => return Err(format!("messages[{i}]: missing `content`")),
            // Multimodal parts (an image, a video: Qwen3.5's vision-language format) are named:
            // oxrl trains the language model only.
            Some(Value::Array(parts)) => {
                let kind = |p: &Value| p.get("type").and_then(Value::as_str).unwrap_or("untyped").to_string();
                let kinds: Vec<String> = parts.iter().map(kind).filter(|k| k != "text").collect();
                return Err(match kinds.first() {
                    Some(k) => format!(
                        "messages[{i}].content: a `{k}` part: multimodal input is not supported (oxrl trains \
                         text models; a vision-language checkpoint's vision tower is left aside)"
                    ),
                    None => format!("messages[{i}].content: expected a string, not a list of text parts"),
                });
            }
            Some(_) => return Err(format!("messages[{i}].content: expected a string")),
        }
        out.push(Value::Object(m));
    }
    if !out.iter().any(|m| m["role"] == "assistant") {
        return Err("no assistant message: nothing to train on".into());
    }
    Ok(out)
}

fn parse_instruction(obj: &Map<String, Value>) -> std::result::Result<Conversation, String> {
    let text = |key: &str, required: bool| -> std::result::Result<String, String> {
        match obj.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            None | Some(Value::Null) if !required => Ok(String::new()),
            None | Some(Value::Null) => Err(format!("instruction row: missing `{key}`")),
            Some(_) => Err(format!("instruction row: `{key}` must be a string")),
        }
    };
    let instruction = text("instruction", true)?;
    let input = text("input", false)?;
    let output = text("output", true)?;
    let system = text("system", false)?;
    let user = if input.trim().is_empty() { instruction } else { format!("{instruction}\n\n{input}") };
    let mut messages = Vec::new();
    if !system.is_empty() {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    messages.push(serde_json::json!({"role": "user", "content": user}));
    messages.push(serde_json::json!({"role": "assistant", "content": output}));
    Ok(Conversation { messages, tools: None })
}

fn decode_json_string(s: &str, field: &str) -> std::result::Result<Value, String> {
    serde_json::from_str(s).map_err(|e| format!("`{field}` is a string but not valid JSON: {e}"))
}

fn bad_row(location: &RowLocation, message: &str, policy: OnBadRow, stats: &mut DataStats) -> Result<()> {
    match policy {
        OnBadRow::Error => {
            Err(Error::input(format!("{location}: {message} (set data.on_bad_row = \"skip\" to skip such rows)")))
        }
        OnBadRow::Skip => {
            stats.bad_rows += 1;
            if stats.bad_rows <= MAX_WARNINGS {
                eprintln!("warning: {location}: {message}; row skipped");
            } else if stats.bad_rows == MAX_WARNINGS + 1 {
                eprintln!("warning: more malformed rows; counting them without printing");
            }
            Ok(())
        }
    }
}

/// Convenience for tests and tools: tokenize one conversation into an example.
pub fn example_of(
    tokenizer: &Tokenizer,
    conv: &Conversation,
    train_on: TrainOn,
    max_length: usize,
) -> Result<Option<SftExample>> {
    let masked = tokenize_conversation(tokenizer, &conv.messages, conv.tools.as_ref(), train_on)?;
    Ok(SftExample::from_masked(&masked, max_length))
}
