//! The tokens of a conversation and which of them are trained, by incremental rendering of the
//! chat template.
//!
//! For each trained assistant message `i` (every one, or only the last):
//!
//! ```text
//! before = tokens(render(messages[..i], add_generation_prompt = true))
//! after  = tokens(render(messages[..=i], add_generation_prompt = false))
//! full   = tokens(render(messages,        add_generation_prompt = false))
//! ```
//!
//! The template must be prefix-stable: `before` a prefix of `after`, and `after` a prefix of
//! `full`. Then `after[before.len()..]` is exactly what the model would generate for turn `i`
//! (content and end-of-turn), at positions `before.len()..after.len()` of `full`. A template that
//! rewrites earlier turns (e.g. one that strips the reasoning of past assistant turns) or a
//! tokenizer that merges across the boundary breaks the property; that is an error naming the
//! message and the first differing token, never a silently wrong mask.
//!
//! Convention for the tokens after the end-of-turn token (ChatML's `"\n"` after `<|im_end|>`):
//! **not trained**. As in Hugging Face's assistant masks (`{% generation %}` blocks) and TRL,
//! training stops at and includes the end-of-turn token: generation stops there, so the model
//! never has to produce what follows; it stays in the sequence as context for the next turn.
//! The end-of-turn tokens are the tokenizer's EOS ids; the span is cut after the last EOS id in
//! it, and kept whole if it has none.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::tokenizer::Tokenizer;
use crate::trainer::sft::config::TrainOn;

/// A tokenized conversation: `trained[t]` says whether token `t` carries loss.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskedTokens {
    pub tokens: Vec<u32>,
    pub trained: Vec<bool>,
}

/// Why a conversation could not be tokenized: something about this row, or something about the
/// template that every row would hit (never worth skipping rows for).
#[derive(Debug)]
pub enum MaskError {
    Row(Error),
    Template(Error),
}

impl From<MaskError> for Error {
    fn from(e: MaskError) -> Error {
        match e {
            MaskError::Row(e) | MaskError::Template(e) => e,
        }
    }
}

/// Tokenizes `messages` with the tokenizer's chat template and marks the trained tokens (see the
/// module docs). Errors if no assistant message is trained or the template is not prefix-stable.
pub fn tokenize_conversation(
    tokenizer: &Tokenizer,
    messages: &[Value],
    tools: Option<&Value>,
    train_on: TrainOn,
) -> std::result::Result<MaskedTokens, MaskError> {
    if tokenizer.chat_template().is_none() {
        // The tokenizer's own error says where a template was looked for.
        tokenizer.apply_chat_template(&[], false, None).map_err(MaskError::Template)?;
    }
    let render = |msgs: &[Value], gen: bool| tokenizer.encode_chat(msgs, gen, tools).map_err(MaskError::Row);
    let assistant: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .map(|(i, _)| i)
        .collect();
    let trained_turns: &[usize] = match train_on {
        TrainOn::AllAssistant => &assistant,
        TrainOn::LastAssistant => match assistant.last() {
            Some(last) => std::slice::from_ref(last),
            None => &[],
        },
    };
    if trained_turns.is_empty() {
        return Err(MaskError::Row(Error::input("the conversation has no assistant message to train on")));
    }

    let full = render(messages, false)?;
    let mut trained = vec![false; full.len()];
    let eos = tokenizer.eos_token_ids();
    for &i in trained_turns {
        let before = render(&messages[..i], true)?;
        let after = render(&messages[..=i], false)?;
        check_prefix(tokenizer, &before, &after, || {
            format!(
                "the rendering of messages[..={i}] does not start with the rendering of \
                 messages[..{i}] plus the generation prompt"
            )
        })
        .map_err(MaskError::Template)?;
        check_prefix(tokenizer, &after, &full, || {
            format!(
                "the rendering of the whole conversation does not start with the rendering of \
                 messages[..={i}] (the template changes earlier turns once later ones exist)"
            )
        })
        .map_err(MaskError::Template)?;
        let start = before.len();
        // Cut after the last end-of-turn token: what follows it is never generated.
        let end = match after[start..].iter().rposition(|t| eos.contains(t)) {
            Some(k) => start + k + 1,
            None => after.len(),
        };
        trained[start..end].iter_mut().for_each(|t| *t = true);
    }
    Ok(MaskedTokens { tokens: full, trained })
}

/// Errors unless `prefix` is a prefix of `whole`, showing where they part.
fn check_prefix(tokenizer: &Tokenizer, prefix: &[u32], whole: &[u32], what: impl FnOnce() -> String) -> Result<()> {
    let common = prefix.iter().zip(whole).take_while(|(a, b)| a == b).count();
    if common == prefix.len() {
        return Ok(());
    }
    let show = |ids: &[u32]| {
        let window = &ids[common..ids.len().min(common + 8)];
        format!("{window:?} {:?}", tokenizer.decode(window, false).unwrap_or_default())
    };
    Err(Error::input(format!(
        "chat template of {} is not prefix-stable, so the trained tokens cannot be found by \
         incremental rendering: {}; first difference at token {common}: {} vs {}",
        tokenizer.dir().display(),
        what(),
        show(prefix),
        show(whole),
    )))
}
