//! The bodies a served request reads and writes: a request body with a read deadline, and a
//! response body that keeps its connection busy and ends at the shutdown deadline.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Sleep;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::{BodyReadTimeout, InFlight};
use crate::api::error::{ApiError, ErrorResponse};

pub(super) fn shutdown_error() -> ApiError {
    ApiError::Unavailable(crate::engine::EngineError::Stopped)
}

/// A request body that fails with [`BodyReadTimeout`] once its time is up.
pub(super) struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
}

impl TimedBody {
    pub(super) fn new(inner: Incoming, timeout: Duration) -> TimedBody {
        TimedBody {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
        }
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        ready!(self.deadline.as_mut().poll(cx));
        Poll::Ready(Some(Err(Box::new(BodyReadTimeout(self.timeout)))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that keeps its connection busy while it lives and, at the shutdown
/// deadline, ends: an event stream with an error event, anything else with an error that
/// makes hyper close the connection.
pub(super) struct GuardedBody {
    inner: Body,
    _in_flight: InFlight,
    /// `None` for the response that the deadline itself produced.
    deadline_passed: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    is_event_stream: bool,
    ended: bool,
}

impl GuardedBody {
    pub(super) fn new(
        inner: Body,
        in_flight: InFlight,
        deadline_passed: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
        is_event_stream: bool,
    ) -> GuardedBody {
        GuardedBody {
            inner,
            _in_flight: in_flight,
            deadline_passed,
            is_event_stream,
            ended: false,
        }
    }
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(deadline_passed) = &mut this.deadline_passed
            && deadline_passed.as_mut().poll(cx).is_ready()
        {
            this.ended = true;
            if this.is_event_stream {
                return Poll::Ready(Some(Ok(Frame::data(shutdown_event()))));
            }
            return Poll::Ready(Some(Err(axum::Error::new(shutdown_error()))));
        }
        Pin::new(&mut this.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The server-sent event that ends a stream cut by the shutdown deadline, in the shape of
/// every other error event.
fn shutdown_event() -> Bytes {
    let (_, axum::Json(body)): (StatusCode, axum::Json<ErrorResponse>) = shutdown_error().into();
    let json = crate::api::stream::to_json(&body);
    Bytes::from(format!("data: {json}\n\n"))
}
