//! Streamed answers (`stream: true`): server-sent events, one `data: {json}` chunk per engine
//! step and choice, `data: [DONE]` last; with `stream_options.include_usage`, every chunk has
//! `usage: null` and a last chunk without choices carries the usage.
//!
//! What a stream holds, concatenated per choice, is exactly the unstreamed answer: the token ids,
//! log-probs and top log-probs arrive as the engine samples them, and the text as far as it is
//! final — a piece that could still be the start of a stop string, bytes of a character not yet
//! complete (U+FFFD so far), or trailing whitespace (a tokenizer's clean-up removes a space before
//! punctuation), wait for the next tokens; the last chunk of a choice brings the
//! rest of its final text and its `finish_reason`. A client that disconnects drops the body,
//! which ends the producing task and with it the engine requests ([`super::jobs`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use hyper::body::Frame;
use serde_json::Value;
use tokio::sync::mpsc;

use super::openai::{text, OpenAiError};
use super::EngineServer;

/// The response body: what the producing task sends, as it sends it.
struct SseBody(mpsc::UnboundedReceiver<Bytes>);

impl hyper::body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// Where a stream's chunks go.
pub struct Sender(mpsc::UnboundedSender<Bytes>);

impl Sender {
    /// Sends one chunk; false once the client has gone.
    pub fn chunk(&self, v: &Value) -> bool {
        self.0.send(Bytes::from(format!("data: {v}\n\n"))).is_ok()
    }

    pub fn done(&self) {
        let _ = self.0.send(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    /// Completes once the client has gone (the body was dropped).
    pub async fn closed(&self) {
        self.0.closed().await
    }
}

/// An event-stream response whose chunks `produce` sends; it runs as a task of its own, and
/// what it holds (the engine requests) is dropped when it ends or the client goes.
pub fn respond<F, Fut>(produce: F) -> Response
where
    F: FnOnce(Sender) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let sender = Sender(tx);
    tokio::spawn(produce(sender));
    (
        [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")],
        axum::body::Body::new(SseBody(rx)),
    )
        .into_response()
}

/// One choice's text as its tokens arrive: what can be sent now, and the rest at the end.
#[derive(Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    sent: String,
}

impl TextStream {
    /// Tokens sent so far.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Adds `tokens`; returns the text that became final (possibly empty).
    pub fn push(&mut self, s: &EngineServer, tokens: &[u32], stops: &[String]) -> Result<String, OpenAiError> {
        self.push_with(|t| text(s, t), tokens, stops)
    }

    /// [`TextStream::push`] with `decode` for the tokenizer's decoding.
    fn push_with(
        &mut self,
        decode: impl Fn(&[u32]) -> Result<String, OpenAiError>,
        tokens: &[u32],
        stops: &[String],
    ) -> Result<String, OpenAiError> {
        self.tokens.extend_from_slice(tokens);
        let mut t = decode(&self.tokens)?;
        match stops.iter().filter_map(|stop| t.find(stop.as_str())).min() {
            Some(cut) => t.truncate(cut),
            None => {
                // The end could be the start of a stop string: hold back that much.
                let hold = stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
                let mut cut = t.len().saturating_sub(hold);
                while !t.is_char_boundary(cut) {
                    cut -= 1;
                }
                t.truncate(cut);
            }
        }
        // A character whose bytes are not all decoded yet; trailing whitespace, which the
        // tokenizer's clean-up (`clean_up_tokenization_spaces`, Llama 3's) drops before the
        // punctuation that may follow.
        while t.ends_with('\u{FFFD}') || t.ends_with(char::is_whitespace) {
            t.pop();
        }
        if t.len() > self.sent.len() && t.starts_with(&self.sent) {
            let new = t[self.sent.len()..].to_string();
            self.sent = t;
            return Ok(new);
        }
        Ok(String::new())
    }

    /// The rest of `final_text` (the choice's unstreamed text) after what was sent.
    pub fn finish(&mut self, final_text: &str) -> String {
        let rest = final_text.get(self.sent.len()..).unwrap_or_default().to_string();
        self.sent = final_text.to_string();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token i is PIECES[i]; decoding joins them and cleans up as transformers'
    /// `clean_up_tokenization_spaces` does (" ." → ".").
    const PIECES: [&str; 8] = ["Hello", " ", ".", " wor", "ld", " \u{FFFD}", "ST", "OP and more"];

    fn decode(tokens: &[u32]) -> Result<String, OpenAiError> {
        Ok(tokens.iter().map(|&t| PIECES[t as usize]).collect::<String>().replace(" .", "."))
    }

    /// Streams `tokens` one at a time; the pieces sent and the concatenation with the rest.
    fn stream(tokens: &[u32], stops: &[String], final_text: &str) -> (Vec<String>, String) {
        let mut s = TextStream::default();
        let sent: Vec<String> = tokens.iter().map(|t| s.push_with(decode, &[*t], stops).unwrap()).collect();
        let rest = s.finish(final_text);
        let whole = sent.concat() + &rest;
        (sent, whole)
    }

    #[test]
    fn the_concatenated_stream_is_the_final_text() {
        let all: Vec<u32> = (0..8).collect();
        let full = decode(&all).unwrap();
        let (sent, whole) = stream(&all, &[], &full);
        assert_eq!(whole, full);
        // The space waits for the token after it (clean-up removed it), U+FFFD for more bytes.
        assert_eq!(sent[..4], ["Hello", "", ".", " wor"]);
        assert_eq!(sent[5], "");
        // A stop string: the text before it, and nothing of it, ever sent.
        let stops = vec!["STOP".to_string()];
        let cut = full[..full.find("STOP").unwrap()].to_string();
        let (sent, whole) = stream(&all, &stops, &cut);
        assert_eq!(whole, cut);
        assert!(sent.iter().all(|p| !p.contains('S')), "{sent:?}");
    }
}
