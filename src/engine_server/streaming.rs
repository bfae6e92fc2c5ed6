//! Streamed answers (`stream: true`): server-sent events, one `data: {json}` chunk per engine
//! step and choice, `data: [DONE]` last; with `stream_options.include_usage`, every chunk has
//! `usage: null` and a last chunk without choices carries the usage.
//!
//! What a stream holds, concatenated per choice, is exactly the unstreamed answer: the token ids,
//! log-probs and top log-probs arrive as the engine samples them, and the text as far as it is
//! final — a piece that could still be the start of a stop string, or bytes of a character not
//! yet complete (U+FFFD so far), wait for the next tokens; the last chunk of a choice brings the
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
        self.tokens.extend_from_slice(tokens);
        let mut t = text(s, &self.tokens)?;
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
        // A character whose bytes are not all decoded yet.
        while t.ends_with('\u{FFFD}') {
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
