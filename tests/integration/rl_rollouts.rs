//! Episodes through the trainer's rollout path with a scripted sampler: a multi-turn calculator
//! episode runs several turns, its token sequence is the chat template's rendering of the whole
//! conversation, and the loss mask covers exactly the sampled tokens.

use crate::common;

use std::cell::RefCell;

use oxrl::env::{EnvConfig, EnvFactory, PromptRow};
use oxrl::handle::Handle;
use oxrl::model::tokenizer::Tokenizer;
use oxrl::rollout::{Generation, Request, RequestOutput, SamplingParams, StopReason};
use oxrl::trainer::rl::episodes::{generate_episodes, TurnSampler};
use serde_json::json;

/// Replies with the next scripted turn (plus the end-of-turn token) to every request.
struct Script {
    tok: Tokenizer,
    turns: Vec<&'static str>,
    calls: RefCell<Vec<Request>>,
}

impl TurnSampler for Script {
    fn submit(&self, req: Request) -> Handle<RequestOutput> {
        let k = self.calls.borrow().len();
        let mut tokens = self.tok.encode(self.turns[k], false).unwrap();
        tokens.push(self.tok.token_to_id("<|im_end|>").unwrap());
        let g = Generation {
            logprobs: (0..tokens.len()).map(|i| -0.1 * (i + 1) as f32).collect(),
            versions: vec![3; tokens.len()],
            tokens,
            topk: vec![],
            stop_reason: StopReason::Stop,
        };
        let out = RequestOutput { samples: vec![g; req.num_samples], prompt_logprobs: None, prompt_topk: None };
        self.calls.borrow_mut().push(req);
        Handle::ready(Ok(out))
    }
}

#[test]
fn a_calculator_episode_runs_several_turns_and_masks_only_sampled_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    common::tiny_byte_model(tmp.path(), 16, 512, 1);
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let turns = vec!["<calc>17*3</calc>", "<calc>51+9</calc>", "Answer: 60"];
    let script =
        Script { tok: Tokenizer::from_dir(tmp.path()).unwrap(), turns: turns.clone(), calls: RefCell::new(vec![]) };
    let row = PromptRow {
        uid: "q1".into(),
        env: "calculator".into(),
        row: json!({"prompt": "What is 17 * 3 + 9?", "answer": "60"}),
        source: "test".into(),
    };
    let cfg = EnvConfig { max_turns: 4, max_turn_tokens: 32, ..Default::default() };
    let params = SamplingParams { temperature: 1.0, ..Default::default() };
    let episodes = generate_episodes(&script, &tok, &[row], &EnvFactory::builtin(cfg.clone()), &params, 1, 5).unwrap();
    assert_eq!(episodes.len(), 1);
    let e = &episodes[0];
    assert_eq!((e.turns, e.reward, e.correct, e.truncated), (3, 1.0, true, false));
    assert_eq!(e.min_version, 3);
    let calls = script.calls.borrow();
    assert_eq!(calls.len(), 3, "one engine call per model turn");
    assert!(calls[0].params.stop_strings.contains(&"</calc>".to_string()), "the env's stop strings reach the sampler");
    assert_eq!(calls[0].params.max_tokens, 32);

    // The sequence is the template's rendering of the whole conversation.
    let s = &e.sequence;
    let mut full = s.input_tokens.clone();
    full.push(*s.target_tokens.last().unwrap());
    let text = tok.decode(&full, false).unwrap();
    assert!(text.contains("<|im_start|>assistant\n<calc>17*3</calc><|im_end|>\n<|im_start|>user\n<result>51</result><|im_end|>\n<|im_start|>assistant\n<calc>51+9</calc><|im_end|>"), "{text}");
    assert!(text.ends_with("<result>60</result><|im_end|>\n<|im_start|>assistant\nAnswer: 60<|im_end|>"), "{text}");
    // Each later prompt is the previous sequence plus the env's tokens.
    assert!(calls[1].prompt.starts_with(&calls[0].prompt) && calls[2].prompt.starts_with(&calls[1].prompt));

    // The mask covers exactly the sampled tokens, with their sampler log-probs.
    let sampled: Vec<u32> = s.target_tokens.iter().zip(&s.mask).filter(|(_, &m)| m == 1.0).map(|(&t, _)| t).collect();
    let mut want = vec![];
    let mut want_lp = vec![];
    for t in &turns {
        let mut toks = tok.encode(t, false).unwrap();
        toks.push(tok.token_to_id("<|im_end|>").unwrap());
        want_lp.extend((0..toks.len()).map(|i| -0.1 * (i + 1) as f32));
        want.extend(toks);
    }
    assert_eq!(sampled, want);
    let lps: Vec<f32> = s.logprobs.iter().zip(&s.mask).filter(|(_, &m)| m == 1.0).map(|(&l, _)| l).collect();
    assert_eq!(lps, want_lp);
    assert_eq!(e.response_tokens, want.len());
    // Tool results and template tokens are never trained on.
    let env_text: String = s
        .target_tokens
        .iter()
        .zip(&s.mask)
        .filter(|(_, &m)| m == 0.0)
        .map(|(&t, _)| tok.decode(&[t], false).unwrap())
        .collect();
    assert!(env_text.contains("<result>51</result>") && env_text.contains("<result>60</result>"));
}

#[test]
fn a_tool_call_on_the_last_allowed_turn_truncates_with_no_reward() {
    let tmp = tempfile::tempdir().unwrap();
    common::tiny_byte_model(tmp.path(), 16, 512, 1);
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let script = Script {
        tok: Tokenizer::from_dir(tmp.path()).unwrap(),
        turns: vec!["<calc>1+1</calc>", "<calc>2+2</calc>"],
        calls: RefCell::new(vec![]),
    };
    let row = PromptRow {
        uid: "q".into(),
        env: "calculator".into(),
        row: json!({"prompt": "What is 4?", "answer": "4"}),
        source: "test".into(),
    };
    let cfg = EnvConfig { max_turns: 2, max_turn_tokens: 16, ..Default::default() };
    let episodes =
        generate_episodes(&script, &tok, &[row], &EnvFactory::builtin(cfg.clone()), &SamplingParams::default(), 1, 0)
            .unwrap();
    assert_eq!((episodes[0].turns, episodes[0].reward, episodes[0].truncated), (2, 0.0, true));
}

/// An env that keeps going past its own `max_turns` broke its contract: the trainer's episode
/// loop stops it there with an error naming the env and the row (a library user's Rust env,
/// registered on the factory).
#[test]
fn an_env_that_never_finishes_is_an_error_naming_it() {
    struct Endless;
    impl oxrl::env::Env for Endless {
        fn initial(&self) -> Vec<oxrl::env::Message> {
            vec![oxrl::env::Message::user("go")]
        }
        fn step(&mut self, _: &str) -> oxrl::Result<oxrl::env::Step> {
            Ok(oxrl::env::Step::Continue { observation: vec![oxrl::env::Message::user("more")] })
        }
        fn max_turns(&self) -> usize {
            2
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    common::tiny_byte_model(tmp.path(), 16, 512, 1);
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let script = Script {
        tok: Tokenizer::from_dir(tmp.path()).unwrap(),
        turns: vec!["a", "b", "c"],
        calls: RefCell::new(vec![]),
    };
    let envs = EnvFactory::builtin(EnvConfig::default()).register(
        "endless",
        std::sync::Arc::new(|_: &serde_json::Value, _: &EnvConfig| Ok(Box::new(Endless) as Box<dyn oxrl::env::Env>)),
    );
    let row = PromptRow { uid: "q".into(), env: "endless".into(), row: json!({}), source: "rows.jsonl:7".into() };
    let e = generate_episodes(&script, &tok, &[row], &envs, &SamplingParams::default(), 1, 0).unwrap_err().to_string();
    assert_eq!(
        e,
        "env `endless` is not done after its max_turns (2) model turns on row rows.jsonl:7: an env must end its episodes"
    );
    assert_eq!(script.calls.borrow().len(), 2, "two turns sampled, no third");
}
