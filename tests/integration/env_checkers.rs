//! The reward checkers on hand-written cases: math answers (extraction and equivalence), the
//! exact expression parser, countdown, and arithmetic's integer reading.

use oxrl::env::answer::{answers_match, extract_final_answer, parse_number, reference_answer};
use oxrl::env::arithmetic::last_integer;
use oxrl::env::countdown::{check_countdown, extract_expression, Verdict};
use oxrl::env::expr::{evaluate, parse, Rational};
use oxrl::env::{make_env, EnvConfig, Step};
use serde_json::json;

fn r(n: i128, d: i128) -> Rational {
    Rational::new(n, d).unwrap()
}

#[test]
fn final_answer_extraction() {
    assert_eq!(extract_final_answer("so \\boxed{42}."), Some("42".into()));
    // Nested braces, and the LAST box wins.
    assert_eq!(extract_final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}"), Some("\\frac{1}{2}".into()));
    assert_eq!(extract_final_answer("\\boxed {7}"), Some("7".into()));
    assert_eq!(extract_final_answer("\\fbox{x+1}"), Some("x+1".into()));
    // An unclosed last box is no answer (the reply was cut off).
    assert_eq!(extract_final_answer("\\boxed{12"), None);
    assert_eq!(extract_final_answer("work\n#### 1,000\nmore"), Some("1,000".into()));
    assert_eq!(extract_final_answer("#### 3\n#### 4"), Some("4".into()));
    assert_eq!(extract_final_answer("The answer: 18 apples"), Some("18 apples".into()));
    assert_eq!(extract_final_answer("ANSWER: -2"), Some("-2".into()));
    // A box takes precedence over ####.
    assert_eq!(extract_final_answer("#### 5 \\boxed{6}"), Some("6".into()));
    assert_eq!(extract_final_answer("I think it is 42"), None);
    assert_eq!(extract_final_answer(""), None);
}

#[test]
fn reference_answers() {
    assert_eq!(reference_answer("Natalia sold 48/2 = 24 clips.\n#### 72"), "72");
    assert_eq!(reference_answer("  3/4 "), "3/4");
}

#[test]
fn numbers_parse_exactly() {
    assert_eq!(parse_number("42"), Some(r(42, 1)));
    assert_eq!(parse_number("-3"), Some(r(-3, 1)));
    assert_eq!(parse_number("- 3"), Some(r(-3, 1)));
    assert_eq!(parse_number("0.5"), Some(r(1, 2)));
    assert_eq!(parse_number("1/2"), Some(r(1, 2)));
    assert_eq!(parse_number("\\frac{1}{2}"), Some(r(1, 2)));
    assert_eq!(parse_number("\\dfrac{3}{6}"), Some(r(1, 2)));
    assert_eq!(parse_number("-\\frac{1}{4}"), Some(r(-1, 4)));
    assert_eq!(parse_number("1,000"), Some(r(1000, 1)));
    assert_eq!(parse_number("12,345,678.5"), Some(r(24691357, 2)));
    assert_eq!(parse_number("5 cm"), Some(r(5, 1)));
    assert_eq!(parse_number("50%"), Some(r(50, 1)));
    // Not numbers.
    assert_eq!(parse_number("1,00"), None);
    assert_eq!(parse_number("1,0000"), None);
    assert_eq!(parse_number("3x"), None);
    assert_eq!(parse_number("2\\pi"), None);
    assert_eq!(parse_number("1/0"), None);
    assert_eq!(parse_number("abc"), None);
    assert_eq!(parse_number(""), None);
    assert_eq!(parse_number("3, 4"), None);
}

#[test]
fn answer_equivalence() {
    let yes = [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "1/2"),
        ("0.50", "\\frac{2}{4}"),
        ("1,000", "1000"),
        ("$1,000", "1000"),
        ("\\$18", "18"),
        ("-3", "- 3"),
        ("72.", "72"),
        ("72.0", "72"),
        ("5 \\text{ cm}", "5"),
        ("\\text{5}", "5"),
        ("$\\frac{3}{4}$", "0.75"),
        ("x + 1", "x  +  1"),
        ("\\text{yes}", "yes"),
        ("+7", "7"),
    ];
    for (p, r) in yes {
        assert!(answers_match(p, r), "{p:?} should match {r:?}");
    }
    let no = [
        ("0.33", "1/3"),
        ("-3", "3"),
        ("1.000", "1,000"),
        ("x+1", "x + 1"),
        ("", ""),
        ("72", "27"),
        ("3x", "3"),
        ("\\frac{1}{2", "0.5"),
    ];
    for (p, r) in no {
        assert!(!answers_match(p, r), "{p:?} should not match {r:?}");
    }
}

#[test]
fn expression_precedence_and_parentheses() {
    assert_eq!(evaluate("2 + 3 * 4").unwrap(), r(14, 1));
    assert_eq!(evaluate("(2 + 3) * 4").unwrap(), r(20, 1));
    assert_eq!(evaluate("10 - 4 - 3").unwrap(), r(3, 1), "left associative");
    assert_eq!(evaluate("64 / 4 / 2").unwrap(), r(8, 1), "left associative");
    assert_eq!(evaluate("-2 * 3").unwrap(), r(-6, 1));
    assert_eq!(evaluate("2 - -3").unwrap(), r(5, 1));
    assert_eq!(evaluate("((7))").unwrap(), r(7, 1));
    assert_eq!(evaluate("7 / 2").unwrap(), r(7, 2), "exact fractions");
    assert_eq!(evaluate("1/3 * 3").unwrap(), r(1, 1));
    assert_eq!(evaluate("1.5 * 4").unwrap(), r(6, 1));
    assert_eq!(evaluate("3 × 4 ÷ 6").unwrap(), r(2, 1));
    assert_eq!(r(7, 2).to_string(), "7/2");
    assert_eq!(r(-6, 3).to_string(), "-2");
}

#[test]
fn expression_errors() {
    for bad in ["", "2 +", "(2 + 3", "2 + 3)", "2 3", "2 ** 3", "a + 1", "1..2", "1.", "()", "4 / (2 - 2)"] {
        assert!(evaluate(bad).is_err(), "{bad:?} should be an error");
    }
    assert_eq!(evaluate("1/0").unwrap_err().0, "division by zero");
    // Deep nesting is an error, not a stack overflow.
    let deep = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
    assert!(evaluate(&deep).is_err());
    let negs = format!("{}1", "-".repeat(10_000));
    assert!(evaluate(&negs).is_err());
    // Overflow is an error.
    assert!(evaluate("99999999999999999999 * 99999999999999999999 * 99999999999999999999").is_err());
    assert_eq!(parse("1 + 2").unwrap().numbers(), vec![r(1, 1), r(2, 1)]);
}

#[test]
fn countdown_checks() {
    let nums = [3, 5, 7, 2];
    assert_eq!(check_countdown("(3 + 5) * 2", &nums, 16), Verdict::Correct);
    assert_eq!(check_countdown("7 * 2 + 5 - 3", &nums, 16), Verdict::Correct);
    // Intermediate fractions are fine.
    assert_eq!(check_countdown("(7 / 2) * 4", &[7, 2, 4], 14), Verdict::Correct);
    assert_eq!(check_countdown("3 * 5", &nums, 15), Verdict::Correct, "unused numbers are allowed");
    // Reuse of a number.
    assert!(matches!(check_countdown("3 * 3 + 7", &nums, 16), Verdict::Wrong(_)));
    // A number listed twice may be used twice.
    assert_eq!(check_countdown("3 * 3", &[3, 3], 9), Verdict::Correct);
    // A number not given.
    assert!(matches!(check_countdown("4 * 4", &nums, 16), Verdict::Wrong(_)));
    // Wrong value.
    assert!(matches!(check_countdown("3 + 5", &nums, 16), Verdict::Wrong(_)));
    // Invalid: syntax, division by zero.
    assert!(matches!(check_countdown("3 + * 5", &nums, 16), Verdict::Invalid(_)));
    assert!(matches!(check_countdown("7 / (5 - 5)", &[7, 5, 5], 1), Verdict::Invalid(_)));
}

#[test]
fn countdown_expression_extraction() {
    assert_eq!(extract_expression("thinking... <answer>(3+5)*2</answer>"), Some("(3+5)*2".into()));
    assert_eq!(extract_expression("Answer: (3+5)*2 = 16\nok"), Some("(3+5)*2".into()));
    assert_eq!(extract_expression("answer: 1\nAnswer: 2+2"), Some("2+2".into()));
    assert_eq!(extract_expression("<answer>1+1"), None, "unclosed tag");
    assert_eq!(extract_expression("Answer: "), None);
    assert_eq!(extract_expression("16"), None);
}

fn reward(name: &str, row: serde_json::Value, reply: &str) -> f64 {
    let mut env = make_env(name, &row, &EnvConfig::default()).unwrap();
    match env.step(reply).unwrap() {
        Step::Done(o) => o.reward,
        other => panic!("single-turn env continued: {other:?}"),
    }
}

#[test]
fn countdown_rewards() {
    let row = json!({"numbers": [3, 5, 2], "target": 16});
    assert_eq!(reward("countdown", row.clone(), "Answer: (3 + 5) * 2"), 1.0);
    assert_eq!(reward("countdown", row.clone(), "<answer>3 + 5</answer>"), 0.1);
    assert_eq!(reward("countdown", row.clone(), "Answer: 3 * 3 + 7"), 0.1);
    assert_eq!(reward("countdown", row.clone(), "Answer: (3 + 5"), 0.0);
    assert_eq!(reward("countdown", row.clone(), "Answer: 5 / (3 - 3)"), 0.0);
    assert_eq!(reward("countdown", row, "no idea"), 0.0);
}

#[test]
fn math_rewards() {
    let row = json!({"question": "Half of one?", "answer": "It is one half.\n#### 0.5"});
    assert_eq!(reward("math", row.clone(), "so \\boxed{\\frac{1}{2}}"), 1.0);
    assert_eq!(reward("math", row.clone(), "#### 1/2"), 1.0);
    assert_eq!(reward("math", row.clone(), "\\boxed{0.25}"), 0.0);
    assert_eq!(reward("math", row.clone(), "0.5"), 0.0, "no final-answer marker");
    let gsm = json!({"prompt": "How many?", "answer": "lots\n#### 1,000"});
    assert_eq!(reward("math", gsm.clone(), "The answer is \\boxed{1000}"), 1.0);
    assert_eq!(reward("math", gsm, "#### $1,000."), 1.0);
    let numeric = json!({"prompt": "p", "answer": -3});
    assert_eq!(reward("math", numeric, "Answer: - 3"), 1.0);
    // Format reward for an extracted but wrong answer.
    let cfg = EnvConfig { format_reward: Some(0.2), ..EnvConfig::default() };
    let mut env = make_env("math", &row, &cfg).unwrap();
    assert!(matches!(env.step("\\boxed{7}").unwrap(), Step::Done(o) if o.reward == 0.2 && !o.correct));
}

#[test]
fn arithmetic_reads_the_last_integer() {
    assert_eq!(last_integer("81"), Some(81));
    assert_eq!(last_integer("23 + 58 = 81"), Some(81));
    assert_eq!(last_integer("58-23=35"), Some(35));
    assert_eq!(last_integer("= -35"), Some(-35));
    assert_eq!(last_integer("-35"), Some(-35));
    assert_eq!(last_integer("x-3"), Some(3));
    assert_eq!(last_integer("(2)-3"), Some(3));
    assert_eq!(last_integer("81."), Some(81));
    assert_eq!(last_integer("1,234"), Some(234));
    assert_eq!(last_integer("none"), None);
    assert_eq!(last_integer(""), None);
    assert_eq!(last_integer("99999999999999999999999999999999999999999"), None);
}

#[test]
fn arithmetic_rewards() {
    let row = json!({"prompt": "What is 23 + 58?", "answer": 81});
    assert_eq!(reward("arithmetic", row.clone(), "81"), 1.0);
    assert_eq!(reward("arithmetic", row.clone(), " 81\n"), 1.0);
    assert_eq!(reward("arithmetic", row.clone(), "It is 81"), 1.0);
    assert_eq!(reward("arithmetic", row.clone(), "80"), 0.0);
    assert_eq!(reward("arithmetic", row.clone(), ""), 0.0);
    let cfg = EnvConfig { format_reward: Some(0.1), ..EnvConfig::default() };
    let mut env = make_env("arithmetic", &row, &cfg).unwrap();
    assert!(matches!(env.step("80").unwrap(), Step::Done(o) if o.reward == 0.1));
    let mut env = make_env("arithmetic", &row, &cfg).unwrap();
    assert!(
        matches!(env.step("it is 80").unwrap(), Step::Done(o) if o.reward == 0.0),
        "format reward needs a bare integer"
    );
    let string_answer = json!({"prompt": "What is 5 - 9?", "answer": "-4"});
    assert_eq!(reward("arithmetic", string_answer, "-4"), 1.0);
}

#[test]
fn extreme_values_are_errors_not_panics() {
    let max = i128::MAX.to_string();
    // i128::MIN is reachable; negating or dividing it by -1 overflows: an error.
    assert_eq!(evaluate(&format!("-{max} - 1")).unwrap().to_string(), i128::MIN.to_string());
    assert!(evaluate(&format!("(-{max} - 1) / -1")).is_err());
    assert!(evaluate(&format!("-(-{max} - 1)")).is_err());
    assert!(evaluate(&format!("{max} + 1")).is_err());
    // 1 / i128::MIN needs a denominator of 2^127, which does not fit.
    assert!(evaluate(&format!("1 / (-{max} - 1)")).is_err());
    assert!(evaluate("1000000000000000000000000000000000000000000").is_err());
    assert!(evaluate("0.0000000000000000000000000000000000000000001").is_err());
}

/// Random replies never panic, and every outcome is in range: a finite reward in [0, 1], the full
/// reward exactly when the answer is correct (and only then), with the default and a set format
/// reward.
#[test]
fn random_replies_never_panic() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    let alphabet: Vec<char> = "0123456789+-*/().,{}\\$ #:<>=%xé−boxedfracAnswer".chars().collect();
    let mut rng = StdRng::seed_from_u64(0);
    let envs = [
        ("math", json!({"prompt": "p", "answer": "1/2"})),
        ("countdown", json!({"numbers": [1, 2, 3], "target": 6})),
        ("arithmetic", json!({"prompt": "p", "answer": 5})),
        ("calculator", json!({"prompt": "p", "answer": "3"})),
    ];
    let configs = [EnvConfig::default(), EnvConfig { format_reward: Some(0.25), ..Default::default() }];
    let mut correct = 0usize;
    for _ in 0..3000 {
        let len = rng.random_range(0..40);
        let mut text: String = (0..len).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect();
        if rng.random_bool(0.3) {
            text = format!("\\boxed{{{text}}} <calc>{text}</calc> Answer: {text} <answer>{text}</answer>");
        }
        let _ = evaluate(&text);
        let _ = answers_match(&text, "0.5");
        let _ = extract_final_answer(&text);
        for (name, row) in &envs {
            for cfg in &configs {
                let mut env = make_env(name, row, cfg).unwrap();
                if let Step::Done(o) = env.step(&text).unwrap() {
                    check(name, &text, &o);
                    correct += o.correct as usize;
                }
            }
        }
    }
    // Correct replies, so that the full-reward branch is checked too.
    for (name, reply) in [
        ("math", "\\boxed{0.5}"),
        ("countdown", "<answer>1+2+3</answer>"),
        ("arithmetic", "Answer: 5"),
        ("calculator", "Answer: 3"),
    ] {
        let row = &envs.iter().find(|(n, _)| *n == name).unwrap().1;
        for cfg in &configs {
            match make_env(name, row, cfg).unwrap().step(reply).unwrap() {
                Step::Done(o) => {
                    assert!(o.correct, "{name}: {reply:?} is correct: {o:?}");
                    check(name, reply, &o);
                }
                other => panic!("{name}: {reply:?} did not end the episode: {other:?}"),
            }
        }
    }
    println!("{correct} random replies were correct");
}

fn check(name: &str, reply: &str, o: &oxrl::env::Outcome) {
    assert!(o.reward.is_finite() && (0.0..=1.0).contains(&o.reward), "{name}: {reply:?}: reward {}", o.reward);
    assert_eq!(o.correct, o.reward == 1.0, "{name}: {reply:?}: correct {} with reward {}", o.correct, o.reward);
}
