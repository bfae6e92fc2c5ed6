//! A request whose `Content-Length` is over `--max-body-mib` is answered `413` naming the limit
//! and its flag before any of its body is read. The body the client is still sending is then
//! read and dropped (up to [`DRAIN_MAX`] bytes, while it keeps coming) so that the client, which
//! usually writes its whole body before reading, gets the 413 rather than a reset connection;
//! the connection is closed after. Bodies without a length (chunked) are cut at the limit by
//! the extractor's `DefaultBodyLimit` as before.

use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use super::AppState;

/// Bytes of a refused body read and dropped at most; past them the connection is closed.
pub const DRAIN_MAX: u64 = 1 << 30;

/// The 413 for a body of `length` bytes over `limit` bytes.
pub fn too_large(length: u64, limit: usize) -> ApiError {
    let mib = limit >> 20;
    let limit_text = if limit.is_multiple_of(1 << 20) { format!("{mib} MiB") } else { format!("{limit} bytes") };
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        ..ApiError::user(format!(
            "the request body is {length} bytes, over this server's limit of {limit_text} (oxrl serve \
             --max-body-mib): send less per request (fewer datums or samples), or ask for a larger limit"
        ))
    }
}

pub async fn refuse_oversized(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let length = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let Some(length) = length.filter(|&n| n > state.body_limit as u64) else {
        return next.run(req).await;
    };
    if length <= DRAIN_MAX {
        tokio::spawn(drain(req.into_body()));
    }
    let mut response = too_large(length, state.body_limit).into_response();
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Reads `body` to its end and drops it (the connection's idle timeout ends a stalled one).
async fn drain(mut body: Body) {
    while let Some(Ok(_)) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {}
}
