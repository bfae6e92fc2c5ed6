//! [`ApiError`]: how a failed request or future is reported to the SDK.
//!
//! A direct request answers with an HTTP status and `{"error", "category"}`; a future that
//! failed answers `retrieve_future` with 200 and the same body (the SDK raises it). The category
//! is `user` for bad input (unknown model, loss name, config key, tensor shape, malformed body:
//! the library's [`Error::Input`] and friends) and `server` for everything else.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    User,
    Server,
}

impl Category {
    pub fn as_str(self) -> &'static str {
        match self {
            Category::User => "user",
            Category::Server => "server",
        }
    }

    pub fn parse(s: &str) -> Category {
        if s == "user" {
            Category::User
        } else {
            Category::Server
        }
    }
}

#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub category: Category,
    pub message: String,
}

impl ApiError {
    /// Bad input: 400, category `user`.
    pub fn user(message: impl std::fmt::Display) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, category: Category::User, message: message.to_string() }
    }

    /// An unknown id: 404, category `user`.
    pub fn not_found(message: impl std::fmt::Display) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, category: Category::User, message: message.to_string() }
    }

    pub fn unauthorized(message: impl std::fmt::Display) -> Self {
        ApiError { status: StatusCode::UNAUTHORIZED, category: Category::User, message: message.to_string() }
    }

    /// A failure of the server itself: 500, category `server`.
    pub fn server(message: impl std::fmt::Display) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, category: Category::Server, message: message.to_string() }
    }

    /// The body the SDK reads: `{"error": message, "category": "user" | "server"}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": self.message, "category": self.category.as_str()})
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        match e {
            Error::Input(_) | Error::ConfigField { .. } | Error::Tensor { .. } => ApiError::user(e),
            _ => ApiError::server(e),
        }
    }
}

impl From<rusqlite::Error> for ApiError {
    fn from(e: rusqlite::Error) -> Self {
        ApiError::server(format!("database: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

pub type ApiResult<T> = std::result::Result<T, ApiError>;
