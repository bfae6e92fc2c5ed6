//! Tool calls in a model's reply, in the two forms chat templates teach models:
//! - Hermes (Qwen2.5, Qwen3, Qwen3.5 and most tool-tuned models): any text, then one or more
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the last one may be cut off
//!   before its closing tag by the end of the reply);
//! - Llama 3's JSON form: the whole reply is `{"name": ..., "parameters": {...}}` (or
//!   `"arguments"`), optionally after `<|python_tag|>`, several separated by `;`.
//!
//! A reply with no call, or with a call that does not parse (not JSON, no string `name`, arguments
//! not an object), is no tool call at all: the caller returns it as content.

use serde_json::{Deserializer, Value};

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// The calls in a reply: the text before them (None when only whitespace) and the calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// The tool calls of `reply`, or None when it has none that parse.
pub fn parse(reply: &str) -> Option<Parsed> {
    if let Some(start) = reply.find(OPEN) {
        return hermes(reply, start);
    }
    let body = reply.trim_start();
    let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
    if body.starts_with('{') {
        return json_form(body);
    }
    None
}

fn hermes(reply: &str, start: usize) -> Option<Parsed> {
    let content = reply[..start].trim();
    let mut calls = vec![];
    let mut rest = &reply[start..];
    while let Some(at) = rest.find(OPEN) {
        let after = &rest[at + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        calls.push(call(&serde_json::from_str::<Value>(body.trim()).ok()?, "arguments")?);
        rest = next;
    }
    Some(Parsed { content: (!content.is_empty()).then(|| content.to_string()), calls })
}

fn json_form(body: &str) -> Option<Parsed> {
    let mut calls = vec![];
    let mut rest = body;
    while !rest.is_empty() {
        let mut values = Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        let key = if value.get("parameters").is_some() { "parameters" } else { "arguments" };
        calls.push(call(&value, key)?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    Some(Parsed { content: None, calls })
}

/// `{"name": "...", key: {...}}` as a call (arguments also taken as JSON text of an object).
fn call(v: &Value, key: &str) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get(key) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(o @ Value::Object(_)) => o.clone(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments: arguments.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str, args: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: args.into() }
    }

    #[test]
    fn hermes_calls_with_text_before_them() {
        let reply = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let p = parse(reply).unwrap();
        assert_eq!(p.content.as_deref(), Some("Let me look."));
        assert_eq!(p.calls, vec![one("get_weather", r#"{"city":"Paris","days":2}"#), one("now", "{}")]);
    }

    #[test]
    fn a_hermes_call_cut_off_before_its_closing_tag_still_parses_when_complete() {
        let p = parse("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}").unwrap();
        assert_eq!((p.content, p.calls), (None, vec![one("f", r#"{"x":1}"#)]));
    }

    #[test]
    fn llama3_json_calls() {
        let p = parse(
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": \"a;b\"}}; {\"name\": \"g\", \"parameters\": {}}",
        )
        .unwrap();
        assert_eq!(p.calls, vec![one("f", r#"{"x":"a;b"}"#), one("g", "{}")]);
        let p = parse(" {\"name\": \"f\", \"arguments\": \"{\\\"y\\\": 2}\"}").unwrap();
        assert_eq!(p.calls, vec![one("f", r#"{"y":2}"#)]);
    }

    #[test]
    fn malformed_or_absent_calls_are_no_calls() {
        for reply in [
            "plain text",
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
            "{\"name\": \"f\", \"parameters\": {}} trailing words",
            "{not json",
            "<tool_call>",
        ] {
            assert_eq!(parse(reply), None, "{reply}");
        }
    }
}
