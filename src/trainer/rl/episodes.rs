//! Episodes: prompts × n samples through the sampling engines and the environments.
//!
//! ```text
//! for each prompt p (a group of n episodes, one env each):
//!     tokens = chat_template(env.initial(), generation prompt)        # Env segment
//!     loop:                                                           # one model turn
//!         reply = engine(tokens, max_tokens = budget(p))              # Model segment
//!         match env.step(text(reply)):
//!             Done(outcome)        -> the episode ends with its reward
//!             Continue(observation) -> tokens += the template text the observation adds
//! ```
//! A turn's budget is `env.max_turn_tokens`, or the prompt row's own `max_tokens` when that is
//! smaller ([`PromptRow::max_tokens`]: per-prompt budgets, e.g. a long-tail workload).
//! Every prompt's first turn is one request of n samples (they share the prefill); every
//! request of the step is submitted before any is awaited, so the engines batch them all.
//! Sampled tokens are kept exactly as sampled (never re-tokenized): a later turn appends the
//! template's closing of the reply that the model did not generate (e.g. the newline after
//! `<|im_end|>`, or the whole end-of-turn marker after a reply cut at max_tokens) and the
//! rendering of the new messages, found as the difference of two renderings. The loss mask
//! ([`crate::env::build_sequence`]) covers only the sampled tokens.
//!
//! Seeds: each group has its own seed `s` (given, or `hash(seed, i)` for prompt i); its first
//! turn samples j with `s + j` (the engine's rule), later turns of episode j with
//! `hash(s, 1_000_003 · turn + j)`. A group's random draws therefore depend only on its prompt
//! and seed — not on the other prompts of the call, nor on how the engines interleave them — so
//! the asynchronous trainer, which generates one group at a time, samples what the synchronous
//! one does, up to float rounding: a row's logits can differ in their last bits with the rows it
//! shares a decode step with (the matmul kernel and its summation order depend on the batch
//! size, and which requests share a step depends on when they reached the engine), and a draw
//! that lands within that of a boundary between two tokens picks the other one. Rare (two
//! 500-step demo runs with one seed: identical rewards and losses, entropies 1e-8 apart), but two
//! runs are not bit-identical.

use crate::env::{
    build_sequence, messages_to_json, Env, EnvConfig, Message, PromptRow, Segment, Step, TrainingSequence,
};
use crate::handle::Handle;
use crate::model::tokenizer::Tokenizer;
use crate::rollout::{EngineClient, Request, RequestOutput, SamplingParams};
use crate::splitmix;
use crate::{Error, Result};

/// Where episodes get their model turns: the engine client, or a script in tests.
pub trait TurnSampler {
    fn submit(&self, req: Request) -> Handle<RequestOutput>;
}

impl TurnSampler for EngineClient {
    fn submit(&self, req: Request) -> Handle<RequestOutput> {
        EngineClient::submit(self, req)
    }
}

/// One finished episode.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Episode {
    /// Index of its prompt in the step's batch (episodes of one prompt form a group).
    pub group: usize,
    pub uid: String,
    /// Input/target tokens, the loss mask over sampled tokens and their sampler log-probs.
    pub sequence: TrainingSequence,
    pub reward: f64,
    /// The env's verdict without format rewards (eval accuracy).
    pub correct: bool,
    pub truncated: bool,
    pub turns: usize,
    /// Sampled tokens over all turns.
    pub response_tokens: usize,
    /// The lowest weight version among its sampled tokens.
    pub min_version: u64,
    /// The weight version that sampled each sampled token, in order over the turns (an update
    /// in flight changes it mid-sequence).
    pub versions: Vec<u64>,
}

/// An episode in progress.
struct Running {
    group: usize,
    uid: String,
    env: Box<dyn Env>,
    messages: Vec<Message>,
    segments: Vec<Segment>,
    /// The full token sequence so far (the next request's prompt).
    tokens: Vec<u32>,
    turns: usize,
    versions: Vec<u64>,
}

/// A 64-bit mix of the step seed and a prompt index: output `index` of the SplitMix64 stream
/// that starts at state `seed` (the first output of state `seed + index·GOLDEN`).
pub fn prompt_seed(seed: u64, index: usize) -> u64 {
    let mut state = seed.wrapping_add((index as u64).wrapping_mul(splitmix::GOLDEN));
    splitmix::next(&mut state)
}

fn render(tok: &Tokenizer, messages: &[Message], generation_prompt: bool) -> Result<String> {
    tok.apply_chat_template(&messages_to_json(messages), generation_prompt, None)
}

/// Runs `n` episodes of every prompt (prompt i seeded with `hash(seed, i)`); episodes come
/// back grouped, prompt by prompt.
pub fn generate_episodes(
    client: &dyn TurnSampler,
    tok: &Tokenizer,
    prompts: &[PromptRow],
    env_config: &EnvConfig,
    params: &SamplingParams,
    n: usize,
    seed: u64,
) -> Result<Vec<Episode>> {
    let seeds: Vec<u64> = (0..prompts.len()).map(|i| prompt_seed(seed, i)).collect();
    generate_groups(client, tok, prompts, &seeds, env_config, params, n)
}

/// Runs `n` episodes of every prompt, prompt i's group seeded with `seeds[i]`; episodes come
/// back grouped, prompt by prompt.
pub fn generate_groups(
    client: &dyn TurnSampler,
    tok: &Tokenizer,
    prompts: &[PromptRow],
    seeds: &[u64],
    env_config: &EnvConfig,
    params: &SamplingParams,
    n: usize,
) -> Result<Vec<Episode>> {
    if seeds.len() != prompts.len() {
        return Err(Error::Other(format!("{} group seeds for {} prompts", seeds.len(), prompts.len())));
    }
    // Each prompt's per-turn budget: the env's, capped by the row's own `max_tokens`.
    let budgets: Vec<usize> = prompts
        .iter()
        .map(|p| p.max_tokens().map_or(env_config.max_turn_tokens, |m| m.min(env_config.max_turn_tokens)))
        .collect();
    // First turns: one request of n samples per prompt.
    let mut running: Vec<Running> = vec![];
    let mut first: Vec<Handle<RequestOutput>> = vec![];
    for (i, p) in prompts.iter().enumerate() {
        let envs = (0..n).map(|_| p.make_env(env_config)).collect::<Result<Vec<_>>>()?;
        let messages = envs.first().map(|e| e.initial()).unwrap_or_default();
        let prompt = tok.encode(&render(tok, &messages, true)?, false)?;
        let stop_strings = envs.first().map(|e| e.stop_strings()).unwrap_or_default();
        let request_params =
            SamplingParams { max_tokens: budgets[i], seed: Some(seeds[i]), stop_strings, ..params.clone() };
        first.push(client.submit(Request {
            num_samples: n,
            group: Some(i as u64),
            ..Request::new(prompt.clone(), request_params)
        }));
        for env in envs {
            running.push(Running {
                group: i,
                uid: p.uid.clone(),
                env,
                messages: messages.clone(),
                segments: vec![Segment::env(prompt.clone())],
                tokens: prompt.clone(),
                turns: 0,
                versions: vec![],
            });
        }
    }
    let mut replies: Vec<Option<Handle<RequestOutput>>> = vec![];
    for h in first {
        let out = h.wait()?;
        if out.samples.len() != n {
            return Err(Error::Other(format!("the engine returned {} samples for {n}", out.samples.len())));
        }
        for g in out.samples {
            replies.push(Some(Handle::ready(Ok(RequestOutput {
                samples: vec![g],
                prompt_logprobs: None,
                prompt_topk: None,
            }))));
        }
    }

    let mut done: Vec<Option<Episode>> = (0..running.len()).map(|_| None).collect();
    let mut round = 0usize;
    loop {
        let mut next: Vec<Option<Handle<RequestOutput>>> = (0..running.len()).map(|_| None).collect();
        let mut any = false;
        for (k, reply) in replies.iter_mut().enumerate() {
            let Some(h) = reply.take() else { continue };
            let g = h.wait()?.samples.into_iter().next().ok_or_else(|| Error::Other("empty engine reply".into()))?;
            let ep = &mut running[k];
            let text = tok.decode(&g.tokens, true)?;
            ep.turns += 1;
            ep.versions.extend(&g.versions);
            ep.tokens.extend(&g.tokens);
            let sampled = g.tokens.clone();
            ep.segments.push(Segment::model(g.tokens, g.logprobs));
            match ep.env.step(&text) {
                Step::Done(outcome) => {
                    let sequence = build_sequence(&ep.segments)?;
                    done[k] = Some(Episode {
                        group: ep.group,
                        uid: ep.uid.clone(),
                        response_tokens: sequence.num_model_tokens(),
                        sequence,
                        reward: outcome.reward,
                        correct: outcome.correct,
                        truncated: outcome.truncated,
                        turns: ep.turns,
                        min_version: ep.versions.iter().copied().min().unwrap_or(0),
                        versions: std::mem::take(&mut ep.versions),
                    });
                }
                Step::Continue { observation } => {
                    let added = continuation_tokens(tok, &ep.messages, &text, &sampled, &observation)?;
                    ep.messages.push(Message::assistant(text));
                    ep.messages.extend(observation);
                    ep.tokens.extend(&added);
                    ep.segments.push(Segment::env(added));
                    let turn_seed = prompt_seed(seeds[ep.group], 1_000_003 * (round + 1) + k % n);
                    let stop_strings = ep.env.stop_strings();
                    let request_params = SamplingParams {
                        max_tokens: budgets[ep.group],
                        seed: Some(turn_seed),
                        stop_strings,
                        ..params.clone()
                    };
                    next[k] = Some(client.submit(Request::new(ep.tokens.clone(), request_params)));
                    any = true;
                }
            }
        }
        if !any {
            break;
        }
        replies = next;
        round += 1;
    }
    done.into_iter()
        .enumerate()
        .map(|(k, e)| e.ok_or_else(|| Error::Other(format!("episode {k} did not finish"))))
        .collect()
}

/// The tokens that follow a sampled reply before the model's next turn: the template's closing
/// of the reply that was not sampled, then the observation's messages and the generation
/// prompt — all as the chat template renders them after `history` + the reply.
fn continuation_tokens(
    tok: &Tokenizer,
    history: &[Message],
    reply_text: &str,
    reply_tokens: &[u32],
    observation: &[Message],
) -> Result<Vec<u32>> {
    let prompt = render(tok, history, true)?;
    let mut with_reply = history.to_vec();
    with_reply.push(Message::assistant(reply_text));
    let closed = render(tok, &with_reply, false)?;
    let mut with_obs = with_reply.clone();
    with_obs.extend_from_slice(observation);
    let next = render(tok, &with_obs, true)?;
    let template_error = |what: &str| {
        Error::input(format!(
            "multi-turn rollout: the chat template does not render conversations as prefixes of each other ({what})"
        ))
    };
    let rendered_reply = closed.strip_prefix(&prompt).ok_or_else(|| template_error("prompt vs reply"))?;
    let added = next.strip_prefix(&closed).ok_or_else(|| template_error("reply vs observation"))?;
    // What the model produced, special tokens included (an end-of-turn token it sampled).
    let sampled = tok.decode(reply_tokens, false)?;
    let closing = match rendered_reply.strip_prefix(sampled.as_str()) {
        Some(rest) => rest.to_string(),
        // The sample's text differs from its rendering (e.g. the template trims it): close
        // after the reply's plain text.
        None => rendered_reply.strip_prefix(reply_text).map(str::to_string).unwrap_or_default(),
    };
    tok.encode(&format!("{closing}{added}"), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_seeds_are_pinned() {
        // Computed before `prompt_seed` moved onto `crate::splitmix`: a run's sampling seeds
        // must not change with it.
        assert_eq!(prompt_seed(0, 0), 0xe220a8397b1dcdaf);
        assert_eq!(prompt_seed(0, 1), 0x6e789e6aa1b965f4);
        assert_eq!(prompt_seed(0, 2), 0x06c45d188009454f);
        assert_eq!(prompt_seed(7, 0), 0x63cbe1e459320dd7);
        assert_eq!(prompt_seed(7, 5), 0x3fdabe86cbbeaa11);
        assert_eq!(prompt_seed(42, 1_000_003), 0xc0fd206e762d2420);
        assert_eq!(prompt_seed(u64::MAX, 3), 0x6d1db36ccba982d2);
    }
}
