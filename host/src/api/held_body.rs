//! A response body that holds a value until the body is dropped: after its last byte went out, or when the connection closed.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::response::Response;
use http_body::{Frame, SizeHint};

/// `body`, passing every frame through, with `held` dropped when it is.
pub struct HeldBody<T> {
    body: Body,
    _held: T,
}

impl<T: Send + Unpin + 'static> HeldBody<T> {
    pub fn new(body: Body, held: T) -> HeldBody<T> {
        HeldBody { body, _held: held }
    }

    /// `response` with its body holding `held`.
    pub fn around(response: Response, held: T) -> Response {
        response.map(|body| Body::new(HeldBody::new(body, held)))
    }
}

impl<T: Unpin> http_body::Body for HeldBody<T> {
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
