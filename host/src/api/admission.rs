//! Admission control: at most `--max-waiting-requests` generation requests in the server at
//! once, from their headers until their response body is done; the rest get 429 at once.
//!
//! A request holds its permit while its body uploads, while it waits for the engine, and while
//! its response streams, and gives it back however it ends (finished, failed, or the client
//! gone), because the permit lives in the response body. Admitting before the body is read also
//! bounds the memory bodies can take to the limit times `--max-request-body`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;

/// How many generation requests may be in the server at once.
#[derive(Debug, Clone)]
pub struct Admission {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl Admission {
    pub fn new(limit: usize) -> Admission {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        Admission {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }

    /// Requests admitted and not yet finished.
    pub fn num_in_flight(&self) -> usize {
        self.limit - self.permits.available_permits()
    }
}

/// Admits the request or answers 429 with `Retry-After`.
pub async fn admit(State(admission): State<Admission>, request: Request, next: Next) -> Response {
    let Ok(permit) = admission.permits.clone().try_acquire_owned() else {
        return ApiError::Overloaded {
            limit: admission.limit,
        }
        .into_response();
    };
    next.run(request).await.map(|body| {
        Body::new(PermitBody {
            body,
            _permit: permit,
        })
    })
}

/// A response body that returns its request's permit when it is dropped: after the last
/// byte was sent, or when the connection closed.
struct PermitBody {
    body: Body,
    _permit: OwnedSemaphorePermit,
}

impl http_body::Body for PermitBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_come_back_when_bodies_drop() {
        let admission = Admission::new(2);
        let first = admission.permits.clone().try_acquire_owned().expect("one");
        let body = PermitBody {
            body: Body::from("done"),
            _permit: first,
        };
        let _second = admission.permits.clone().try_acquire_owned().expect("two");
        assert_eq!(admission.num_in_flight(), 2);
        assert!(admission.permits.clone().try_acquire_owned().is_err());
        drop(body);
        assert_eq!(admission.num_in_flight(), 1);
        assert_eq!(Admission::new(0).limit, 1);
    }
}
