//! Futures: retrieve a request's result (long poll), cancel a pending one.

use super::*;

pub(super) async fn cancel_future(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let req: types::RetrieveFutureRequest = types::parse_json(&body, "cancel_future")?;
    check_future(&state, &headers, &req.request_id)?;
    state.futures.cancel(&req.request_id)?;
    Ok(Json(json!({})))
}

pub(super) async fn retrieve_future(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let req: types::RetrieveFutureRequest = types::parse_json(&body, "retrieve_future")?;
    let accept_proto = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains(PROTOBUF));
    check_future(&state, &headers, &req.request_id)?;
    state.futures.retrieve(&req.request_id, accept_proto).await
}
