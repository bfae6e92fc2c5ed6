//! Request futures: every long call (create_model, forward_backward, optim_step, …) answers at
//! once with `{"request_id"}` and runs in the background; the SDK polls
//! `POST /api/v1/retrieve_future` for the result.
//!
//! The outcome of a finished future lives in the [`Store`] (so it survives a restart); while a
//! future is pending, an in-memory slot lets pollers wait for it. A poll long-polls up to
//! [`LONG_POLL`] (the SDK's read timeout is 45 s), then answers `try_again` and the SDK polls
//! again at once. A pending sampling future can be cancelled (`cancel_future`, which the SDK sends
//! for samples it abandoned): its engine request ends at once and the future fails as cancelled.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::Notify;

use super::errors::{ApiError, ApiResult, Category};
use super::store::{Store, StoredOutcome};
use crate::locks::lock;

pub const LONG_POLL: Duration = Duration::from_secs(30);

pub const PROTOBUF: &str = "application/x-protobuf";

pub struct Futures {
    store: Arc<Store>,
    /// Error messages are stored without paths under it ([`super::checkpoints::redact`]).
    data_dir: std::path::PathBuf,
    pending: Mutex<HashMap<String, Arc<Notify>>>,
    /// Cancel hooks of pending cancellable futures.
    cancels: Mutex<HashMap<String, Canceller>>,
    long_poll: Duration,
}

type Canceller = Arc<dyn Fn() + Send + Sync>;

/// A fresh random id (128 bits, hex).
pub fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl Futures {
    pub fn new(store: Arc<Store>, long_poll: Duration, data_dir: std::path::PathBuf) -> Self {
        Futures { store, data_dir, pending: Mutex::new(HashMap::new()), cancels: Mutex::new(HashMap::new()), long_poll }
    }

    /// Registers a new pending future of the caller with `api_key`; returns its request id.
    pub fn create(&self, model_id: Option<&str>, kind: &str, api_key: Option<&str>) -> ApiResult<String> {
        let id = new_id();
        self.store.add_future(&id, model_id, kind, api_key)?;
        lock(&self.pending).insert(id.clone(), Arc::new(Notify::new()));
        Ok(id)
    }

    /// How many futures are still pending.
    pub fn pending(&self) -> usize {
        lock(&self.pending).len()
    }

    /// Makes pending future `id` cancellable with `cancel` (which must make it complete soon).
    pub fn set_canceller(&self, id: &str, cancel: Option<Canceller>) {
        if let Some(c) = cancel {
            if lock(&self.pending).contains_key(id) {
                lock(&self.cancels).insert(id.to_string(), c);
            }
        }
    }

    /// Cancels future `id` if it is pending and cancellable; a no-op for a finished one, 404 for
    /// an unknown one.
    pub fn cancel(&self, id: &str) -> ApiResult<()> {
        let hook = lock(&self.cancels).get(id).cloned();
        match hook {
            Some(c) => {
                c();
                Ok(())
            }
            None => self.store.future(id).map(|_| ()),
        }
    }

    /// Records the outcome and wakes the pollers.
    pub fn complete(&self, id: &str, outcome: StoredOutcome) {
        let outcome = match outcome {
            StoredOutcome::Error { message, category } => {
                StoredOutcome::Error { message: super::checkpoints::redact(&message, &self.data_dir), category }
            }
            other => other,
        };
        if let Err(e) = self.store.finish_future(id, &outcome) {
            // The outcome cannot be stored: report that instead (best effort).
            let _ =
                self.store.finish_future(id, &StoredOutcome::Error { message: e.message, category: Category::Server });
        }
        lock(&self.cancels).remove(id);
        let notify = lock(&self.pending).remove(id);
        if let Some(n) = notify {
            n.notify_waiters();
        }
    }

    pub fn complete_json(&self, id: &str, result: ApiResult<Value>) {
        self.complete(id, to_outcome(result.map(|v| v.to_string())));
    }

    /// Waits up to the long-poll time for the outcome; the response the SDK expects.
    pub async fn retrieve(&self, id: &str, accept_proto: bool) -> ApiResult<Response> {
        let deadline = tokio::time::Instant::now() + self.long_poll;
        loop {
            let notify = lock(&self.pending).get(id).cloned();
            let notified = notify.as_ref().map(|n| n.notified());
            if let Some(outcome) = self.store.future(id)? {
                return Ok(respond(outcome, accept_proto));
            }
            match notified {
                Some(n) => {
                    if tokio::time::timeout_at(deadline, n).await.is_err() {
                        return Ok(try_again(id));
                    }
                }
                // Pending in the store but not in memory: cannot happen after the store's
                // restart sweep, but never hang on it.
                None => return Ok(try_again(id)),
            }
        }
    }
}

pub fn to_outcome(result: ApiResult<String>) -> StoredOutcome {
    match result {
        Ok(json) => StoredOutcome::Json(json),
        Err(e) => StoredOutcome::Error { message: e.message, category: e.category },
    }
}

fn try_again(id: &str) -> Response {
    axum::Json(json!({"type": "try_again", "request_id": id, "queue_state": "active"})).into_response()
}

fn respond(outcome: StoredOutcome, accept_proto: bool) -> Response {
    let json_body = |s: String| (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], s).into_response();
    match outcome {
        StoredOutcome::Json(s) => json_body(s),
        StoredOutcome::Proto { proto, .. } if accept_proto => {
            (StatusCode::OK, [(header::CONTENT_TYPE, PROTOBUF)], proto).into_response()
        }
        StoredOutcome::Proto { json, .. } => json_body(json),
        StoredOutcome::Error { message, category } => {
            // 200 with an error body: the SDK raises it (a 4xx would be a transport error).
            axum::Json(ApiError { status: StatusCode::OK, category, message }.body()).into_response()
        }
    }
}
