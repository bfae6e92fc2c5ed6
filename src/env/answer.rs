//! Final-answer extraction and answer equivalence for math-style tasks (`math`, `calculator`).
//!
//! Extraction from a reply ([`extract_final_answer`]), first rule that applies:
//! 1. the content of the last `\boxed{...}` (or `\fbox{...}`), braces nested to any depth;
//!    an unclosed box is no answer;
//! 2. else the text after the last `####`, up to the end of its line;
//! 3. else the text after the last `Answer:` (any case), up to the end of its line.
//!
//! A reference answer ([`reference_answer`]) is the text after the last `####` when there is one
//! (GSM8K's `... #### 42`), else the whole text.
//!
//! Equivalence ([`answers_match`]): both sides are normalised (trimmed; `$`, `\$`, `\!`, `\,`,
//! `\left`, `\right` dropped; `\text{x}`/`\mbox{x}`/`\mathrm{x}` unwrapped; one trailing `.`
//! dropped). If both parse as numbers ([`parse_number`]) they match iff the values are exactly
//! equal (rationals, no tolerance: `0.33` is not `1/3`). Otherwise they match iff the strings
//! are equal after collapsing whitespace runs to one space. Number forms: integers, decimals,
//! `a/b`, `\frac{a}{b}` (also `\dfrac`, `\tfrac`), a sign (spaces after it allowed: `- 3` is -3),
//! thousands separators (`1,000`, groups of exactly three digits), and trailing unit words or
//! `%` after the number (`5 cm`, `50%` read as 5 and 50: minimal unit handling, not a unit
//! conversion).

use super::expr::Rational;

/// The final answer of a model reply, or `None` when it gives none (see the module rules).
pub fn extract_final_answer(reply: &str) -> Option<String> {
    if let Some(boxed) = last_boxed(reply) {
        return boxed.map(|s| s.trim().to_string());
    }
    if let Some(i) = reply.rfind("####") {
        return Some(first_line(&reply[i + 4..]));
    }
    let lower = reply.to_ascii_lowercase();
    lower.rfind("answer:").map(|i| first_line(&reply[i + "answer:".len()..]))
}

/// A dataset's reference answer: after the last `####` if any, else the whole text, trimmed.
pub fn reference_answer(answer: &str) -> String {
    match answer.rfind("####") {
        Some(i) => answer[i + 4..].trim().to_string(),
        None => answer.trim().to_string(),
    }
}

/// Whether a predicted answer matches the reference (numerically, else as normalised strings).
pub fn answers_match(predicted: &str, reference: &str) -> bool {
    let (p, r) = (normalize(predicted), normalize(reference));
    match (parse_number(&p), parse_number(&r)) {
        (Some(a), Some(b)) => a == b,
        _ => !p.is_empty() && collapse_ws(&p) == collapse_ws(&r),
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").trim().to_string()
}

fn collapse_ws(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `Some(Some(content))` for the last closed box, `Some(None)` when the last box is unclosed,
/// `None` when there is no box at all.
fn last_boxed(text: &str) -> Option<Option<String>> {
    let start = ["\\boxed", "\\fbox"].iter().filter_map(|m| text.rfind(m).map(|i| (i, m.len()))).max()?;
    let rest = text[start.0 + start.1..].trim_start();
    let Some(inner) = rest.strip_prefix('{') else { return Some(None) };
    Some(braced(inner).map(|(content, _)| content.to_string()))
}

/// Given the text just after an opening `{`, its content up to the matching `}` and the rest.
fn braced(text: &str) -> Option<(&str, &str)> {
    let mut depth = 1usize;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[..i], &text[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// Drops the LaTeX and punctuation noise that does not change an answer (module doc).
pub fn normalize(answer: &str) -> String {
    let mut s = answer.trim().to_string();
    for wrapper in ["\\text{", "\\mbox{", "\\mathrm{", "\\textbf{"] {
        while let Some(i) = s.find(wrapper) {
            match braced(&s[i + wrapper.len()..]) {
                Some((content, rest)) => s = format!("{}{}{}", &s[..i], content, rest),
                None => break,
            }
        }
    }
    s = s.replace("\\%", "%");
    for noise in ["\\left", "\\right", "\\$", "\\!", "\\,", "\\;", "$"] {
        s = s.replace(noise, "");
    }
    let s = s.trim();
    let s = s.strip_suffix('.').unwrap_or(s);
    s.trim().to_string()
}

/// The exact value of a normalised answer that is a number (module doc), else `None`.
pub fn parse_number(text: &str) -> Option<Rational> {
    let t = text.trim();
    let (negative, t) = match t.strip_prefix('-').or_else(|| t.strip_prefix('−')) {
        Some(rest) => (true, rest.trim_start()),
        None => (false, t.strip_prefix('+').unwrap_or(t).trim_start()),
    };
    let value = parse_frac_command(t).or_else(|| parse_plain(t))?;
    if negative {
        value.checked_neg().ok()
    } else {
        Some(value)
    }
}

/// `\frac{a}{b}` (also `\dfrac`, `\tfrac`) with numbers a and b, nothing after.
fn parse_frac_command(t: &str) -> Option<Rational> {
    let rest = ["\\frac", "\\dfrac", "\\tfrac"].iter().find_map(|c| t.strip_prefix(c))?;
    let (a, rest) = braced(rest.trim_start().strip_prefix('{')?)?;
    let (b, rest) = braced(rest.trim_start().strip_prefix('{')?)?;
    if !rest.trim().is_empty() {
        return None;
    }
    parse_number(a)?.checked_div(parse_number(b)?).ok()
}

/// `number` or `number/number`, then optional unit words or `%`.
fn parse_plain(t: &str) -> Option<Rational> {
    let (value, rest) = unsigned_number(t)?;
    let (value, rest) = match rest.trim_start().strip_prefix('/') {
        Some(after) => {
            let (den, rest) = unsigned_number(after.trim_start())?;
            (value.checked_div(den).ok()?, rest)
        }
        None => (value, rest),
    };
    // Minimal units: what remains may only be `%`, or letter words after a space (`5 cm`,
    // `12 dollars`); `3x` or `2\pi` are not numbers, so they compare as strings.
    let units = rest.trim_end();
    let ok = units.is_empty()
        || units == "%"
        || (rest.starts_with(char::is_whitespace) && units.chars().all(|c| c.is_alphabetic() || c.is_whitespace()));
    ok.then_some(value)
}

/// An unsigned decimal with optional thousands separators at the start of `t`, and the rest.
fn unsigned_number(t: &str) -> Option<(Rational, &str)> {
    let bytes = t.as_bytes();
    let mut i = 0;
    let mut digits = String::new();
    let mut group = 0usize; // digits since the last comma
    let mut saw_comma = false;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_digit() {
            digits.push(b as char);
            group += 1;
        } else if b == b','
            && is_group(&bytes[i + 1..])
            && group >= 1
            && (if saw_comma { group == 3 } else { group <= 3 })
        {
            // A thousands separator: after 1-3 digits (first group) or exactly 3, before 3.
            saw_comma = true;
            group = 0;
        } else {
            break;
        }
        i += 1;
    }
    if digits.is_empty() || (saw_comma && group != 3) {
        return None;
    }
    let mut text = digits;
    if i < bytes.len() && bytes[i] == b'.' && bytes.get(i + 1).is_some_and(|b| b.is_ascii_digit()) {
        let start = i + 1;
        i = start;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        text = format!("{text}.{}", &t[start..i]);
    }
    Some((Rational::parse_decimal(&text).ok()?, &t[i..]))
}

/// Whether `rest` starts with exactly three digits not followed by a fourth.
fn is_group(rest: &[u8]) -> bool {
    rest.len() >= 3 && rest[..3].iter().all(u8::is_ascii_digit) && !rest.get(3).is_some_and(u8::is_ascii_digit)
}
