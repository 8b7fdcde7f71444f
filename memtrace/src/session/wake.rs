//! The wake loop every session runs on: a tokio loop woken by a timer, a ring with data,
//! a signal, the target's exit or the deadline.
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    sync::Arc,
    time::Duration,
};

use anyhow::{Result, anyhow};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{Signal, SignalKind, signal},
    sync::Notify,
    task::JoinHandle as TaskHandle,
};

use super::Tracer;

/// A raw fd polled for readiness, owned elsewhere (the ring).
struct BorrowedFd(RawFd);
impl AsRawFd for BorrowedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A descriptor that becomes readable when process `pid` exits (exited already: at once).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Why the loop woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The timer, or a ring with a batch waiting.
    Tick,
    Signal(i32),
    TargetExited,
    Deadline,
}

/// Everything a session waits on. Create it inside the tokio runtime, and drop it (with
/// the runtime) before the tracer: its watchers borrow the rings' descriptors.
pub struct WakeLoop {
    notify: Arc<Notify>,
    watchers: Vec<TaskHandle<()>>,
    target: Option<AsyncFd<OwnedFd>>,
    target_exited: bool,
    sigint: Signal,
    sigterm: Signal,
    sighup: Signal,
    tick: tokio::time::Interval,
    deadline: Option<tokio::time::Instant>,
}

impl WakeLoop {
    pub fn new(tracer: &mut Tracer, interval: Duration, duration: Option<Duration>) -> Result<Self> {
        let notify = Arc::new(Notify::new());
        let mut watchers = Vec::new();
        for ring in tracer.probes.rings_mut() {
            // SAFETY: the ring outlives this watcher: the WakeLoop, which aborts it, is dropped
            // with the runtime before the tracer and its rings.
            let fd = unsafe { AsyncFd::register_with_interest(BorrowedFd(ring.ring.as_raw_fd()), Interest::READABLE) }
                .map_err(|e| anyhow!("polling a ring buffer: {e}"))?;
            let notify = Arc::clone(&notify);
            watchers.push(tokio::spawn(async move {
                while let Ok(mut guard) = fd.readable().await {
                    guard.clear_ready();
                    notify.notify_one();
                }
            }));
        }
        // Opened as the session began (`Tracer::start`): a target that exits (and is
        // reaped) before this is still seen exiting, at the first wait.
        let target = match tracer.target_pidfd.take() {
            Some(pidfd) => Some(
                // SAFETY: the AsyncFd owns the pidfd, which stays open as long as it does.
                unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
                    .map_err(|e| anyhow!("watching the target process: {e}"))?,
            ),
            None => None,
        };
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ok(Self {
            notify,
            watchers,
            target,
            target_exited: false,
            sigint: signal(SignalKind::interrupt())?,
            sigterm: signal(SignalKind::terminate())?,
            sighup: signal(SignalKind::hangup())?,
            tick,
            deadline: duration.map(|d| tokio::time::Instant::now() + d),
        })
    }

    pub async fn wait(&mut self) -> Wake {
        let target = self.target.as_ref().filter(|_| !self.target_exited);
        let target_exit = async {
            match target {
                Some(fd) => {
                    let _ = fd.readable().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let deadline = self.deadline;
        let until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending::<()>().await,
            }
        };
        // Signals first: one that came during the last drains is read before the next tick
        // (a repeat is told by how soon it follows, `Tracer::on_signal`).
        tokio::select! {
            biased;
            _ = self.sigint.recv() => Wake::Signal(libc::SIGINT),
            _ = self.sigterm.recv() => Wake::Signal(libc::SIGTERM),
            _ = self.sighup.recv() => Wake::Signal(libc::SIGHUP),
            _ = target_exit => {
                self.target_exited = true;
                Wake::TargetExited
            }
            _ = until_deadline => Wake::Deadline,
            _ = self.tick.tick() => Wake::Tick,
            _ = self.notify.notified() => Wake::Tick,
        }
    }
}

impl Drop for WakeLoop {
    fn drop(&mut self) {
        for w in &self.watchers {
            w.abort();
        }
    }
}

/// Runs `body` on a single-threaded tokio runtime that ends (with every task on it) when
/// `body` returns.
pub fn block_on<T>(body: impl std::future::Future<Output = T>) -> Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    Ok(runtime.block_on(body))
}
