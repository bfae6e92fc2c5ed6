//! What a sampling request asks for and what it gets back.
//!
//! A request is one prompt and `num_samples` completions of it. Sample j draws from its own
//! random stream seeded with `seed + j`, so a seeded request gives the same tokens whatever else
//! the engine is running. Every sampled token carries its log-prob under the distribution it
//! was drawn from and the version of the weights that produced it.

use super::sampler::SamplingParams;

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    /// A stop or EOS token was generated, or a stop string completed (the token is included).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The engine was paused in `abort` mode (or the request aborted): the tokens so far. The
    /// engine client continues such samples after `resume`.
    Abort,
    /// The request was cancelled by its caller: the tokens so far; never continued.
    Cancelled,
}

/// One completion.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// log p(token) under the distribution it was drawn from (the model's own when greedy).
    pub logprobs: Vec<f32>,
    /// The weight version that produced each token.
    pub versions: Vec<u64>,
    /// With `Request::sample_topk` > 0: the most likely tokens at each step, with their log-probs
    /// (see [`super::top_logprobs`]); empty otherwise.
    pub topk: Vec<TopLogprobs>,
    pub stop_reason: StopReason,
}

/// (token, log-prob) pairs, most likely first.
pub type TopLogprobs = Vec<(u32, f32)>;

impl Generation {
    pub fn empty() -> Self {
        Generation { tokens: vec![], logprobs: vec![], versions: vec![], topk: vec![], stop_reason: StopReason::Length }
    }

    /// Appends a continuation: its tokens, log-probs and versions; its stop reason wins.
    pub fn append(&mut self, next: Generation) {
        self.tokens.extend(next.tokens);
        self.logprobs.extend(next.logprobs);
        self.versions.extend(next.versions);
        self.topk.extend(next.topk);
        self.stop_reason = next.stop_reason;
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Completions of the prompt (they share its prefill). Default 1.
    pub num_samples: usize,
    /// Also return log p(prompt\[i\] | prompt[..i]) for i ≥ 1.
    pub prompt_logprobs: bool,
    /// Also return the `prompt_topk` most likely tokens at each prompt position i ≥ 1.
    pub prompt_topk: usize,
    /// Also return the `sample_topk` most likely tokens at each sampled position.
    pub sample_topk: usize,
    /// Requests with the same key go to the same engine while it is up (e.g. the samples of one
    /// RL prompt, so that they share its prefill); `None`: the least loaded engine. `group` on
    /// the wire, the name engine servers and clients already exchange.
    #[serde(rename = "group")]
    pub route_key: Option<u64>,
    /// Random draws to skip before sampling: a continuation after an abort passes the number of
    /// tokens it already has, so a seeded sample continues its own stream.
    pub rng_skip: usize,
    /// The LoRA adapter (registered on the engine by this name) the request samples with; None =
    /// the engine's model as it is.
    pub adapter: Option<String>,
    /// Added to the logits of these tokens before each draw (OpenAI's `logit_bias`): the samples,
    /// their log-probs and top log-probs are those of the biased distribution; prompt log-probs
    /// are the model's. Absent on the wire from older clients: none.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Decoded in the engine's priority lane, in turns with the main batch rather than in it
    /// (see [`super::engine_core`]): a small request of a tenant beside a saturated batch.
    /// Absent on the wire from older clients: false.
    #[serde(default)]
    pub priority: bool,
}

impl Request {
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        Request {
            prompt,
            params,
            num_samples: 1,
            prompt_logprobs: false,
            prompt_topk: 0,
            sample_topk: 0,
            route_key: None,
            rng_skip: 0,
            adapter: None,
            logit_bias: vec![],
            priority: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestOutput {
    /// One per sample, in sample order.
    pub samples: Vec<Generation>,
    /// One per prompt token after the first, when asked for.
    pub prompt_logprobs: Option<Vec<f32>>,
    /// One per prompt token after the first, when `prompt_topk` > 0.
    pub prompt_topk: Option<Vec<TopLogprobs>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_key_crosses_to_engine_servers_as_group() {
        let request = Request { route_key: Some(3), ..Request::new(vec![1, 2], SamplingParams::default()) };
        let wire = rmp_serde::to_vec_named(&request).unwrap();
        let fields: serde_json::Value = rmp_serde::from_slice(&wire).unwrap();
        assert_eq!((fields["group"].as_u64(), fields.get("route_key")), (Some(3), None));
        assert_eq!(rmp_serde::from_slice::<Request>(&wire).unwrap(), request);
    }
}
