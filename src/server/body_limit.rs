//! A request body over `--max-body-mib` is answered `413` naming the limit and its flag:
//! - with a `Content-Length` over the limit, before any of the body is read;
//! - without one (`Transfer-Encoding: chunked`), when the chunks read so far pass the limit:
//!   such a body is read here, up to the limit, and handed on whole.
//!
//! Either way the rest of the body the client is still sending is then read and dropped (up to
//! [`DRAIN_MAX`] bytes, while it keeps coming) so that the client, which usually writes its
//! whole body before reading, gets the 413 rather than a reset connection; the connection is
//! closed after.

use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::{ApiError, ApiResult};
use super::AppState;

/// Bytes of a refused body read and dropped at most; past them the connection is closed.
pub const DRAIN_MAX: u64 = 1 << 30;

/// The 413 for a body of `length` bytes over `limit` bytes (`chunked`: a body without a length,
/// `length` the bytes read when it passed the limit).
pub fn too_large(length: u64, limit: usize, chunked: bool) -> ApiError {
    let mib = limit >> 20;
    let limit_text = if limit.is_multiple_of(1 << 20) { format!("{mib} MiB") } else { format!("{limit} bytes") };
    let size = if chunked {
        format!("the request body (chunked, no Content-Length) passed {length} bytes")
    } else {
        format!("the request body is {length} bytes")
    };
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        ..ApiError::user(format!(
            "{size}, over this server's limit of {limit_text} (oxrl serve --max-body-mib): send less per request \
             (fewer datums or samples), or ask for a larger limit"
        ))
    }
}

pub async fn refuse_oversized(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let limit = state.body_limit;
    let length = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    match length {
        Some(length) if length > limit as u64 => {
            if length <= DRAIN_MAX {
                tokio::spawn(drain(req.into_body(), 0));
            }
            refusal(too_large(length, limit, false))
        }
        Some(_) => next.run(req).await,
        None => {
            let (parts, mut body) = req.into_parts();
            match read_up_to(&mut body, limit).await {
                Ok(Ok(bytes)) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
                Ok(Err(read)) => {
                    tokio::spawn(drain(body, read));
                    refusal(too_large(read, limit, true))
                }
                Err(e) => e.into_response(),
            }
        }
    }
}

fn refusal(error: ApiError) -> Response {
    let mut response = error.into_response();
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Reads `body` to its end if it is at most `limit` bytes: `Ok(Ok(bytes))`; `Ok(Err(read))` once
/// the bytes read pass the limit (the rest is left in `body`).
async fn read_up_to(body: &mut Body, limit: usize) -> ApiResult<Result<Bytes, u64>> {
    let mut buf = Vec::new();
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
        let frame = frame.map_err(|e| ApiError::user(format!("reading the request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                return Ok(Err(buf.len() as u64));
            }
        }
    }
    Ok(Ok(Bytes::from(buf)))
}

/// Reads `body` to its end and drops it (the connection's idle timeout ends a stalled one),
/// `read` bytes of it read already; stops past [`DRAIN_MAX`] in all (the connection is then
/// closed).
async fn drain(mut body: Body, mut read: u64) {
    while let Some(Ok(frame)) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        read += frame.data_ref().map_or(0, |d| d.len() as u64);
        if read > DRAIN_MAX {
            return;
        }
    }
}
