//! Hugging Face chat templates (Jinja) rendered with minijinja the way transformers renders them.
//!
//! transformers compiles a template in a sandboxed jinja2 environment with `trim_blocks=True`,
//! `lstrip_blocks=True` (and jinja2's default `keep_trailing_newline=False`, which drops one
//! trailing newline of the source), no auto-escaping, a custom `tojson` filter
//! (`json.dumps(ensure_ascii=False, ...)`) and the globals `raise_exception` and `strftime_now`,
//! then renders with `messages`, `tools`, `documents`, `add_generation_prompt`, the special
//! tokens (`bos_token`, `eos_token`, ...) and any extra keyword arguments (e.g. Qwen3's
//! `enable_thinking`). This module reproduces that environment; Python string and dict methods
//! (`.strip()`, `.startswith()`, `.items()`, ...) come from minijinja-contrib's pycompat callback.
//!
//! Simplifications, where the output can differ from jinja2 on unusual templates:
//! - Map keys keep their insertion order as in Python (minijinja and serde_json are built with
//!   `preserve_order`), so `tojson` of tool schemas matches transformers.
//! - A printed list or dict quotes its strings with `"` (`[1, "a", None]`) where Python's repr
//!   uses `'`; scalars print as in Python (`None`, `True`, `1.0`).
//! - `strftime_now` formats the current time in UTC (transformers uses local time), and knows
//!   the common `%` directives only.
//! - `{% generation %}` blocks (used only for assistant-token masks) are rendered as plain
//!   content; assistant masks are not computed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Rest, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, UndefinedBehavior};

use crate::dates::{civil_from_days, days_from_civil};
use crate::error::{Error, Result};

/// Where a template's source came from, for error messages: a file, and the JSON field within it
/// when the template was embedded in `tokenizer_config.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateOrigin {
    pub path: PathBuf,
    pub field: Option<String>,
}

impl TemplateOrigin {
    /// A template stored as a whole file (e.g. `chat_template.jinja`).
    pub fn file(path: impl Into<PathBuf>) -> Self {
        TemplateOrigin { path: path.into(), field: None }
    }

    /// A template stored in a JSON field (e.g. `tokenizer_config.json` field `chat_template`).
    pub fn field(path: impl Into<PathBuf>, field: impl Into<String>) -> Self {
        TemplateOrigin { path: path.into(), field: Some(field.into()) }
    }

    /// An error naming this origin.
    pub fn error(&self, message: impl std::fmt::Display) -> Error {
        match &self.field {
            Some(field) => Error::field(&self.path, field, message),
            None => Error::file(&self.path, message),
        }
    }

    fn display_name(&self) -> String {
        match &self.field {
            Some(field) => format!("{}:{}", self.path.display(), field),
            None => self.path.display().to_string(),
        }
    }
}

/// The special-token strings a template may reference (`bos_token`, `eos_token`, ...); unset ones
/// are left undefined in the template, as in transformers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub pad: Option<String>,
    pub unk: Option<String>,
}

/// A compiled chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    name: String,
    source: String,
    origin: TemplateOrigin,
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors name `origin`.
    pub fn new(source: impl Into<String>, origin: TemplateOrigin) -> Result<Self> {
        let source = source.into();
        let name = origin.display_name();
        let mut env = Environment::new();
        // The settings of transformers' `_compile_jinja_template`.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(name.clone(), strip_generation_tags(&source))
            .map_err(|e| origin.error(format!("invalid chat template: {}", describe(&e))))?;
        Ok(ChatTemplate { env, name, source, origin })
    }

    /// Reads and compiles a template file (e.g. `chat_template.jinja`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let source =
            std::fs::read_to_string(path).map_err(|e| Error::file(path, format!("cannot read chat template: {e}")))?;
        Self::new(source, TemplateOrigin::file(path))
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template came from.
    pub fn origin(&self) -> &TemplateOrigin {
        &self.origin
    }

    /// Renders a conversation as transformers' `apply_chat_template(tokenize=False)` does.
    /// `extra` holds further template variables (transformers' `**kwargs`, e.g.
    /// `{"enable_thinking": false}`); they override the standard ones of the same name.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        special: &SpecialTokens,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        // transformers passes `tools=None` / `documents=None` rather than leaving them undefined.
        ctx.insert("tools".into(), tools.map(Value::from_serialize).unwrap_or(Value::from(())));
        ctx.insert("documents".into(), Value::from(()));
        let tokens = [
            ("bos_token", &special.bos),
            ("eos_token", &special.eos),
            ("pad_token", &special.pad),
            ("unk_token", &special.unk),
        ];
        for (name, token) in tokens {
            if let Some(token) = token {
                ctx.insert(name.into(), Value::from(token.as_str()));
            }
        }
        if let Some(extra) = extra {
            for (k, v) in extra {
                ctx.insert(k.clone(), Value::from_serialize(v));
            }
        }
        let template = self
            .env
            .get_template(&self.name)
            .map_err(|e| self.origin.error(format!("invalid chat template: {}", describe(&e))))?;
        template.render(ctx).map_err(|e| {
            if e.kind() == ErrorKind::InvalidOperation && is_raised(&e) {
                self.origin.error(format!(
                    "chat template raised an exception: {}",
                    e.detail().unwrap_or_default().trim_start_matches(RAISED_PREFIX)
                ))
            } else {
                self.origin.error(format!("cannot render chat template: {}", describe(&e)))
            }
        })
    }
}

const RAISED_PREFIX: &str = "raise_exception: ";

fn is_raised(e: &minijinja::Error) -> bool {
    e.detail().is_some_and(|d| d.starts_with(RAISED_PREFIX))
}

/// The error's message with its template line, and the causes below it.
fn describe(e: &minijinja::Error) -> String {
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        out.push_str(&format!(": {c}"));
        cause = c.source();
    }
    out
}

/// `raise_exception(msg)`: aborts rendering with `msg` (transformers raises `TemplateError`).
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("{RAISED_PREFIX}{message}")))
}

/// minijinja has no custom tags, so `{% generation %}` / `{% endgeneration %}` (transformers'
/// `AssistantTracker` extension, which only records spans) become an always-true `if`; whitespace
/// control markers are kept.
fn strip_generation_tags(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_string();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

// ---------------------------------------------------------------------------------------------
// tojson: Python's json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn tojson_filter(value: &Value, args: Rest<Value>) -> std::result::Result<String, minijinja::Error> {
    let mut args = args.0;
    let kwargs = if args.last().is_some_and(Value::is_kwargs) { args.pop() } else { None };
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(minijinja::Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let mut given: BTreeMap<&str, Value> = names.iter().copied().zip(args).collect();
    if let Some(kwargs) = kwargs {
        for key in kwargs.try_iter()? {
            let name = key.as_str().unwrap_or_default().to_string();
            let Some(slot) = names.iter().find(|n| **n == name) else {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got an unexpected keyword argument `{name}`"),
                ));
            };
            given.insert(slot, kwargs.get_item(&key)?);
        }
    }
    let is_set = |v: Option<&Value>| v.filter(|v| !v.is_none() && !v.is_undefined()).cloned();
    let indent = match is_set(given.get("indent")) {
        None => None,
        Some(v) if v.kind() == ValueKind::Number => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
        Some(v) => Some(v.as_str().unwrap_or_default().to_string()),
    };
    let (item_sep, key_sep) = match is_set(given.get("separators")) {
        Some(seps) => {
            let parts: Vec<Value> = seps.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => (a.to_string(), b.to_string()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be a pair (item_separator, key_separator)",
                    ))
                }
            }
        }
        // Python drops the space after ',' when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let opts = JsonOptions {
        ensure_ascii: is_set(given.get("ensure_ascii")).is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: is_set(given.get("sort_keys")).is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, v: &Value, o: &JsonOptions, depth: usize) -> std::result::Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: Object of type Undefined is not JSON serializable",
            ))
        }
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&python_float_repr(f64::try_from(v.clone())?));
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                write_newline_indent(out, o, depth + 1);
                // Python coerces non-string keys: 1 -> "1", True -> "true", None -> "null".
                let key_text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    _ => {
                        let mut s = String::new();
                        write_json(&mut s, key, o, depth)?;
                        s
                    }
                };
                write_json_str(out, &key_text, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, &v.get_item(key)?, o, depth + 1)?;
            }
            write_newline_indent(out, o, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                write_newline_indent(out, o, depth + 1);
                write_json(out, item, o, depth + 1)?;
            }
            write_newline_indent(out, o, depth);
            out.push(']');
        }
        other => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {other} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_newline_indent(out: &mut String, o: &JsonOptions, depth: usize) {
    if let Some(indent) = &o.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// A JSON string literal escaped as Python's `json.dumps` escapes it.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, positional for exponents in -4..16,
/// scientific (`1e+16`, `1.5e-05`) otherwise.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "1.5e-7" or "-1e16".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` always has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{sign}{a}.{b}")
        }
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

// ---------------------------------------------------------------------------------------------
// strftime_now

/// `strftime_now(fmt)`: the current time (UTC) formatted with Python `strftime` directives.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    Ok(strftime(&format, secs))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Formats Unix time `secs` (UTC) with the common `strftime` directives; others are copied.
pub(crate) fn strftime(format: &str, secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (hour, minute, second) = (tod / 3600, tod / 60 % 60, tod % 60);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (index 3)
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(-2.5), "-2.5");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(0.0001), "0.0001");
        assert_eq!(python_float_repr(123456789.125), "123456789.125");
    }

    #[test]
    fn strftime_known_date() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_309;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-07-26 13:25:09");
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %B %j %I%p %%", t), "Friday July 208 01PM %");
    }

    #[test]
    fn generation_tags_become_ifs() {
        assert_eq!(
            strip_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}{% endif %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}{% endif %}"
        );
    }
}
