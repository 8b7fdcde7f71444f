//! The command's lifecycle once it runs: signals passed on like perf does, reaping its
//! exit status, ending it when the view it was started for closes.
use std::time::{Duration, Instant};

use super::{Tracer, spawn};

/// After a signal was passed to the command, how long an agent waits for it to exit.
const CHILD_GRACE: Duration = Duration::from_secs(2);

/// The same signal again within this long (of the reads its first one waited for) is the
/// first one seen twice, not a second Ctrl-C: `timeout -s INT` signals memtrace and then
/// its whole process group, a few microseconds apart (the second was taken as "stop and
/// leave it running", and the command's exit status was lost). A person's second Ctrl-C
/// comes much later.
const REPEAT_WINDOW: Duration = Duration::from_millis(100);

impl Tracer {
    /// Decides what a signal does, like perf: a command gets the first one and tracing
    /// goes on until it exits (it decides how to stop, or whether to); a second one stops
    /// tracing and leaves the command running. Anything else stops the session at once.
    /// Ctrl-C at a terminal already reached the command (the terminal signals the whole
    /// foreground process group), so it is passed on only when it came from elsewhere
    /// (`kill`): the command sees each Ctrl-C once. The same signal again within
    /// [`REPEAT_WINDOW`] is the first one delivered twice. Returns whether to stop now.
    pub fn on_signal(&mut self, sig: i32) -> bool {
        match (self.is_command, self.forwarded_signal, self.target_pid) {
            (true, None, Some(pid)) => {
                if !(sig == libc::SIGINT && from_the_terminal_to(pid)) {
                    // SAFETY: sends a signal to our own child.
                    unsafe { libc::kill(pid as i32, sig) };
                }
                self.forwarded_signal = Some((sig, Instant::now()));
                if !self.options.quiet {
                    eprintln!(
                        "memtrace: {} passed to the command; tracing until it exits (Ctrl-C again to stop tracing and leave it running)",
                        signal_name(sig)
                    );
                }
                false
            }
            (true, Some((first, at)), _) if first == sig && at.elapsed() < REPEAT_WINDOW => false,
            _ => true,
        }
    }

    /// The rings were read through after a signal passed on: its repeat window starts
    /// now (its twin waited through those reads, however long they took).
    pub fn signal_read_through(&mut self) {
        if let Some((sig, _)) = self.forwarded_signal {
            self.forwarded_signal = Some((sig, Instant::now()));
        }
    }

    /// A signal passed to the command that did not make it exit within [`CHILD_GRACE`]
    /// (`serve` then ends the command itself).
    pub fn signal_grace_expired(&self) -> Option<i32> {
        self.forwarded_signal.filter(|(_, at)| at.elapsed() > CHILD_GRACE).map(|(sig, _)| sig)
    }

    /// After tracing stopped on a second signal: the pid of the command if it still runs
    /// (it is left running, no longer traced).
    pub fn command_left_running(&mut self) -> Option<u32> {
        let pid = self.target_pid.filter(|_| self.is_command && self.forwarded_signal.is_some())?;
        let mut status = 0;
        // SAFETY: polls our own child; WNOHANG never blocks.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
        (r == 0).then_some(pid)
    }

    /// The command's exit code once it exited (None when tracing a pid we did not start).
    pub fn reap_command(&mut self) -> Option<i32> {
        if !self.is_command {
            return None;
        }
        let pid = self.target_pid?;
        let mut status = 0;
        // SAFETY: waits for our own child, which the pidfd reported as exited.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        if r != pid as i32 {
            return None;
        }
        self.command_ended = Some(spawn::describe_status(status));
        Some(spawn::exit_code(status))
    }

    /// Ends a command that is still running (the view it was started for is closing):
    /// SIGTERM, then SIGKILL if it has not exited within a second. Returns what was done
    /// and how the command ended ("SIGTERM sent; it exited with status 3"), or `None` when
    /// it had already exited (or there is no command).
    pub fn end_command(&mut self) -> Option<String> {
        let (true, Some(pid)) = (self.is_command, self.target_pid) else { return None };
        let pid = pid as i32;
        let mut status = 0;
        // SAFETY: signals and reaps our own child; WNOHANG never blocks.
        unsafe {
            if libc::waitpid(pid, &mut status, libc::WNOHANG) != 0 {
                return None; // already reaped, or exited just now
            }
            libc::kill(pid, libc::SIGTERM);
            for _ in 0..100 {
                match libc::waitpid(pid, &mut status, libc::WNOHANG) {
                    0 => std::thread::sleep(Duration::from_millis(10)),
                    r if r == pid => return Some(format!("SIGTERM sent; it {}", spawn::describe_status(status))),
                    _ => return None, // reaped elsewhere: nothing more to send
                }
            }
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, 0);
        }
        Some(format!("SIGTERM sent, then SIGKILL a second later; it {}", spawn::describe_status(status)))
    }
}

/// Whether a SIGINT just received came from our terminal and reached `child` too: we are
/// in the terminal's foreground process group, and so is the child.
fn from_the_terminal_to(child: u32) -> bool {
    // SAFETY: plain queries about processes and descriptors; no memory is passed.
    unsafe {
        let group = libc::getpgrp();
        libc::getpgid(child as i32) == group
            && [0, 1, 2].iter().any(|&fd| libc::isatty(fd) == 1 && libc::tcgetpgrp(fd) == group)
    }
}

/// `SIGINT`, `SIGTERM`, `SIGHUP`.
fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        n => format!("signal {n}"),
    }
}
