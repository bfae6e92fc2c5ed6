//! Chat sampling: messages in, the chat template applied with the generation prompt, the
//! assistant's reply out — its text, and the prompt and reply token ids with the reply's
//! log-probs and weight versions that the trainer needs. For a multi-turn rollout, append
//! [`ChatReply::message`] and the next user (or tool) message and call again.

use serde_json::{json, Value};

use super::client::EngineClient;
use super::request::{Request, StopReason};
use super::sampler::SamplingParams;
use crate::model::tokenizer::Tokenizer;
use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct ChatReply {
    /// The rendered conversation up to the assistant's turn.
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<u64>,
    pub stop_reason: StopReason,
    /// The reply decoded without special tokens.
    pub text: String,
}

impl ChatReply {
    /// The reply as a message to append to the conversation.
    pub fn message(&self) -> Value {
        json!({"role": "assistant", "content": self.text})
    }
}

/// `num_samples` replies to `messages` (with abort-and-continue, through the client).
pub fn chat(
    client: &EngineClient,
    tok: &Tokenizer,
    messages: &[Value],
    params: SamplingParams,
    num_samples: usize,
) -> Result<Vec<ChatReply>> {
    let prompt = tok.encode_chat(messages, true, None)?;
    let req = Request { num_samples, ..Request::new(prompt.clone(), params) };
    let out = client.generate(req)?;
    out.samples
        .into_iter()
        .map(|g| {
            Ok(ChatReply {
                prompt_tokens: prompt.clone(),
                text: tok.decode(&g.tokens, true)?,
                tokens: g.tokens,
                logprobs: g.logprobs,
                versions: g.versions,
                stop_reason: g.stop_reason,
            })
        })
        .collect()
}
