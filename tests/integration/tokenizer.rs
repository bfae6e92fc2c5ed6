//! Tokenizer and chat-template checks against what transformers produced for the fixtures
//! (tests/fixtures/hf/*/chat_examples.json), plus error reporting and the byte-level tokenizer.

use std::path::{Path, PathBuf};

use oxrl::model::chat_template::{ChatTemplate, SpecialTokens, TemplateOrigin};
use oxrl::model::tokenizer::{write_byte_level_tokenizer, Tokenizer, BYTE_LEVEL_VOCAB_SIZE};
use oxrl::Error;
use serde_json::{json, Value};

const ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(arch)
}

fn examples(arch: &str) -> Value {
    let text = std::fs::read_to_string(fixture(arch).join("chat_examples.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Copies a fixture's tokenizer files into a temporary directory to be broken by a test.
fn copy_fixture(arch: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture(arch).join(name), dir.path().join(name)).unwrap();
    }
    dir
}

fn user(content: &str) -> Value {
    json!({"role": "user", "content": content})
}

#[test]
fn chat_examples_match_transformers() {
    for arch in ARCHS {
        let tok = Tokenizer::from_dir(&fixture(arch)).unwrap();
        let chats = examples(arch)["chat"].as_array().unwrap().clone();
        assert!(!chats.is_empty());
        for (i, ex) in chats.iter().enumerate() {
            let messages = ex["messages"].as_array().unwrap();
            let gen = ex["add_generation_prompt"].as_bool().unwrap();
            let text = tok.apply_chat_template(messages, gen, None).unwrap();
            assert_eq!(text, ex["text"].as_str().unwrap(), "{arch} chat example {i}: text");
            let got = tok.encode_chat(messages, gen, None).unwrap();
            assert_eq!(got, ids(&ex["input_ids"]), "{arch} chat example {i}: ids");
        }
    }
}

#[test]
fn plain_texts_match_transformers() {
    for arch in ARCHS {
        let tok = Tokenizer::from_dir(&fixture(arch)).unwrap();
        for (i, ex) in examples(arch)["encode"].as_array().unwrap().iter().enumerate() {
            let expected = ids(&ex["input_ids"]);
            let got = tok.encode(ex["text"].as_str().unwrap(), true).unwrap();
            assert_eq!(got, expected, "{arch} text {i}: ids");
            // These tokenizers have no post-processor, so special tokens change nothing here.
            assert_eq!(tok.encode(ex["text"].as_str().unwrap(), false).unwrap(), expected);
            let decoded = tok.decode(&expected, false).unwrap();
            assert_eq!(decoded, ex["decoded"].as_str().unwrap(), "{arch} text {i}: decoded");
        }
    }
}

#[test]
fn special_tokens_and_vocab() {
    for arch in ARCHS {
        let tok = Tokenizer::from_dir(&fixture(arch)).unwrap();
        assert_eq!(tok.eos_token_ids(), &[2], "{arch}");
        assert_eq!(tok.pad_token_id(), Some(0), "{arch}");
        assert_eq!(tok.bos_token_id(), None, "{arch}");
        assert_eq!(tok.vocab_size(), 300, "{arch}");
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(tok.id_to_token(1).as_deref(), Some("<|im_start|>"));
        assert_eq!(tok.special_tokens().eos.as_deref(), Some("<|im_end|>"));
        // skip_special_tokens drops the ChatML markers.
        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    }
}

#[test]
fn eos_ids_are_the_union_of_all_sources() {
    let dir = copy_fixture("qwen2");
    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": [0, 2]}"#).unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"eos_token_id": 1}"#).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[0, 2, 1]);

    std::fs::write(dir.path().join("config.json"), r#"{"eos_token_id": "two"}"#).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("config.json") && err.contains("eos_token_id"), "{err}");
}

#[test]
fn special_tokens_as_objects_and_template_in_config() {
    let dir = copy_fixture("llama");
    std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
    std::fs::remove_file(dir.path().join("special_tokens_map.json")).unwrap();
    let config = json!({
        "eos_token": {"content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false},
        "pad_token": "<|endoftext|>",
        "bos_token": null,
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token ~ eos_token ~ messages[0]['content'] }}"}
        ]
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[2]);
    // bos_token is unset, so it renders as the empty string (jinja2's lenient undefined).
    assert_eq!(tok.apply_chat_template(&[user("x")], false, None).unwrap(), "<|im_end|>x");

    // A list without a `default` entry names the field.
    let config = json!({"eos_token": "<|im_end|>", "chat_template": [{"name": "tool_use", "template": "T"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::ConfigField { field, .. } if field == "chat_template"), "{err}");

    // No template anywhere: loading works, rendering names the missing field.
    std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"eos_token": "<|im_end|>"}"#).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let err = tok.apply_chat_template(&[user("x")], false, None).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json") && err.contains("chat_template"), "{err}");
}

#[test]
fn missing_tokenizer_json_names_the_file() {
    let dir = copy_fixture("qwen3");
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::File { path, .. } if path.ends_with("tokenizer.json")), "{err}");
}

#[test]
fn corrupt_json_names_the_file() {
    for name in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"] {
        let dir = copy_fixture("qwen3");
        std::fs::write(dir.path().join(name), "{ not json").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(&err, Error::File { path, .. } if path.ends_with(name)), "{name}: {err}");
    }
}

#[test]
fn bad_template_syntax_names_the_file() {
    let dir = copy_fixture("qwen2");
    std::fs::write(dir.path().join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(&err, Error::File { path, .. } if path.ends_with("chat_template.jinja")), "{err}");
}

#[test]
fn raise_exception_names_the_template() {
    let dir = copy_fixture("qwen2");
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversations must start with a system message') }}{% endif %}ok",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let err = tok.apply_chat_template(&[user("hi")], false, None).unwrap_err();
    assert!(matches!(&err, Error::File { path, .. } if path.ends_with("chat_template.jinja")), "{err}");
    assert!(err.to_string().contains("Conversations must start with a system message"), "{err}");
    let sys = json!({"role": "system", "content": "s"});
    assert_eq!(tok.apply_chat_template(&[sys], false, None).unwrap(), "ok");

    // The same from a template embedded in tokenizer_config.json names the field.
    let t =
        ChatTemplate::new("{{ raise_exception('nope') }}", TemplateOrigin::field("cfg.json", "chat_template")).unwrap();
    let err = t.render(&[], false, None, &SpecialTokens::default(), None).unwrap_err();
    assert!(matches!(&err, Error::ConfigField { field, .. } if field == "chat_template"), "{err}");
    assert!(err.to_string().contains("cfg.json") && err.to_string().contains("nope"), "{err}");
}

/// A trimmed Qwen2.5-style template: `.strip()`, `.startswith()`, `.split()`, `loop.last`,
/// `namespace`, `tojson`, whitespace control and the jinja2 block trimming transformers uses.
const QWEN_STYLE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" and message.content.startswith('<tool_response>') %}
        {{- '<|im_start|>tool\n' + message.content.strip() + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
        {{- '<|im_start|>assistant\n' + content.strip() }}
        {%- if not loop.last %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif not (tools and loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\n' + message.content.strip() + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

#[test]
fn qwen_style_template_uses_python_methods() {
    let t = ChatTemplate::new(QWEN_STYLE, TemplateOrigin::file("qwen.jinja")).unwrap();
    let special = SpecialTokens { eos: Some("<|im_end|>".into()), ..Default::default() };
    let messages = vec![
        user("  what is 2+2?  \n"),
        json!({"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}),
        user("<tool_response> 42 </tool_response>"),
        json!({"role": "assistant", "content": " done "}),
    ];
    let text = t.render(&messages, false, None, &special, None).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nwhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n4<|im_end|>\n\
         <|im_start|>tool\n<tool_response> 42 </tool_response><|im_end|>\n\
         <|im_start|>assistant\ndone"
    );

    let tools =
        json!([{"type": "function", "function": {"name": "add", "parameters": {"a": 1.5, "ok": true, "s": "é\"<"}}}]);
    let sys = json!({"role": "system", "content": "Be brief."});
    let text = t.render(&[sys, user("hi")], true, Some(&tools), &special, None).unwrap();
    // Python's json.dumps(ensure_ascii=False) spacing; keys keep their insertion order, as in Python.
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n\
         {\"type\": \"function\", \"function\": {\"name\": \"add\", \"parameters\": {\"a\": 1.5, \"ok\": true, \"s\": \"é\\\"<\"}}}\n\
         </tools><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn jinja2_whitespace_and_filters() {
    let special = SpecialTokens::default();
    let render = |src: &str, extra: Option<&serde_json::Map<String, Value>>| {
        ChatTemplate::new(src, TemplateOrigin::file("t.jinja"))
            .unwrap()
            .render(&[user("a"), user("b")], false, None, &special, extra)
            .unwrap()
    };
    // trim_blocks + lstrip_blocks: block lines leave no blank lines or indentation.
    assert_eq!(
        render("{% for m in messages %}\n  {% if loop.last %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}\n", None),
        "b\n"
    );
    // One trailing newline of the source is dropped (keep_trailing_newline=False), not two.
    assert_eq!(render("x\n\n", None), "x\n");
    // tojson with indent, as Python's json.dumps(indent=2).
    assert_eq!(
        render("{{ messages[0] | tojson(indent=2) }}", None),
        "{\n  \"role\": \"user\",\n  \"content\": \"a\"\n}"
    );
    // Extra variables (e.g. Qwen3's enable_thinking) and tools=None; booleans print as Python's.
    let extra = json!({"enable_thinking": false}).as_object().unwrap().clone();
    assert_eq!(
        render(
            "{% if enable_thinking is defined and not enable_thinking %}off{% endif %}{{ tools is none }}",
            Some(&extra)
        ),
        "offTrue"
    );
    // strftime_now gives a four-digit year.
    let year = render("{{ strftime_now('%Y') }}", None);
    assert!(year.len() == 4 && year.parse::<u32>().unwrap() >= 2024, "{year}");
    // {% generation %} blocks render their content.
    assert_eq!(render("{% generation %}g{% endgeneration %}", None), "g");
}

#[test]
fn byte_level_tokenizer_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    write_byte_level_tokenizer(dir.path()).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.vocab_size(), BYTE_LEVEL_VOCAB_SIZE);
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert_eq!(tok.pad_token_id(), Some(0));
    assert_eq!(tok.bos_token_id(), None);

    for text in [
        "",
        "hello world",
        "  leading spaces and ünïcödé ✓",
        "emoji 🦀🎉\ttab\r\nnewline",
        "日本語のテキスト",
        "\u{0}\u{1f} control",
    ] {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte: {text:?}");
        assert!(ids.iter().all(|&id| (3..BYTE_LEVEL_VOCAB_SIZE as u32).contains(&id)));
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // Every single byte value maps to its own id.
    let all: std::collections::HashSet<u32> =
        (0u8..=127).map(|b| tok.encode(std::str::from_utf8(&[b]).unwrap(), false).unwrap()[0]).collect();
    assert_eq!(all.len(), 128);

    // Same ChatML rendering and special-token ids as the fixtures.
    let messages = vec![json!({"role": "system", "content": "You are terse."}), user("Hello, world!")];
    let text = tok.apply_chat_template(&messages, true, None).unwrap();
    assert_eq!(text, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n");
    let ids = tok.encode_chat(&messages, true, None).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 2);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(tok.decode(&ids, true).unwrap(), "system\nYou are terse.\nuser\nHello, world!\nassistant\n");

    // Its chat template matches the fixtures' chat_template.jinja.
    let fixture_template = std::fs::read_to_string(fixture("qwen2").join("chat_template.jinja")).unwrap();
    assert_eq!(tok.chat_template().unwrap().source(), fixture_template);
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<ChatTemplate>();
}
