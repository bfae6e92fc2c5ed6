//! A Hugging Face tokenizer directory: `tokenizer.json` (run by the `tokenizers` crate), the chat
//! template, the special tokens and the EOS token ids, loaded the way transformers'
//! `AutoTokenizer.from_pretrained` + `GenerationConfig` see them.
//!
//! What is read from the directory:
//! - `tokenizer.json` (required). Its padding and truncation settings are dropped, as
//!   transformers does for a plain `encode` call.
//! - The chat template: `chat_template.jinja` if present (transformers gives the separate file
//!   priority), else `tokenizer_config.json` field `chat_template` (a string, or a list of
//!   `{name, template}` of which `default` is used).
//! - Special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`, each a string or an
//!   `{"content": ...}` object) from `tokenizer_config.json`, overridden by
//!   `special_tokens_map.json` as in transformers.
//! - EOS ids: the union of `generation_config.json` and `config.json` `eos_token_id` (an integer
//!   or a list) and the id of the `eos_token`, so generation stops on any of them.
//! - `clean_up_tokenization_spaces` from `tokenizer_config.json`, applied on decode.
//!
//! Simplifications: slow (sentencepiece-only) tokenizers are not supported, and tokenizer-class
//! specific rewrites of the post-processor (`LlamaTokenizerFast`'s `add_bos_token` /
//! `add_eos_token`) are not applied: `tokenizer.json`'s post-processor is used as saved.
//!
//! [`write_byte_level_tokenizer`] writes a tiny self-contained byte-level BPE tokenizer (ChatML
//! special tokens + the 256 byte symbols) for randomly initialised models.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::files::JsonFields;
use crate::model::chat_template::{ChatTemplate, SpecialTokens, TemplateOrigin};

/// Vocabulary size of [`write_byte_level_tokenizer`]'s tokenizer: 3 special tokens + 256 bytes.
pub const BYTE_LEVEL_VOCAB_SIZE: usize = 259;

/// The ChatML template (the fixtures' and Qwen's basic format), used by the byte-level tokenizer.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
const SPECIAL_TOKENS_MAP: &str = "special_tokens_map.json";
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
const GENERATION_CONFIG: &str = "generation_config.json";
const MODEL_CONFIG: &str = "config.json";

/// A loaded tokenizer directory. Cheap to share across threads (`Send + Sync`); `Clone` copies.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    chat_template: Option<ChatTemplate>,
    special: SpecialTokens,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    clean_up_tokenization_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads a Hugging Face tokenizer directory (see the module docs for what is read).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer_path = dir.join(TOKENIZER_JSON);
        if !tokenizer_path.is_file() {
            return Err(Error::file(&tokenizer_path, "missing: a tokenizer directory needs tokenizer.json"));
        }
        let mut inner = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| Error::file(&tokenizer_path, format!("cannot load tokenizer: {e}")))?;
        // transformers encodes without the padding / truncation saved in tokenizer.json.
        inner
            .with_truncation(None)
            .map_err(|e| Error::file(&tokenizer_path, format!("cannot disable truncation: {e}")))?;
        inner.with_padding(None);

        let config_path = dir.join(TOKENIZER_CONFIG);
        let config = read_json_object(&config_path)?;
        let map_path = dir.join(SPECIAL_TOKENS_MAP);
        let special_map = read_json_object(&map_path)?;

        // Special tokens: tokenizer_config.json, then special_tokens_map.json overrides.
        let mut special = SpecialTokens::default();
        let mut eos_source = config_path.clone();
        for (path, obj) in [(&config_path, &config), (&map_path, &special_map)] {
            let Some(obj) = obj else { continue };
            let slots = [
                ("bos_token", &mut special.bos),
                ("eos_token", &mut special.eos),
                ("pad_token", &mut special.pad),
                ("unk_token", &mut special.unk),
            ];
            for (field, slot) in slots {
                if let Some(v) = obj.get(field) {
                    if let Some(token) = special_token_content(path, field, v)? {
                        if field == "eos_token" {
                            eos_source = path.clone();
                        }
                        *slot = Some(token);
                    }
                }
            }
        }
        let id_of = |token: &Option<String>, field: &str, path: &Path| -> Result<Option<u32>> {
            match token {
                None => Ok(None),
                Some(t) => inner.token_to_id(t).map(Some).ok_or_else(|| {
                    Error::field(path, field, format!("token {t:?} is not in {}", tokenizer_path.display()))
                }),
            }
        };
        let special_source = |field: &str| {
            if special_map.as_ref().is_some_and(|m| m.get(field).is_some_and(|v| !v.is_null())) {
                map_path.clone()
            } else {
                config_path.clone()
            }
        };
        let bos_token_id = id_of(&special.bos, "bos_token", &special_source("bos_token"))?;
        let pad_token_id = id_of(&special.pad, "pad_token", &special_source("pad_token"))?;
        let eos_token_id = id_of(&special.eos, "eos_token", &eos_source)?;

        // EOS ids: generation_config.json, config.json, then the tokenizer's eos token.
        let mut eos_token_ids = Vec::new();
        for name in [GENERATION_CONFIG, MODEL_CONFIG] {
            let path = dir.join(name);
            if let Some(obj) = read_json_object(&path)? {
                for id in JsonFields::of_map(&path, &obj).token_ids("eos_token_id")? {
                    push_unique(&mut eos_token_ids, id);
                }
            }
        }
        if let Some(id) = eos_token_id {
            push_unique(&mut eos_token_ids, id);
        }

        let clean_up_tokenization_spaces = match &config {
            Some(c) => JsonFields::of_map(&config_path, c).bool_or("clean_up_tokenization_spaces", false)?,
            None => false,
        };

        let chat_template = load_chat_template(dir, &config_path, config.as_ref())?;

        Ok(Tokenizer {
            inner,
            dir: dir.to_path_buf(),
            chat_template,
            special,
            eos_token_ids,
            bos_token_id,
            pad_token_id,
            clean_up_tokenization_spaces,
        })
    }

    /// Token ids of `text`; `add_special_tokens` runs tokenizer.json's post-processor (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::file(self.dir.join(TOKENIZER_JSON), format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`. Unknown ids are skipped, as in transformers.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::file(self.dir.join(TOKENIZER_JSON), format!("cannot decode ids: {e}")))?;
        Ok(if self.clean_up_tokenization_spaces { clean_up_tokenization(&text) } else { text })
    }

    /// The conversation rendered by the chat template (transformers' `apply_chat_template` with
    /// `tokenize=False`). `messages` are `{"role": ..., "content": ...}` objects; `tools` is a
    /// list of JSON tool schemas.
    pub fn apply_chat_template(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, tools, &serde_json::Map::new())
    }

    /// [`apply_chat_template`](Self::apply_chat_template) with extra template variables
    /// (transformers' `**kwargs`, e.g. `{"enable_thinking": false}` for Qwen3).
    pub fn apply_chat_template_with(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            Error::field(
                self.dir.join(TOKENIZER_CONFIG),
                "chat_template",
                format!("no chat template: the field is absent and there is no {CHAT_TEMPLATE_FILE}"),
            )
        })?;
        template.render(messages, add_generation_prompt, tools, &self.special, Some(extra))
    }

    /// Token ids of the rendered conversation. The text is encoded without adding special tokens
    /// again (the template already has them), as transformers does with `tokenize=True`.
    pub fn encode_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, add_generation_prompt, tools)?;
        self.encode(&text, false)
    }

    /// Ids that end a generation (see the module docs); may be empty.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Id of the `pad_token`, if the tokenizer has one.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// Id of the `bos_token`, if the tokenizer has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Number of ids, added tokens included (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The special-token strings (`bos_token`, `eos_token`, ...).
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The directory this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` tokenizer, for anything not wrapped here.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The chat template: `chat_template.jinja` first (as transformers), else the config field.
fn load_chat_template(
    dir: &Path,
    config_path: &Path,
    config: Option<&serde_json::Map<String, Value>>,
) -> Result<Option<ChatTemplate>> {
    let file = dir.join(CHAT_TEMPLATE_FILE);
    if file.is_file() {
        return ChatTemplate::from_file(&file).map(Some);
    }
    let field = "chat_template";
    let source = match config.and_then(|c| c.get(field)) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(list)) => {
            let mut default = None;
            for entry in list {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => default = Some(t.to_string()),
                    (Some(_), Some(_)) => {}
                    _ => {
                        return Err(Error::field(
                            config_path,
                            field,
                            "each entry of the list must be an object with string `name` and `template`",
                        ))
                    }
                }
            }
            default.ok_or_else(|| {
                Error::field(config_path, field, "a list of named templates must contain one named `default`")
            })?
        }
        Some(other) => {
            return Err(Error::field(
                config_path,
                field,
                format!("expected a string or a list of {{name, template}}, found {other}"),
            ))
        }
    };
    ChatTemplate::new(source, TemplateOrigin::field(config_path, field)).map(Some)
}

/// A JSON object file, or `None` if the file does not exist.
fn read_json_object(path: &Path) -> Result<Option<serde_json::Map<String, Value>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::file(path, format!("cannot read: {e}"))),
    };
    match serde_json::from_str(&text) {
        Ok(Value::Object(obj)) => Ok(Some(obj)),
        Ok(_) => Err(Error::file(path, "invalid JSON: expected an object at the top level")),
        Err(e) => Err(Error::file(path, format!("invalid JSON: {e}"))),
    }
}

/// A special token given as a string, an `{"content": ...}` object (an AddedToken), or null.
fn special_token_content(path: &Path, field: &str, v: &Value) -> Result<Option<String>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(obj) => match obj.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(Error::field(path, field, "an object special token needs a string `content`")),
        },
        other => Err(Error::field(path, field, format!("expected a string or {{\"content\": ...}}, found {other}"))),
    }
}

fn push_unique(ids: &mut Vec<u32>, id: u32) {
    if !ids.contains(&id) {
        ids.push(id);
    }
}

/// transformers' `clean_up_tokenization`: removes the space before punctuation and English
/// contractions that word-level tokenizers leave.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

/// GPT-2's byte-to-symbol map: printable bytes map to themselves, the others to U+0100 onwards.
/// Returned in GPT-2's order (printable bytes first), which is also the vocabulary order.
fn byte_level_symbols() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut symbols: Vec<char> = (0..256u32).filter(|b| printable(*b)).filter_map(char::from_u32).collect();
    let mut next = 256u32;
    for b in 0..256u32 {
        if !printable(b) {
            symbols.push(char::from_u32(next).expect("U+0100..U+0143 are valid chars"));
            next += 1;
        }
    }
    symbols
}

/// Writes a self-contained byte-level BPE tokenizer into `dir` (created if needed):
/// `tokenizer.json` with `<|endoftext|>`=0, `<|im_start|>`=1, `<|im_end|>`=2 and the 256 byte
/// symbols (ids 3..259, no merges, so every byte is one token and any UTF-8 text round-trips),
/// `tokenizer_config.json` (eos `<|im_end|>`, pad `<|endoftext|>`, the ChatML template) and
/// `special_tokens_map.json`. Meant for randomly initialised models (`oxrl init-model`).
pub fn write_byte_level_tokenizer(dir: &Path) -> Result<()> {
    const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create directory: {e}")))?;

    let mut vocab = serde_json::Map::new();
    for (id, token) in SPECIALS.iter().enumerate() {
        vocab.insert(token.to_string(), json!(id));
    }
    for (i, symbol) in byte_level_symbols().into_iter().enumerate() {
        vocab.insert(symbol.to_string(), json!(SPECIALS.len() + i));
    }
    debug_assert_eq!(vocab.len(), BYTE_LEVEL_VOCAB_SIZE);
    let added_tokens: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, token)| {
            json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": [],
        },
    });

    let mut decoder = serde_json::Map::new();
    for (id, token) in SPECIALS.iter().enumerate() {
        decoder.insert(
            id.to_string(),
            json!({"content": token, "lstrip": false, "normalized": false, "rstrip": false,
                   "single_word": false, "special": true}),
        );
    }
    let config = json!({
        "added_tokens_decoder": decoder,
        "bos_token": null,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1_000_000_000_000_000_000u64,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    let special_map = json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"});

    for (name, value) in [(TOKENIZER_JSON, tokenizer), (TOKENIZER_CONFIG, config), (SPECIAL_TOKENS_MAP, special_map)] {
        let path = dir.join(name);
        let text =
            serde_json::to_string_pretty(&value).map_err(|e| Error::file(&path, format!("cannot serialize: {e}")))?;
        std::fs::write(&path, text + "\n").map_err(|e| Error::file(&path, format!("cannot write: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_symbols_are_gpt2_order() {
        let s = byte_level_symbols();
        assert_eq!(s.len(), 256);
        assert_eq!(s[0], '!');
        assert_eq!(s[255], '\u{143}');
        let unique: std::collections::HashSet<_> = s.iter().collect();
        assert_eq!(unique.len(), 256);
    }

    #[test]
    fn clean_up_matches_transformers() {
        assert_eq!(clean_up_tokenization("Hello , world ! I 'm here ."), "Hello, world! I'm here.");
    }
}
