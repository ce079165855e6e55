//! Admission control: at most `--max-waiting-requests` sequences in the server at once, from
//! their request's headers until its response body is done; beyond that, 429 at once.
//!
//! A request takes one permit before its body is read, which bounds the memory bodies can take
//! to the limit times `--max-request-body`. Once validation knows how many sequences it starts
//! (prompts times `n`), it takes one more per extra sequence. It keeps them while it waits for
//! the engine and while its response streams, and gives them back however it ends (finished,
//! failed, or the client gone), because they live in the response body.

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use super::held_body::HeldBody;

/// How many sequences may be in the server at once.
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

    /// Sequences admitted and not yet finished.
    pub fn num_in_flight(&self) -> usize {
        self.limit - self.permits.available_permits()
    }

    fn overloaded(&self) -> ApiError {
        ApiError::Overloaded { limit: self.limit }
    }
}

/// A request's hold on admission, in its extensions: the handler grows it to one permit per
/// sequence with [`AdmissionTicket::reserve`].
#[derive(Debug, Clone)]
pub struct AdmissionTicket {
    admission: Admission,
    held: Arc<Mutex<OwnedSemaphorePermit>>,
}

impl AdmissionTicket {
    /// Makes the request hold one permit per sequence it starts; 429 when they are not free,
    /// 400 when the request alone needs more than the limit.
    pub fn reserve(&self, num_sequences: usize) -> Result<(), ApiError> {
        let limit = self.admission.limit;
        if num_sequences > limit {
            return Err(ApiError::TooManySequences {
                requested: num_sequences,
                limit,
            });
        }
        let mut held = self.held.lock().map_err(|_| self.admission.overloaded())?;
        let extra = num_sequences.saturating_sub(held.num_permits());
        if extra == 0 {
            return Ok(());
        }
        let extra = u32::try_from(extra).map_err(|_| self.admission.overloaded())?;
        let more = self
            .admission
            .permits
            .clone()
            .try_acquire_many_owned(extra)
            .map_err(|_| self.admission.overloaded())?;
        held.merge(more);
        Ok(())
    }
}

/// Admits the request with one permit, or answers 429 with `Retry-After`.
pub async fn admit(
    State(admission): State<Admission>,
    mut request: Request,
    next: Next,
) -> Response {
    let Ok(permit) = admission.permits.clone().try_acquire_owned() else {
        return admission.overloaded().into_response();
    };
    let ticket = AdmissionTicket {
        admission,
        held: Arc::new(Mutex::new(permit)),
    };
    request.extensions_mut().insert(ticket.clone());
    next.run(request)
        .await
        .map(|body| Body::new(HeldBody::new(body, ticket)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(admission: &Admission) -> Option<AdmissionTicket> {
        let permit = admission.permits.clone().try_acquire_owned().ok()?;
        Some(AdmissionTicket {
            admission: admission.clone(),
            held: Arc::new(Mutex::new(permit)),
        })
    }

    #[test]
    fn permits_count_sequences_and_come_back_when_bodies_drop() {
        let admission = Admission::new(4);
        let first = ticket(&admission).expect("one");
        first.reserve(3).expect("three sequences fit");
        first.reserve(2).expect("already held");
        assert_eq!(admission.num_in_flight(), 3);
        let second = ticket(&admission).expect("the fourth permit");
        assert!(matches!(
            second.reserve(2),
            Err(ApiError::Overloaded { limit: 4 })
        ));
        assert!(matches!(
            second.reserve(5),
            Err(ApiError::TooManySequences {
                requested: 5,
                limit: 4
            })
        ));
        assert!(ticket(&admission).is_none());
        // A response body returns its request's permits when it is dropped.
        let body = HeldBody::new(Body::from("done"), first.clone());
        drop(first);
        assert_eq!(admission.num_in_flight(), 4, "the body still holds them");
        drop(body);
        assert_eq!(admission.num_in_flight(), 1);
        drop(second);
        assert_eq!(admission.num_in_flight(), 0);
        assert_eq!(Admission::new(0).limit, 1);
    }
}
