//! Accepting and serving connections with limits: header, body and keep-alive timeouts, a connection cap that closes the oldest idle connection, and a graceful shutdown with a deadline.
//!
//! hyper serves each connection's HTTP/1; this module owns everything around it. Every
//! connection has a [`ConnectionState`] in one [`Registry`]: *waiting* (reading the first
//! request's headers, or idle between requests on keep-alive) or *busy* (a request is in the
//! router or its response body is being written). Only waiting connections are ever cut for
//! time or room, so the limits never end a request that is being served; the shutdown deadline
//! is the one exception, and it tells the client first.
//!
//! A request head that hyper cannot parse (a malformed request line or header, a head over
//! [`MAX_REQUEST_HEAD_BYTES`], a URI too long, an HTTP version other than 1.0 or 1.1) never
//! reaches the router: hyper answers it itself, with an empty body, and closes. hyper 1 has no
//! hook for that answer, so the socket wrapper recognises it on the way out and this module
//! sends an OpenAI-style JSON error in its place. The write side is where this is sound:
//! hyper alone knows where one request ends and the next begins (bodies by length or by
//! chunks, pipelined requests already in its buffer, heads split across reads), so a parser of
//! our own on the read side would have to repeat all of that framing to find the head that
//! failed. On the write side two facts suffice: while no request of the connection is in the
//! router, hyper writes only the end of a response or its own error answer, and that answer
//! alone is a head with an error status and `content-length: 0` (every error the router
//! returns has a body, and hyper keeps a head in a buffer of its own, so it starts a write).
//! The swallowed bodiless answer is replaced once hyper has given up the connection, by a
//! response naming hyper's parse error, with `connection: close`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Request, Response, StatusCode};
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use super::error::{ApiError, ErrorResponse};

mod bodies;

use bodies::{GuardedBody, TimedBody, shutdown_error};

/// How long connections may take and how many may be open.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// From accepting a connection, or from the first byte of a later request, until its
    /// headers are complete. Cuts off clients that send headers byte by byte.
    pub header_read_timeout: Duration,
    /// From a request's headers until the last byte of its body; a slower body gets 408.
    pub body_read_timeout: Duration,
    /// How long a keep-alive connection may sit idle between requests.
    pub keep_alive_timeout: Duration,
    /// Open connections; at the limit the oldest idle one is closed to make room.
    pub max_connections: usize,
    /// After the shutdown signal, how long requests in flight may run before they are ended.
    pub shutdown_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(75),
            max_connections: 10_000,
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// After the shutdown deadline has ended the requests in flight, how long their connections
/// get to write the error out before they are closed regardless. A client that stopped
/// reading never takes it; this only bounds the wait for one that is slow.
const ABORT_FLUSH_GRACE: Duration = Duration::from_secs(1);

/// How long the accept loop pauses after an error that the next accept would repeat (out of
/// file descriptors with no idle connection to close, out of memory), so it does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The largest request head (request line and headers) hyper reads before answering 431:
/// hyper's own default, set explicitly so that the error message can name it.
pub const MAX_REQUEST_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// How long the JSON answer to a malformed request may take to write; then the connection
/// closes regardless.
const REJECTION_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most bytes of a rejected client's remaining request read and dropped before closing, so
/// the close does not reset the connection before the client has read the answer.
const REJECTION_DRAIN_BYTES: usize = 1 << 20;

/// The request body did not arrive within [`ConnectionLimits::body_read_timeout`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("the request body did not arrive within {} s", .0.as_secs())]
pub struct BodyReadTimeout(pub Duration);

impl BodyReadTimeout {
    /// The timeout behind a body read error, looking through the layers that wrap it.
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyReadTimeout> {
        std::iter::successors(Some(error), |e| e.source()).find_map(|e| e.downcast_ref())
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes. Then it stops
/// accepting, closes idle connections, lets requests in flight finish for up to
/// [`ConnectionLimits::shutdown_timeout`], ends the rest (streams with an error event, other
/// requests with a 503), and returns once every connection is closed.
pub async fn serve_app(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let shared = Arc::new(Shared {
        registry: Registry::default(),
        limits,
        draining: AtomicBool::new(false),
        deadline_passed: CancellationToken::new(),
        force_close: AtomicBool::new(false),
    });
    let tasks = TaskTracker::new();
    accept_until(&listener, &app, &shared, &tasks, shutdown).await;
    drop(listener);
    tasks.close();
    let open = shared.registry.len();
    if open > 0 {
        tracing::info!(
            "draining {open} connection(s) for up to {} s",
            shared.limits.shutdown_timeout.as_secs()
        );
    }
    shared.begin_drain();
    if tokio::time::timeout(shared.limits.shutdown_timeout, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "shutdown deadline passed with {} connection(s) open: ending their requests",
            shared.registry.len()
        );
        shared.deadline_passed.cancel();
        if tokio::time::timeout(ABORT_FLUSH_GRACE, tasks.wait())
            .await
            .is_err()
        {
            shared.close_all();
            tasks.wait().await;
        }
    }
    Ok(())
}

async fn accept_until(
    listener: &TcpListener,
    app: &Router,
    shared: &Arc<Shared>,
    tasks: &TaskTracker,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if is_out_of_descriptors(&e) => {
                // Room for the next connection can only come from an idle one.
                if !shared.registry.evict_oldest_idle() {
                    tracing::warn!("cannot accept a connection: {e}; no idle connection to close");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                } else {
                    tokio::task::yield_now().await;
                }
                continue;
            }
            // A connection reset before it was accepted: the next one may work.
            Err(e) if is_connection_error(&e) => {
                tracing::debug!("accept failed: {e}");
                continue;
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Some(connection) = shared.registry.admit(shared.limits.max_connections) else {
            tracing::warn!(
                "{} connections open, all busy: refusing a new one",
                shared.limits.max_connections
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        tasks.spawn(serve_connection(
            stream,
            connection,
            app.clone(),
            shared.clone(),
        ));
    }
}

fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

fn is_out_of_descriptors(error: &io::Error) -> bool {
    // EMFILE (24) and ENFILE (23): the process's or the system's file table is full.
    matches!(error.raw_os_error(), Some(23 | 24))
}

/// What the accept loop, the connections and the shutdown share.
struct Shared {
    registry: Registry,
    limits: ConnectionLimits,
    /// Set at the shutdown signal: idle connections close, busy ones close after their request.
    draining: AtomicBool,
    /// Cancelled at the shutdown deadline: requests in flight end with an error.
    deadline_passed: CancellationToken,
    /// Set when connections that could not flush their error in time are to be dropped.
    force_close: AtomicBool,
}

impl Shared {
    fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.registry.wake_all();
    }

    fn close_all(&self) {
        self.force_close.store(true, Ordering::SeqCst);
        self.registry.wake_all();
    }
}

/// Drives one connection: hyper serves its requests while this loop watches the deadlines of
/// its waiting phases, an eviction, and the shutdown. A request head hyper rejected is then
/// answered with a JSON error.
async fn serve_connection(
    stream: TcpStream,
    state: Arc<ConnectionState>,
    app: Router,
    shared: Arc<Shared>,
) {
    let mut io = WatchedIo {
        inner: stream,
        state: state.clone(),
        rejected: None,
    };
    let failure = drive_connection(&mut io, &state, app, &shared).await;
    // Past the shutdown's last grace, connections close without another word.
    let may_answer = !shared.force_close.load(Ordering::SeqCst);
    if let Some(status) = io.rejected.filter(|_| may_answer) {
        let error = head_error(status, failure.as_ref());
        tracing::debug!("rejected a request head: {error}");
        answer_rejection(&mut io.inner, error).await;
    } else if let Some(e) = failure {
        tracing::debug!("connection closed: {e}");
    }
    shared.registry.remove(state.id);
}

/// Serves the connection's requests until hyper is done with it or this module cuts it;
/// hyper's error, if it ended with one.
async fn drive_connection(
    io: &mut WatchedIo,
    state: &Arc<ConnectionState>,
    app: Router,
    shared: &Shared,
) -> Option<hyper::Error> {
    let service = ConnectionService {
        app,
        state: state.clone(),
        body_read_timeout: shared.limits.body_read_timeout,
        deadline_passed: shared.deadline_passed.clone(),
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // hyper's own header timeout also runs while a keep-alive connection idles, which would
    // make the keep-alive timeout the header timeout; this module times both phases instead.
    builder
        .header_read_timeout(None)
        .keep_alive(true)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    let mut connection = std::pin::pin!(connection);
    let mut closing = false;
    loop {
        let deadline = state.waiting_deadline(&shared.limits);
        tokio::select! {
            result = connection.as_mut() => return result.err(),
            () = state.wake.notified() => {}
            () = sleep_until_some(deadline) => {}
        }
        if shared.force_close.load(Ordering::SeqCst) {
            return None;
        }
        let waiting = state.waiting_deadline(&shared.limits);
        if waiting.is_some_and(|d| d <= Instant::now()) {
            return None;
        }
        let must_close =
            state.evicted.load(Ordering::SeqCst) || shared.draining.load(Ordering::SeqCst);
        if must_close && !closing {
            if waiting.is_some() {
                return None;
            }
            // Busy: hyper finishes the request in flight, writes it out, then closes.
            connection.as_mut().graceful_shutdown();
            closing = true;
        }
    }
}

/// What a request head hyper rejected was wrong with, from the status hyper chose and the
/// error it ended the connection with.
fn head_error(status: StatusCode, failure: Option<&hyper::Error>) -> ApiError {
    match status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => ApiError::RequestHeadTooLarge {
            max_bytes: MAX_REQUEST_HEAD_BYTES,
        },
        StatusCode::URI_TOO_LONG => ApiError::UriTooLong,
        _ => {
            let detail = failure.map_or_else(
                || "the request head could not be parsed".to_string(),
                |e| e.to_string(),
            );
            // hyper answers a version other than 1.0 and 1.1 with a plain 400 and has no
            // predicate for it; its message for that case is a fixed string.
            if detail == "invalid HTTP version parsed" {
                ApiError::HttpVersionNotSupported
            } else {
                ApiError::MalformedRequest { detail }
            }
        }
    }
}

/// Writes the JSON answer to a rejected request head, closes the sending side, and reads
/// what the client still sends for a moment, so that the close does not reset the
/// connection before the client has read the answer.
async fn answer_rejection(stream: &mut TcpStream, error: ApiError) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (status, axum::Json(body)) = <(StatusCode, axum::Json<ErrorResponse>)>::from(error);
    let json = super::stream::to_json(&body);
    let response = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{json}",
        status.as_u16(),
        status.canonical_reason().unwrap_or("Error"),
        json.len(),
    );
    let written = tokio::time::timeout(REJECTION_WRITE_TIMEOUT, async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        return;
    }
    let _ = tokio::time::timeout(ABORT_FLUSH_GRACE, async {
        let mut scratch = vec![0; 16 << 10];
        let mut drained = 0;
        while drained < REJECTION_DRAIN_BYTES {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The open connections, to count them and to find the one to close at the limit.
#[derive(Default)]
struct Registry {
    connections: Mutex<HashMap<u64, Arc<ConnectionState>>>,
    next_id: AtomicU64,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<ConnectionState>>> {
        // A panic while holding this lock leaves the map consistent: every change is one call.
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a new connection, first closing the oldest idle one if `max` are open;
    /// `None` when all `max` are busy.
    fn admit(&self, max: usize) -> Option<Arc<ConnectionState>> {
        let mut connections = self.lock();
        if connections.len() >= max && !evict_oldest_idle(&mut connections) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnectionState::new(id));
        connections.insert(id, state.clone());
        Some(state)
    }

    fn evict_oldest_idle(&self) -> bool {
        evict_oldest_idle(&mut self.lock())
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    fn wake_all(&self) {
        for state in self.lock().values() {
            state.wake.notify_one();
        }
    }
}

/// Closes the connection that has waited longest; false when none is waiting.
fn evict_oldest_idle(connections: &mut HashMap<u64, Arc<ConnectionState>>) -> bool {
    let oldest = connections
        .values()
        .filter_map(|state| state.waiting_since().map(|since| (since, state.id)))
        .min();
    let Some(state) = oldest.and_then(|(_, id)| connections.remove(&id)) else {
        return false;
    };
    state.evicted.store(true, Ordering::SeqCst);
    state.wake.notify_one();
    true
}

/// One connection's phase, shared by its task, its socket wrapper and its service.
struct ConnectionState {
    id: u64,
    phase: Mutex<Phase>,
    /// Wakes the connection's task to look at its phase, eviction or the shutdown again.
    wake: Notify,
    /// Closed to make room for a new connection.
    evicted: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// No request in the router: reading a request's headers, or idle in between.
    Waiting {
        since: Instant,
        /// When the first byte of the next request arrived; the header timeout runs from it.
        first_byte: Option<Instant>,
        /// A fresh connection is reading headers from the start; a reused one idles first.
        reused: bool,
    },
    /// A request is in the router or its response is being written.
    Busy,
}

impl ConnectionState {
    fn new(id: u64) -> ConnectionState {
        ConnectionState {
            id,
            phase: Mutex::new(Phase::Waiting {
                since: Instant::now(),
                first_byte: None,
                reused: false,
            }),
            wake: Notify::new(),
            evicted: AtomicBool::new(false),
        }
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_phase(&self, phase: Phase) {
        *self.phase() = phase;
        self.wake.notify_one();
    }

    fn waiting_since(&self) -> Option<Instant> {
        match *self.phase() {
            Phase::Waiting { since, .. } => Some(since),
            Phase::Busy => None,
        }
    }

    /// When a waiting connection is cut; `None` while busy.
    fn waiting_deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        match *self.phase() {
            Phase::Busy => None,
            Phase::Waiting {
                since,
                reused: false,
                ..
            } => Some(since + limits.header_read_timeout),
            Phase::Waiting {
                first_byte: Some(at),
                ..
            } => Some(at + limits.header_read_timeout),
            Phase::Waiting { since, .. } => Some(since + limits.keep_alive_timeout),
        }
    }

    fn on_bytes_read(&self) {
        let mut phase = self.phase();
        if let Phase::Waiting {
            first_byte: first_byte @ None,
            reused: true,
            ..
        } = &mut *phase
        {
            *first_byte = Some(Instant::now());
            drop(phase);
            self.wake.notify_one();
        }
    }

    fn request_started(self: &Arc<Self>) -> InFlight {
        self.set_phase(Phase::Busy);
        InFlight(self.clone())
    }
}

/// Held by a request from its headers until its response body is dropped (written out, or the
/// connection gone); then the connection waits for the next request.
struct InFlight(Arc<ConnectionState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.set_phase(Phase::Waiting {
            since: Instant::now(),
            first_byte: None,
            reused: true,
        });
    }
}

/// The socket, noting when bytes of a new request start to arrive, and holding back hyper's
/// own bodiless answer to a head it could not parse (see the module docs).
struct WatchedIo {
    inner: TcpStream,
    state: Arc<ConnectionState>,
    /// The status of hyper's answer to a bad head, once it has started: everything hyper
    /// writes from then on is dropped, and the connection answers with JSON once hyper is done.
    rejected: Option<StatusCode>,
}

impl WatchedIo {
    /// The status of hyper's answer to a head it rejected, if `bytes`, written at this point,
    /// start one.
    fn starts_rejection(&self, bytes: &[u8]) -> Option<StatusCode> {
        // Busy: a response of the router's is being written.
        self.state.waiting_since()?;
        bodiless_error_status(bytes)
    }
}

/// The status of a response head with a 4xx or 5xx status and `content-length: 0`: what hyper
/// writes for a head it could not parse. Never a router response: those have JSON bodies.
fn bodiless_error_status(bytes: &[u8]) -> Option<StatusCode> {
    let mut headers = [httparse::EMPTY_HEADER; 8];
    let mut head = httparse::Response::new(&mut headers);
    if !matches!(head.parse(bytes), Ok(httparse::Status::Complete(_))) {
        return None;
    }
    let status = StatusCode::from_u16(head.code?).ok()?;
    let is_empty = head
        .headers
        .iter()
        .any(|header| header.name.eq_ignore_ascii_case("content-length") && header.value == b"0");
    ((status.is_client_error() || status.is_server_error()) && is_empty).then_some(status)
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.state.on_bytes_read();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.rejected.is_none() {
            this.rejected = this.starts_rejection(buf);
        }
        if this.rejected.is_some() {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.rejected.is_some() {
            // The JSON answer still has to go out; the connection's task closes it after.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.rejected.is_none() {
            // hyper keeps a head in a buffer of its own, so an answer starts at a slice; the
            // slices before it (the end of an earlier response) still go out first.
            let start = bufs.iter().enumerate().find_map(|(index, slice)| {
                let status = (!slice.is_empty()).then(|| this.starts_rejection(slice))??;
                Some((index, status))
            });
            match start {
                None => return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs),
                Some((first, status)) if bufs[..first].iter().all(|slice| slice.is_empty()) => {
                    this.rejected = Some(status);
                }
                Some((first, _)) => {
                    return Pin::new(&mut this.inner).poll_write_vectored(cx, &bufs[..first]);
                }
            }
        }
        Poll::Ready(Ok(bufs.iter().map(|slice| slice.len()).sum()))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The router as one connection's hyper service: marks the connection busy, times the
/// request body, and ends the request at the shutdown deadline.
#[derive(Clone)]
struct ConnectionService {
    app: Router,
    state: Arc<ConnectionState>,
    body_read_timeout: Duration,
    deadline_passed: CancellationToken,
}

type ServiceFuture =
    Pin<Box<dyn Future<Output = Result<Response<GuardedBody>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for ConnectionService {
    type Response = Response<GuardedBody>;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, request: Request<Incoming>) -> ServiceFuture {
        let in_flight = self.state.request_started();
        let timeout = self.body_read_timeout;
        let request = request.map(|body| Body::new(TimedBody::new(body, timeout)));
        let app = self.app.clone();
        let deadline_passed = self.deadline_passed.clone();
        Box::pin(async move {
            let (response, watch_deadline) = tokio::select! {
                response = app.oneshot(request) => match response {
                    Ok(response) => (response, true),
                    Err(never) => match never {},
                },
                () = deadline_passed.cancelled() => (shutdown_error().into_response(), false),
            };
            let is_event_stream = response
                .headers()
                .get(CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            Ok(response.map(|body| {
                GuardedBody::new(
                    body,
                    in_flight,
                    watch_deadline.then(|| Box::pin(deadline_passed.cancelled_owned())),
                    is_event_stream,
                )
            }))
        })
    }
}
