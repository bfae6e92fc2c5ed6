//! Episodes: the token-mask builder on a hand-built two-turn example, the calculator env over
//! several turns with a scripted model (its masks covering only model tokens), the turn limit,
//! and the env factory.

use oxrl::env::calculator::{calc_calls, calc_result, CALCULATOR_SYSTEM_PROMPT};
use oxrl::env::{build_sequence, make_env, run_episode, EnvConfig, Message, Segment, Source, Step};
use oxrl::Result;
use serde_json::json;

#[test]
fn mask_builder_two_turns_exactly() {
    // prompt [1 2 3] | model [4 5] | observation [6 7] | model [8 9 10]
    let segments = [
        Segment::env(vec![1, 2, 3]),
        Segment::model(vec![4, 5], vec![-0.4, -0.5]),
        Segment::env(vec![6, 7]),
        Segment::model(vec![8, 9, 10], vec![-0.8, -0.9, -1.0]),
    ];
    let seq = build_sequence(&segments).unwrap();
    assert_eq!(seq.input_tokens, vec![1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(seq.target_tokens, vec![2, 3, 4, 5, 6, 7, 8, 9, 10]);
    assert_eq!(seq.mask, vec![0., 0., 1., 1., 0., 0., 1., 1., 1.]);
    assert_eq!(seq.logprobs, vec![0., 0., -0.4, -0.5, 0., 0., -0.8, -0.9, -1.0]);
    assert_eq!(seq.turn, vec![None, None, Some(0), Some(0), None, None, Some(1), Some(1), Some(1)]);
    assert_eq!(seq.num_model_tokens(), 5);
}

#[test]
fn mask_builder_edge_cases() {
    // A model token at position 0 cannot be predicted: it is dropped from the loss.
    let seq = build_sequence(&[Segment::model(vec![1, 2], vec![-0.1, -0.2])]).unwrap();
    assert_eq!((seq.input_tokens, seq.target_tokens, seq.mask), (vec![1], vec![2], vec![1.0]));
    // Empty segments are fine and do not count as turns.
    let seq = build_sequence(&[
        Segment::env(vec![1]),
        Segment::model(vec![], vec![]),
        Segment::env(vec![]),
        Segment::model(vec![2], vec![-0.2]),
    ])
    .unwrap();
    assert_eq!(seq.turn, vec![Some(1)]);
    // Errors: too short, log-probs missing or mismatched.
    assert!(build_sequence(&[Segment::env(vec![1])]).is_err());
    assert!(build_sequence(&[]).is_err());
    let no_lps = Segment { source: Source::Model, tokens: vec![2], logprobs: None };
    assert!(build_sequence(&[Segment::env(vec![1]), no_lps]).is_err());
    assert!(build_sequence(&[Segment::env(vec![1]), Segment::model(vec![2, 3], vec![-0.1])]).is_err());
}

fn calculator_row() -> serde_json::Value {
    json!({"question": "A box holds 12 eggs. How many eggs are in 17 boxes and 5 loose eggs?", "answer": "#### 209"})
}

/// A toy tokenizer for the scripted episode: one token per byte.
fn toks(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[test]
fn calculator_three_turns_with_a_scripted_model() {
    let cfg = EnvConfig { tool_role: "tool".into(), ..EnvConfig::default() };
    let mut env = make_env("calculator", &calculator_row(), &cfg).unwrap();
    assert_eq!(env.max_turns(), 4);
    assert_eq!(env.stop_strings(), vec!["</calc>".to_string()]);
    let initial = env.initial();
    assert_eq!(initial[0], Message::system(CALCULATOR_SYSTEM_PROMPT));
    assert_eq!(initial[1].role, "user");

    let script = ["First <calc>12 * 17</calc>", "Then <calc>204 + 5</calc>", "Answer: 209"];
    let mut segments = vec![Segment::env(toks("PROMPT:"))];
    let mut observations = Vec::new();
    let mut outcome = None;
    for (i, turn) in script.iter().enumerate() {
        segments.push(Segment::model(toks(turn), vec![-1.0; turn.len()]));
        match env.step(turn).unwrap() {
            Step::Continue { observation } => {
                assert!(i < 2, "turn {i} should end the episode");
                let text: String = observation.iter().map(|m| m.content.clone()).collect();
                segments.push(Segment::env(toks(&text)));
                observations.push(observation);
            }
            Step::Done(o) => {
                assert_eq!(i, 2);
                outcome = Some(o);
            }
        }
    }
    assert_eq!(observations[0], vec![Message::new("tool", "<result>204</result>")]);
    assert_eq!(observations[1], vec![Message::new("tool", "<result>209</result>")]);
    let outcome = outcome.unwrap();
    assert_eq!((outcome.reward, outcome.correct, outcome.truncated), (1.0, true, false));
    assert_eq!(outcome.info["turns"], json!(3));
    // After Done, the same outcome again.
    assert_eq!(env.step("Answer: 1").unwrap(), Step::Done(outcome));

    // Masks cover exactly the model turns' tokens, and each masked target is a model token.
    let seq = build_sequence(&segments).unwrap();
    let model_tokens: usize = script.iter().map(|t| t.len()).sum();
    assert_eq!(seq.num_model_tokens(), model_tokens);
    let mut expected_mask = Vec::new();
    for seg in &segments {
        expected_mask.extend(seg.tokens.iter().map(|_| if seg.source == Source::Model { 1.0 } else { 0.0 }));
    }
    assert_eq!(seq.mask, expected_mask[1..].to_vec());
    let masked: Vec<u8> =
        seq.target_tokens.iter().zip(&seq.mask).filter(|(_, &m)| m > 0.0).map(|(&t, _)| t as u8).collect();
    assert_eq!(String::from_utf8(masked).unwrap(), script.concat());
}

#[test]
fn calculator_turn_limit_truncates_with_zero_reward() {
    let cfg = EnvConfig { max_turns: 2, ..EnvConfig::default() };
    let mut env = make_env("calculator", &calculator_row(), &cfg).unwrap();
    let t = run_episode(env.as_mut(), |_| Ok("<calc>1 + 1</calc>".to_string())).unwrap();
    assert_eq!(t.turns, 2);
    assert_eq!((t.outcome.reward, t.outcome.correct, t.outcome.truncated), (0.0, false, true));
    // Conversation: system, user, assistant, tool result (role `user` by default), assistant.
    let roles: Vec<&str> = t.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"]);
    assert_eq!(t.messages[3].content, "<result>2</result>");
}

#[test]
fn calculator_turn_rules() {
    let mut replies = ["<calc>7/2</calc> and <calc>1/0</calc> and <calc>2 +</calc>", "<calc>3*3", "I give up"].iter();
    let mut env = make_env("calculator", &calculator_row(), &EnvConfig::default()).unwrap();
    let t = run_episode(env.as_mut(), |_| Ok(replies.next().unwrap().to_string())).unwrap();
    assert_eq!(t.messages[3].content, "<result>7/2</result>\n<result>error: division by zero</result>\n<result>error: unexpected end of expression</result>");
    // An unclosed call at the end of a turn (sampling stopped at `</calc>`) is still a call.
    assert_eq!(t.messages[5].content, "<result>9</result>");
    // No call and no answer ends the episode with reward 0.
    assert_eq!((t.turns, t.outcome.reward, t.outcome.truncated), (3, 0.0, false));
    // A wrong final answer.
    let mut env = make_env("calculator", &calculator_row(), &EnvConfig::default()).unwrap();
    let t = run_episode(env.as_mut(), |_| Ok("\\boxed{208}".to_string())).unwrap();
    assert_eq!((t.turns, t.outcome.reward, t.outcome.correct), (1, 0.0, false));
    assert_eq!(calc_calls("a <calc> 1+2 </calc> b <calc>3</calc> <calc>4"), vec!["1+2", "3", "4"]);
    assert_eq!(calc_result("2*(3+4)"), "<result>14</result>");
}

#[test]
fn run_episode_passes_model_errors_through() {
    let mut env = make_env("calculator", &calculator_row(), &EnvConfig::default()).unwrap();
    let result: Result<_> = run_episode(env.as_mut(), |_| Err(oxrl::Error::Other("engine down".into())));
    assert!(result.unwrap_err().to_string().contains("engine down"));
}

#[test]
fn factory_errors_name_the_field_or_suggest_a_name() {
    let cfg = EnvConfig::default();
    let e = make_env("countdwn", &json!({}), &cfg).err().unwrap().to_string();
    assert!(e.contains("unknown env `countdwn`") && e.contains("did you mean `countdown`?"), "{e}");
    let cases = [
        ("math", json!({"answer": "1"}), "field `prompt`: missing"),
        ("math", json!({"prompt": "p"}), "field `answer`: missing"),
        ("math", json!({"prompt": 3, "answer": "1"}), "field `prompt`: must be a string or a list of messages"),
        ("math", json!({"prompt": [{"role": "user"}], "answer": "1"}), "field `prompt`: message 0"),
        ("math", json!({"prompt": "p", "answer": "#### "}), "field `answer`: is empty"),
        ("arithmetic", json!({"prompt": "p", "answer": "1.5"}), "field `answer`: must be an integer"),
        ("countdown", json!({"target": 3}), "field `numbers`: missing"),
        ("countdown", json!({"numbers": [1, "2"], "target": 3}), "field `numbers`: item 1 must be an integer"),
        ("countdown", json!({"numbers": [1, 2], "target": 3.5}), "field `target`: must be an integer"),
        ("calculator", json!({"question": ["x"], "answer": "1"}), "field `question`: must be a string"),
    ];
    for (name, row, expected) in cases {
        let e = make_env(name, &row, &cfg).err().unwrap().to_string();
        assert!(e.contains(&format!("env `{name}`: {expected}")), "{name} {row}: {e}");
    }
}

#[test]
fn prompts_as_messages_and_system_prompt() {
    let cfg = EnvConfig { system_prompt: Some("Be brief.".into()), ..EnvConfig::default() };
    let row = json!({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": 2});
    let env = make_env("arithmetic", &row, &cfg).unwrap();
    assert_eq!(env.initial(), vec![Message::system("Be brief."), Message::user("What is 1 + 1?")]);
    // A prompt that has its own system message keeps it.
    let row = json!({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "answer": 2});
    assert_eq!(make_env("math", &row, &cfg).unwrap().initial()[0], Message::system("S"));
    // Countdown writes its prompt when the row has none.
    let env = make_env("countdown", &json!({"numbers": [1, 2], "target": 3}), &EnvConfig::default()).unwrap();
    assert_eq!(
        env.initial()[0].content,
        "Using the numbers [1, 2], create an expression that equals 3. You may use + - * / and parentheses, and \
         each number at most once. Give the expression after \"Answer:\"."
    );
    assert_eq!(oxrl::env::messages_to_json(&env.initial())[0]["role"], "user");
}
