//! The SFT data path: loss masks against the fixtures' ChatML template, truncation, bad rows,
//! instruction rows, Parquet, the eval split and the seeded, resumable data loader.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::fixture_dir;
use oxrl::model::tokenizer::{write_byte_level_tokenizer, Tokenizer};
use oxrl::rows::read_rows;
use oxrl::trainer::data_loader::{permutation, DataLoader, LoaderPosition};
use oxrl::trainer::sections::OnBadRow;
use oxrl::trainer::sft::chat_mask::tokenize_conversation;
use oxrl::trainer::sft::config::{DataSection, SftConfig, TrainOn};
use oxrl::trainer::sft::data::{example_of, load_sft_dataset, parse_row, split_eval, Conversation, SftExample};
use serde_json::{json, Value};

const IM_END: u32 = 2;

fn tokenizer(arch: &str) -> Tokenizer {
    Tokenizer::from_dir(&fixture_dir(arch)).unwrap()
}

fn conv(messages: Value) -> Conversation {
    Conversation { messages: messages.as_array().unwrap().clone(), tools: None }
}

fn three_turns() -> Value {
    json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "what is 12 plus 30?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "and minus 2?"},
        {"role": "assistant", "content": "It is 40, of course."},
    ])
}

/// Maximal runs of trained target tokens, as token ids.
fn trained_spans(ex: &SftExample) -> Vec<Vec<u32>> {
    let mut spans: Vec<Vec<u32>> = Vec::new();
    let mut prev = false;
    for (t, &w) in ex.weights.iter().enumerate() {
        if w > 0.0 {
            if !prev {
                spans.push(Vec::new());
            }
            spans.last_mut().unwrap().push(ex.target_tokens[t]);
        }
        prev = w > 0.0;
    }
    spans
}

fn data_cfg(train_file: &Path) -> DataSection {
    DataSection { train_file: train_file.to_path_buf(), ..DataSection::default() }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

// ---------------------------------------------------------------- loss masks

/// Hand check on every fixture: exactly each trained assistant message's content tokens and its
/// `<|im_end|>` are trained; the "\n" after `<|im_end|>`, the role headers and the other turns
/// are not.
#[test]
fn mask_is_assistant_content_and_im_end_for_each_mode() {
    for arch in common::ARCHS {
        let tok = tokenizer(arch);
        let c = conv(three_turns());
        let content = |s: &str| {
            let mut ids = tok.encode(s, false).unwrap();
            ids.push(IM_END);
            ids
        };
        let all = example_of(&tok, &c, TrainOn::AllAssistant, 4096).unwrap().unwrap();
        assert_eq!(trained_spans(&all), vec![content("42"), content("It is 40, of course.")], "{arch}");
        let last = example_of(&tok, &c, TrainOn::LastAssistant, 4096).unwrap().unwrap();
        assert_eq!(trained_spans(&last), vec![content("It is 40, of course.")], "{arch}");

        // The sequence is the template's rendering, shifted by one; weights mark targets.
        let full = tok.encode_chat(&c.messages, false, None).unwrap();
        for ex in [&all, &last] {
            assert_eq!(ex.input_tokens, full[..full.len() - 1]);
            assert_eq!(ex.target_tokens, full[1..]);
            assert_eq!(ex.weights.len(), ex.input_tokens.len());
        }
        // The final "\n" after the last <|im_end|> is the last target, untrained.
        assert_eq!(tok.decode(&full[full.len() - 1..], false).unwrap(), "\n");
        assert_eq!(*all.weights.last().unwrap(), 0.0);
        assert_eq!(all.target_tokens[all.target_tokens.len() - 2], IM_END);
        assert_eq!(all.weights[all.weights.len() - 2], 1.0);

        // Text view: the trained spans decode to the assistant messages plus <|im_end|>.
        let texts: Vec<String> = trained_spans(&all).iter().map(|s| tok.decode(s, false).unwrap()).collect();
        assert_eq!(texts, ["42<|im_end|>", "It is 40, of course.<|im_end|>"]);
    }
}

#[test]
fn mask_from_tokenize_conversation_matches_weights() {
    let tok = tokenizer("qwen2");
    let c = conv(three_turns());
    let m = tokenize_conversation(&tok, &c.messages, None, TrainOn::AllAssistant).unwrap();
    let ex = SftExample::from_masked(&m, usize::MAX).unwrap();
    assert!(!m.trained[0]);
    for t in 0..ex.weights.len() {
        assert_eq!(ex.weights[t] == 1.0, m.trained[t + 1]);
    }
}

#[test]
fn tool_messages_and_tools_are_context_only() {
    let tok = tokenizer("qwen3");
    let mut c = conv(json!([
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "calling get_weather", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
        {"role": "assistant", "content": "It is sunny."},
    ]));
    c.tools = Some(json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]));
    let ex = example_of(&tok, &c, TrainOn::AllAssistant, 4096).unwrap().unwrap();
    let texts: Vec<String> = trained_spans(&ex).iter().map(|s| tok.decode(s, false).unwrap()).collect();
    assert_eq!(texts, ["calling get_weather<|im_end|>", "It is sunny.<|im_end|>"]);
}

/// A template that drops earlier assistant turns once a later one exists (as reasoning-stripping
/// templates do) is not prefix-stable; that is an error even with `on_bad_row = "skip"`.
#[test]
fn template_that_is_not_prefix_stable_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for f in
        ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "generation_config.json"]
    {
        std::fs::copy(fixture_dir("qwen2").join(f), dir.path().join(f)).unwrap();
    }
    let template = "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}";
    write(dir.path(), "chat_template.jinja", template);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let c = conv(three_turns());
    // The last turn alone is fine; all turns are not.
    assert!(example_of(&tok, &c, TrainOn::LastAssistant, 4096).is_ok());
    let e = example_of(&tok, &c, TrainOn::AllAssistant, 4096).unwrap_err().to_string();
    assert!(e.contains("not prefix-stable") && e.contains("messages[..=2]"), "{e}");

    let data = write(dir.path(), "d.jsonl", &format!("{}\n", json!({"messages": three_turns()})));
    let cfg = DataSection { on_bad_row: OnBadRow::Skip, ..data_cfg(&data) };
    let e = load_sft_dataset(&cfg, &tok).unwrap_err().to_string();
    assert!(e.contains("d.jsonl:1") && e.contains("not prefix-stable"), "{e}");
}

// ---------------------------------------------------------------- truncation

#[test]
fn truncation_cuts_and_drops_rows_that_lose_every_trained_token() {
    let tok = tokenizer("qwen2");
    let dir = tempfile::tempdir().unwrap();
    let row = |user: &str, answer: &str| {
        json!({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}).to_string()
    };
    let long = "word ".repeat(200);
    let text = [row("hi", "hello"), row(&long, "ok"), row("hi", &long), row("bye", "see you")].join("\n");
    let file = write(dir.path(), "t.jsonl", &text);
    let cfg = DataSection { max_length: 40, ..data_cfg(&file) };
    let ds = load_sft_dataset(&cfg, &tok).unwrap();
    let s = &ds.train_stats;
    assert_eq!((s.rows, s.examples, s.dropped_by_truncation, s.truncated, s.bad_rows), (4, 3, 1, 1, 0));
    for ex in &ds.train {
        assert!(ex.input_tokens.len() <= 39);
        assert!(ex.num_trained() > 0);
    }
    // The cut row (long answer) keeps the start of its answer, trained up to the cut.
    let cut = ds.train.iter().find(|e| e.input_tokens.len() == 39).unwrap();
    assert_eq!(*cut.weights.last().unwrap(), 1.0);
    assert_eq!(s.trained_tokens, ds.train.iter().map(|e| e.num_trained()).sum::<usize>());

    // Every row dropped: a clear error.
    let cfg = DataSection { max_length: 3, ..data_cfg(&file) };
    let e = load_sft_dataset(&cfg, &tok).unwrap_err().to_string();
    assert!(e.contains("no training example left") && e.contains("4 dropped by max_length = 3"), "{e}");
}

// ---------------------------------------------------------------- bad rows

#[test]
fn bad_rows_name_file_and_line_and_can_be_skipped() {
    let tok = tokenizer("llama");
    let dir = tempfile::tempdir().unwrap();
    let good =
        json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}).to_string();
    let lines = [
        good.clone(),
        String::new(), // blank: ignored, not bad
        "{\"messages\": [".to_string(),
        json!({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}).to_string(),
        json!({"messages": [{"role": "user", "content": "only a question"}]}).to_string(),
        json!({"prompt": "x", "completion": "y"}).to_string(),
        json!({"instruction": "x"}).to_string(),
        good.clone(),
    ];
    let file = write(dir.path(), "bad.jsonl", &lines.join("\n"));

    let e = load_sft_dataset(&data_cfg(&file), &tok).unwrap_err().to_string();
    assert!(e.contains("bad.jsonl:3") && e.contains("invalid JSON") && e.contains("on_bad_row"), "{e}");

    let cfg = DataSection { on_bad_row: OnBadRow::Skip, ..data_cfg(&file) };
    let ds = load_sft_dataset(&cfg, &tok).unwrap();
    assert_eq!((ds.train_stats.rows, ds.train_stats.bad_rows, ds.train.len()), (7, 5, 2));

    // Each kind of bad row, one at a time, with its line number and reason.
    let cases = [
        (4, "`robot` is not one of system, user, assistant, tool"),
        (5, "no assistant message"),
        (6, "found keys: prompt, completion"),
        (7, "missing `output`"),
    ];
    for (line, reason) in cases {
        let text: Vec<&str> =
            lines.iter().enumerate().map(|(i, l)| if i + 1 == line || i == 0 { l.as_str() } else { "" }).collect();
        let f = write(dir.path(), "one.jsonl", &text.join("\n"));
        let e = load_sft_dataset(&data_cfg(&f), &tok).unwrap_err().to_string();
        assert!(e.contains(&format!("one.jsonl:{line}:")) && e.contains(reason), "line {line}: {e}");
    }
}

#[test]
fn unsupported_or_missing_files_are_errors() {
    let tok = tokenizer("qwen2");
    let dir = tempfile::tempdir().unwrap();
    let csv = write(dir.path(), "d.csv", "a,b\n");
    let e = load_sft_dataset(&data_cfg(&csv), &tok).unwrap_err().to_string();
    assert!(e.contains("d.csv") && e.contains(".jsonl or .parquet"), "{e}");
    let e = load_sft_dataset(&data_cfg(&dir.path().join("nope.jsonl")), &tok).unwrap_err().to_string();
    assert!(e.contains("nope.jsonl") && e.contains("cannot read"), "{e}");
}

// ---------------------------------------------------------------- instruction rows

#[test]
fn instruction_rows_become_user_and_assistant_messages() {
    let with_input = parse_row(&json!({"instruction": "Translate.", "input": "chat", "output": "cat"})).unwrap();
    assert_eq!(
        Value::Array(with_input.messages.clone()),
        json!([{"role": "user", "content": "Translate.\n\nchat"}, {"role": "assistant", "content": "cat"}])
    );
    let no_input =
        parse_row(&json!({"instruction": "Say hi.", "input": "", "output": "hi", "system": "Be kind."})).unwrap();
    assert_eq!(
        Value::Array(no_input.messages),
        json!([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}])
    );
    let tok = tokenizer("qwen2");
    let ex = example_of(&tok, &with_input, TrainOn::LastAssistant, 4096).unwrap().unwrap();
    let mut expect = tok.encode("cat", false).unwrap();
    expect.push(IM_END);
    assert_eq!(trained_spans(&ex), vec![expect]);
    assert!(parse_row(&json!({"instruction": "x", "output": 3})).unwrap_err().contains("`output` must be a string"));
}

/// A vision-language row (an image part, as Qwen3.5's chat format writes it) is refused by
/// name, not read as text.
#[test]
fn multimodal_content_is_refused_by_name() {
    let row = json!({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "what is it?"}]},
        {"role": "assistant", "content": "a cat"},
    ]});
    let e = parse_row(&row).unwrap_err();
    assert!(e.contains("messages[0].content") && e.contains("`image` part") && e.contains("multimodal"), "{e}");
}

#[test]
fn messages_and_tools_may_be_json_strings_and_nulls_are_dropped() {
    let c = parse_row(&json!({
        "messages": "[{\"role\": \"user\", \"content\": \"q\", \"tool_calls\": null}, {\"role\": \"assistant\", \"content\": \"a\"}]",
        "tools": "[{\"type\": \"function\"}]",
    }))
    .unwrap();
    assert_eq!(c.messages[0], json!({"role": "user", "content": "q"}));
    assert_eq!(c.tools, Some(json!([{"type": "function"}])));
}

// ---------------------------------------------------------------- Parquet

/// Writes `messages: list<struct<role, content>>` rows, the layout of Hugging Face chat datasets.
fn write_chat_parquet(path: &Path, rows: &[Vec<(&str, &str)>]) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = "message schema {
        optional group messages (LIST) {
            repeated group list {
                optional group element {
                    optional binary role (UTF8);
                    optional binary content (UTF8);
                }
            }
        }
    }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let mut writer = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for field in 0..2 {
        let mut col = group.next_column().unwrap().unwrap();
        let (mut values, mut def, mut rep) = (Vec::new(), Vec::new(), Vec::new());
        for row in rows {
            for (i, m) in row.iter().enumerate() {
                values.push(ByteArray::from(if field == 0 { m.0 } else { m.1 }));
                def.push(4); // messages, list, element and the leaf all present
                rep.push(if i == 0 { 0 } else { 1 });
            }
        }
        col.typed::<ByteArrayType>().write_batch(&values, Some(&def), Some(&rep)).unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}

/// Writes flat `instruction, input, output` string columns.
fn write_instruction_parquet(path: &Path, rows: &[[&str; 3]]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = "message schema { required binary instruction (UTF8); required binary input (UTF8); required binary output (UTF8); }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let mut writer = SerializedFileWriter::new(
        std::fs::File::create(path).unwrap(),
        schema,
        Arc::new(WriterProperties::builder().build()),
    )
    .unwrap();
    let mut group = writer.next_row_group().unwrap();
    for field in 0..3 {
        let mut col = group.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(r[field])).collect();
        col.typed::<ByteArrayType>().write_batch(&values, None, None).unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn parquet_chat_and_instruction_rows_match_jsonl() {
    let tok = tokenizer("qwen2");
    let dir = tempfile::tempdir().unwrap();
    let chats = vec![
        vec![("user", "what is 2 plus 2?"), ("assistant", "4")],
        vec![("system", "terse"), ("user", "hi"), ("assistant", "hello"), ("user", "bye"), ("assistant", "ciao")],
    ];
    let pq = dir.path().join("chat.parquet");
    write_chat_parquet(&pq, &chats);
    let rows = read_rows(&pq).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].location.to_string(), format!("{}: row 1", pq.display()));
    assert_eq!(
        rows[0].value.as_ref().unwrap(),
        &json!({"messages": [{"role": "user", "content": "what is 2 plus 2?"}, {"role": "assistant", "content": "4"}]})
    );

    let jsonl: Vec<String> = chats
        .iter()
        .map(|c| {
            json!({"messages": c.iter().map(|(r, t)| json!({"role": r, "content": t})).collect::<Vec<_>>()}).to_string()
        })
        .collect();
    let jl = write(dir.path(), "chat.jsonl", &jsonl.join("\n"));
    let from_pq = load_sft_dataset(&data_cfg(&pq), &tok).unwrap();
    let from_jl = load_sft_dataset(&data_cfg(&jl), &tok).unwrap();
    assert_eq!(from_pq.train, from_jl.train);
    assert_eq!(from_pq.train.len(), 2);

    let ipq = dir.path().join("inst.parquet");
    write_instruction_parquet(&ipq, &[["Add.", "1 2", "3"], ["Say yes.", "", "yes"]]);
    let ds = load_sft_dataset(&data_cfg(&ipq), &tok).unwrap();
    let texts: Vec<String> = ds.train.iter().map(|e| tok.decode(&trained_spans(e)[0], false).unwrap()).collect();
    assert_eq!(texts, ["3<|im_end|>", "yes<|im_end|>"]);

    // A bad Parquet row is named by its 0-based row index.
    let bad = dir.path().join("bad.parquet");
    write_chat_parquet(&bad, &[vec![("user", "a"), ("assistant", "b")], vec![("user", "a"), ("wizard", "b")]]);
    let e = load_sft_dataset(&data_cfg(&bad), &tok).unwrap_err().to_string();
    assert!(e.contains("bad.parquet: row 1") && e.contains("`wizard`"), "{e}");

    let not_pq = write(dir.path(), "fake.parquet", "not parquet");
    let e = load_sft_dataset(&data_cfg(&not_pq), &tok).unwrap_err().to_string();
    assert!(e.contains("fake.parquet") && e.contains("not a readable Parquet file"), "{e}");
}

// ---------------------------------------------------------------- eval split and shuffle

#[test]
fn eval_split_by_fraction_is_seeded_and_eval_file_is_used() {
    let tok = tokenizer("qwen2");
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<String> = (0..20)
        .map(|i| json!({"messages": [{"role": "user", "content": format!("q{i}")}, {"role": "assistant", "content": format!("a{i}")}]}).to_string())
        .collect();
    let file = write(dir.path(), "d.jsonl", &rows.join("\n"));
    let cfg = DataSection { eval_fraction: 0.25, shuffle_seed: 7, ..data_cfg(&file) };
    let a = load_sft_dataset(&cfg, &tok).unwrap();
    let b = load_sft_dataset(&cfg, &tok).unwrap();
    assert_eq!((a.train.len(), a.eval.len()), (15, 5));
    assert_eq!((a.train_stats.rows, a.eval_stats.rows), (15, 5));
    assert_eq!(a.eval, b.eval);
    let other = load_sft_dataset(&DataSection { shuffle_seed: 8, ..cfg.clone() }, &tok).unwrap();
    assert_ne!(a.eval, other.eval);
    // Disjoint, and together the whole set.
    for e in &a.eval {
        assert!(!a.train.contains(e));
    }

    let eval_file = write(dir.path(), "e.jsonl", &rows[..3].join("\n"));
    let cfg = DataSection { eval_file: eval_file.clone(), eval_fraction: 0.5, ..data_cfg(&file) };
    let c = load_sft_dataset(&cfg, &tok).unwrap();
    assert_eq!((c.train.len(), c.eval.len()), (20, 3));

    let (t, e) = split_eval((0..10).collect::<Vec<_>>(), 0.01, 0);
    assert_eq!((t.len(), e.len()), (9, 1), "a positive fraction holds out at least one row");
}

#[test]
fn loader_shuffle_is_seeded_per_epoch_and_covers_every_item() {
    let items: Vec<usize> = (0..10).collect();
    let epochs = |seed: u64| {
        let mut l = DataLoader::new(items.clone(), 4, seed, true);
        assert_eq!(l.steps_per_epoch(), 3);
        (0..9).map(|_| l.next_batch().unwrap()).collect::<Vec<_>>()
    };
    let a = epochs(3);
    assert_eq!(a, epochs(3), "same seed, same batches");
    assert_ne!(a, epochs(4), "another seed, another order");
    // Batch sizes 4, 4, 2 per epoch; each epoch a permutation; epochs differ.
    assert_eq!(a.iter().map(|b| b.items.len()).collect::<Vec<_>>(), [4, 4, 2, 4, 4, 2, 4, 4, 2]);
    let epoch_items = |e: usize| -> Vec<usize> { a[3 * e..3 * e + 3].iter().flat_map(|b| b.items.clone()).collect() };
    for e in 0..3 {
        let mut sorted = epoch_items(e);
        sorted.sort();
        assert_eq!(sorted, items);
        assert!(a[3 * e..3 * e + 3].iter().all(|b| b.epoch == e));
    }
    assert_ne!(epoch_items(0), epoch_items(1));
    assert_ne!(epoch_items(0), items, "shuffled");
    // The permutation is this crate's (SplitMix64 + Fisher–Yates), not a dependency's: pinned,
    // so that a dependency upgrade cannot change the data order of a resumed run.
    assert_eq!(permutation(6, 42), [2, 5, 3, 1, 0, 4]);
    assert_eq!(permutation(10, 0), [4, 9, 2, 5, 1, 7, 6, 0, 3, 8]);
    let mut no_shuffle = DataLoader::new(items.clone(), 4, 3, false);
    assert_eq!(no_shuffle.next_batch().unwrap().items, [0, 1, 2, 3]);
}

#[test]
fn loader_resumes_exactly_from_a_serialised_position() {
    let items: Vec<u32> = (0..23).collect();
    let mut straight = DataLoader::new(items.clone(), 5, 11, true);
    for _ in 0..6 {
        straight.next_batch().unwrap();
    }
    // 23 items in batches of 5: 5 steps an epoch, so 6 steps are 1 batch into epoch 1.
    assert_eq!(straight.position(), LoaderPosition { epoch: 1, index: 5 });
    let saved = serde_json::to_string(&straight.position()).unwrap();
    assert_eq!(saved, r#"{"epoch":1,"index":5}"#);

    // A fresh loader restored to the saved position continues exactly as the uninterrupted one.
    let mut resumed = DataLoader::new(items.clone(), 5, 11, true);
    resumed.set_position(serde_json::from_str::<LoaderPosition>(&saved).unwrap()).unwrap();
    let rest_resumed: Vec<_> = (0..12).map(|_| resumed.next_batch().unwrap()).collect();
    let rest_straight: Vec<_> = (0..12).map(|_| straight.next_batch().unwrap()).collect();
    assert_eq!(rest_resumed, rest_straight);
    assert_eq!(resumed.position(), straight.position());
    // The end of an epoch is the start of the next.
    let mut l = DataLoader::new(items, 5, 11, true);
    l.set_position(LoaderPosition { epoch: 2, index: 23 }).unwrap();
    assert_eq!(l.position(), LoaderPosition { epoch: 3, index: 0 });
    // A position from other data is an error, not a panic.
    let err = l.set_position(LoaderPosition { epoch: 0, index: 24 }).unwrap_err().to_string();
    assert!(err.contains("past the dataset's 23 items"), "{err}");
}

// ---------------------------------------------------------------- the shipped example

#[test]
fn shipped_tiny_chat_example_loads_with_the_byte_level_tokenizer() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = SftConfig::load(Some(&root.join("examples/sft_tiny.toml")), &[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_byte_level_tokenizer(dir.path()).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    // The file's paths are relative to examples/.
    assert_eq!(config.data.train_file, root.join("examples/data/tiny_chat.jsonl"));
    let ds = load_sft_dataset(&config.data, &tok).unwrap();
    assert_eq!(ds.train.len() + ds.eval.len(), 400);
    assert_eq!((ds.train_stats.bad_rows, ds.train_stats.dropped_by_truncation, ds.train_stats.truncated), (0, 0, 0));
    assert!(ds.train.iter().all(|e| e.input_tokens.len() < config.data.max_length));
    // Byte-level: "olleh" is 5 tokens, plus <|im_end|>.
    let c = conv(json!([{"role": "user", "content": "Reverse: hello"}, {"role": "assistant", "content": "olleh"}]));
    let ex = example_of(&tok, &c, TrainOn::AllAssistant, 128).unwrap().unwrap();
    assert_eq!(ex.num_trained(), 6);
}

#[test]
fn token_mean_datums_weigh_each_trained_token_equally_across_the_batch() {
    use oxrl::trainer::sft::data::token_mean_datums;
    let tok = tokenizer("qwen2");
    let a = example_of(&tok, &conv(three_turns()), TrainOn::AllAssistant, 4096).unwrap().unwrap();
    let b = example_of(&tok, &conv(three_turns()), TrainOn::LastAssistant, 4096).unwrap().unwrap();
    let total = (a.num_trained() + b.num_trained()) as f32;
    let datums = token_mean_datums(&[a.clone(), b]);
    let w = datums[0].loss_fn_inputs.weights.as_ref().unwrap();
    assert_eq!(datums[0].input_tokens, a.input_tokens);
    assert_eq!(datums[0].loss_fn_inputs.target_tokens.as_ref().unwrap(), &a.target_tokens);
    for (x, y) in w.iter().zip(&a.weights) {
        assert_eq!(*x, y / total);
    }
    let sum: f32 = datums.iter().flat_map(|d| d.loss_fn_inputs.weights.clone().unwrap()).sum();
    assert!((sum - 1.0).abs() < 1e-5);
}
