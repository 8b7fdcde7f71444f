//! The HTTP side of `serve`, on its own thread and runtime so no client can stall the
//! tracer: HTTP/1.1 (hyper), GET and HEAD only, an optional bearer token, at most
//! `--max-connections` requests answered at once (others wait a second for a slot, then get
//! 503; the health check and refusals take none) and 16 times as many connections open, a
//! deadline for a request's head (idle connections close with it), for building a response,
//! and for a connection's whole life. Building responses (naming, encoding) runs on the
//! blocking pool, two at a time. Errors are one line of text, as Go's net/http/pprof
//! writes them.
use std::{convert::Infallible, net::SocketAddr, sync::Arc, thread::JoinHandle, time::Duration};

use anyhow::{Context as _, Result};
use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header::{self, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::TcpListener,
    sync::{Semaphore, watch},
};

use super::{
    Shared,
    config::HttpConfig,
    metrics::{OPENMETRICS_TYPE, TEXT_TYPE, wants_openmetrics},
    model::Scraper,
    profile::{ProfileKind, ProfileQuery, parse_query},
};

/// Responses built at once (the rest wait, within their deadline).
const BUILDERS: usize = 2;
/// Connections kept open per request slot: clients that connect and send nothing (or
/// slowly) fill these, not the slots scrapes need.
const CONNECTIONS_PER_SLOT: usize = 16;
/// How long a client waits for a free slot before a 503.
const SLOT_WAIT: Duration = Duration::from_secs(1);

/// The running server.
pub struct Server {
    shutdown: watch::Sender<bool>,
    thread: JoinHandle<()>,
}

impl Server {
    /// Serves on `listener` (already bound) from a thread of its own.
    pub fn start(listener: std::net::TcpListener, shared: Arc<Shared>, config: HttpConfig) -> Result<Self> {
        listener.set_nonblocking(true).context("configuring the listening socket")?;
        let (shutdown, stop) = watch::channel(false);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(BUILDERS + 2)
            .build()
            .context("starting the HTTP runtime")?;
        let thread = std::thread::Builder::new()
            .name("memtrace-http".into())
            .spawn(move || {
                let ctx = Arc::new(Context {
                    shared,
                    slots: Arc::new(Semaphore::new(config.max_connections)),
                    metrics_slots: Arc::new(Semaphore::new(config.max_connections)),
                    connections: Arc::new(Semaphore::new(config.max_connections.saturating_mul(CONNECTIONS_PER_SLOT))),
                    builders: Semaphore::new(BUILDERS),
                    config,
                    stop: stop.clone(),
                });
                runtime.block_on(accept(listener, ctx, stop));
                // Responses still being built are abandoned.
                runtime.shutdown_timeout(Duration::from_millis(100));
            })
            .context("starting the HTTP thread")?;
        Ok(Self { shutdown, thread })
    }

    /// Stops accepting, lets requests in flight finish within `grace`, and returns once
    /// the server is gone.
    pub fn shutdown(self, grace: Duration) {
        let _ = self.shutdown.send(true);
        let deadline = std::time::Instant::now() + grace + Duration::from_millis(500);
        while !self.thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.thread.is_finished() {
            let _ = self.thread.join();
        }
    }
}

struct Context {
    shared: Arc<Shared>,
    config: HttpConfig,
    /// Requests being answered (`--max-connections`): taken per request, past the health
    /// check and the token, so idle or slow clients hold none. Scrapes of `/metrics` have
    /// slots of their own: delta profiles waiting out their `?seconds=` (eight
    /// `go tool pprof -seconds 30` at once) left Prometheus a 503 and a gap in every series.
    slots: Arc<Semaphore>,
    metrics_slots: Arc<Semaphore>,
    /// Connections open (reading a request, idle, or being answered), at most
    /// [`CONNECTIONS_PER_SLOT`] per slot: beyond, a new one gets a 503 at once.
    connections: Arc<Semaphore>,
    builders: Semaphore,
    /// Becomes true when the server stops (delta profiles stop waiting).
    stop: watch::Receiver<bool>,
}

async fn accept(listener: std::net::TcpListener, ctx: Arc<Context>, mut stop: watch::Receiver<bool>) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("memtrace: the HTTP server cannot run: {e}");
            return;
        }
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match Arc::clone(&ctx.connections).try_acquire_owned() {
                    Ok(open) => {
                        connections.spawn(connection(stream, peer, open, Arc::clone(&ctx), stop.clone()));
                    }
                    Err(_) => {
                        ctx.shared.count_response(503);
                        connections.spawn(busy(stream));
                    }
                },
                // Out of descriptors, or a connection reset before it was accepted.
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let grace = Duration::from_secs(2);
    let _ = tokio::time::timeout(grace, async { while connections.join_next().await.is_some() {} }).await;
    connections.abort_all();
}

/// One client: serves its requests until it goes, idles past the head deadline, outlives
/// its lifetime, or the server stops (`open`: its place among the connections).
async fn connection(
    stream: tokio::net::TcpStream,
    _peer: SocketAddr,
    open: tokio::sync::OwnedSemaphorePermit,
    ctx: Arc<Context>,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let lifetime = ctx.config.request_timeout * 2 + Duration::from_secs(ctx.config.max_profile_seconds);
    let service_ctx = Arc::clone(&ctx);
    let service = service_fn(move |req| {
        let ctx = Arc::clone(&service_ctx);
        async move {
            let (response, slot) = respond(req, &ctx).await;
            ctx.shared.count_response(response.status().as_u16());
            Ok::<_, Infallible>(response.map(|body| SlotBody { body, _slot: slot }))
        }
    });
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(ctx.config.header_timeout).max_buf_size(64 << 10);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let deadline = tokio::time::sleep(lifetime);
    tokio::pin!(deadline);
    let mut stopping = *stop.borrow();
    if stopping {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            _ = conn.as_mut() => break,
            _ = &mut deadline => break,
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
    drop(open);
}

/// A 503 to a client beyond the connections kept open, without reading its request.
async fn busy(stream: tokio::net::TcpStream) {
    let body = "memtrace: too many clients at once (--max-connections); retry later\n";
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // One small write: it fits the socket buffer, or the client is not worth waiting for.
    if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(1), stream.writable()).await {
        let _ = stream.try_write(response.as_bytes());
    }
    // Half-close and read what the client sent: closing with its request unread would
    // reset the connection, and the client might lose the answer.
    // SAFETY: shutdown(2) on a socket this function owns.
    unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&stream), libc::SHUT_WR) };
    let drain = async {
        let mut buf = [0u8; 4096];
        loop {
            if stream.readable().await.is_err() {
                return;
            }
            match stream.try_read(&mut buf) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
}

type Reply = Response<Full<Bytes>>;

/// An answer's body, holding the request's slot until it is written (or the connection
/// ends): a client that reads slowly holds one slot, so at most `--max-connections` built
/// answers wait in memory.
struct SlotBody {
    body: Full<Bytes>,
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl hyper::body::Body for SlotBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A one-line text answer (errors, as net/http/pprof writes them).
fn text(status: StatusCode, line: &str) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(format!("{line}\n"))));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    r
}

fn body(content_type: &'static str, bytes: Vec<u8>) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(bytes)));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    r
}

/// Compares without stopping at the first difference (the time says nothing of the token).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorized(req: &Request<Incoming>, token: &str) -> bool {
    let Some(value) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, credentials)) = value.trim().split_once(' ') else { return false };
    scheme.eq_ignore_ascii_case("bearer") && same_secret(credentials.trim().as_bytes(), token.as_bytes())
}

const INDEX: &str = "memtrace serve\n\n/metrics              Prometheus exposition (OpenMetrics when asked)\n/debug/pprof/heap     live memory, Go's heap profile (?seconds=N for a delta, ?pid=, ?domain=user|kernel)\n/debug/pprof/allocs   the same, allocations first\n/healthz              ok while serving\n";

/// The answer to one request, and the slot it was built in (none for the health check and
/// refusals).
async fn respond(req: Request<Incoming>, ctx: &Context) -> (Reply, Option<tokio::sync::OwnedSemaphorePermit>) {
    if let Some(r) = without_slot(&req, ctx) {
        return (r, None);
    }
    let slots = if req.uri().path() == "/metrics" { &ctx.metrics_slots } else { &ctx.slots };
    let Ok(Ok(slot)) = tokio::time::timeout(SLOT_WAIT, Arc::clone(slots).acquire_owned()).await else {
        let mut r = text(
            StatusCode::SERVICE_UNAVAILABLE,
            "memtrace: too many requests at once (--max-connections); retry later",
        );
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return (r, None);
    };
    (answer(req, ctx).await, Some(slot))
}

/// The answers that take no slot: a method not served, the health check, a missing token.
fn without_slot(req: &Request<Incoming>, ctx: &Context) -> Option<Reply> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, &format!("method {} not allowed: GET or HEAD", req.method()));
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Some(r);
    }
    if req.uri().path() == "/healthz" {
        return Some(text(StatusCode::OK, "ok"));
    }
    if let Some(token) = &ctx.config.auth_token
        && !authorized(req, token)
    {
        let mut r =
            text(StatusCode::UNAUTHORIZED, "unauthorized: send Authorization: Bearer <the token of --auth-token-file>");
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"memtrace\""));
        return Some(r);
    }
    None
}

/// Whether every `%` of a query starts an escape (two hex digits); the bytes escaped need
/// not be UTF-8, as Go's `ParseQuery` does not ask.
fn well_formed_query(query: &str) -> bool {
    let bytes = query.as_bytes();
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b != b'%' || bytes.get(i + 1..i + 3).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)))
}

/// The answer to a request past [`without_slot`].
async fn answer(req: Request<Incoming>, ctx: &Context) -> Reply {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    match path.as_str() {
        "/metrics" => {
            // Parameters are ignored, as node_exporter ignores those it does not know:
            // a scrape config's `params:` (one set for several exporters) must not fail
            // the scrape. A query that is not a query still gets its 400.
            if !well_formed_query(&query) {
                return text(StatusCode::BAD_REQUEST, &format!("malformed query: bad percent-encoding in {query:?}"));
            }
            let accept = req.headers().get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
            let openmetrics = wants_openmetrics(accept);
            let content_type = if openmetrics { OPENMETRICS_TYPE } else { TEXT_TYPE };
            if req.method() == Method::HEAD {
                // The headers alone (hyper writes no length for an empty HEAD answer): no
                // scrape is taken, which would count as the scraper having seen the
                // processes that exited and update the counters' bookkeeping.
                return body(content_type, Vec::new());
            }
            let shared = Arc::clone(&ctx.shared);
            let config = ctx.config.clone();
            match build(ctx, move || shared.metrics_text(&config, openmetrics)).await {
                Ok(text) => body(content_type, text.into_bytes()),
                Err(r) => r,
            }
        }
        "/debug/pprof/heap" | "/debug/pprof/allocs" => {
            let kind = if path.ends_with("heap") { ProfileKind::Heap } else { ProfileKind::Allocs };
            profile(ctx, kind, &query, req.method() == Method::HEAD).await
        }
        "/" | "/debug/pprof" | "/debug/pprof/" => text(StatusCode::OK, INDEX.trim_end()),
        p => match p.strip_prefix("/debug/pprof/") {
            Some(name) => {
                text(StatusCode::NOT_FOUND, &format!("unknown profile {name:?}: memtrace serves heap and allocs"))
            }
            None => text(
                StatusCode::NOT_FOUND,
                &format!("no such endpoint {p:?}: memtrace serves /metrics, /debug/pprof/heap and /debug/pprof/allocs"),
            ),
        },
    }
}

/// Runs `work` on the blocking pool, within the request deadline, two at a time.
async fn build<T: Send + 'static>(ctx: &Context, work: impl FnOnce() -> T + Send + 'static) -> Result<T, Reply> {
    let timeout = ctx.config.request_timeout;
    let run = async {
        let _permit = ctx.builders.acquire().await.map_err(|_| text(StatusCode::SERVICE_UNAVAILABLE, "stopping"))?;
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "memtrace: building the response failed"))
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(result) => result,
        Err(_) => Err(text(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("memtrace: the response was not ready within {} s; retry later", timeout.as_secs()),
        )),
    }
}

/// A profile; for HEAD, the headers a GET would get once its query is checked, without
/// building it (nor waiting `?seconds=`).
async fn profile(ctx: &Context, kind: ProfileKind, query: &str, head: bool) -> Reply {
    let q = match parse_query(query, ctx.config.max_profile_seconds) {
        Ok(q) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, &e.0),
    };
    if head {
        return profile_reply(kind, &q, Vec::new());
    }
    let base = match q.seconds {
        None => None,
        Some(seconds) => {
            let shared = Arc::clone(&ctx.shared);
            let scraper = if kind == ProfileKind::Heap { Scraper::Heap } else { Scraper::Allocs };
            let base = match build(ctx, move || shared.snapshot(scraper)).await {
                Ok(b) => b,
                Err(r) => return r,
            };
            // A pid that is no process is told now, not after the wait (one that runs may
            // meet the model with its first event during the wait).
            let unknown = |pid: u32| {
                !base.processes.iter().any(|p| p.pid == pid) && !std::path::Path::new(&format!("/proc/{pid}")).exists()
            };
            if let Some(pid) = q.pids.iter().copied().find(|&pid| unknown(pid)) {
                return text(StatusCode::BAD_REQUEST, &format!("pid {pid} is not traced (or exited and was dropped)"));
            }
            let mut stop = ctx.stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(seconds)) => {}
                _ = stop.wait_for(|&stopping| stopping) => {
                    return text(StatusCode::SERVICE_UNAVAILABLE, "memtrace is stopping: the delta profile was cut short");
                }
            }
            Some(base)
        }
    };
    let shared = Arc::clone(&ctx.shared);
    let q2 = q.clone();
    let built = build(ctx, move || shared.profile(kind, &q2, base.as_ref())).await;
    match built {
        Ok(Ok(bytes)) => profile_reply(kind, &q, bytes),
        Ok(Err(bad)) => text(StatusCode::BAD_REQUEST, &bad.0),
        Err(r) => r,
    }
}

fn profile_reply(kind: ProfileKind, q: &ProfileQuery, bytes: Vec<u8>) -> Reply {
    let mut r = body("application/octet-stream", bytes);
    let name = if q.seconds.is_some() { format!("{}-delta", kind.name()) } else { kind.name().to_string() };
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        r.headers_mut().insert(header::CONTENT_DISPOSITION, v);
    }
    r
}
