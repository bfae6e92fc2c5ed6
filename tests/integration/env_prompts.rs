//! Prompt datasets: uids, env names, bad rows reported at `file:line` naming the field (or
//! skipped), and the synthetic arithmetic generator (deterministic, held-out eval).

use std::collections::HashSet;
use std::io::Write;

use oxrl::env::arithmetic::Problem;
use oxrl::env::{generate_arithmetic, load_prompts, make_env, ArithmeticSpec, EnvConfig, PromptOptions, Step};
use oxrl::trainer::sections::OnBadRow;

fn jsonl(lines: &[&str]) -> tempfile::TempPath {
    let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
    for line in lines {
        writeln!(f, "{line}").unwrap();
    }
    f.into_temp_path()
}

fn options(default_env: Option<&str>, on_bad_row: OnBadRow) -> PromptOptions {
    PromptOptions { default_env: default_env.map(String::from), on_bad_row, config: EnvConfig::default() }
}

#[test]
fn rows_become_prompts_with_stable_uids() {
    let path = jsonl(&[
        r#"{"prompt": "What is 1 + 1?", "answer": 2}"#,
        "",
        r#"{"id": "q7", "env": "countdown", "numbers": [1, 2], "target": 3}"#,
        r#####"{"id": 12, "question": "Half?", "answer": "#### 0.5", "env": "math"}"#####,
    ]);
    let set = load_prompts(&path, &options(Some("arithmetic"), OnBadRow::Error)).unwrap();
    assert_eq!(set.bad_rows, 0);
    let got: Vec<(&str, &str)> = set.rows.iter().map(|p| (p.uid.as_str(), p.env.as_str())).collect();
    // The index counts rows, not lines: the blank line is not a row.
    assert_eq!(got, [("0", "arithmetic"), ("q7", "countdown"), ("12", "math")]);
    assert_eq!(set.rows[1].source, format!("{}:3", path.display()));
    let mut env = set.rows[2].make_env(&EnvConfig::default()).unwrap();
    assert!(matches!(env.step("\\boxed{1/2}").unwrap(), Step::Done(o) if o.reward == 1.0));
}

#[test]
fn bad_rows_are_errors_at_file_line_naming_the_field() {
    let cases = [
        (r#"{"prompt": "p"}"#, "field `answer`: missing"),
        (r#"{"prompt": "p", "answer": [1]}"#, "field `answer`: must be a string or a number"),
        (r#"{"env": "countdown", "numbers": [1], "target": "3"}"#, "field `target`: must be an integer"),
        (r#"{"env": 3, "prompt": "p", "answer": 1}"#, "field `env`: must be a string"),
        (r#"{"env": "maths", "prompt": "p", "answer": 1}"#, "unknown env `maths`; did you mean `math`?"),
        (r#"{"id": [], "prompt": "p", "answer": 1}"#, "field `id`: must be a non-empty string or an integer"),
        (r#"{"prompt": "p", "answer": 1"#, "invalid JSON"),
        (r#"[1, 2]"#, "expected a JSON object"),
    ];
    for (bad, expected) in cases {
        let path = jsonl(&[r#"{"prompt": "What is 1 + 1?", "answer": 2}"#, bad]);
        let e = load_prompts(&path, &options(Some("math"), OnBadRow::Error)).unwrap_err().to_string();
        let at = format!("{}:2: ", path.display());
        assert!(e.contains(&format!("{at}{expected}")), "{bad}: {e}");
        assert!(e.contains("on_bad_row"), "{e}");
    }
    // Without a default env, `env` is required.
    let path = jsonl(&[r#"{"prompt": "p", "answer": 1}"#]);
    let e = load_prompts(&path, &options(None, OnBadRow::Error)).unwrap_err().to_string();
    assert!(e.contains(&format!("{}:1: field `env`: missing", path.display())), "{e}");
    // A duplicate uid.
    let path = jsonl(&[r#"{"id": "a", "prompt": "p", "answer": 1}"#, r#"{"id": "a", "prompt": "q", "answer": 1}"#]);
    let e = load_prompts(&path, &options(Some("math"), OnBadRow::Error)).unwrap_err().to_string();
    assert!(e.contains(&format!("{}:2: field `id`: duplicate uid `a`", path.display())), "{e}");
}

#[test]
fn bad_rows_can_be_skipped_and_counted() {
    let path = jsonl(&[
        r#"{"prompt": "p", "answer": 1}"#,
        r#"{"prompt": "p"}"#,
        "not json",
        r#"{"prompt": "q", "answer": 2}"#,
    ]);
    let set = load_prompts(&path, &options(Some("math"), OnBadRow::Skip)).unwrap();
    assert_eq!(set.bad_rows, 2);
    // Uids stay the row index in the file, so skipping does not renumber the rows after.
    let uids: Vec<&str> = set.rows.iter().map(|p| p.uid.as_str()).collect();
    assert_eq!(uids, ["0", "3"]);
}

#[test]
fn unsupported_file_is_an_error() {
    let f = tempfile::Builder::new().suffix(".csv").tempfile().unwrap();
    assert!(load_prompts(f.path(), &PromptOptions::default()).is_err());
}

#[test]
fn arithmetic_generator_is_deterministic_and_held_out() {
    let spec = ArithmeticSpec::default();
    let (train, eval) = generate_arithmetic(&spec, 200, 50, 7).unwrap();
    let (train2, eval2) = generate_arithmetic(&spec, 200, 50, 7).unwrap();
    assert_eq!((&train, &eval), (&train2, &eval2));
    let (other, _) = generate_arithmetic(&spec, 200, 50, 8).unwrap();
    assert_ne!(train, other);
    assert_eq!((train.len(), eval.len()), (200, 50));
    assert_eq!((train[0].uid.as_str(), eval[49].uid.as_str()), ("train-0", "eval-49"));
    let key = |p: &oxrl::env::PromptRow| {
        let r = &p.row;
        (r["a"].as_i64().unwrap(), r["op"].as_str().unwrap().to_string(), r["b"].as_i64().unwrap())
    };
    let train_set: HashSet<_> = train.iter().map(key).collect();
    let eval_set: HashSet<_> = eval.iter().map(key).collect();
    assert_eq!(eval_set.len(), 50, "eval problems are distinct");
    assert!(train_set.is_disjoint(&eval_set), "eval is held out");
    let mut ops = HashSet::new();
    for p in train.iter().chain(&eval) {
        let (a, op, b) = key(p);
        assert!((10..=99).contains(&a) && (10..=99).contains(&b));
        let problem = Problem { a, op: op.chars().next().unwrap(), b };
        assert_eq!(p.row["prompt"], problem.prompt());
        assert_eq!(p.row["answer"], problem.answer());
        assert!(problem.answer() >= 0, "no negative answers");
        ops.insert(op);
        // The row builds its env and the right answer gets reward 1.
        let mut env = make_env(&p.env, &p.row, &EnvConfig::default()).unwrap();
        assert!(matches!(env.step(&problem.answer().to_string()).unwrap(), Step::Done(o) if o.reward == 1.0));
    }
    assert_eq!(ops.len(), 3);
    assert_eq!(Problem { a: 23, op: '+', b: 58 }.prompt(), "What is 23 + 58?");
}

#[test]
fn arithmetic_generator_holds_out_eval_problems_first() {
    // One digit, `+` only: 100 problems. 99 held out leave one problem, drawn every time.
    let spec = ArithmeticSpec { digits: 1, ops: "+".into() };
    let (train, eval) = generate_arithmetic(&spec, 50, 99, 1).unwrap();
    let held: HashSet<String> = eval.iter().map(|p| p.row["prompt"].to_string()).collect();
    assert_eq!(held.len(), 99, "eval problems are distinct");
    let trained: HashSet<String> = train.iter().map(|p| p.row["prompt"].to_string()).collect();
    assert_eq!((train.len(), trained.len()), (50, 1), "the one problem left, drawn 50 times");
    assert!(trained.is_disjoint(&held));
    // A large train set over a small space is fine; holding out everything is not.
    let (train, eval) = generate_arithmetic(&spec, 2000, 20, 3).unwrap();
    assert_eq!((train.len(), eval.len()), (2000, 20));
    assert!(generate_arithmetic(&spec, 10, 100, 1).is_err());
    assert!(generate_arithmetic(&ArithmeticSpec { digits: 0, ops: "+".into() }, 1, 1, 0).is_err());
    assert!(generate_arithmetic(&ArithmeticSpec { digits: 2, ops: "/".into() }, 1, 1, 0).is_err());
}

/// Writes `question` (required) and `answer` (optional: `None` is a null) string columns.
fn write_math_parquet(path: &std::path::Path, rows: &[(&str, Option<&str>)]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;
    let schema = "message schema { required binary question (UTF8); optional binary answer (UTF8); }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut col = group.next_column().unwrap().unwrap();
    let questions: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(r.0)).collect();
    col.typed::<ByteArrayType>().write_batch(&questions, None, None).unwrap();
    col.close().unwrap();
    let mut col = group.next_column().unwrap().unwrap();
    let answers: Vec<ByteArray> = rows.iter().filter_map(|r| r.1.map(ByteArray::from)).collect();
    let def: Vec<i16> = rows.iter().map(|r| i16::from(r.1.is_some())).collect();
    col.typed::<ByteArrayType>().write_batch(&answers, Some(&def), None).unwrap();
    col.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn parquet_prompts_and_bad_rows_at_their_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gsm.parquet");
    write_math_parquet(&path, &[("Twice 21?", Some("21 * 2 = 42\n#### 42")), ("Half of 3?", None)]);
    let e = load_prompts(&path, &options(Some("math"), OnBadRow::Error)).unwrap_err().to_string();
    assert!(e.contains(&format!("{}: row 1: field `answer`: missing", path.display())), "{e}");
    let set = load_prompts(&path, &options(Some("math"), OnBadRow::Skip)).unwrap();
    assert_eq!((set.rows.len(), set.bad_rows), (1, 1));
    assert_eq!(set.rows[0].uid, "0");
    let mut env = set.rows[0].make_env(&EnvConfig::default()).unwrap();
    assert_eq!(env.initial()[0].content, "Twice 21?");
    assert!(matches!(env.step("#### 42").unwrap(), Step::Done(o) if o.reward == 1.0));
}
